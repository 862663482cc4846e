"""A small generation driven through the packed KV ops, shared by the packed-op tests.

Rows of a batch are independent requests with their own forwards (prefill chunks, then decode
steps). Each forward computes every depth of its tokens: depths 0 and 1 densely, later depths
for nested subsets (token-sparse prefill); decode tokens are active at every depth. Logical
values follow SPEC.md: a token changes at depth d iff it is active there, otherwise it inherits
depth d-1's value. The same values feed ``QuantizedKVStore`` (one per row).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from flashloop_compile.reference.kvstore import QuantizedKVStore

GARBAGE = 1.0e4  # padded entries of k/v: must never reach the cache


@dataclass
class RowForward:
    """One row's part of a forward: positions and, per token, the number of depths computed."""

    start: int
    n: int
    counts: Tensor  # [n] int64, 1..R
    k: list[Tensor] = field(default_factory=list)  # per depth [n, H, D]
    v: list[Tensor] = field(default_factory=list)

    @property
    def positions(self) -> Tensor:
        return torch.arange(self.start, self.start + self.n)


def nested_counts(n: int, R: int, g: torch.Generator, fractions=(1.0, 1.0, 0.3, 0.12), start: int = 0) -> Tensor:
    """Depth counts of a prefill chunk: depth d active for a nested random subset."""
    counts = torch.ones(n, dtype=torch.long)
    active = torch.ones(n, dtype=torch.bool)
    for d in range(1, R):
        f = fractions[min(d, len(fractions) - 1)]
        if f < 1.0:
            idx = torch.nonzero(active).flatten()
            keep = max(1, int(round(f * n)))
            keep = min(keep, idx.numel())
            chosen = idx[torch.randperm(idx.numel(), generator=g)[:keep]]
            active = torch.zeros(n, dtype=torch.bool)
            active[chosen] = True
        counts[active] = d + 1
    return counts


def logical_values(n: int, H: int, D: int, counts: Tensor, R: int, g: torch.Generator, dtype, step: float = 0.05):
    k0 = torch.randn(n, H, D, generator=g) * 2.0
    v0 = torch.randn(n, H, D, generator=g)
    ks, vs = [k0], [v0]
    for d in range(1, R):
        kd, vd = ks[-1].clone(), vs[-1].clone()
        rows = counts > d
        m = int(rows.sum())
        kd[rows] += step * torch.randn(m, H, D, generator=g)
        vd[rows] += step * torch.randn(m, H, D, generator=g)
        ks.append(kd)
        vs.append(vd)
    return [x.to(dtype) for x in ks], [x.to(dtype) for x in vs]


def make_row_forward(start: int, n: int, H: int, D: int, R: int, g: torch.Generator, dtype, sparse: bool) -> RowForward:
    counts = nested_counts(n, R, g) if sparse else torch.full((n,), R, dtype=torch.long)
    ks, vs = logical_values(n, H, D, counts, R, g, dtype)
    return RowForward(start, n, counts, ks, vs)


def batched_depth_call(rows: list[RowForward | None], depth: int, H: int, D: int, dtype, pad: str = "right"):
    """k, v [B, H, T, D] and positions [B, T] of the tokens active at ``depth`` (padding -1 with
    garbage values), T = the longest row."""
    sel = []
    for rf in rows:
        if rf is None:
            sel.append(None)
            continue
        sel.append(torch.nonzero(rf.counts > depth).flatten())
    T = max([0] + [s.numel() for s in sel if s is not None])
    B = len(rows)
    k = torch.full((B, H, T, D), GARBAGE, dtype=dtype)
    v = torch.full((B, H, T, D), -GARBAGE, dtype=dtype)
    pos = torch.full((B, T), -1, dtype=torch.long)
    for b, (rf, s) in enumerate(zip(rows, sel)):
        if rf is None or s.numel() == 0:
            continue
        m = s.numel()
        sl = slice(0, m) if pad == "right" else slice(T - m, T)
        pos[b, sl] = rf.positions[s]
        k[b, :, sl] = rf.k[depth][s].transpose(0, 1)
        v[b, :, sl] = rf.v[depth][s].transpose(0, 1)
    return k, v, pos


def batched_inflight(rows: list[RowForward | None], depth: int, H: int, D: int, dtype):
    """Every token of the forward at ``depth`` (logical: inactive ones inherit), padded."""
    T = max([0] + [rf.n for rf in rows if rf is not None])
    B = len(rows)
    k = torch.full((B, H, T, D), GARBAGE, dtype=dtype)
    v = torch.full((B, H, T, D), -GARBAGE, dtype=dtype)
    pos = torch.full((B, T), -1, dtype=torch.long)
    for b, rf in enumerate(rows):
        if rf is None:
            continue
        pos[b, : rf.n] = rf.positions
        k[b, :, : rf.n] = rf.k[depth].transpose(0, 1)
        v[b, :, : rf.n] = rf.v[depth].transpose(0, 1)
    return k, v, pos


