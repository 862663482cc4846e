"""Prefill mode of flashloop.packed_attention: the in-flight keys' loop bounds (inflight_bounds)
and the whole-row kernel against the op's ATen body, under the Triton interpreter.

The kernel attends keys [0, a_end) of a query tile without a position mask and stops at hi_end;
both come from inflight_bounds, which must hold for any order of positions (the kernel is only
faster, never different, when they ascend)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashloop_compile.lowering import packed_ops as P
from flashloop_compile.lowering.kernels import packed_attention as PA
from flashloop_compile.runtime import PackedKVCache


@st.composite
def _positions(draw):
    B = draw(st.integers(1, 3))
    Ti = draw(st.integers(1, 40))
    T = draw(st.integers(1, 40))
    pos = st.integers(-1, 50)
    kp = torch.tensor(draw(st.lists(st.lists(pos, min_size=Ti, max_size=Ti), min_size=B, max_size=B)))
    qp = torch.tensor(draw(st.lists(st.lists(pos, min_size=T, max_size=T), min_size=B, max_size=B)))
    if draw(st.booleans()):  # a prompt: ascending keys, right padding, queries a sorted subset
        n = draw(st.integers(0, Ti))
        kp = torch.full((B, Ti), -1)
        kp[:, :n] = torch.arange(n) + draw(st.integers(0, 5))
        qp = kp[:, :T] if T <= Ti else torch.cat([kp, torch.full((B, T - Ti), -1)], 1)
    qpk = draw(st.sampled_from([1, 2]))
    block_m = draw(st.sampled_from([1, 4, 16]))
    block_n = draw(st.sampled_from([1, 4, 16]))
    return qp, kp, qpk, block_m, block_n


@settings(max_examples=300, deadline=None)
@given(_positions())
def test_inflight_bounds_admit_every_visible_key_and_mask_nothing_needed(case):
    qp, kp, qpk, block_m, block_n = case
    B, T = qp.shape
    bounds = PA.inflight_bounds(qp, kp, qpk, block_m, block_n)
    tiles = -(-(T * qpk) // block_m)
    assert bounds.shape == (B, tiles, 2) and bounds.dtype == torch.int32
    for b in range(B):
        for m in range(tiles):
            a, hi = bounds[b, m].tolist()
            rows = [r // qpk for r in range(m * block_m, min((m + 1) * block_m, T * qpk))]
            qs = [qp[b, t].item() for t in rows if qp[b, t] >= 0]
            assert a % block_n == 0 and 0 <= a <= hi <= kp.shape[1], (a, hi)
            for i, p in enumerate(kp[b].tolist()):
                if i < a:  # attended without a mask: valid and visible to every valid row
                    assert p >= 0 and all(p <= x for x in qs), (b, m, i, p, qs)
                if i >= hi:  # never loaded: visible to no row
                    assert p < 0 or all(p > x for x in qs), (b, m, i, p, qs)
            if qs and kp[b].tolist() == list(range(kp.shape[1])):  # a fresh prompt: the causal band only
                assert hi == min(kp.shape[1], max(qs) + 1) and a == min(min(qs) + 1, kp.shape[1]) // block_n * block_n


def _batch(T: int, dtype):
    """Three rows of in-flight keys: a fresh prompt (ascending), the same shuffled with padding
    spread through it, and a prompt of 40 right-padded to T."""
    g = torch.Generator().manual_seed(3)
    ipos = torch.arange(T).repeat(3, 1)
    shuffled = torch.where(torch.rand(T, generator=g) < 0.15, -1, ipos[1])
    ipos[1] = shuffled[torch.randperm(T, generator=g)]
    ipos[2, 40:] = -1
    return ipos, g


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("queries", ["every token", "token-sparse subset"])
def test_prefill_attention_matches_aten(dtype, queries):
    # Fresh prompts (nothing stored: P0 = 0) at two query heads per kv head, 16-row query tiles
    # and 16-key tiles: unmasked tiles, the masked band, skipped tiles and padding in each row.
    H, D, T = 2, 64, 64
    ipos, g = _batch(T, dtype)
    k, v = (torch.randn(3, H, T, D, generator=g).to(dtype) for _ in range(2))
    if queries == "every token":
        qpos = ipos.clone()
    else:  # loops 3..R: active tokens (sorted) attend every in-flight key
        qpos = torch.stack([ipos[b][torch.randperm(T, generator=g)[:20]].sort().values for b in range(3)])
    q = torch.randn(3, 2 * H, qpos.shape[1], D, generator=g).to(dtype)
    cache = PackedKVCache(1, 4, 3, 256, H, D, dtype=dtype)
    ref = P.packed_attention_aten(q, k, v, qpos, ipos, 0, *cache.op_tensors(0), 0.125)
    out = torch.empty_like(q)
    PA.launch_packed_attention(cache.op_tensors(0), q, k, v, qpos, ipos, 0, 0.125, out, mode="prefill",
                              tuning={"block_m": 16, "block_n_inflight": 16})
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("depth", [0, 2])
def test_prefill_over_stored_keys_matches_aten(dtype, depth):
    # Chunks over a stored prefix (the stored keys read once as rows, then the flash loop): row 0
    # a 40-token chunk after 100 stored tokens (flushed groups, the ring; residual rows of a nested
    # subset at depth 2), row 1 no in-flight keys and queries at scattered stored positions (it
    # reads the store up to its last query: the masked stored band), row 2 a fresh prompt.
    H, D, G = 2, 64, 16
    g = torch.Generator().manual_seed(5)
    cache = PackedKVCache(1, 4, 3, 256, H, D, dtype=dtype, group_size=G, tail=G)
    n = torch.tensor([100, 70, 0])
    pos = torch.arange(100).repeat(3, 1)
    pos = torch.where(pos < n[:, None], pos, -1)
    keep = torch.ones_like(pos, dtype=torch.bool)
    for d in range(depth + 1):
        if d >= 2:
            keep &= torch.rand(pos.shape, generator=g) < 0.5
        k, v = (torch.randn(3, H, 100, D, generator=g).to(dtype) for _ in range(2))
        P.packed_kv_write_aten(*cache.op_tensors(0), k, v, torch.where(keep, pos, -1), d)
    T = 40
    ipos = torch.full((3, T), -1)
    ipos[0] = torch.arange(100, 100 + T)
    ipos[2, :30] = torch.arange(30)
    qpos = ipos.clone()
    qpos[1] = torch.randint(-1, 70, (T,), generator=g).sort().values
    k, v = (torch.randn(3, H, T, D, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(3, 2 * H, T, D, generator=g).to(dtype)
    ref = P.packed_attention_aten(q, k, v, qpos, ipos, depth, *cache.op_tensors(0), 0.125)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    for tuning in ({"block_m": 16, "block_n_inflight": 16}, None):
        out = torch.empty_like(q)
        PA.launch_packed_attention(cache.op_tensors(0), q, k, v, qpos, ipos, depth, 0.125, out, mode="prefill",
                                  tuning=tuning)
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("key,val", [("block_m", 8), ("block_n_inflight", 48)])
def test_prefill_refuses_a_tile_that_is_not_a_tensor_core_tile(key, val):
    cache = PackedKVCache(1, 4, 1, 256, 2, 64)
    q = torch.zeros(1, 2, 80, 64)
    pos = torch.arange(80)[None]
    with pytest.raises(ValueError, match=f"prefill {key} must be a power of two >= 16"):
        PA.launch_packed_attention(cache.op_tensors(0), q, q, q, pos, pos, 0, 0.125, torch.empty_like(q),
                                  mode="prefill", tuning={key: val})
