"""Token selection for token-sparse prefill (SPEC.md section 1)."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashloop_compile.config import ConfigError, TokenSparsePrefill
from flashloop_compile.reference.selection import SCORE_EPS, change_scores, select_active, window_bounds


def budget(ratio: Fraction, length: int) -> int:
    """Exact budget of a window: max(1, ceil(ratio * length)) in rational arithmetic."""
    return max(1, math.ceil(ratio * length))


def run_loops(score_list, positions, windows, ratios, cfg, last=None):
    """Active masks for loops 3.. given one score vector per selecting loop (loops 1-2 all active)."""
    active = torch.ones(len(positions), dtype=torch.bool)
    masks = []
    for scores, ratio in zip(score_list, ratios):
        active = select_active(scores, active, positions, windows, ratio, cfg, last)
        masks.append(active)
    return masks


# --------------------------------------------------------------------------------------------
# The SPEC's 8-token illustration
# --------------------------------------------------------------------------------------------


def illustration_states():
    """H1, H2, H3 for 8 tokens (hidden 4), so that the change scores pick t2,t4,t6,t8 then t4,t8."""
    t = 8
    h1 = torch.zeros(t, 4)
    h1[:, 0] = 1.0
    # Loop 2 moves each token along e1 by delta; the score |delta| / sqrt(1 + delta^2) is
    # monotone in delta, so the top 4 are t4 (0.9), t2 (0.8), t6 (0.7), t8 (0.6).
    delta = torch.tensor([0.1, 0.8, 0.2, 0.9, 0.3, 0.7, 0.05, 0.6])
    h2 = h1.clone()
    h2[:, 1] = delta
    # Loop 3 recomputes only its active rows; inactive rows keep their loop-2 state.
    h3 = h2.clone()
    move = {1: 0.1, 3: 0.5, 5: 0.2, 7: 0.4}  # zero-based rows of t2, t4, t6, t8
    for i, m in move.items():
        h3[i, 2] = m
    return h1, h2, h3


@pytest.mark.parametrize("window", [None, 8, 16])
def test_spec_illustration(window):
    cfg = TokenSparsePrefill(enabled=True, window=window, retention=(1, 1, 0.5, 0.25))
    assert cfg.budgets(8) == (8, 8, 4, 2)
    h1, h2, h3 = illustration_states()
    pos = torch.arange(8)
    windows = window_bounds(0, 8, window)
    assert windows == [(0, 8)]
    loop2 = torch.ones(8, dtype=torch.bool)
    loop3 = select_active(change_scores(h2, h1), loop2, pos, windows, cfg.retention[2], cfg, None)
    assert torch.nonzero(loop3).flatten().add(1).tolist() == [2, 4, 6, 8]
    loop4 = select_active(change_scores(h3, h2), loop3, pos, windows, cfg.retention[3], cfg, None)
    assert torch.nonzero(loop4).flatten().add(1).tolist() == [4, 8]


def test_inactive_tokens_never_return():
    # Even if an inactive token's score is the largest (e.g. a stale state), nesting wins.
    cfg = TokenSparsePrefill(enabled=True, retention=(1, 1, 0.5, 0.25))
    pos = torch.arange(8)
    loop3 = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1], dtype=torch.bool)
    scores = torch.tensor([9.0, 0.1, 9.0, 0.5, 9.0, 0.2, 9.0, 0.4])
    loop4 = select_active(scores, loop3, pos, [(0, 8)], 0.25, cfg, None)
    assert torch.nonzero(loop4).flatten().add(1).tolist() == [4, 8]


def test_aliased_states_give_zero_scores():
    h = torch.randn(5, 16)
    assert torch.equal(change_scores(h, h), torch.zeros(5))


# --------------------------------------------------------------------------------------------
# change_scores
# --------------------------------------------------------------------------------------------


@settings(max_examples=50, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), t=st.integers(1, 40), hidden=st.sampled_from([1, 8, 64]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), mag=st.sampled_from([1e-3, 1.0, 50.0]))
def test_change_scores_formula(seed, t, hidden, dtype, mag):
    g = torch.Generator().manual_seed(seed)
    h2 = (torch.randn(t, hidden, generator=g) * mag).to(dtype)
    h1 = (h2.float() + torch.randn(t, hidden, generator=g) * mag * 0.3).to(dtype)
    out = change_scores(h2, h1)
    assert out.dtype == torch.float32 and out.shape == (t,)
    a, b = h2.double(), h1.double()
    expected = (a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(SCORE_EPS)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=0)


def test_change_scores_eps_and_direction():
    h_prev = torch.tensor([[0.0, 0.0], [3.0, 4.0], [3.0, 4.0]])
    h_prev2 = torch.tensor([[1.0, 0.0], [3.0, 4.0], [0.0, 0.0]])
    out = change_scores(h_prev, h_prev2)
    # Row 0: zero newest state -> denominator eps. Row 1: no change. Row 2: |d| / |H[r-1]| = 5/5.
    assert out[0].item() == pytest.approx(1.0 / SCORE_EPS, rel=1e-6)
    assert out[1].item() == 0.0
    assert out[2].item() == pytest.approx(1.0)
    # The normalizer is the newer state (first argument), not the older one.
    assert change_scores(torch.tensor([[2.0, 0.0]]), torch.tensor([[1.0, 0.0]])).item() == pytest.approx(0.5)


# --------------------------------------------------------------------------------------------
# window_bounds
# --------------------------------------------------------------------------------------------


def test_window_bounds():
    assert window_bounds(0, 20, 8) == [(0, 8), (8, 16), (16, 20)]
    assert window_bounds(0, 16, 8) == [(0, 8), (8, 16)]
    assert window_bounds(8, 16, 8, prompt_done=False) == [(8, 16), (16, 24)]
    assert window_bounds(16, 3, 8) == [(16, 19)]
    assert window_bounds(0, 5, None) == [(0, 5)]
    assert window_bounds(0, 5, 1) == [(i, i + 1) for i in range(5)]


@pytest.mark.parametrize(
    "start,length,window,done",
    [
        (4, 8, 8, True),  # chunk starts inside a window
        (3, 5, 8, True),
        (0, 12, 8, False),  # non-final chunk ends inside a window
        (8, 1, 8, False),
        (0, 5, None, False),  # global selection needs the whole prompt
        (4, 4, None, True),
    ],
)
def test_window_bounds_errors(start, length, window, done):
    with pytest.raises(ConfigError, match="window"):
        window_bounds(start, length, window, prompt_done=done)


# --------------------------------------------------------------------------------------------
# Properties of select_active
# --------------------------------------------------------------------------------------------

RATIO_STEPS = 20  # ratios k/20


@st.composite
def selection_case(draw):
    t = draw(st.integers(1, 80))
    window = draw(st.one_of(st.none(), st.integers(1, 24)))
    n_sparse = draw(st.integers(1, 3))
    ks = sorted(draw(st.lists(st.integers(1, RATIO_STEPS), min_size=n_sparse, max_size=n_sparse)), reverse=True)
    ratios = [Fraction(k, RATIO_STEPS) for k in ks]
    seed = draw(st.integers(0, 2**31 - 1))
    tie_heavy = draw(st.booleans())
    g = torch.Generator().manual_seed(seed)
    if tie_heavy:  # few distinct values: lots of ties
        scores = [torch.randint(0, 3, (t,), generator=g).float() for _ in ratios]
    else:
        scores = [torch.rand(t, generator=g) for _ in ratios]
    return t, window, ratios, scores


def cfg_for(window, ratios, keep_last=False):
    return TokenSparsePrefill(enabled=True, window=window, retention=(1, 1, *[float(r) for r in ratios]),
                              keep_last_token=keep_last)


@settings(max_examples=100, deadline=None, derandomize=True)
@given(case=selection_case())
def test_nested_exact_budget_and_top_k_with_position_ties(case):
    t, window, ratios, scores = case
    cfg = cfg_for(window, ratios)
    pos = torch.arange(t)
    windows = window_bounds(0, t, window)
    masks = run_loops(scores, pos, windows, [float(r) for r in ratios], cfg)
    prev = torch.ones(t, dtype=torch.bool)
    for mask, ratio, sc in zip(masks, ratios, scores):
        assert mask.dtype == torch.bool and mask.shape == (t,)
        assert not bool((mask & ~prev).any()), "active sets must be nested"
        for lo, hi in windows:
            w = slice(lo, hi)
            # Budget from the window's original length (final window may be shorter).
            assert int(mask[w].sum()) == budget(ratio, hi - lo)
            # Every selected candidate beats every unselected candidate: higher score, or equal
            # score and lower absolute position.
            sel = [i for i in range(lo, hi) if mask[i]]
            rej = [i for i in range(lo, hi) if prev[i] and not mask[i]]
            for i in sel:
                for j in rej:
                    assert (sc[i] > sc[j]) or (sc[i] == sc[j] and i < j), (i, j, sc[i].item(), sc[j].item())
        prev = mask


def test_final_window_shorter():
    cfg = TokenSparsePrefill(enabled=True, window=8, retention=(1, 1, 0.5, 0.25))
    pos = torch.arange(19)
    windows = window_bounds(0, 19, 8)
    assert windows[-1] == (16, 19)
    mask = select_active(torch.rand(19), torch.ones(19, dtype=torch.bool), pos, windows, 0.5, cfg, None)
    assert [int(mask[lo:hi].sum()) for lo, hi in windows] == [4, 4, 2]
    mask4 = select_active(torch.rand(19), mask, pos, windows, 0.25, cfg, None)
    assert [int(mask4[lo:hi].sum()) for lo, hi in windows] == [2, 2, 1]


def test_all_ties_go_to_lowest_positions():
    cfg = TokenSparsePrefill(enabled=True, window=10, retention=(1, 1, 0.3))
    pos = torch.arange(25)
    windows = window_bounds(0, 25, 10)
    mask = select_active(torch.zeros(25), torch.ones(25, dtype=torch.bool), pos, windows, 0.3, cfg, None)
    assert torch.nonzero(mask).flatten().tolist() == [0, 1, 2, 10, 11, 12, 20, 21]


def test_ties_go_to_lower_position_not_lower_row_in_a_later_chunk():
    # Positions 16..23 as the chunk (rows 0..7): ties resolve by position, same as rows here,
    # and the mask agrees with the whole-prompt selection restricted to those positions.
    cfg = TokenSparsePrefill(enabled=True, window=8, retention=(1, 1, 0.25))
    full_scores = torch.tensor([1.0, 2.0] * 12)
    full = select_active(full_scores, torch.ones(24, dtype=torch.bool), torch.arange(24), window_bounds(0, 24, 8),
                         0.25, cfg, None)
    chunk = select_active(full_scores[16:], torch.ones(8, dtype=torch.bool), torch.arange(16, 24),
                          window_bounds(16, 8, 8), 0.25, cfg, None)
    assert torch.equal(chunk, full[16:])
    assert torch.nonzero(chunk).flatten().tolist() == [1, 3]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(case=selection_case(), data=st.data())
def test_window_selection_independent_of_grouping(case, data):
    t, window, ratios, scores = case
    if window is None:
        window = data.draw(st.integers(1, 24))
    cfg = cfg_for(window, ratios)
    fl = [float(r) for r in ratios]
    pos = torch.arange(t)
    windows = window_bounds(0, t, window)
    reference = run_loops(scores, pos, windows, fl, cfg)

    # 1) Each window alone.
    for lo, hi in windows:
        alone = run_loops([s[lo:hi] for s in scores], pos[lo:hi], [(lo, hi)], fl, cfg)
        for a, r in zip(alone, reference):
            assert torch.equal(a, r[lo:hi])

    # 2) Regroup the windows into random chunks of whole windows (not necessarily contiguous),
    #    each chunk's rows in ascending position order.
    labels = data.draw(st.lists(st.integers(0, 2), min_size=len(windows), max_size=len(windows)))
    for c in set(labels):
        chunk_windows = [w for w, lab in zip(windows, labels) if lab == c]
        idx = torch.cat([torch.arange(lo, hi) for lo, hi in chunk_windows])
        got = run_loops([s[idx] for s in scores], pos[idx], chunk_windows, fl, cfg)
        for a, r in zip(got, reference):
            assert torch.equal(a, r[idx])

    # 3) The order of the window list does not matter.
    rev = run_loops(scores, pos, list(reversed(windows)), fl, cfg)
    for a, r in zip(rev, reference):
        assert torch.equal(a, r)


def test_scores_of_other_windows_do_not_matter():
    cfg = TokenSparsePrefill(enabled=True, window=8, retention=(1, 1, 0.25))
    g = torch.Generator().manual_seed(0)
    s = torch.rand(24, generator=g)
    s2 = s.clone()
    s2[8:16] = 100.0 + torch.rand(8, generator=g)  # change only window 2
    w = window_bounds(0, 24, 8)
    ones = torch.ones(24, dtype=torch.bool)
    a = select_active(s, ones, torch.arange(24), w, 0.25, cfg, None)
    b = select_active(s2, ones, torch.arange(24), w, 0.25, cfg, None)
    assert torch.equal(a[:8], b[:8]) and torch.equal(a[16:], b[16:])


@settings(max_examples=60, deadline=None, derandomize=True)
@given(case=selection_case())
def test_keep_last_token(case):
    t, window, ratios, scores = case
    cfg = cfg_for(window, ratios, keep_last=True)
    pos = torch.arange(t)
    windows = window_bounds(0, t, window)
    # Make the last token the worst candidate everywhere: it is still kept.
    scores = [s.clone() for s in scores]
    for s in scores:
        s[-1] = -1.0
    masks = run_loops(scores, pos, windows, [float(r) for r in ratios], cfg, last=t - 1)
    prev = torch.ones(t, dtype=torch.bool)
    for mask, ratio, sc in zip(masks, ratios, scores):
        assert bool(mask[-1])
        assert not bool((mask & ~prev).any())
        for lo, hi in windows:
            assert int(mask[lo:hi].sum()) == budget(ratio, hi - lo)  # it takes one of the slots
        # The other windows' selections are untouched by the forced token.
        lo_last = windows[-1][0]
        plain = select_active(sc, prev, pos, windows, float(ratio), cfg, None)
        assert torch.equal(mask[:lo_last], plain[:lo_last])
        prev = mask
    # Without keep_last_token the worst-scoring last token is dropped when the budget allows.
    plain = run_loops(scores, pos, windows, [float(r) for r in ratios], cfg_for(window, ratios))
    lo, hi = windows[-1]
    if budget(ratios[0], hi - lo) < hi - lo:
        assert not bool(plain[0][-1])


def test_keep_last_token_outside_chunk_has_no_effect():
    cfg = TokenSparsePrefill(enabled=True, window=4, retention=(1, 1, 0.25), keep_last_token=True)
    s = torch.tensor([0.1, 0.9, 0.2, 0.3])
    ones = torch.ones(4, dtype=torch.bool)
    a = select_active(s, ones, torch.arange(4), [(0, 4)], 0.25, cfg, 11)  # the prompt ends in a later chunk
    b = select_active(s, ones, torch.arange(4), [(0, 4)], 0.25, cfg, None)
    assert torch.equal(a, b)
    assert torch.nonzero(a).flatten().tolist() == [1]
    c = select_active(s, ones, torch.arange(4), [(0, 4)], 0.25, cfg, 3)
    assert torch.nonzero(c).flatten().tolist() == [3]
