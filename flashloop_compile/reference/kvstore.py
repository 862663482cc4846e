"""Per-request KV stores of the reference: what each depth of each layer holds for every position.

Both stores answer one question, ``read(layer, depth, length)``: the logical K/V that depth
``depth`` (zero-based) sees at positions 0..length-1. A token that was not recomputed at a depth
(inactive in token-sparse prefill, or a forward that ran fewer loops) inherits its last computed
K/V there.

``DenseKVStore`` keeps every depth's logical values. ``QuantizedKVStore`` keeps SPEC.md
section 3's format: per flushed block of G tokens an INT4 base (depth 0) and, for depths >= 1,
INT4 residuals against the *reconstructed* predecessor for the block's active tokens only,
stored compactly with explicit position -> row maps; recent tokens stay in a tail in the compute
dtype (BF16 on GPU), holding tail..tail+G-1 tokens after each append once that many exist.

K residual groups are block-local: one group per channel over the block's active rows (up to G,
so sparse depths give partial groups). Storage then depends only on the token's block, never on
how a prompt was chunked or batched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from flashloop_compile.reference.codec import (
    QuantizedChannelGroups,
    QuantizedTokenGroups,
    quantize_channel_groups,
    quantize_token_groups,
)

__all__ = ["DenseKVStore", "QuantizedKVStore", "QuantizedBlock", "KVBytes"]


@dataclass
class KVBytes:
    """Bytes held by a store, by kind; ``dense_equivalent`` is the BF16 cache of the same tokens."""

    payload: int = 0
    params: int = 0
    maps: int = 0
    tail: int = 0
    dense_equivalent: int = 0

    @property
    def total(self) -> int:
        return self.payload + self.params + self.maps + self.tail

    @property
    def ratio(self) -> float:
        return self.dense_equivalent / max(self.total, 1)


class DenseKVStore:
    """Logical K/V per (layer, depth): lists of [T, H, D] chunks in the compute dtype."""

    def __init__(self, num_layers: int, num_depths: int) -> None:
        self.num_depths = num_depths
        self.k = [[[] for _ in range(num_depths)] for _ in range(num_layers)]
        self.v = [[[] for _ in range(num_depths)] for _ in range(num_layers)]
        self.length = 0

    def append(self, layer: int, k: list[Tensor], v: list[Tensor], depth_count: Tensor) -> None:
        """Append one forward's tokens: k[d]/v[d] [n, H, D] logical values for every depth."""
        for d in range(self.num_depths):
            self.k[layer][d].append(k[d])
            self.v[layer][d].append(v[d])
        if layer == len(self.k) - 1:
            self.length += k[0].shape[0]

    def read(self, layer: int, depth: int, length: int) -> tuple[Tensor, Tensor]:
        k, v = torch.cat(self.k[layer][depth]), torch.cat(self.v[layer][depth])
        return k[:length], v[:length]

    def nbytes(self) -> KVBytes:
        n = sum(t.numel() * t.element_size() for kv in (self.k, self.v) for layer in kv for d in layer for t in d)
        return KVBytes(payload=n, dense_equivalent=n)


@dataclass
class QuantizedBlock:
    """One flushed block of G tokens of one layer.

    rows[d] (d >= 1): block-local indices of the tokens with a depth-d residual, ascending —
    the position -> row map is ``rows[d].tolist().index(i)``; absent means inheritance.
    """

    start: int
    base_k: QuantizedTokenGroups
    base_v: QuantizedChannelGroups
    residual_k: dict[int, QuantizedTokenGroups] = field(default_factory=dict)
    residual_v: dict[int, QuantizedChannelGroups] = field(default_factory=dict)
    rows: dict[int, Tensor] = field(default_factory=dict)

    def reconstruct(self, depth: int) -> tuple[Tensor, Tensor]:
        """FP32 X_hat[depth] of every token of the block: base plus the residuals it has."""
        k, v = self.base_k.decode(), self.base_v.decode()
        for d in range(1, depth + 1):
            if d in self.rows:
                k[self.rows[d]] += self.residual_k[d].decode()
                v[self.rows[d]] += self.residual_v[d].decode()
        return k, v


