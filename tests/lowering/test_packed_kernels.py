"""The packed-KV Triton launchers (run by the interpreter on CPU tensors) against the ATen bodies:
identical cache tensors after the same writes, identical reads, attention within tolerance."""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.lowering import packed_ops as P
from flashloop_compile.lowering.kernels import packed_attention as PA, packed_read as PR, packed_write as PW
from flashloop_compile.runtime import PackedKVCache
from tests.lowering.packed_scenario import batched_depth_call, batched_inflight, scenario

H, D, R, S = 2, 64, 4, 256


def write_kernel(cache, layer, k, v, pos, depth, chunks=None, rows_tile=None):
    PW.launch_packed_kv_write(cache.op_tensors(layer), k, v, pos, depth, chunks=chunks, rows_tile=rows_tile)


def read_kernel(cache, layer, pos, depth, **kw):
    shape = (pos.shape[0], cache.kv_heads, pos.shape[-1], cache.head_dim)
    out_k = torch.empty(shape, dtype=cache.dtype)
    out_v = torch.empty(shape, dtype=cache.dtype)
    PR.launch_packed_read(cache.op_tensors(layer), pos, depth, out_k, out_v, **kw)
    return out_k, out_v


def attention_kernel(cache, layer, q, ki, vi, qpos, ipos, depth, scale, **kw):
    out = torch.empty_like(q)
    PA.launch_packed_attention(cache.op_tensors(layer), q, ki, vi, qpos, ipos, depth, scale, out, **kw)
    return out


def assert_same_cache(a: PackedKVCache, b: PackedKVCache, where: str) -> None:
    for name, x, y in zip(P.CACHE_NAMES, a.op_tensors(0), b.op_tensors(0)):
        assert torch.equal(x, y), f"{name} differs after {where}"


def _positions(lengths):
    n = max(lengths)
    pos = torch.full((len(lengths), n), -1, dtype=torch.long)
    for b, m in enumerate(lengths):
        pos[b, :m] = torch.arange(m)
    return pos


# Where test_write_read_attention_match_aten runs each launch variant. Under the interpreter a
# launch costs per program and operation (minutes for the whole scenario), so a variant runs at
# the data points that exercise its code rather than at every point of the scenario. Every
# variant still runs at every depth it ran at (the fast decode and bulk read kernels take the
# depth as a constexpr), against the ATen body with the same tolerance; writes and cache checks
# are unchanged. The default launches run in both dtypes (the compute-dtype code: _round_to, the
# ring's dtype); the tile-size variants (PREFILL_TILES, DECODE_F3) in float32 only: a tile size
# changes no dtype code (under the interpreter every dot is FP32 in both dtypes).
#
# Prefill (f == 0 at depth 0, f == 1 at depth 3): the default tiles at both. The tile-size variants (block_m 32 / 16, block_n_inflight 16) at
# f == 1 only: stored keys (row 0: a flushed group and the ring, residuals to depth 3),
# left-padded queries, in-flight keys in 7 tiles of 16 (padded tiles skipped) and, at block_m
# 16, two query tiles. f == 0 (a fresh prompt: no stored key) runs the same code on more tiles.
# num_warps is ignored by the interpreter.
PREFILL_BOTH = [dict(mode="prefill")]
PREFILL_TILES = [dict(mode="prefill", tuning={"block_m": 32, "block_n_inflight": 16, "num_warps": 4}),
                 dict(mode="prefill", tuning={"block_m": 16, "block_n_inflight": 16})]
