"""Dense causal attention and the sparse-decode reference/correction pair (SPEC.md section 2)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashloop_compile.reference.attention import (
    attention_probs,
    causal_attention,
    correction_attention,
    reference_attention,
    reuse_correction_attention,
)

ATOL = 1e-5


def rand(g, *shape, scale=1.0):
    return torch.randn(*shape, generator=g) * scale


# --------------------------------------------------------------------------------------------
# The SPEC's scalar worked example
# --------------------------------------------------------------------------------------------


def test_spec_scalar_example():
    # head_dim 1, one head; query at position 2 sees keys at 0, 1, 2. With q = 1 the score of
    # key i is k_i / sqrt(1) = log p_i, so the reference softmax is exactly p = [0.1, 0.3, 0.6].
    p_ref = torch.tensor([0.1, 0.3, 0.6], dtype=torch.float64)
    q = torch.ones(1, 1, 1)
    k_pos, q_pos = torch.arange(3), torch.tensor([2])
    k2 = p_ref.log().float().reshape(3, 1, 1)
    v2 = torch.tensor([10.0, 20.0, 30.0]).reshape(3, 1, 1)
    # ceil(0.5 * 3) = 2 keys: the two most probable, positions 2 and 1.
    o_ref, (state,) = reference_attention(q, q_pos, k2, v2, k_pos, [0.5])
    assert o_ref.item() == pytest.approx(25.0, abs=ATOL)
    assert state.count.tolist() == [2]
    assert state.keys[0, 0].tolist() == [2, 1]
    assert state.mass.item() == pytest.approx(0.9, abs=1e-6)
    assert state.c_ref.item() == pytest.approx(24.0, abs=ATOL)
    assert state.o_ref.item() == pytest.approx(25.0, abs=ATOL)

    # The later loop: selected softmax [0.75, 0.25] over keys 1, 2 with values [20, 40]. The
    # unselected key 0 gets a huge score and value: it must not matter.
    k4 = torch.tensor([50.0, math.log(0.75), math.log(0.25)]).reshape(3, 1, 1)
    v4 = torch.tensor([1000.0, 20.0, 40.0]).reshape(3, 1, 1)
    out = correction_attention(q, k4, v4, state)
    # 25 - 24 + 0.9 * (0.75 * 20 + 0.25 * 40) = 23.5, up to FP32 rounding of log/exp.
    assert out.shape == (1, 1, 1)
    assert out.item() == pytest.approx(23.5, abs=ATOL)
    # Dense attention over the later loop's keys would be dominated by key 0: very different.
    assert causal_attention(q, q_pos, k4, v4, k_pos).item() == pytest.approx(1000.0, abs=1e-3)

    # reuse_selected_probabilities: loop 2's probabilities over S renormalized, [0.6, 0.3] / 0.9 in
    # the state's key order (2, 1), with the later values (40 at key 2, 20 at key 1); no K read.
    assert state.probs[0, 0].tolist() == pytest.approx([0.6, 0.3], abs=1e-6)
    reused = reuse_correction_attention(v4, state)
    # 25 - 24 + 0.9 * (2/3 * 40 + 1/3 * 20) = 31
    assert reused.item() == pytest.approx(31.0, abs=1e-4)


# --------------------------------------------------------------------------------------------
# Full retention, reference-loop identity
# --------------------------------------------------------------------------------------------

SHAPES = [(1, 1, 4), (2, 2, 8), (4, 2, 8), (4, 1, 16), (6, 3, 4)]  # (Hq, Hkv, D)


@pytest.mark.parametrize("hq,hkv,d", SHAPES)
def test_full_retention_same_kv_equals_dense(hq, hkv, d):
    g = torch.Generator().manual_seed(hq * 100 + hkv * 10 + d)
    tk, tq = 11, 4
    k_pos = torch.arange(tk)
    q_pos = torch.arange(tk - tq, tk)
    q, k, v = rand(g, tq, hq, d), rand(g, tk, hkv, d), rand(g, tk, hkv, d)
    dense = causal_attention(q, q_pos, k, v, k_pos)
    o_ref, (state,) = reference_attention(q, q_pos, k, v, k_pos, [1.0])
    torch.testing.assert_close(o_ref, dense, atol=ATOL, rtol=0)
    assert state.count.tolist() == (q_pos + 1).tolist()
    torch.testing.assert_close(state.mass, torch.ones(tq, hq), atol=1e-6, rtol=0)
    out = correction_attention(q, k, v, state)
    torch.testing.assert_close(out, dense, atol=ATOL, rtol=0)


@pytest.mark.parametrize("hq,hkv,d", SHAPES)
def test_full_retention_new_kv_equals_dense_of_new_kv(hq, hkv, d):
    g = torch.Generator().manual_seed(7 + hq * 100 + hkv * 10 + d)
    tk, tq = 9, 3
    k_pos = torch.arange(tk)
    q_pos = torch.arange(tk - tq, tk)
    q2, k2, v2 = rand(g, tq, hq, d), rand(g, tk, hkv, d), rand(g, tk, hkv, d)
    q4, k4, v4 = rand(g, tq, hq, d, scale=2), rand(g, tk, hkv, d, scale=2), rand(g, tk, hkv, d, scale=3)
    _, (state,) = reference_attention(q2, q_pos, k2, v2, k_pos, [1.0])
    out = correction_attention(q4, k4, v4, state)
    torch.testing.assert_close(out, causal_attention(q4, q_pos, k4, v4, k_pos), atol=ATOL, rtol=1e-5)


@pytest.mark.parametrize("fraction", [0.1, 0.3, 0.5, 0.99])
def test_reference_loop_identity(fraction):
    # Re-running the reference loop's own Q/K/V through the correction gives O_ref back:
    # C_new = m * (p_S / m) @ V_S = C_ref.
    g = torch.Generator().manual_seed(3)
    tk, tq, hq, hkv, d = 20, 5, 4, 2, 8
    k_pos, q_pos = torch.arange(tk), torch.arange(tk - tq, tk)
    q, k, v = rand(g, tq, hq, d), rand(g, tk, hkv, d), rand(g, tk, hkv, d)
    o_ref, (state,) = reference_attention(q, q_pos, k, v, k_pos, [fraction])
    torch.testing.assert_close(correction_attention(q, k, v, state), o_ref, atol=ATOL, rtol=0)
    assert bool((state.mass < 1 + 1e-6).all()) and bool((state.mass > 0).all())


def test_several_fractions_give_several_states():
    g = torch.Generator().manual_seed(4)
    tk, d = 10, 4
    q, k, v = rand(g, 1, 2, d), rand(g, tk, 2, d), rand(g, tk, 2, d)
    o_ref, states = reference_attention(q, torch.tensor([9]), k, v, torch.arange(tk), [0.3, 0.1])
    assert [s.count.tolist() for s in states] == [[3], [1]]
    # Nested by construction of top-k over the same probabilities, same O_ref.
    for h in range(2):
        assert set(states[1].keys[0, h, :1].tolist()) <= set(states[0].keys[0, h, :3].tolist())
    assert all(torch.equal(s.o_ref, o_ref) for s in states)
    assert bool((states[1].mass <= states[0].mass).all())


# --------------------------------------------------------------------------------------------
# Several heads and GQA against an explicit per-head loop
# --------------------------------------------------------------------------------------------


def per_head_reference(q, q_pos, k, v, k_pos, fraction, q_later, k_later, v_later):
    """FP64 per-(query, head) loop of SPEC.md section 2, query head h -> kv head h // (Hq // Hkv)."""
    tq, hq, d = q.shape
    group = hq // k.shape[1]
    out_ref = torch.zeros(tq, hq, d, dtype=torch.float64)
    out_new = torch.zeros(tq, hq, d, dtype=torch.float64)
    sets = {}
    for i in range(tq):
        vis = [j for j in range(k.shape[0]) if k_pos[j] <= q_pos[i]]
        n_sel = max(1, math.ceil(Fraction(fraction).limit_denominator(1000) * len(vis)))
        for h in range(hq):
            kh = h // group
            s = torch.stack([q[i, h].double() @ k[j, kh].double() for j in vis]) / math.sqrt(d)
            p = torch.softmax(s, 0)
            o = sum(p[a] * v[j, kh].double() for a, j in enumerate(vis))
            ranked = sorted(range(len(vis)), key=lambda a: (-p[a].item(), a))[:n_sel]
            sel = [vis[a] for a in ranked]
            m = sum(p[a] for a in ranked)
            c_ref = sum(p[a] * v[vis[a], kh].double() for a in ranked)
            s_new = torch.stack([q_later[i, h].double() @ k_later[j, kh].double() for j in sel]) / math.sqrt(d)
            p_new = torch.softmax(s_new, 0)
            c_new = m * sum(p_new[b] * v_later[j, kh].double() for b, j in enumerate(sel))
            out_ref[i, h] = o
            out_new[i, h] = o - c_ref + c_new
            sets[i, h] = set(sel)
    return out_ref, out_new, sets