class QuantizedKVStore:
    """INT4 base + cross-loop INT4 residuals + a compute-dtype tail, for one request."""

    def __init__(self, num_layers: int, num_depths: int, group_size: int = 64, tail: int = 64) -> None:
        self.num_depths, self.group_size, self.tail_min = num_depths, group_size, tail
        self.blocks: list[list[QuantizedBlock]] = [[] for _ in range(num_layers)]
        # tail_k[layer][d]: [n_tail, H, D] logical values of positions flushed..length-1
        self.tail_k: list[list[Tensor | None]] = [[None] * num_depths for _ in range(num_layers)]
        self.tail_v: list[list[Tensor | None]] = [[None] * num_depths for _ in range(num_layers)]
        self.tail_count: list[Tensor | None] = [None] * num_layers  # active depths per tail token
        self.flushed = [0] * num_layers

    @property
    def length(self) -> int:
        n = self.tail_k[-1][0]
        return self.flushed[-1] + (0 if n is None else n.shape[0])

    def append(self, layer: int, k: list[Tensor], v: list[Tensor], depth_count: Tensor) -> None:
        """Append tokens with logical values per depth and their number of active depths [n]."""
        for d in range(self.num_depths):
            self.tail_k[layer][d] = k[d] if self.tail_k[layer][d] is None else torch.cat([self.tail_k[layer][d], k[d]])
            self.tail_v[layer][d] = v[d] if self.tail_v[layer][d] is None else torch.cat([self.tail_v[layer][d], v[d]])
        tc = self.tail_count[layer]
        self.tail_count[layer] = depth_count.clone() if tc is None else torch.cat([tc, depth_count])
        g = self.group_size
        while self.tail_k[layer][0].shape[0] >= self.tail_min + g:
            self._flush_block(layer)

    def _flush_block(self, layer: int) -> None:
        g = self.group_size
        xk = [t[:g] for t in self.tail_k[layer]]
        xv = [t[:g] for t in self.tail_v[layer]]
        count = self.tail_count[layer][:g]
        block = QuantizedBlock(self.flushed[layer], quantize_token_groups(xk[0]), quantize_channel_groups(xv[0], g))
        k_hat, v_hat = block.base_k.decode(), block.base_v.decode()
        for d in range(1, self.num_depths):
            rows = torch.nonzero(count > d).flatten()
            if rows.numel() == 0:
                continue
            # Residual against the reconstructed predecessor, not its source value.
            rk = quantize_token_groups(xk[d][rows].float() - k_hat[rows])
            rv = quantize_channel_groups(xv[d][rows].float() - v_hat[rows], g)
            k_hat[rows] += rk.decode()
            v_hat[rows] += rv.decode()
            block.rows[d], block.residual_k[d], block.residual_v[d] = rows, rk, rv
        self.blocks[layer].append(block)
        self.flushed[layer] += g
        self.tail_k[layer] = [t[g:] for t in self.tail_k[layer]]
        self.tail_v[layer] = [t[g:] for t in self.tail_v[layer]]
        self.tail_count[layer] = self.tail_count[layer][g:]

    def read(self, layer: int, depth: int, length: int) -> tuple[Tensor, Tensor]:
        """Logical K/V at ``depth`` for positions 0..length-1, in the tail's dtype."""
        dtype = self.tail_k[layer][depth].dtype
        ks = [b.reconstruct(depth)[0].to(dtype) for b in self.blocks[layer]]
        vs = [b.reconstruct(depth)[1].to(dtype) for b in self.blocks[layer]]
        k = torch.cat(ks + [self.tail_k[layer][depth]])
        v = torch.cat(vs + [self.tail_v[layer][depth]])
        return k[:length], v[:length]

    def nbytes(self) -> KVBytes:
        out = KVBytes()
        for layer, blocks in enumerate(self.blocks):
            for b in blocks:
                for q in [b.base_k, b.base_v, *b.residual_k.values(), *b.residual_v.values()]:
                    out.payload += q.codes.numel() // 2
                    out.params += (q.minimum.numel() + q.scale.numel()) * 2
            tail = self.tail_k[layer] + self.tail_v[layer]
            if tail[0] is None:
                continue
            out.tail += sum(t.numel() * t.element_size() for t in tail)
            n_tok, heads, dim = tail[0].shape
            out.dense_equivalent += (self.flushed[layer] + n_tok) * heads * dim * tail[0].element_size() * 2 * self.num_depths
        # position -> row maps: one int32 per flushed position and residual depth, per request
        # (shared by every layer and head, since active sets are per loop).
        out.maps = self.flushed[-1] * (self.num_depths - 1) * 4
        return out
