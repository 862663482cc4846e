"""The code-domain loop-2 reference (sparse decode under quantization, one query row per kv head):
scores and the O_ref / C_ref product taken on the packed codes below the flushed boundary, the
ring and the in-flight token from a small packed_read window -- against the ATen body of
``flashloop::packed_reference_attention``, run by the interpreter.

Without the compute-dtype rounding of the reconstruction, the code domain equals the reference up
to FP32 rounding on fp32 caches; on bf16 caches up to the reference's bf16 rounding of K/V. The
selection is checked as what it is, a top-k of the reference's probabilities: every key taken
outranks every key left (up to the tolerance), and the count is exact."""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.config import ceil_fraction
from flashloop_compile.lowering import packed_ops as P
from flashloop_compile.lowering import packed_sparse_ops as PS
from flashloop_compile.lowering.kernels import packed_read as PR, reference_attention as RA
from flashloop_compile.runtime import PackedKVCache
from tests.lowering.packed_scenario import nested_residual_cache

B, H, D, R, S = 2, 2, 128, 4, 256
LENGTHS = (200, 131)  # stored tokens per row: neither a multiple of the group


def _cache(dtype: torch.dtype, group: int) -> tuple[PackedKVCache, torch.Generator]:
    """Rows written at depths 0..3 with residuals on nested random subsets (absent rows inherit)."""
    return nested_residual_cache(dtype, group, S, LENGTHS, H, D, R, 21, lambda k, d: k * (1 + 0.5 * d), lambda v, d: v - 0.2 * d)


def _step(g, dtype, padded_row: bool = False):
    q = (2.0 * torch.randn(B, H, 1, D, generator=g)).to(dtype)  # sharp enough that top-k carries mass
    ki = torch.randn(B, H, 1, D, generator=g).to(dtype)
    vi = torch.randn(B, H, 1, D, generator=g).to(dtype)
    ip = torch.tensor(LENGTHS)[:, None]
    if padded_row:
        ip[1, 0] = -1
    mask = (torch.arange(S)[None, :] <= ip)[:, None, None, :]  # [B, 1, 1, S]
    return q, ki, vi, ip, mask


def _linear(cache, q, ki, vi, ip, mask, depth, fractions, capacities):
    tensors = cache.op_tensors(0)
    lo, window = RA.linear_window(tensors, depth, ip)
    kw = torch.full((B, H, window.shape[1], D), float("nan"), dtype=q.dtype)
    vw = torch.full_like(kw, float("nan"))
    PR.launch_packed_read(tensors, window, depth, kw, vw, inflight=(ip, ki, vi))
    return lo, window, RA.reference_attention_triton(q, kw, vw, mask, 0.125, fractions, capacities,
                                                     linear=(tensors, depth, lo))


def _check_topk(keys, count, probs, tol):
    """keys [B, H, 1, KMAX] (-1 padded) is a top-count set of probs [B, H, S]."""
    for b in range(B):
        for h in range(H):
            c = int(count[b, h, 0])
            taken = keys[b, h, 0, :c].long()
            assert (keys[b, h, 0, c:] == -1).all() and (taken >= 0).all() and len(set(taken.tolist())) == c
            left = torch.ones(S, dtype=torch.bool)
            left[taken] = False
            if c and left.any():
                assert probs[b, h, taken].min() >= probs[b, h, left].max() - tol, (b, h)


@pytest.mark.parametrize("dtype, group, depth, fraction", [
    (torch.float32, 64, 1, 0.1), (torch.float32, 64, 3, 0.25), (torch.bfloat16, 32, 1, 0.1), (torch.float32, 32, 2, 0.5),
], ids=["fp32_g64_d1", "fp32_g64_d3", "bf16_g32_d1", "fp32_g32_d2"])
def test_linear_reference_matches_aten(dtype, group, depth, fraction):
    # two rows of different lengths (the window starts at each row's own boundary), two kv heads
    # (the residual K parameters are per depth, row and head), residuals present and absent
    # within a tile, groups of 64 and 32 (two and four V groups per row), depths 1..3
    cache, g = _cache(dtype, group)
    q, ki, vi, ip, mask = _step(g, dtype)
    fractions = [fraction]
    capacities = [ceil_fraction(f, S) for f in fractions]
    lo, window, got = _linear(cache, q, ki, vi, ip, mask, depth, fractions, capacities)
    assert (lo > 0).all() and (lo % 16 == 0).all()  # codes below, the window above
    assert (window.amax(1) >= ip[:, 0]).all() and (window[:, 0] == lo).all()  # every visible key from lo on is in the window
    ref = PS.packed_reference_attention_aten(q, ip, ki, vi, depth, *cache.op_tensors(0), mask, 0.125, fractions, capacities)
    out, keys, count, mass, o_ref, c_ref = got
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.equal(count, ref[2])
    torch.testing.assert_close(o_ref, ref[4], atol=tol, rtol=tol)
    torch.testing.assert_close(out.float(), ref[0].float(), atol=tol, rtol=tol)
    # the reference's own probabilities (ATen reads the whole history in the compute dtype)
    kf, vf = P.packed_read_aten(*cache.op_tensors(0), torch.arange(S)[None].expand(B, S), depth, ip, ki, vi)
    probs = torch.softmax(torch.where(mask, (q.float() @ kf.float().transpose(-1, -2)) * 0.125, float("-inf")), -1)
    for f in range(len(fractions)):
        _check_topk(keys[f], count[f], probs[:, :, 0], tol)
        # C_ref and mass of the set the kernel chose, recomputed from the reference's K/V
        sel = torch.zeros(B, H, S)
        for b in range(B):
            for h in range(H):
                sel[b, h, keys[f, b, h, 0, : int(count[f, b, h, 0])].long()] = 1.0
        p_sel = probs[:, :, 0] * sel
        torch.testing.assert_close(mass[f, :, :, 0], p_sel.sum(-1), atol=tol, rtol=tol)
        torch.testing.assert_close(c_ref[f, :, :, 0], torch.einsum("bhs,bhsd->bhd", p_sel, vf.float()), atol=tol, rtol=tol)


