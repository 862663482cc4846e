"""Memory accounting and capacity planning: KV bytes per configuration, dense vs packed, and the
largest batch that fits a memory budget at a given context.

The packed cache is sized exactly as :class:`~flashloop_compile.runtime.packed_kv.PackedKVCache`
allocates it (built on the meta device, so nothing is allocated to count it). With token-sparse
prefill the residual streams of loops 3..R only need rows for the retained prompt tokens plus
every generated token: ``capacity_d = ceil(retention_d * prompt) + new_tokens`` (rounded up to a
whole group, at most the context).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.models.ouro import OuroConfig

__all__ = ["KVMemory", "residual_capacity", "kv_memory", "decode_scratch_bytes", "max_batch_for"]


def residual_capacity(config: FlashLoopConfig, num_loops: int, max_seq: int, max_new_tokens: int | None) -> list[int]:
    """Compact residual rows per depth 1..R-1 for one slot."""
    tsp, g = config.token_sparse_prefill, config.kv_residual_quantization.group_size
    if not tsp.enabled or max_new_tokens is None:
        return [max_seq] * (num_loops - 1)
    prompt = max_seq - max_new_tokens
    caps = []
    for d in range(1, num_loops):
        rows = math.ceil(tsp.retention[d] * prompt) + max_new_tokens
        caps.append(min(max_seq, -(-rows // g) * g + g))  # a spare group for block-local rounding
    return caps


@dataclass
class KVMemory:
    dense_bytes: int  # the BF16 cache of max_batch x max_seq x R loops x N layers
    packed: dict[str, float] | None  # the packed cache's breakdown (payload, params, maps, tails, total)
    scratch: int = 0  # decode's largest working buffers besides the cache (decode_scratch_bytes); not in the ratio

    @property
    def bytes(self) -> int:
        return int(self.packed["total"]) if self.packed else self.dense_bytes

    @property
    def ratio(self) -> float:
        return self.dense_bytes / self.bytes

    def lines(self) -> list[str]:
        out = [f"dense BF16 KV: {self.dense_bytes / 2**30:.2f} GiB"]
        if self.packed:
            p = self.packed
            out.append(
                f"packed KV: {p['total'] / 2**30:.2f} GiB (payload {p['payload'] / 2**30:.2f}, min/scale "
                f"{p['params'] / 2**30:.2f}, maps {p['maps'] / 2**20:.1f} MiB, tails {p['tails'] / 2**20:.1f} MiB); "
                f"{self.ratio:.2f}x smaller"
            )
        if self.scratch:
            out.append(f"decode scratch (one layer's working buffers, not cache): {self.scratch / 2**20:.1f} MiB")
        return out


def kv_memory(
    model: OuroConfig, config: FlashLoopConfig, max_batch: int, max_seq: int, *, max_new_tokens: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> KVMemory:
    from flashloop_compile.runtime.packed_kv import PackedKVCache

    elem = torch.finfo(dtype).bits // 8
    dense = 2 * model.num_loops * model.num_hidden_layers * max_batch * model.num_key_value_heads * max_seq * model.head_dim * elem
    packed = None
    q = config.kv_residual_quantization
    if q.enabled:
        cache = PackedKVCache(
            model.num_hidden_layers, model.num_loops, max_batch, max_seq, model.num_key_value_heads, model.head_dim,
            group_size=q.group_size, tail=q.tail, dtype=dtype, device="meta",
            residual_capacity=residual_capacity(config, model.num_loops, max_seq, max_new_tokens),
        )
        packed = cache.nbytes().as_dict()
    return KVMemory(dense, packed, decode_scratch_bytes(model, config, max_batch, max_seq, dtype=dtype))


def decode_scratch_bytes(
    model: OuroConfig, config: FlashLoopConfig, max_batch: int, max_seq: int, *, dtype: torch.dtype = torch.bfloat16,
) -> int:
    """The working buffers a decode step allocates besides the cache that grow with the context,
    for one layer (the layers run one after another, so one layer's are live at a time): sparse
    decode's reference writes an FP32 probability row per query head; with quantization it also
    reads the layer's whole history into BF16 K and V (``flashloop.packed_read``). Dense decode
    attends in place. Capacity planning adds this per slot: at 32K context it is 0.25 GiB per
    request next to 4.24 GiB of packed cache (all features on, ouro-1.4b); the allocation that
    failed in the first max-batch run on the H200 (batch 30) was one layer's BF16 K of this read."""
    if not config.sparse_decode_attention.enabled:
        return 0
    scratch = max_batch * model.num_attention_heads * max_seq * 4
    if config.kv_residual_quantization.enabled:
        scratch += 2 * max_batch * model.num_key_value_heads * max_seq * model.head_dim * (torch.finfo(dtype).bits // 8)
    return scratch


def max_batch_for(
    model: OuroConfig, config: FlashLoopConfig, context: int, budget_bytes: float, *, weight_bytes: float,
    max_new_tokens: int | None = None, reserve_bytes: float = 0.0,
) -> int:
    """The largest batch whose KV (dense or packed, by config) and decode scratch fit the budget
    next to the weights and a reserve for activations."""
    free = budget_bytes - weight_bytes - reserve_bytes
    one = kv_memory(model, config, 1, context, max_new_tokens=max_new_tokens)
    per_slot = one.bytes + one.scratch
    return max(0, int(free // per_slot))