def add_constant_groups(rf: RowForward, R: int) -> None:
    """Constant K group (channel 3 of head 0 over the first block, every depth) and constant V
    groups (token 5's whole head-1 row), kept through inheritance."""
    if rf.n >= 64:
        for d in range(R):
            rf.k[d][:64, 0, 3] = 0.75
    if rf.n > 5:
        for d in range(R):
            rf.v[d][5, 1, :] = -1.25


def scenario(H: int, D: int, R: int, dtype, seed: int = 0, decode_steps: int = 3):
    """Forwards of a two-row batch: list of [RowForward | None, RowForward | None].

    Row 0: a 190-token prompt in chunks of 130 and 60 (sparse depths 2, 3), then decode steps
    (lengths 191: tail 127; 192: a flush, tail 64; then a 2-token step). Row 1: a 37-token prompt
    (shorter than one group), a second chunk of 100, then decode steps (one skipped: padding)."""
    g = torch.Generator().manual_seed(seed)
    f1 = [make_row_forward(0, 130, H, D, R, g, dtype, True), make_row_forward(0, 37, H, D, R, g, dtype, True)]
    add_constant_groups(f1[0], R)
    add_constant_groups(f1[1], R)
    f2 = [make_row_forward(130, 60, H, D, R, g, dtype, True), make_row_forward(37, 100, H, D, R, g, dtype, True)]
    forwards = [f1, f2]
    lens = [190, 137]
    for step in range(decode_steps):
        fw = []
        for b in range(2):
            if b == 1 and step == 1:
                fw.append(None)  # row 1 does not take part in this step
                continue
            n = 2 if step == 2 else 1
            fw.append(make_row_forward(lens[b], n, H, D, R, g, dtype, False))
            lens[b] += n
        forwards.append(fw)
    return forwards


def reference_stores(num_layers: int, R: int, B: int = 2) -> list[QuantizedKVStore]:
    return [QuantizedKVStore(num_layers, R, 64, 64) for _ in range(B)]


def append_reference(stores: list[QuantizedKVStore], layer: int, fw: list[RowForward | None], layer_values) -> None:
    for b, rf in enumerate(fw):
        if rf is None:
            continue
        ks, vs = layer_values(rf)
        stores[b].append(layer, ks, vs, rf.counts)


def layer_perturb(rf: RowForward, layer: int) -> tuple[list[Tensor], list[Tensor]]:
    """Per-layer values: layer l's K/V = base values * (1 + 0.5 l) (same activity pattern)."""
    f = 1.0 + 0.5 * layer
    return [(x.float() * f).to(x.dtype) for x in rf.k], [(x.float() * f).to(x.dtype) for x in rf.v]


def scale_call(k: Tensor, v: Tensor, pos: Tensor, layer: int) -> tuple[Tensor, Tensor]:
    f = 1.0 + 0.5 * layer
    pad = (pos < 0)[:, None, :, None]
    ks = torch.where(pad, k, (k.float() * f).to(k.dtype))
    vs = torch.where(pad, v, (v.float() * f).to(v.dtype))
    return ks, vs


def nested_residual_cache(dtype, group: int, max_seq: int, lengths, heads: int, head_dim: int, R: int, seed: int,
                          k_at, v_at, keep: float = 0.6):
    """A one-layer packed cache of len(lengths) rows written with packed_kv_write_aten at depths
    0..R-1: every stored token at depth 0, then nested random subsets (each token kept with
    probability ``keep`` per depth; absent residuals inherit). k_at(k, d) / v_at(v, d) give depth
    d's values from one FP32 draw per row. Returns the cache and the generator (for more draws)."""
    from flashloop_compile.lowering import packed_ops as P
    from flashloop_compile.runtime import PackedKVCache

    B = len(lengths)
    cache = PackedKVCache(1, R, B, max_seq, heads, head_dim, group_size=group, tail=group, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    n = max(lengths)
    k = torch.randn(B, heads, n, head_dim, generator=g)
    v = torch.randn(B, heads, n, head_dim, generator=g)
    pos = torch.arange(n).expand(B, n)
    kept = pos < torch.tensor(lengths)[:, None]
    for d in range(R):
        if d:
            kept = kept & (torch.rand(B, n, generator=g) < keep)
        P.packed_kv_write_aten(*cache.op_tensors(0), k_at(k, d).to(dtype), v_at(v, d).to(dtype), torch.where(kept, pos, -1), d)
    return cache, g