@pytest.mark.parametrize("hq,hkv", [(4, 2), (4, 1), (3, 3), (8, 2)])
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_heads_and_gqa_match_per_head_loop(hq, hkv, fraction):
    g = torch.Generator().manual_seed(hq * 10 + hkv + int(fraction * 100))
    tk, tq, d = 12, 4, 8
    k_pos, q_pos = torch.arange(tk), torch.tensor([3, 6, 10, 11])
    q2, k2, v2 = rand(g, tq, hq, d), rand(g, tk, hkv, d, scale=1.5), rand(g, tk, hkv, d)
    q4, k4, v4 = rand(g, tq, hq, d), rand(g, tk, hkv, d, scale=1.5), rand(g, tk, hkv, d)
    o_ref, (state,) = reference_attention(q2, q_pos, k2, v2, k_pos, [fraction])
    out = correction_attention(q4, k4, v4, state)
    exp_ref, exp_new, sets = per_head_reference(q2, q_pos, k2, v2, k_pos, fraction, q4, k4, v4)
    torch.testing.assert_close(o_ref.double(), exp_ref, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(out.double(), exp_new, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(causal_attention(q2, q_pos, k2, v2, k_pos).double(), exp_ref, atol=ATOL, rtol=1e-5)
    for i in range(tq):
        for h in range(hq):
            got = state.keys[i, h, : state.count[i]].tolist()
            assert set(got) == sets[i, h]
            assert all(x == -1 for x in state.keys[i, h, state.count[i]:].tolist())


def test_gqa_maps_query_heads_to_consecutive_kv_heads():
    # Hq=4, Hkv=2: heads 0,1 read kv head 0 and heads 2,3 read kv head 1 (not h % Hkv).
    d = 2
    q = torch.ones(1, 4, d)
    k = torch.zeros(1, 2, d)
    v = torch.tensor([[[1.0, 1.0], [5.0, 5.0]]])
    out = causal_attention(q, torch.tensor([0]), k, v, torch.tensor([0]))
    assert out[0, :, 0].tolist() == [1.0, 1.0, 5.0, 5.0]


# --------------------------------------------------------------------------------------------
# Causality: the current token, future keys, per-query causal lengths
# --------------------------------------------------------------------------------------------


def test_current_token_selected_when_it_ranks():
    d = 4
    tk = 8
    k_pos, q_pos = torch.arange(tk), torch.tensor([5])
    q = torch.zeros(1, 1, d)
    q[0, 0, 0] = 1.0
    k = torch.zeros(tk, 1, d)
    k[:, 0, 0] = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 3.0, 9.0, 9.0])  # key 5 is the current token
    v = torch.arange(tk, dtype=torch.float32)[:, None, None].expand(tk, 1, d).contiguous()
    # ceil(0.2 * 6) = 2: the current token (5) and the best previous key (4).
    _, (state,) = reference_attention(q, q_pos, k, v, k_pos, [0.2])
    assert state.count.tolist() == [2]
    assert state.keys[0, 0].tolist() == [5, 4]
    # The current token's probability is part of the mass.
    p = attention_probs(q, q_pos, k, k_pos)[0, 0]
    assert state.mass.item() == pytest.approx((p[5] + p[4]).item(), abs=1e-6)
    # When it does not rank, it is not forced in.
    k2 = k.clone()
    k2[5, 0, 0] = -3.0
    _, (state2,) = reference_attention(q, q_pos, k2, v, k_pos, [0.2])
    assert 5 not in state2.keys[0, 0].tolist()