# One query row per kv head (f == 2: both rows active, 2 bulk tiles each (one split empty), the
# ring wrapped in both; f == 3: row 0 just flushed a second group, 4 bulk tiles over uneven
# splits, _flushed_min over depths whose boundaries differ mid-forward; row 1 padding). The fast
# path's default launch and the generic path (fast False) at both. The other variants at f == 3
# only: block_n 16 with the default splits, num_splits 2 with num_stages 1 (num_stages is ignored
# by the interpreter). What f == 2 adds for them is code checked
# elsewhere here: the fast kernel's second row (row offsets) and the FAST tail program over a
# wrapped ring by the default launch at f == 2, _bulk_k / _bulk_v of a second row by the reads.
DECODE_BOTH = [dict(num_splits=3), dict(num_splits=3, fast=False)]
DECODE_F3 = [dict(tuning={"block_n": 16, "block_n_residual": 16}), dict(num_splits=2, tuning={"num_stages": 1})]
# Reads (f == 1, after the prompt, and f == 4, at the end; every depth): the default read of the
# whole history and the per-head read at both. The bulk read with 16-position tiles at f == 4
# only, over the shifted run: there row 0's bulk is two blocks and row 1's one (f == 1: one block
# each, the same values), and the run's tiles are of every kind the unshifted and f == 1 runs
# had -- bulk tiles, padding, the ring (wrapped in row 1, token-sparse prompt tokens), a partial
# last tile -- plus a bulk tile across a block boundary, a generic tile straddling the flushed
# boundary, unwritten positions, and read slots that differ from the positions (the unshifted
# run's are equal). The per-head bulk read at f == 4.


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_read_attention_match_aten(dtype):
    ca = PackedKVCache(1, R, 2, S, H, D, dtype=dtype)
    ck = PackedKVCache(1, R, 2, S, H, D, dtype=dtype)
    lengths = [0, 0]
    g = torch.Generator().manual_seed(7)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    forwards = scenario(H, D, R, dtype, seed=1)
    last = len(forwards) - 1
    for f, fw in enumerate(forwards):
        for d in range(R):
            k, v, pos = batched_depth_call(fw, d, H, D, dtype, pad="left" if f == 1 else "right")
            P.packed_kv_write_aten(*ca.op_tensors(0), k, v, pos, d)
            write_kernel(ck, 0, k, v, pos, d)
            assert_same_cache(ca, ck, f"forward {f} depth {d}")
            if (f < 2 and d == 3 * f) or (f == last and d in (0, 2, 3)):
                # attention mid-forward: decode mode (split-K) and, for the prompt chunk, prefill mode
                ki, vi, ipos = batched_inflight(fw, d, H, D, dtype)
                q = torch.randn(pos.shape[0], 2 * H, pos.shape[1], D, generator=g).to(dtype)
                ref = P.packed_attention_aten(q, ki, vi, pos, ipos, d, *ca.op_tensors(0), 0.125)
                tiles = PREFILL_TILES if f == 1 and dtype == torch.float32 else []
                variants = [dict(num_splits=1 + d)] if f >= 2 else PREFILL_BOTH + tiles
                for kw in variants:
                    out = attention_kernel(ck, 0, q, ki, vi, pos, ipos, d, 0.125, **kw)
                    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
            if f >= 2 and pos.shape[1] == 1 and d in (0, 2, 3):
                # one query row per kv head: the fast decode path (packed bulk without per-token
                # resolution) and the generic path, over token-sparse residual rows; a padded row
                ki, vi, ipos = batched_inflight(fw, d, H, D, dtype)
                q1 = torch.randn(pos.shape[0], H, 1, D, generator=g).to(dtype)
                ref1 = P.packed_attention_aten(q1, ki, vi, pos, ipos, d, *ca.op_tensors(0), 0.125)
                for kw in DECODE_BOTH + (DECODE_F3 if f == 3 and dtype == torch.float32 else []):
                    out = attention_kernel(ck, 0, q1, ki, vi, pos, ipos, d, 0.125, **kw)
                    torch.testing.assert_close(out.float(), ref1.float(), atol=tol, rtol=tol)
        for b, rf in enumerate(fw):
            if rf is not None:
                lengths[b] = rf.start + rf.n
        if f in (1, last):
            pos = _positions(lengths)
            for d in range(R):
                ka, va = P.packed_read_aten(*ca.op_tensors(0), pos, d, *P.no_inflight(ca, pos.shape[0], pos.device))
                kk, vk = read_kernel(ck, 0, pos, d)
                assert torch.equal(ka, kk) and torch.equal(va, vk), (f, d)
                if f == last:
                    # the bulk read (runs of consecutive positions below the flushed boundaries; the
                    # ragged rows' padding, the ring and the run's end go to the generic kernel)
                    run = torch.where(pos >= 0, pos + 5, pos)
                    ka, va = P.packed_read_aten(*ca.op_tensors(0), run, d, *P.no_inflight(ca, run.shape[0], run.device))
                    kk, vk = read_kernel(ck, 0, run, d, bulk=True, block_p=16)
                    assert torch.equal(ka, kk) and torch.equal(va, vk), (f, d, "bulk", 5)
                # per-head positions (sparse decode's selected keys): out of order, repeated,
                # unwritten and -1 entries; each head equals the shared read of its positions
                sel = torch.randint(-1, max(lengths) + 3, (pos.shape[0], H, 37), generator=g)
                ka, va = P.packed_read_aten(*ca.op_tensors(0), sel, d, *P.no_inflight(ca, sel.shape[0], sel.device))
                kk, vk = read_kernel(ck, 0, sel, d)
                assert torch.equal(ka, kk) and torch.equal(va, vk), (f, d, "per head")
                if f == last:
                    kk, vk = read_kernel(ck, 0, sel, d, bulk=True, block_p=16)
                    assert torch.equal(ka, kk) and torch.equal(va, vk), (f, d, "per head, bulk")
                for h in range(H):
                    ks, vs = P.packed_read_aten(*ca.op_tensors(0), sel[:, h].contiguous(), d, *P.no_inflight(ca, sel.shape[0], sel.device))
                    assert torch.equal(ka[:, h], ks[:, h]) and torch.equal(va[:, h], vs[:, h]), (f, d, h)


