"""``flashloop.select_active``: the nested top-k of token-sparse prefill, as one op.

Per row of a (right-padded) batch and per selection window (absolute boundaries: window w holds
positions [w*W, (w+1)*W); ``window=None`` is one window over the forward's tokens), keep the
``ceil(p/q * n_w)`` candidates with the highest FP32 change score
``||h_prev - h_prev2|| / max(||h_prev||, eps)`` (n_w = the window's real tokens; candidates = the
previous loop's active tokens), ties to the lower position. ``keep_last_token`` forces the
prompt's last token in. Written with sorts and scatters only: no host sync, static output size
``k_out`` (the most any row can select); rows that select fewer repeat their last index, so the
gathered rows are recomputed identically and scatter back the same values.

Returns ``(index [B, k_out] int64 ascending, active [B, T] bool)``. The body is plain ATen and
serves CPU and GPU alike: selection is a few sorts per loop, small next to the prefill it saves.
"""

from __future__ import annotations

import torch
from torch import Tensor

from flashloop_compile.reference.selection import SCORE_EPS

__all__ = ["select_active", "ratio_fraction", "selected_count"]


def ratio_fraction(ratio: float) -> tuple[int, int]:
    """The retention ratio as p/q with q <= 10**6, so budgets are exact integer arithmetic."""
    from fractions import Fraction

    f = Fraction(repr(float(ratio))).limit_denominator(10**6)
    return f.numerator, f.denominator


def selected_count(n_tokens, window: int | None, p: int, q: int):
    """Most tokens one row can select from ``n_tokens`` (ints or SymInts): the sum of window budgets."""
    def budget(n):
        return (p * n + q - 1) // q

    if window is None:
        return budget(n_tokens)
    return (n_tokens // window) * budget(window) + budget(n_tokens % window)


@torch.library.custom_op("flashloop::select_active", mutates_args=())
def _select_active(
    h_prev: Tensor,
    h_prev2: Tensor,
    prev_active: Tensor | None,
    positions: Tensor,
    seq_lens: Tensor,
    last_pos: Tensor,
    window: int | None,
    p: int,
    q: int,
    keep_last: bool,
    k_out: int,
) -> tuple[Tensor, Tensor]:
    b, t = positions.shape
    a, c = h_prev.float(), h_prev2.float()
    score = torch.linalg.vector_norm(a - c, dim=-1) / torch.linalg.vector_norm(a, dim=-1).clamp_min(SCORE_EPS)
    lens = seq_lens[:b, None].long()
    valid = (lens < 0) | (positions < lens)
    cand = valid if prev_active is None else valid & prev_active
    if keep_last:
        end = torch.where(valid, positions, torch.full_like(positions, -1)).amax(-1, keepdim=True)
        lp = last_pos[:b, None].long()
        last = torch.where(lp == -2, end, lp)
        score = torch.where(positions == last, torch.full_like(score, float("inf")), score)
    score = torch.where(cand, score.double(), torch.full_like(score, float("-inf"), dtype=torch.float64))
    wid = torch.zeros_like(positions) if window is None else positions // window
    local = wid - wid[:, :1]
    # order: window ascending, score descending, position ascending (stable sorts, last key first)
    o1 = torch.sort(-score, dim=-1, stable=True).indices
    o2 = torch.sort(local.gather(1, o1), dim=-1, stable=True).indices
    order = o1.gather(1, o2)
    local_sorted = local.gather(1, order)
    ones = torch.ones_like(positions)
    per_window = torch.zeros_like(positions).scatter_add_(1, local, ones)
    real_window = torch.zeros_like(positions).scatter_add_(1, local, valid.long())
    start = torch.cumsum(per_window, dim=1) - per_window
    rank = torch.arange(t, device=positions.device)[None] - start.gather(1, local_sorted)
    budget = (p * real_window.gather(1, local_sorted) + q - 1) // q
    chosen = (rank < budget) & cand.gather(1, order)
    active = torch.zeros_like(cand).scatter_(1, order, chosen)
    first = torch.sort((~active).to(torch.int8), dim=-1, stable=True).indices  # active indices first, ascending
    n_sel = active.sum(-1, keepdim=True)
    take = torch.minimum(torch.arange(k_out, device=positions.device)[None], (n_sel - 1).clamp_min(0))
    index = first.gather(1, take)
    return index, active


@_select_active.register_fake
def _(h_prev, h_prev2, prev_active, positions, seq_lens, last_pos, window, p, q, keep_last, k_out):
    torch._check(h_prev.shape == h_prev2.shape and h_prev.dim() == 3, lambda: "h_prev, h_prev2 must be [B, T, hidden]")
    torch._check(positions.dim() == 2 and positions.shape == h_prev.shape[:2], lambda: "positions must be [B, T]")
    torch._check(prev_active is None or prev_active.shape == positions.shape, lambda: "prev_active must be [B, T]")
    torch._check(seq_lens.dim() == 1 and last_pos.dim() == 1, lambda: "seq_lens, last_pos are [max_batch]")
    torch._check(0 < p <= q, lambda: f"ratio {p}/{q} must lie in (0, 1]")
    b, t = positions.shape
    return positions.new_empty(b, k_out), positions.new_empty(b, t, dtype=torch.bool)


def select_active(h_prev, h_prev2, prev_active, positions, seq_lens, last_pos, window, ratio, keep_last, k_out):
    p, q = ratio_fraction(ratio)
    return torch.ops.flashloop.select_active(h_prev, h_prev2, prev_active, positions, seq_lens, last_pos, window, p, q, keep_last, k_out)