@pytest.mark.parametrize("fraction", [0.25, 0.5, 1.0])
def test_future_keys_never_selected(fraction):
    g = torch.Generator().manual_seed(5)
    tk, d = 10, 4
    k_pos = torch.arange(tk)
    q_pos = torch.tensor([2, 5])
    q = rand(g, 2, 2, d)
    k = rand(g, tk, 2, d)
    # Future keys align perfectly with the queries: they would win any unmasked ranking.
    k[6:] = 50 * q[0, 0] / q[0, 0].norm()
    v = rand(g, tk, 2, d)
    probs = attention_probs(q, q_pos, k, k_pos)
    assert bool((probs[0, :, 3:] == 0).all()) and bool((probs[1, :, 6:] == 0).all())
    _, (state,) = reference_attention(q, q_pos, k, v, k_pos, [fraction])
    for i in range(2):
        for h in range(2):
            sel = state.keys[i, h, : state.count[i]].tolist()
            assert all(k_pos[j] <= q_pos[i] for j in sel)
            assert len(set(sel)) == len(sel)
    # And the later loop's future keys cannot leak in either.
    k_later = k.clone()
    k_later[6:] *= 10
    v_later = v.clone()
    v_later[6:] = 1e6
    out = correction_attention(q, k_later, v_later, state)
    assert bool((out.abs() < 1e3).all())


