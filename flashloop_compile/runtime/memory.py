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

__all__ = ["KVMemory", "residual_capacity", "kv_memory", "max_batch_for"]


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
    return KVMemory(dense, packed)


def max_batch_for(
    model: OuroConfig, config: FlashLoopConfig, context: int, budget_bytes: float, *, weight_bytes: float,
    max_new_tokens: int | None = None, reserve_bytes: float = 0.0,
) -> int:
    """The largest batch whose KV (dense or packed, by config) fits the budget next to the
    weights and a reserve for activations and scratch."""
    free = budget_bytes - weight_bytes - reserve_bytes
    per_slot = kv_memory(model, config, 1, context, max_new_tokens=max_new_tokens).bytes
    return max(0, int(free // per_slot))