def test_linear_reference_takes_only_the_window_from_the_buffer():
    # the window's rows are the only buffer rows read: a window poisoned below the boundary would
    # show; here the positions before lo are checked to be absent from the window, and a padded
    # query row (-1) sees no key (count 0, O_ref 0)
    cache, g = _cache(torch.float32, 64)
    q, ki, vi, ip, mask = _step(g, torch.float32, padded_row=True)
    caps = [ceil_fraction(0.1, S)]
    lo, window, (out, keys, count, mass, o_ref, c_ref) = _linear(cache, q, ki, vi, ip, mask, 1, [0.1], caps)
    assert int(window[0, 0]) == int(lo[0]) and int(lo[0]) <= LENGTHS[0] - 64
    assert (count[0, 1] == 0).all() and (keys[0, 1] == -1).all() and (o_ref[1] == 0).all() and (mass[0, 1] == 0).all()
    ref = PS.packed_reference_attention_aten(q, ip, ki, vi, 1, *cache.op_tensors(0), mask, 0.125, [0.1], caps)
    torch.testing.assert_close(o_ref[0], ref[4][0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads, fractions", [(2 * H, [0.1]), (H, [0.1, 0.25])], ids=["grouped_queries", "two_fractions"])
def test_linear_reference_rejects_what_it_does_not_cover(heads, fractions):
    # packed_reference_attention takes the two-step path for these (linear_fits is False)
    cache, g = _cache(torch.float32, 64)
    q = torch.zeros(B, heads, 1, D)
    ip = torch.tensor(LENGTHS)[:, None]
    kw = torch.zeros(B, H, 192, D)
    mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
    assert not RA.linear_fits(q, H, D, 64, fractions)
    with pytest.raises(ValueError, match="one query row per kv head, one key fraction"):
        RA.reference_attention_triton(q, kw, kw, mask, 0.1, fractions, [26] * len(fractions),
                                      linear=(cache.op_tensors(0), 1, ip[:, 0]))


def test_linear_reference_keeps_the_selected_probabilities():
    # reuse_selected_probabilities' loop 2 over the packed cache: the same outputs, plus each selected
    # key's probability (written by the selection's compaction), equal to the reference's there
    cache, g = _cache(torch.float32, 64)
    q, ki, vi, ip, mask = _step(g, torch.float32)
    tensors = cache.op_tensors(0)
    caps = [ceil_fraction(0.25, S)]
    lo, window = RA.linear_window(tensors, 2, ip)
    kw = torch.empty((B, H, window.shape[1], D))
    vw = torch.empty_like(kw)
    PR.launch_packed_read(tensors, window, 2, kw, vw, inflight=(ip, ki, vi))
    plain = RA.reference_attention_triton(q, kw, vw, mask, 0.125, [0.25], caps, linear=(tensors, 2, lo))
    got = RA.reference_attention_triton(q, kw, vw, mask, 0.125, [0.25], caps, linear=(tensors, 2, lo), keep_probs=True)
    assert len(got) == 7
    for a, b in zip(plain, got):
        assert torch.equal(a, b)
    keys, count, mass, p_sel = got[1], got[2], got[3], got[6]
    kf, _ = P.packed_read_aten(*tensors, torch.arange(S)[None].expand(B, S), 2, ip, ki, vi)
    probs = torch.softmax(torch.where(mask, (q @ kf.transpose(-1, -2)) * 0.125, float("-inf")), -1)[:, :, 0]
    valid = keys[0, :, :, 0] >= 0
    want = torch.where(valid, probs.gather(-1, keys[0, :, :, 0].clamp_min(0).long()), 0.0)
    torch.testing.assert_close(p_sel[0, :, :, 0], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(p_sel.sum(-1), mass, atol=1e-5, rtol=1e-5)
    # the op's ATen body keeps the same probabilities at the same keys
    ref = PS.packed_reference_attention_probs_aten(q, ip, ki, vi, 2, *tensors, mask, 0.125, [0.25], caps)
    dense = lambda k, p: torch.zeros(B, H, 1, S + 1).scatter(-1, torch.where(k >= 0, k, S).long(), p)[..., :S]  # noqa: E731
    torch.testing.assert_close(dense(keys[0], p_sel[0]), dense(ref[1][0], ref[6][0]), atol=1e-5, rtol=1e-5)