def test_future_keys_never_selected_even_with_underflowing_visible_keys():
    # A visible key whose probability underflows to exactly 0 ties with the (masked) future keys
    # when every visible key is kept: the visible key must win the slot.
    d = 1
    k_pos = torch.arange(5)
    q_pos = torch.tensor([2])
    q = torch.ones(1, 1, d)
    k = torch.tensor([-500.0, 0.0, 0.0, 7.0, 7.0]).reshape(5, 1, 1)
    v = torch.arange(5, dtype=torch.float32).reshape(5, 1, 1)
    probs = attention_probs(q, q_pos, k, k_pos)
    assert probs[0, 0, 0].item() == 0.0  # underflow
    _, (state,) = reference_attention(q, q_pos, k, v, k_pos, [1.0])
    assert sorted(state.keys[0, 0].tolist()) == [0, 1, 2]


def test_key_order_does_not_matter():
    # Keys given in a permuted storage order (with their positions) select the same positions
    # and give the same outputs (no exactly tied probabilities here).
    g = torch.Generator().manual_seed(6)
    tk, tq, hq, hkv, d = 10, 3, 4, 2, 4
    k_pos, q_pos = torch.arange(tk), torch.tensor([4, 7, 9])
    q, k, v = rand(g, tq, hq, d), rand(g, tk, hkv, d, scale=2), rand(g, tk, hkv, d)
    perm = torch.randperm(tk, generator=g)
    o1, (s1,) = reference_attention(q, q_pos, k, v, k_pos, [0.4])
    o2, (s2,) = reference_attention(q, q_pos, k[perm], v[perm], k_pos[perm], [0.4])
    torch.testing.assert_close(o1, o2, atol=ATOL, rtol=0)
    assert torch.equal(s1.count, s2.count)
    for i in range(tq):
        for h in range(hq):
            a = {int(k_pos[j]) for j in s1.keys[i, h, : s1.count[i]]}
            b = {int(k_pos[perm][j]) for j in s2.keys[i, h, : s2.count[i]]}
            assert a == b
    torch.testing.assert_close(s1.mass, s2.mass, atol=1e-6, rtol=0)
    k4, v4 = rand(g, tk, hkv, d), rand(g, tk, hkv, d)
    torch.testing.assert_close(
        correction_attention(q, k4, v4, s1), correction_attention(q, k4[perm], v4[perm], s2), atol=ATOL, rtol=0
    )