def test_decode_attention_single_query_and_gqa_dot_path():
    # T=1 with Hq=H (BM=1, no dot) and T=1 with Hq=4H (dot path), one split and several splits.
    cache = PackedKVCache(1, 2, 2, S, H, D, dtype=torch.float32)
    g = torch.Generator().manual_seed(3)
    n = 200
    k, v = torch.randn(2, H, n, D, generator=g), torch.randn(2, H, n, D, generator=g)
    pos = torch.arange(n)[None].repeat(2, 1)
    pos[1, 150:] = -1  # ragged: row 1 has 150 tokens
    for d in range(2):
        P.packed_kv_write_aten(*cache.op_tensors(0), k + d * 0.1, v - d * 0.1, pos, d)
    ki, vi = torch.randn(2, H, 1, D, generator=g), torch.randn(2, H, 1, D, generator=g)
    ipos = torch.tensor([[200], [150]])
    for hq in (H, 4 * H):
        q = torch.randn(2, hq, 1, D, generator=g)
        for d in range(2):
            ref = P.packed_attention_aten(q, ki, vi, ipos, ipos, d, *cache.op_tensors(0), 0.2)
            for ns in (1, 4):
                out = attention_kernel(cache, 0, q, ki, vi, ipos, ipos, d, 0.2, num_splits=ns)
                torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunks, rows_tile", [(1, None), (5, None), (2, 0), (1, 4), (2, 64)])
