"""Runtime state the compiled model reads and writes: the packed KV cache."""

from flashloop_compile.runtime.packed_kv import PackedKVBytes, PackedKVCache, PackedKVOverflowError

__all__ = ["PackedKVCache", "PackedKVBytes", "PackedKVOverflowError"]
