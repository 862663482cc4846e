"""flashloop.select_active (the compiled path's selection) against the reference selection."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashloop_compile.config import TokenSparsePrefill
from flashloop_compile.lowering.selection_ops import ratio_fraction, select_active, selected_count
from flashloop_compile.reference.selection import change_scores, select_active as reference_select, window_bounds


def _states_with_scores(scores: torch.Tensor, hidden: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """h_prev, h_prev2 [1, T, hidden] whose change scores are exactly ``scores``."""
    t = scores.shape[0]
    h_prev = torch.zeros(1, t, hidden, dtype=torch.float64)
    h_prev[..., 0] = 1.0
    h_prev2 = h_prev.clone()
    h_prev2[0, :, 1] = scores.double()
    return h_prev.float(), h_prev2.float()


def test_spec_eight_token_illustration():
    # loop 3 keeps t2, t4, t6, t8 (budget 4 of 8); loop 4 keeps t4, t8 (budget 2)
    scores3 = torch.tensor([0.1, 0.9, 0.2, 0.8, 0.3, 0.7, 0.15, 0.6])
    scores4 = torch.tensor([0.0, 0.1, 0.0, 0.9, 0.0, 0.2, 0.0, 0.5])
    pos = torch.arange(8)[None]
    lens, last = torch.tensor([-1], dtype=torch.int32), torch.tensor([-2], dtype=torch.int32)
    idx3, act3 = select_active(*_states_with_scores(scores3), None, pos, lens, last, None, 0.5, False, 4)
    idx4, act4 = select_active(*_states_with_scores(scores4), act3, pos, lens, last, None, 0.25, False, 2)
    assert (idx3[0] + 1).tolist() == [2, 4, 6, 8]
    assert (idx4[0] + 1).tolist() == [4, 8]
    assert act4.tolist() == [[False, False, False, True, False, False, False, True]]


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    t=st.integers(1, 40),
    window=st.sampled_from([None, 1, 4, 7, 16]),
    ratio=st.sampled_from([0.5, 0.25, 0.1, 0.34]),
    keep_last=st.booleans(),
    ties=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_matches_reference_selection(t, window, ratio, keep_last, ties, seed):
    g = torch.Generator().manual_seed(seed)
    h1, h2 = torch.randn(1, t, 8, generator=g), torch.randn(1, t, 8, generator=g)
    if ties:  # repeated rows: equal scores, broken by position
        h1[0, 1::2], h2[0, 1::2] = h1[0, ::2][: h1[0, 1::2].shape[0]], h2[0, ::2][: h2[0, 1::2].shape[0]]
    pos = torch.arange(t)
    cfg = TokenSparsePrefill(enabled=True, window=window, keep_last_token=keep_last)
    expected = reference_select(change_scores(h1[0], h2[0]), torch.ones(t, dtype=torch.bool), pos, window_bounds(0, t, window), ratio, cfg, t - 1 if keep_last else None)
    k = selected_count(t, window, *ratio_fraction(ratio))
    index, active = select_active(h1, h2, None, pos[None], torch.tensor([-1], dtype=torch.int32), torch.tensor([-2], dtype=torch.int32), window, ratio, keep_last, k)
    assert torch.equal(active[0], expected)
    chosen = torch.nonzero(expected).flatten()
    assert torch.equal(index[0, : chosen.numel()], chosen)
    assert bool((index[0, chosen.numel():] == chosen[-1]).all()), "rows that select fewer repeat their last index"


def test_padding_rows_never_selected_and_budgets_use_real_length():
    g = torch.Generator().manual_seed(0)
    h1, h2 = torch.randn(2, 12, 8, generator=g), torch.randn(2, 12, 8, generator=g)
    pos = torch.arange(12)[None].expand(2, -1)
    lens = torch.tensor([7, 12], dtype=torch.int32)
    index, active = select_active(h1, h2, None, pos, lens, torch.tensor([-2, -2], dtype=torch.int32), 4, 0.5, False, 6)
    assert not active[0, 7:].any()
    # row 0: windows [0,4) and [4,7): budgets 2 and ceil(0.5 * 3) = 2
    assert int(active[0].sum()) == 4 and int(active[1].sum()) == 6


@pytest.mark.parametrize("window, p, q, expected", [(None, 1, 4, 3), (4, 1, 4, 1 + 1 + 1), (4, 1, 2, 2 + 2 + 1)])
def test_selected_count(window, p, q, expected):
    assert selected_count(10, window, p, q) == expected
