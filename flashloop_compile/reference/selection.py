"""Token selection for token-sparse prefill (SPEC.md section 1), written for clarity.

Before loop r >= 3 every prompt token still active at loop r-1 gets the FP32 change score::

    score[i] = ||H[r-1, i] - H[r-2, i]|| / max(||H[r-1, i]||, eps)

and each selection window keeps its ``budget[r]`` highest-scoring tokens. Windows are anchored at
absolute prompt positions (window w covers [w*W, (w+1)*W)); the final window may be shorter;
``window=None`` is one window over the whole prompt. Budgets come from the window's original
length, so active sets are nested. Ties go to the lower absolute position, so packing and batch
order never change a selection.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashloop_compile.config import ConfigError, TokenSparsePrefill, ceil_fraction

__all__ = ["SCORE_EPS", "change_scores", "window_bounds", "select_active"]

SCORE_EPS = 1e-6


def change_scores(h_prev: Tensor, h_prev2: Tensor) -> Tensor:
    """FP32 relative change of each row of [T, hidden] from loop r-2 to loop r-1."""
    a, b = h_prev.float(), h_prev2.float()
    return torch.linalg.vector_norm(a - b, dim=-1) / torch.linalg.vector_norm(a, dim=-1).clamp_min(SCORE_EPS)


def window_bounds(start: int, length: int, window: int | None, prompt_done: bool = True) -> list[tuple[int, int]]:
    """Absolute [lo, hi) windows covering positions start..start+length-1.

    A chunk must begin on a window boundary and, unless it ends the prompt, end on one: a
    window's selection needs all of its scores.
    """
    end = start + length
    if window is None:
        if start != 0 or not prompt_done:
            raise ConfigError(
                "token_sparse_prefill.window=None (global selection) needs the whole prompt in one prefill "
                "chunk; set a window size to prefill in chunks"
            )
        return [(0, end)]
    if start % window or (not prompt_done and end % window):
        raise ConfigError(
            f"prefill chunk [{start}, {end}) does not align to token_sparse_prefill.window={window}: chunks must "
            f"start on a window boundary and end on one unless they end the prompt"
        )
    return [(lo, min(lo + window, end)) for lo in range(start, end, window)]


def select_active(
    scores: Tensor,
    prev_active: Tensor,
    positions: Tensor,
    windows: list[tuple[int, int]],
    ratio: float,
    cfg: TokenSparsePrefill,
    last_position: int | None,
) -> Tensor:
    """Nested top-k per window: a bool mask [T] over the chunk's tokens.

    scores [T] FP32; prev_active [T] bool (the loop r-1 set); positions [T] absolute, ascending.
    ``last_position``: the prompt's last position when keep_last_token applies to this chunk.
    """
    active = torch.zeros_like(prev_active)
    for lo, hi in windows:
        in_window = (positions >= lo) & (positions < hi)
        budget = ceil_fraction(ratio, hi - lo)
        cand = torch.nonzero(in_window & prev_active).flatten()
        s = scores[cand].double()
        if last_position is not None:
            s = torch.where(positions[cand] == last_position, torch.full_like(s, float("inf")), s)
        # Highest score first; among equal scores the lower position (cand is ascending, sort is stable).
        order = torch.sort(-s, stable=True).indices
        active[cand[order[:budget]]] = True
    return active