def test_chunked_flush_writes_the_same_cache(chunks, rows_tile):
    # several flush programs per (batch, head), each a range of groups: the same cache tensors
    # (residual rows allocated in position order across ranges) over the mixed scenario (ring
    # rows active at a depth: chunked prompts, decode steps). rows_tile: a residual flush on
    # whole groups (0), on its active rows in tiles of 4 (up to 16 tiles a group: the extrema
    # pass) or in one tile of the whole group (None: the launcher's choice per depth). Ranges of
    # several groups with the launcher's tiles: 5 ranges over the long prompt's six groups; two
    # ranges of three groups with whole-group and one-tile flushes.
    ca = PackedKVCache(1, R, 2, S, H, D, dtype=torch.float32)
    ck = PackedKVCache(1, R, 2, S, H, D, dtype=torch.float32)
    for f, fw in enumerate(scenario(H, D, R, torch.float32, seed=3)):
        for d in range(R):
            k, v, pos = batched_depth_call(fw, d, H, D, torch.float32, pad="left" if f == 1 else "right")
            P.packed_kv_write_aten(*ca.op_tensors(0), k, v, pos, d)
            write_kernel(ck, 0, k, v, pos, d, chunks=chunks, rows_tile=rows_tile)
            assert_same_cache(ca, ck, f"forward {f} depth {d} ({chunks} ranges, rows tile {rows_tile})")
    if rows_tile == 4:
        # tiles of 4 in one range: the scenario's 130-token chunk already flushes two groups of 16
        # tiles at depth 1 and token-sparse groups at depths 2-3; the long prompt's six groups of
        # the same tiles run the same code (for most of a minute under the interpreter)
        return
    # one long prompt: six groups flushed per call, depths 2-3 on nested subsets (token-sparse
    # rows: residual rows allocated in position order across the ranges), a ragged second row
    ca = PackedKVCache(1, R, 2, 512, H, D, dtype=torch.float32)
    ck = PackedKVCache(1, R, 2, 512, H, D, dtype=torch.float32)
    g = torch.Generator().manual_seed(4)
    n = 450
    k, v = torch.randn(2, H, n, D, generator=g), torch.randn(2, H, n, D, generator=g)
    pos = torch.arange(n)[None].repeat(2, 1)
    pos[1, 300:] = -1
    keep = torch.ones(2, n, dtype=torch.bool)
    for d in range(R):
        if d >= 2:
            keep &= torch.rand(2, n, generator=g) < 0.5
        sel = torch.where(keep, pos, -1)
        P.packed_kv_write_aten(*ca.op_tensors(0), k + d, v - d, sel, d)
        write_kernel(ck, 0, k + d, v - d, sel, d, chunks=chunks, rows_tile=rows_tile)
        assert_same_cache(ca, ck, f"long prompt depth {d} ({chunks} ranges, rows tile {rows_tile})")


