"""The packed KV cache's tensor names, in the order the ``flashloop.packed_*`` ops take them, and
the interface the op wrappers need from a cache. The runtime (runtime/packed_kv.py) allocates a
cache with these tensors; the ops and kernels read them by these names. No Triton, no runtime."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

__all__ = ["LAYER_TENSOR_NAMES", "MODEL_TENSOR_NAMES", "CACHE_NAMES", "PackedCache"]

# one layer's tensors (shapes in runtime/packed_kv.py), then the model's
LAYER_TENSOR_NAMES = (
    "k_base", "k_base_min", "k_base_scale", "v_base", "v_base_min", "v_base_scale",
    "k_res", "k_res_min", "k_res_scale", "v_res", "v_res_min", "v_res_scale",
    "k_tail", "v_tail", "flushed", "row_count",
)
MODEL_TENSOR_NAMES = ("rows", "depth_count", "res_layout", "overflow")
CACHE_NAMES = LAYER_TENSOR_NAMES + MODEL_TENSOR_NAMES


class PackedCache(Protocol):
    """What the op wrappers read from a packed cache (runtime.PackedKVCache)."""

    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def op_tensors(self, layer: int) -> tuple[Tensor, ...]: ...
