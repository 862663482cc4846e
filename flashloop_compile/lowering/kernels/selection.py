"""Top-k selection of sparse decode's reference: a radix select over the bit pattern of the
probability, split over SPLIT_B programs per row (digits of RADIX_BITS = 8 bits: 8, 8, 8, 6;
probabilities are in [0, 1] so the sortable key ``bits(p) + 1`` (0 for invisible keys) is below
2**30; ``tl.histogram`` cost grows with the bin count, 256 bins measured fastest on an H200):

- ``_select_first_kernel`` grid (R, SPLIT_B): row normalizer from the partials, rewrites the
  scratch row in place with ``p`` (-1.0 for invisible keys; later kernels never recompute an
  exponential, so every kernel sees bit-identical probabilities) and histograms digit 0;
- ``_select_level_kernel`` grid (R, SPLIT_B), once per further digit: reduces the previous
  digit's per-chunk histograms, picks the digit holding the k-th largest key and histograms
  the next digit inside that bucket;
- ``_select_compact_kernel`` grid (R, SPLIT_B): picks the last digit (the exact k-th largest
  key K*), derives how many keys equal to K* to take (lowest indices first), and writes the
  selected indices (ascending) with a cumsum compaction; stores K* and the index of the last
  tie taken, so the predicate ``key > K* or (key == K* and index <= cut)`` reproduces the set.
  With KEEP_P (``reuse_selected_probabilities``) it also writes each selected key's probability
  at the key's slot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashloop_compile.lowering.kernels.common import next_pow2
from flashloop_compile.lowering.kernels.sparse_config import cdiv, split_range

__all__ = ["RADIX_BITS", "KEY_BITS", "radix_digits", "radix_select"]

RADIX_BITS = 8  # 4 digits (8, 8, 8, 6 bits) cover the 30-bit probability keys


KEY_BITS = 30


@triton.jit
def _prob_key(v):
    """Sortable int32 key of a stored probability: bits(p) + 1 for p >= 0, 0 for invisible (-1)."""
    bits = v.to(tl.int32, bitcast=True)
    return tl.where(v >= 0.0, tl.minimum(bits, (1 << 30) - 2) + 1, 0)


@triton.jit
def _pick_digit(h, rnk, NB: tl.constexpr):
    """Bucket holding the rnk-th largest element of histogram h, and the count above it."""
    bins = tl.arange(0, NB)
    suffix = tl.cumsum(h, 0, reverse=True)
    d = tl.maximum(tl.sum((suffix >= rnk).to(tl.int32), 0) - 1, 0)
    above = tl.sum(tl.where(bins > d, h, 0), 0)
    return d, above


@triton.jit
def _normalize_hist(p_row, pm_row, pl_row, SPLIT_A, start, end, lo,
                    SPLIT_A_P2: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr):
    """Rewrites positions start..end - 1 of a row of scaled scores with their probabilities (the
    row normalizer from the split partials pm_row / pl_row; -1.0 for invisible keys) and returns
    the histogram [NB] of the probability keys' digit at lo."""
    sa = tl.arange(0, SPLIT_A_P2)
    pm = tl.load(pm_row + sa, mask=sa < SPLIT_A, other=float("-inf"))
    pl = tl.load(pl_row + sa, mask=sa < SPLIT_A, other=0.0)
    m = tl.max(pm, 0)
    m = tl.where(m > float("-inf"), m, 0.0)  # a row without visible keys: every v is -1 below
    inv_l = 1.0 / tl.maximum(tl.sum(pl * tl.exp(pm - m), 0), 1e-30)
    hist = tl.zeros([NB], tl.int32)
    for n0 in range(start, end, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        n_ok = n < end
        s = tl.load(p_row + n, mask=n_ok, other=float("-inf"))
        v = tl.where(s > float("-inf"), tl.exp(s - m) * inv_l, -1.0)
        tl.store(p_row + n, v, mask=n_ok)
        hist += tl.histogram((_prob_key(v) >> lo) & (NB - 1), NB, mask=n_ok)
    return hist


@triton.jit
def _digit_hist(p_row, start, end, pre, prev_lo, cur_lo, NB: tl.constexpr, BLOCK: tl.constexpr):
    """Histogram [NB] of the digit at cur_lo of the probability keys at positions start..end - 1
    of a row whose higher digits (from prev_lo up) equal pre."""
    hist = tl.zeros([NB], tl.int32)
    for n0 in range(start, end, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        n_ok = n < end
        key = _prob_key(tl.load(p_row + n, mask=n_ok, other=-1.0))
        hist += tl.histogram((key >> cur_lo) & (NB - 1), NB, mask=n_ok & ((key >> prev_lo) == pre))
    return hist


@triton.jit
def _compact_range(p_row, keys_row, psel_row, start, end, kstar, need, taken, ties, KMAX, BLOCK: tl.constexpr,
                   KEEP_P: tl.constexpr):
    """Writes the selected positions in start..end - 1 (key > K*, or == K* among the first `need`
    ties of the row) to keys_row at their ranks (KEEP_P: their probabilities to psel_row too),
    given the keys taken and the ties seen before start; returns the position of the last tie
    taken here (-1 if none)."""
    cut = tl.full([], -1, tl.int32)
    for n0 in range(start, end, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        n_ok = n < end
        pv = tl.load(p_row + n, mask=n_ok, other=-1.0)
        key = _prob_key(pv)
        eq = n_ok & (key == kstar)
        eq_i = eq.to(tl.int32)
        eq_rank = ties + tl.cumsum(eq_i, 0) - eq_i
        tie_take = eq & (eq_rank < need)
        take = (n_ok & (key > kstar)) | tie_take
        take_i = take.to(tl.int32)
        pos = taken + tl.cumsum(take_i, 0) - take_i
        tl.store(keys_row + pos, n, mask=take & (pos < KMAX))
        if KEEP_P:
            tl.store(psel_row + pos, pv, mask=take & (pos < KMAX))
        cut = tl.maximum(cut, tl.max(tl.where(tie_take & (eq_rank == need - 1), n, -1), 0))
        ties += tl.sum(eq_i, 0)
        taken += tl.sum(take_i, 0)
    return cut


@triton.jit
def _select_first_kernel(
    p_ptr, pm_ptr, pl_ptr, hist_ptr,
    S, SPLIT_A, CHUNK, SPLIT,
    SPLIT_A_P2: tl.constexpr, LO: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    start = c * CHUNK
    hist = _normalize_hist(p_ptr + row * S, pm_ptr + row * SPLIT_A, pl_ptr + row * SPLIT_A, SPLIT_A, start,
                           tl.minimum(start + CHUNK, S), LO, SPLIT_A_P2, NB, BLOCK)
    tl.store(hist_ptr + (row * SPLIT + c) * NB + tl.arange(0, NB), hist)


@triton.jit
def _select_level_kernel(
    p_ptr, kk_ptr, hprev_ptr, hcur_ptr, pre_prev_ptr, rnk_prev_ptr, pre_cur_ptr, rnk_cur_ptr, above_ptr,
    S, R, J, CHUNK, SPLIT,
    FIRST: tl.constexpr, SHARED_PREV: tl.constexpr,
    PREV_LO: tl.constexpr, PREV_WIDTH: tl.constexpr, CUR_LO: tl.constexpr,
    NB: tl.constexpr, BLOCK: tl.constexpr,
):
    """Digit `level-1` is fixed from the previous histograms, digit `level` is histogrammed."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    bins = tl.arange(0, NB)
    for j in range(J):
        jr = j * R + row
        if FIRST:
            pre = tl.zeros([], tl.int32)
            rnk = tl.load(kk_ptr + jr)
        else:
            pre = tl.load(pre_prev_ptr + jr)
            rnk = tl.load(rnk_prev_ptr + jr)
        if SHARED_PREV:
            hrow = hprev_ptr + row * SPLIT * NB
        else:
            hrow = hprev_ptr + jr * SPLIT * NB
        h = tl.zeros([NB], tl.int32)
        for c2 in range(SPLIT):
            h += tl.load(hrow + c2 * NB + bins)
        d, above = _pick_digit(h, rnk, NB)
        pre = (pre << PREV_WIDTH) | d
        rnk = rnk - above
        tl.store(pre_cur_ptr + jr, pre, mask=c == 0)
        tl.store(rnk_cur_ptr + jr, rnk, mask=c == 0)
        mine = tl.load(hrow + c * NB + bins)
        mine_above = tl.sum(tl.where(bins > d, mine, 0), 0)
        if not FIRST:
            mine_above += tl.load(above_ptr + jr * SPLIT + c)
        tl.store(above_ptr + jr * SPLIT + c, mine_above)
        start = c * CHUNK
        hist = _digit_hist(p_ptr + row * S, start, tl.minimum(start + CHUNK, S), pre, PREV_LO, CUR_LO, NB, BLOCK)
        tl.store(hcur_ptr + (jr * SPLIT + c) * NB + bins, hist)


@triton.jit
def _select_compact_kernel(
    p_ptr, kk_ptr, hprev_ptr, pre_prev_ptr, rnk_prev_ptr, above_ptr, keys_ptr, thr_ptr, cut_ptr, psel_ptr,
    S, R, J, CHUNK, SPLIT, KMAX,
    PREV_WIDTH: tl.constexpr, NB: tl.constexpr, BLOCK: tl.constexpr, KEEP_P: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    bins = tl.arange(0, NB)
    for j in range(J):
        jr = j * R + row
        k = tl.load(kk_ptr + jr)
        pre = tl.load(pre_prev_ptr + jr)
        rnk = tl.load(rnk_prev_ptr + jr)
        hrow = hprev_ptr + jr * SPLIT * NB
        h = tl.zeros([NB], tl.int32)
        for c2 in range(SPLIT):
            h += tl.load(hrow + c2 * NB + bins)
        d, above = _pick_digit(h, rnk, NB)
        kstar = (pre << PREV_WIDTH) | d  # the exact k-th largest key
        need = rnk - above  # how many keys equal to K* are taken (lowest indices first)
        kstar = tl.where(k > 0, kstar, 2147483647)
        need = tl.where(k > 0, need, 0)
        tl.store(thr_ptr + jr, kstar, mask=c == 0)
        if c == 0:  # the row's slots past its k keys are padding: -1 (and probability 0), no fill launch
            for s0 in range((k // BLOCK) * BLOCK, KMAX, BLOCK):
                slot = s0 + tl.arange(0, BLOCK)
                pad = (slot >= k) & (slot < KMAX)
                tl.store(keys_ptr + jr * KMAX + slot, tl.full([BLOCK], -1, tl.int32), mask=pad)
                if KEEP_P:
                    tl.store(psel_ptr + jr * KMAX + slot, tl.zeros([BLOCK], tl.float32), mask=pad)
        # keys taken and ties seen in the chunks before this one
        taken = tl.zeros([], tl.int32)
        ties = tl.zeros([], tl.int32)
        for c2 in range(c):
            hc = tl.load(hrow + c2 * NB + bins)
            taken += tl.load(above_ptr + jr * SPLIT + c2) + tl.sum(tl.where(bins > d, hc, 0), 0)
            ties += tl.sum(tl.where(bins == d, hc, 0), 0)
        taken += tl.minimum(ties, need)
        start = c * CHUNK
        cut = _compact_range(p_ptr + row * S, keys_ptr + jr * KMAX, psel_ptr + jr * KMAX, start,
                             tl.minimum(start + CHUNK, S), kstar, need, taken, ties, KMAX, BLOCK, KEEP_P)
        tl.store(cut_ptr + jr, cut, mask=cut >= 0)


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------


def radix_digits() -> list[tuple[int, int]]:
    """(lo, width) of each digit, most significant first."""
    digits, hi = [], KEY_BITS
    while hi > 0:
        lo = max(hi - RADIX_BITS, 0)
        digits.append((lo, hi - lo))
        hi = lo
    return digits


def radix_select(probs, part_m, part_l, kk, digits, s, rows, f, kmax, split_a, b, hq, t, n_sm, cfg, launch, dev,
                 keep_probs: bool = False):
    """The radix select over SPLIT_B programs per row (first, level and compact kernels): the
    selected keys [F, B, Hq, T, KMAX] (-1 padded), K* and the last tie taken [F, rows], and with
    keep_probs the selected keys' probabilities [F, B, Hq, T, KMAX] (0 padded; else None)."""
    nb = 1 << RADIX_BITS
    want = cfg.split_sel or min(cdiv(4 * n_sm, rows), max(1, s // cfg.min_sel_chunk))
    chunk_b, split_b = split_range(s, cfg.block_sel, want)
    hist0 = torch.empty(rows, split_b, nb, dtype=torch.int32, device=dev)
    launch(_select_first_kernel, (rows, split_b))(
        probs, part_m, part_l, hist0,
        s, split_a, chunk_b, split_b,
        SPLIT_A_P2=next_pow2(split_a), LO=digits[0][0], NB=nb, BLOCK=cfg.block_sel,
        num_warps=cfg.num_warps_sel,
    )
    above = torch.empty(f, rows, split_b, dtype=torch.int32, device=dev)  # written by the first level
    hprev, pre_prev, rnk_prev = hist0, kk, kk  # pre/rnk unused at the first level
    for level in range(1, len(digits)):
        hcur = torch.empty(f, rows, split_b, nb, dtype=torch.int32, device=dev)
        pre_cur = torch.empty(f, rows, dtype=torch.int32, device=dev)
        rnk_cur = torch.empty(f, rows, dtype=torch.int32, device=dev)
        launch(_select_level_kernel, (rows, split_b))(
            probs, kk, hprev, hcur, pre_prev, rnk_prev, pre_cur, rnk_cur, above,
            s, rows, f, chunk_b, split_b,
            FIRST=level == 1, SHARED_PREV=level == 1,
            PREV_LO=digits[level - 1][0], PREV_WIDTH=digits[level - 1][1], CUR_LO=digits[level][0],
            NB=nb, BLOCK=cfg.block_sel,
            num_warps=cfg.num_warps_sel,
        )
        hprev, pre_prev, rnk_prev = hcur, pre_cur, rnk_cur
    # every slot is written by the compaction: a row's k keys, then -1 (probability 0) up to kmax
    keys = torch.empty((f, b, hq, t, kmax), dtype=torch.int32, device=dev)
    thr = torch.empty(f, rows, dtype=torch.int32, device=dev)
    cut = torch.empty(f, rows, dtype=torch.int32, device=dev)  # written when k > 0 (else thr excludes all)
    psel = torch.empty((f, b, hq, t, kmax), dtype=torch.float32, device=dev) if keep_probs else None
    launch(_select_compact_kernel, (rows, split_b))(
        probs, kk, hprev, pre_prev, rnk_prev, above, keys, thr, cut, probs if psel is None else psel,
        s, rows, f, chunk_b, split_b, kmax,
        PREV_WIDTH=digits[-1][1], NB=nb, BLOCK=min(cfg.block_compact, cfg.block_sel), KEEP_P=keep_probs,
        num_warps=cfg.num_warps_compact,
    )
    if keep_probs:
        return keys, thr, cut, psel
    return keys, thr, cut