def test_future_keys_never_selected_in_any_storage_order():
    # Keys stored in descending position order, and a dominant visible key so that every other
    # visible key's probability underflows to exactly 0 -- the same value as a masked future
    # key's. Keeping every visible key (fraction 1) must still pick visible keys only.
    d = 1
    k_pos = torch.tensor([5, 4, 3, 2, 1, 0])
    q_pos = torch.tensor([2])
    q = torch.ones(1, 1, d)
    k = torch.tensor([0.0, 0.0, 0.0, -300.0, -300.0, 300.0]).reshape(6, 1, 1)  # positions 5..0
    v = torch.tensor([100.0, 100.0, 100.0, 2.0, 1.0, 0.0]).reshape(6, 1, 1)
    probs = attention_probs(q, q_pos, k, k_pos)[0, 0]
    assert probs.tolist() == [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]
    _, (state,) = reference_attention(q, q_pos, k, v, k_pos, [1.0])
    assert state.count.tolist() == [3]
    sel = state.keys[0, 0, :3].tolist()
    assert sorted(int(k_pos[j]) for j in sel) == [0, 1, 2]
    # With every visible key kept the correction is dense attention of the later loop's K/V,
    # which never sees the future keys (value 100).
    k_later = torch.zeros(6, 1, 1)
    out = correction_attention(q, k_later, v, state)
    dense = causal_attention(q, q_pos, k_later, v, k_pos)
    assert dense.item() == pytest.approx(1.0, abs=ATOL)
    assert out.item() == pytest.approx(dense.item(), abs=ATOL)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), tk=st.integers(1, 24), tq=st.integers(1, 6), k20=st.integers(1, 20),
       hq=st.sampled_from([1, 2, 4]))
def test_query_rows_have_their_own_causal_lengths(seed, tk, tq, k20, hq):
    g = torch.Generator().manual_seed(seed)
    tq = min(tq, tk)
    d, hkv = 4, 1 if hq == 1 else 2
    k_pos = torch.arange(tk)
    q_pos = torch.sort(torch.randperm(tk, generator=g)[:tq]).values
    q, k, v = rand(g, tq, hq, d), rand(g, tk, hkv, d), rand(g, tk, hkv, d)
    fraction = k20 / 20
    _, (state,) = reference_attention(q, q_pos, k, v, k_pos, [fraction])
    probs = attention_probs(q, q_pos, k, k_pos)
    expected = [max(1, math.ceil(Fraction(k20, 20) * (int(p) + 1))) for p in q_pos]
    assert state.count.tolist() == expected
    assert state.keys.shape == (tq, hq, max(expected))
    for i in range(tq):
        for h in range(hq):
            sel = state.keys[i, h, : expected[i]].tolist()
            assert all(0 <= j <= int(q_pos[i]) for j in sel)
            assert len(set(sel)) == len(sel)
            assert all(x == -1 for x in state.keys[i, h, expected[i]:].tolist())
            # Top-k: every selected key is at least as probable as every unselected visible key.
            rest = [j for j in range(int(q_pos[i]) + 1) if j not in sel]
            if rest:
                assert min(probs[i, h, sel]) >= max(probs[i, h, rest])
            # Mass and contribution are over exactly this set.
            assert state.mass[i, h].item() == pytest.approx(probs[i, h, sel].sum().item(), abs=1e-6)
            kv = h // (hq // hkv)
            c = (probs[i, h, sel, None] * v[sel, kv]).sum(0)
            torch.testing.assert_close(state.c_ref[i, h], c, atol=ATOL, rtol=0)


def test_dense_causal_attention_matches_masked_softmax():
    g = torch.Generator().manual_seed(8)
    tk, d = 7, 4
    q, k, v = rand(g, tk, 2, d), rand(g, tk, 2, d), rand(g, tk, 2, d)
    pos = torch.arange(tk)
    out = causal_attention(q, pos, k, v, pos)
    for i in range(tk):
        for h in range(2):
            s = (k[: i + 1, h].double() @ q[i, h].double()) / math.sqrt(d)
            expected = torch.softmax(s, 0) @ v[: i + 1, h].double()
            torch.testing.assert_close(out[i, h].double(), expected, atol=ATOL, rtol=0)
    # The first query sees only itself.
    torch.testing.assert_close(out[0], v[0], atol=1e-6, rtol=0)