def test_one_token_writes_match_aten_across_a_flush_with_a_padded_row():
    # decode writes one token per call (launch_packed_kv_write's ONE_TOKEN: no search keys, no run
    # test): the same cache tensors as the ATen body at every depth of every step, over steps that
    # flush row 0's group 64..127 (its ring full at 128), row 1 padded (-1) on alternate steps and
    # token-sparse residuals (depths 2-3 on a subset of the prompt and of the steps)
    ca = PackedKVCache(1, R, 2, S, H, D, dtype=torch.float32)
    ck = PackedKVCache(1, R, 2, S, H, D, dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    n = 120
    k, v = torch.randn(2, H, n, D, generator=g), torch.randn(2, H, n, D, generator=g)
    pos = torch.arange(n)[None].repeat(2, 1)
    pos[1, 50:] = -1
    for d in range(R):
        sel = torch.where(torch.rand(2, n, generator=g) < (1.0 if d < 2 else 0.4), pos, -1)
        P.packed_kv_write_aten(*ca.op_tensors(0), k + d, v - d, sel, d)
        write_kernel(ck, 0, k + d, v - d, sel, d)
    assert_same_cache(ca, ck, "the prompt")
    for step in range(12):
        p = torch.tensor([[n + step], [50 + step // 2 if step % 2 == 0 else -1]])
        kt, vt = torch.randn(2, H, 1, D, generator=g), torch.randn(2, H, 1, D, generator=g)
        for d in range(R):
            sel = p if d < 2 or step % 3 else torch.full_like(p, -1)
            P.packed_kv_write_aten(*ca.op_tensors(0), kt + d, vt - d, sel, d)
            write_kernel(ck, 0, kt + d, vt - d, sel, d)
            assert_same_cache(ca, ck, f"step {step} depth {d}")
    flushed = dict(zip(P.CACHE_NAMES, ca.op_tensors(0)))["flushed"]
    assert flushed[0, 0].item() == 64, f"the steps flushed row 0's second group: {flushed}"


def test_overflow_matches_aten():
    ca = PackedKVCache(1, 3, 1, 128, H, D, residual_capacity=[8, 2], dtype=torch.float32)
    ck = PackedKVCache(1, 3, 1, 128, H, D, residual_capacity=[8, 2], dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, H, 128, D, generator=g), torch.randn(1, H, 128, D, generator=g)
    pos = torch.arange(128)[None]
    for d in range(3):
        P.packed_kv_write_aten(*ca.op_tensors(0), k + d, v - d, pos, d)
        write_kernel(ck, 0, k + d, v - d, pos, d)
        assert_same_cache(ca, ck, f"depth {d}")
    assert ck.overflow.item() == 1


@pytest.mark.parametrize("tuning", [{}, {"block_n": 16, "block_n_residual": 16, "num_stages": 1}], ids=["defaults", "bn16_stages1"])
def test_fast_decode_variants_with_two_v_groups_per_row(tuning):
    # head_dim 128: two V groups per row, so a wrong group broadcast shows; residuals at depths
    # 1-2 on a nested subset (absent rows inherit), one decode token at each depth
    _fast_decode_case(tuning, group=64)


def test_decode_bulk_kernel_with_four_v_groups_per_row():
    # group 32 at head_dim 128: the bulk kernel's general (reshape) broadcast of V parameters
    _fast_decode_case({"block_n": 16, "block_n_residual": 16}, group=32)


def _fast_decode_case(tuning, group):
    d_, s_ = 128, 192
    cache = PackedKVCache(1, 3, 1, s_, 1, d_, group_size=group, tail=group, dtype=torch.float32)
    g = torch.Generator().manual_seed(5)
    n = 160
    k, v = torch.randn(1, 1, n, d_, generator=g), torch.randn(1, 1, n, d_, generator=g)
    pos = torch.arange(n)[None]
    keep = torch.ones(n, dtype=torch.bool)
    for d in range(3):
        if d:
            keep &= torch.rand(n, generator=g) < 0.6
        sel = pos[:, keep]
        P.packed_kv_write_aten(*cache.op_tensors(0), (k + d * 0.3)[:, :, keep], (v - d * 0.2)[:, :, keep], sel, d)
    ki, vi = torch.randn(1, 1, 1, d_, generator=g), torch.randn(1, 1, 1, d_, generator=g)
    ipos = torch.tensor([[n]])
    q = torch.randn(1, 1, 1, d_, generator=g)
    for d in range(3):
        ref = P.packed_attention_aten(q, ki, vi, ipos, ipos, d, *cache.op_tensors(0), 0.1)
        out = attention_kernel(cache, 0, q, ki, vi, ipos, ipos, d, 0.1, num_splits=2, tuning=tuning)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


class _Skipped:
    """Stands in for a kernel that must not be needed: launching it does nothing."""

    arg_names = ()

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@pytest.mark.parametrize("split", [4, 2])
@pytest.mark.parametrize("head1_tile2", [[384] + [3] * 15, list(range(8)) + [384] + [5] * 7],
                         ids=["tail_first", "tail_in_second_half"])
def test_scattered_keys_are_read_by_the_bulk_kernel_alone(monkeypatch, split, head1_tile2):
    # A correction's selected keys: scattered, unsorted, per head, flushed at every depth, over
    # token-sparse residuals (depths 2-3 on nested subsets); head 1's second 16-position tile holds
    # a tail position (the bulk test refuses it), read on ``split`` sub-tiles. The bulk kernel
    # alone (the generic kernel disabled, outputs poisoned) writes every row as the ATen body reads it.
    monkeypatch.setattr(PR, "_read_kernel", _Skipped())
    cache, g = _token_sparse_cache()
    sel = torch.stack([torch.randperm(384, generator=g)[:32] for _ in range(H)])[None]  # [1, H, 32]
    sel[0, 1, 16:] = torch.tensor(head1_tile2)
    for d in range(R):
        ka, va = P.packed_read_aten(*cache.op_tensors(0), sel, d, *P.no_inflight(cache, 1, sel.device))
        kk = torch.full((1, H, 32, D), float("nan"))
        vk = torch.full_like(kk, float("nan"))
        PR.launch_packed_read(cache.op_tensors(0), sel, d, kk, vk, block_p=16, split=split)
        assert torch.equal(ka, kk) and torch.equal(va, vk), f"depth {d}"


def _token_sparse_cache():
    """One row of 450 tokens, depths 2-3 on nested random subsets: 6 groups flushed at every depth
    (384 positions), 66 in the tail."""
    cache = PackedKVCache(1, R, 1, 512, H, D, dtype=torch.float32)
    g = torch.Generator().manual_seed(6)
    n = 450
    k, v = torch.randn(1, H, n, D, generator=g), torch.randn(1, H, n, D, generator=g)
    pos = torch.arange(n)[None]
    keep = torch.ones(1, n, dtype=torch.bool)
    for d in range(R):
        if d >= 2:
            keep &= torch.rand(1, n, generator=g) < 0.5
        P.packed_kv_write_aten(*cache.op_tensors(0), k + d, v - d, torch.where(keep, pos, -1), d)
    assert cache.op_tensors(0)[P.CACHE_NAMES.index("flushed")].min().item() == 384
    return cache, g


@pytest.mark.parametrize("mode", ["generic", "bulk"])
def test_read_returns_the_steps_own_tokens_from_flight(monkeypatch, mode):
    # sparse decode's reads: the whole history and per-head selected keys (with a padding entry),
    # with this step's tokens in flight (decode: one past the end; and, as a stress of the bulk
    # tiles, one below the flushed boundary, whose tile must not skip the overlay, with a padded
    # second token). "bulk" (the default at this shape): the bulk kernel reads every tile itself,
    # the generic kernel is never launched (here: launching it does nothing, so a tile left to it
    # stays NaN); "generic": the generic kernel alone
    bulk = mode == "bulk"
    if bulk:
        monkeypatch.setattr(PR, "_read_kernel", _Skipped())
    cache, g = _token_sparse_cache()
    for inflight_pos in ([[450]], [[100, -1]]):
        ip = torch.tensor(inflight_pos)
        ki = torch.randn(1, H, ip.shape[1], D, generator=g)
        vi = torch.randn(1, H, ip.shape[1], D, generator=g)
        whole = torch.arange(452)[None]
        sel = torch.stack([torch.randperm(452, generator=g)[:48] for _ in range(H)])[None]
        sel[0, 0, :2] = ip.clamp_min(0)[0, 0]  # head 0 selected the in-flight token (twice)
        sel[0, 1, -1] = -1  # padding: reads as 0
        for positions in (whole, sel):
            for d in (1, 3):
                ka, va = P.packed_read_aten(*cache.op_tensors(0), positions, d, ip, ki, vi)
                out_k = torch.full((1, H, positions.shape[-1], D), float("nan"))
                out_v = torch.full_like(out_k, float("nan"))
                PR.launch_packed_read(cache.op_tensors(0), positions, d, out_k, out_v, inflight=(ip, ki, vi),
                                     bulk=bulk, block_p=64 if positions is whole else 16)
                assert torch.equal(ka, out_k) and torch.equal(va, out_v), (inflight_pos, positions.dim(), d)
            # the overlay is there (not only equal to the ATen body): the first token's rows, exactly
            if positions is whole:
                assert torch.equal(out_k[0, :, ip[0, 0]], ki[0, :, 0]) and torch.equal(out_v[0, :, ip[0, 0]], vi[0, :, 0])
            else:
                assert torch.equal(out_k[0, 0, :2], ki[0, 0, :1].expand(2, -1))
