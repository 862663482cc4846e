"""Triton kernels of ``flashloop::packed_kv_write`` (conventions in packed_codec.py).

- ``_write_flush_kernel`` [B, H, ranges]: quantize the whole G-token blocks a write moves out of
  the tail window (base at depth 0, residuals against the reconstructed predecessor at depth >= 1;
  one compilation per depth); values of earlier calls come from the ring, values of this call
  from k/v (at p - first when the call's positions are consecutive, else found by binary search),
  whole rows loaded contiguously. At depth > 0 a first launch of the same kernel (COUNT) stores each group's
  count of residual rows, and each range starts at the sum of the counts before it. Writes the
  position -> row map (h == 0) and the new counters to a scratch.
- ``_write_tail_kernel`` [B, H, tiles of T]: the call's tokens past the new boundary go to the
  ring; depth_count and the counters are committed (separate launch: the flush must read the ring
  before it is overwritten).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashloop_compile.lowering.kernels.common import next_pow2, no_wrap
from flashloop_compile.lowering.kernels.packed_codec import DEPTH_BIAS, _DEPTH_BIAS, _bulk_k, _bulk_v, _codes, _geometry, _params, _row_bases
from flashloop_compile.lowering.kernels.running_extrema import running_extrema
from flashloop_compile.lowering.packed_layout import PackedTensors

__all__ = ["launch_packed_kv_write"]


@triton.jit(do_not_specialize=["depth_arg"])
def _write_flush_kernel(
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
    k_tail, v_tail, flushed, row_count, rows, depth_count, res_layout, overflow,
    k, v, positions, skey, contig, counts, scratch, compact,
    sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, sp_b, sp_t,
    Tn, depth_arg, B, H, S, NB, CAPT, R,
    NCH, D: tl.constexpr, G: tl.constexpr, NSEARCH: tl.constexpr, NBP: tl.constexpr,
    BASE: tl.constexpr, COUNT: tl.constexpr, PRED: tl.constexpr = 0, ONE_TOKEN: tl.constexpr = False,
    RT: tl.constexpr = 0,
):
    """One program per (b, h, range of the row's groups to flush). BASE: depth 0 (a separate
    compilation). PRED: depth - 1 at depth > 0, the predecessor whose reconstruction the
    residuals are taken against (its residuals 1..PRED unroll: one compilation per depth).
    COUNT: grid (B, 1, NCH), store each group's count of residual rows in counts[b, group] and
    nothing else (the flush's ranges at depth > 0 start at the sum of the counts before them).
    A group is handled G channels at a time (one V group), as even/odd halves [G, G/2], K then
    V, so that one tile's rows, reconstruction and codes are live at a time. RT > 0 (a residual
    flush): only the group's active rows are worked on, compacted in position order into tiles
    of RT rows (token-sparse prefill leaves a quarter or a tenth of a group active at depths
    2-3); where they fill more than one tile, a first pass over the tiles takes each K channel's
    extrema and a second writes the codes."""
    if BASE:
        depth = 0
    else:
        depth = depth_arg - _DEPTH_BIAS
    HD: tl.constexpr = D // 2
    NG: tl.constexpr = D // G
    HG: tl.constexpr = G // 2
    RING: tl.constexpr = 2 * G
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    bh = b * H + h
    F = tl.load(flushed + b * R + depth)
    if BASE:
        # length of the row = max position + 1 of this call: the last of the running maxima skey,
        # one load per program (not a pass over the call's positions in each of them)
        if ONE_TOKEN:
            L = tl.load(positions + b * sp_b) + 1
        else:
            L = tl.maximum(tl.load(skey + b * Tn + Tn - 1), -1) + 1
        target = tl.where(L >= G, ((L - G) // G) * G, 0).to(tl.int32)
    else:
        # up to where the previous depth stands (depth 0 set it from the row's full length)
        target = tl.load(flushed + b * R + depth - 1)
    T_new = tl.minimum(tl.maximum(F, target), S)
    row = tl.load(row_count + b * R + depth)
    off = tl.load(res_layout + depth)
    cap = tl.load(res_layout + R + depth)

    # the call's positions are first, first + 1, ... (a prompt or a chunk): index = p - first,
    # no binary search (a chain of NSEARCH dependent loads per group). One token (decode) is
    # always such a run: a padded row (first = -1) puts every p >= 0 out of the call's range
    if ONE_TOKEN:
        consecutive = tl.full([], 1, tl.int1)
    else:
        consecutive = tl.load(contig + b) != 0
    first = tl.load(positions + b * sp_b, mask=Tn > 0, other=-1)
    # NCH programs per (b, h) split the row's groups into contiguous ranges
    n_groups = (T_new - F + G - 1) // G  # F, T_new: multiples of G (max_seq is one)
    c = tl.program_id(2)
    g_start = F + (c * n_groups) // NCH * G  # this program's range: g_start .. s_end
    s_end = F + ((c + 1) * n_groups) // NCH * G
    # Residual rows are allocated in position order: a range starts at the count of the rows the
    # groups before it allocate. At depth 0 every position of a group is stored (row index =
    # position); at depth > 0 the COUNT launch stored each group's count.
    if BASE:
        row += g_start - F
    elif not COUNT:
        if not ONE_TOKEN:  # one token: a single range (the launcher's NCH = 1), nothing before it
            j = tl.arange(0, NBP)
            row += tl.sum(tl.load(counts + b * NBP + j, mask=(j >= F // G) & (j < g_start // G), other=0), 0)
    # Written out here, not in a helper: torch's wrap_triton analysis takes a store whose address
    # depends on a call's result as a store through every pointer the call was given.
    s = g_start
    while s < s_end:
        # the G positions p of the group at s: each one's index in this call's positions (idx,
        # valid where inb), whether the call writes it (in_call), and whether the flush stores it
        # (act: every position at depth 0; at depth d > 0 those written now or written at a later
        # depth before, i.e. the tokens with a residual at d)
        p = s.to(tl.int64) + tl.arange(0, G).to(tl.int64)
        if consecutive:
            lo = p - first
        else:
            # lower bound of p in this row's running-max positions (non-decreasing)
            lo = tl.zeros([G], tl.int64)
            hi = tl.zeros([G], tl.int64) + Tn
            for _ in tl.static_range(NSEARCH):
                open_ = lo < hi
                mid = (lo + hi) // 2
                kv = tl.load(skey + b * Tn + mid, mask=open_ & (mid < Tn), other=0)
                right = open_ & (kv < p)
                lo = tl.where(right, mid + 1, lo)
                hi = tl.where(open_ & (kv >= p), mid, hi)
        inb = (lo >= 0) & (lo < Tn)
        idx = tl.where(inb, lo, 0)
        cp = tl.load(positions + b * sp_b + idx * sp_t, mask=inb, other=-1)
        in_call = inb & (cp == p)
        if BASE:
            act = p >= 0
        else:
            dcv = tl.load(depth_count + b * S + p).to(tl.int32)
            act = in_call | (dcv > depth)
        n_act = tl.sum(act.to(tl.int32), 0)
        blk = s // G
        if COUNT:
            tl.store(counts + b * NBP + blk, n_act)
        elif n_act > 0:
            local = row + tl.cumsum(act.to(tl.int32), 0) - 1
            fits = act & (local < cap)
            if not BASE:
                tl.store(rows + ((depth - 1) * B + b) * S + p, local, mask=fits & (h == 0))
                tl.store(overflow + tl.zeros([G], tl.int32), tl.full([G], 1, tl.int32), mask=act & (local >= cap))
                kb_codes, kb_min, kb_scale, vb_codes, vb_min, vb_scale, kr_codes, vr_codes, vr_min, vr_scale = _row_bases(
                    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, v_res, v_res_min, v_res_scale,
                    bh, S, NB, CAPT, D, G)
            if RT == 0:
                grow = tl.where(fits, off + local, 0).to(tl.int64)
                mc = (in_call & act)[:, None]
                mr = ((in_call == 0) & act)[:, None]
                am = act[:, None]
                fm = fits[:, None]
                xk_rows = k + (b * sk_b + h * sk_h + idx * sk_t)[:, None]
                xv_rows = v + (b * sv_b + h * sv_h + idx * sv_t)[:, None]
                ring = (((b * R + depth) * H + h) * RING + p % RING)[:, None] * D
                for g in tl.static_range(NG):
                    # channels g*G .. g*G + G - 1 of the block's rows (whole rows of k/v or the ring,
                    # loaded contiguously) as even/odd halves [G, G/2]: pair i's two codes make byte i.
                    # One V group per row exactly; K groups are per channel. K's and V's loads (and
                    # their predecessors') are issued together, before either is reduced or stored:
                    # a program keeps both in flight (a 32K site at depth 1 1.126 -> 1.051 ms)
                    ch = g * G + tl.arange(0, G)
                    if BASE:
                        i = g * HG + tl.arange(0, HG)
                    else:
                        # the predecessor's codes as 4-byte vectors: their tiles then share the
                        # layout of K's and V's halves (16-byte vectors of codes had Triton move
                        # the four FP32 halves through shared memory: a 32K prompt's depth-1 write
                        # 1.08 -> 0.58 ms)
                        i = g * HG + tl.max_contiguous(tl.arange(0, HG), 4)
                    x = tl.where(mc, tl.load(xk_rows + ch[None, :] * sk_d, mask=mc, other=0.0).to(tl.float32),
                                 tl.load(k_tail + ring + ch[None, :], mask=mr, other=0.0).to(tl.float32))
                    xe, xo = tl.split(tl.reshape(x, [G, HG, 2]))
                    y = tl.where(mc, tl.load(xv_rows + ch[None, :] * sv_d, mask=mc, other=0.0).to(tl.float32),
                                 tl.load(v_tail + ring + ch[None, :], mask=mr, other=0.0).to(tl.float32))
                    ye, yo = tl.split(tl.reshape(y, [G, HG, 2]))
                    if not BASE:
                        # the predecessor (depth - 1): every active row lies below flushed[d-1] (the
                        # flush's target), where base + residuals 1..d-1 are present exactly where the
                        # rows maps say, read as the bulk readers do (no ring, no per-token resolution)
                        re_, ro_ = _bulk_k(kb_codes, kb_min, kb_scale, kr_codes, k_res_min, k_res_scale, rows, res_layout, p,
                                           (blk * HD + i)[None, :], b, h, B, H, S, NB, D, PRED, g * HG, HG, VEC=4)
                        xe = xe - re_
                        xo = xo - ro_
                        re_, ro_ = _bulk_v(vb_codes, vb_min, vb_scale, vr_codes, vr_min, vr_scale, rows, res_layout, p, b, B, S,
                                           D, G, G, PRED, g, VEC=4)
                        ye = ye - re_
                        yo = yo - ro_
                    # K: one group per channel over the block's active rows
                    mne, sce = _params(tl.min(tl.where(am, xe, float("inf")), 0), tl.max(tl.where(am, xe, float("-inf")), 0))
                    mno, sco = _params(tl.min(tl.where(am, xo, float("inf")), 0), tl.max(tl.where(am, xo, float("-inf")), 0))
                    kbyte = (_codes(xe, mne[None, :], sce[None, :]) | (_codes(xo, mno[None, :], sco[None, :]) << 4)).to(tl.uint8)
                    if BASE:
                        tl.store(k_base + (bh * S + p)[:, None] * HD + i[None, :], kbyte)
                        kpp = (bh * NB + blk) * D + 2 * i
                        tl.store(k_base_min + kpp, mne)
                        tl.store(k_base_min + kpp + 1, mno)
                        tl.store(k_base_scale + kpp, sce)
                        tl.store(k_base_scale + kpp + 1, sco)
                    else:
                        tl.store(k_res + (bh * CAPT + grow)[:, None] * HD + i[None, :], kbyte, mask=fm)
                        kpp = ((((depth - 1) * B + b) * H + h) * NB + blk) * D + 2 * i
                        tl.store(k_res_min + kpp, mne)
                        tl.store(k_res_min + kpp + 1, mno)
                        tl.store(k_res_scale + kpp, sce)
                        tl.store(k_res_scale + kpp + 1, sco)
                    # V: one group per row over these G channels
                    vmn, vsc = _params(tl.minimum(tl.min(ye, 1), tl.min(yo, 1)), tl.maximum(tl.max(ye, 1), tl.max(yo, 1)))
                    vbyte = (_codes(ye, vmn[:, None], vsc[:, None]) | (_codes(yo, vmn[:, None], vsc[:, None]) << 4)).to(tl.uint8)
                    if BASE:
                        tl.store(v_base + (bh * S + p)[:, None] * HD + i[None, :], vbyte)
                        tl.store(v_base_min + (bh * S + p) * NG + g, vmn)
                        tl.store(v_base_scale + (bh * S + p) * NG + g, vsc)
                    else:
                        tl.store(v_res + (bh * CAPT + grow)[:, None] * HD + i[None, :], vbyte, mask=fm)
                        tl.store(v_res_min + (bh * CAPT + grow) * NG + g, vmn, mask=fits)
                        tl.store(v_res_scale + (bh * CAPT + grow) * NG + g, vsc, mask=fits)
            else:
                # the active rows in position order: rank r (= local - row) goes to tile r // RT,
                # slot r % RT, so a tile loads and reconstructs only active rows. The ranks are
                # inverted through this program's slice of `compact` (rank -> the row in the
                # group, and its index in the call's positions or -1 for a ring row): a tile
                # loads its RT entries (an [RT, G] rank match per tile and channel group cost
                # 14% of the kernel's instructions and its spills at depth 2)
                n_tiles = (n_act + RT - 1) // RT
                n_first = tl.where(n_tiles > 1, n_tiles, 0)  # the extrema pass, where one tile does not hold them
                cslot = compact + ((b * H + h) * NCH + c) * (2 * G)
                tl.store(cslot + (local - row), tl.arange(0, G), mask=act)
                tl.store(cslot + G + (local - row), tl.where(in_call, idx, -1).to(tl.int32), mask=act)
                tl.debug_barrier()  # the entries other threads stored
                for g in tl.static_range(NG):
                    ch = g * G + tl.arange(0, G)
                    i = g * HG + tl.arange(0, HG)
                    lo_e = tl.full([HG], float("inf"), tl.float32)
                    hi_e = tl.full([HG], float("-inf"), tl.float32)
                    lo_o = lo_e
                    hi_o = hi_e
                    it = 0
                    while it < n_first + n_tiles:
                        first_pass = it < n_first
                        t = tl.where(first_pass, it, it - n_first) * RT + tl.arange(0, RT)
                        ok = t < n_act
                        r = tl.load(cslot + t, mask=ok, other=0)
                        xc = tl.load(cslot + G + t, mask=ok, other=-1)
                        inc = ok & (xc >= 0)
                        ring_ok = ok & (xc < 0)
                        ix = tl.maximum(xc, 0).to(tl.int64)
                        ps = s.to(tl.int64) + r.to(tl.int64)
                        xr = (b * sk_b + h * sk_h + ix * sk_t)[:, None]
                        ring = (((b * R + depth) * H + h) * RING + ps % RING)[:, None] * D
                        x = tl.where(inc[:, None], tl.load(k + xr + ch[None, :] * sk_d, mask=inc[:, None], other=0.0).to(tl.float32),
                                     tl.load(k_tail + ring + ch[None, :], mask=ring_ok[:, None], other=0.0).to(tl.float32))
                        xe, xo = tl.split(tl.reshape(x, [RT, HG, 2]))
                        re_, ro_ = _bulk_k(kb_codes, kb_min, kb_scale, kr_codes, k_res_min, k_res_scale, rows, res_layout, ps,
                                           (blk * HD + i)[None, :], b, h, B, H, S, NB, D, PRED, g * HG, HG)
                        xe = xe - re_
                        xo = xo - ro_
                        om = ok[:, None]
                        lo_e = tl.minimum(lo_e, tl.min(tl.where(om, xe, float("inf")), 0))
                        hi_e = tl.maximum(hi_e, tl.max(tl.where(om, xe, float("-inf")), 0))
                        lo_o = tl.minimum(lo_o, tl.min(tl.where(om, xo, float("inf")), 0))
                        hi_o = tl.maximum(hi_o, tl.max(tl.where(om, xo, float("-inf")), 0))
                        if not first_pass:
                            lt = row + t
                            ft = ok & (lt < cap)
                            gt = tl.where(ft, off + lt, 0).to(tl.int64)
                            mne, sce = _params(lo_e, hi_e)
                            mno, sco = _params(lo_o, hi_o)
                            kbyte = (_codes(xe, mne[None, :], sce[None, :]) | (_codes(xo, mno[None, :], sco[None, :]) << 4)).to(tl.uint8)
                            tl.store(k_res + (bh * CAPT + gt)[:, None] * HD + i[None, :], kbyte, mask=ft[:, None])
                            kpp = ((((depth - 1) * B + b) * H + h) * NB + blk) * D + 2 * i
                            tl.store(k_res_min + kpp, mne)
                            tl.store(k_res_min + kpp + 1, mno)
                            tl.store(k_res_scale + kpp, sce)
                            tl.store(k_res_scale + kpp + 1, sco)
                            xr = (b * sv_b + h * sv_h + ix * sv_t)[:, None]
                            x = tl.where(inc[:, None], tl.load(v + xr + ch[None, :] * sv_d, mask=inc[:, None], other=0.0).to(tl.float32),
                                         tl.load(v_tail + ring + ch[None, :], mask=ring_ok[:, None], other=0.0).to(tl.float32))
                            ve, vo = tl.split(tl.reshape(x, [RT, HG, 2]))
                            re_, ro_ = _bulk_v(vb_codes, vb_min, vb_scale, vr_codes, vr_min, vr_scale, rows, res_layout, ps, b, B,
                                               S, D, G, RT, PRED, g)
                            ve = ve - re_
                            vo = vo - ro_
                            vmn, vsc = _params(tl.minimum(tl.min(ve, 1), tl.min(vo, 1)), tl.maximum(tl.max(ve, 1), tl.max(vo, 1)))
                            vbyte = (_codes(ve, vmn[:, None], vsc[:, None]) | (_codes(vo, vmn[:, None], vsc[:, None]) << 4)).to(tl.uint8)
                            tl.store(v_res + (bh * CAPT + gt)[:, None] * HD + i[None, :], vbyte, mask=ft[:, None])
                            tl.store(v_res_min + (bh * CAPT + gt) * NG + g, vmn, mask=ft)
                            tl.store(v_res_scale + (bh * CAPT + gt) * NG + g, vsc, mask=ft)
                        it += 1
                tl.debug_barrier()  # every tile read the slice before the next group rewrites it
        row += n_act
        s += G
    if not COUNT:
        if (h == 0) & (c == NCH - 1):  # the last range's count is the row's total
            tl.store(scratch + b * 2, T_new)
            tl.store(scratch + b * 2 + 1, row)


@triton.jit(do_not_specialize=["depth_arg"])
def _write_tail_kernel(
    k_tail, v_tail, flushed, row_count, depth_count,
    k, v, positions, scratch,
    sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, sp_b, sp_t,
    Tn, depth_arg, H, S, R,
    D: tl.constexpr, G: tl.constexpr, DP: tl.constexpr, BT: tl.constexpr,
):
    depth = depth_arg - _DEPTH_BIAS
    RING: tl.constexpr = 2 * G
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    tb = tl.program_id(2)
    T_new = tl.load(scratch + b * 2)
    t = tb * BT + tl.arange(0, BT)
    tm = t < Tn
    p = tl.load(positions + b * sp_b + t * sp_t, mask=tm, other=-1)
    valid = tm & (p >= 0)
    pc = tl.where(valid, p, 0)
    keep = valid & (pc >= T_new)
    c = tl.arange(0, DP)
    m2 = keep[:, None] & (c < D)[None, :]
    dst = (((b * R + depth) * H + h) * RING + pc % RING)[:, None] * D + c[None, :]
    xk = tl.load(k + (b * sk_b + h * sk_h + t * sk_t)[:, None] + c[None, :] * sk_d, mask=m2, other=0.0)
    tl.store(k_tail + dst, xk, mask=m2)
    xv = tl.load(v + (b * sv_b + h * sv_h + t * sv_t)[:, None] + c[None, :] * sv_d, mask=m2, other=0.0)
    tl.store(v_tail + dst, xv, mask=m2)
    if h == 0:
        tl.store(depth_count + b * S + pc, (tl.zeros([BT], tl.int32) + (depth + 1)).to(tl.uint8), mask=valid)
        if tb == 0:
            tl.store(flushed + b * R + depth, T_new)
            tl.store(row_count + b * R + depth, tl.load(scratch + b * 2 + 1))


# ------------------------------------------------------------------------------------------------
# launcher
# ------------------------------------------------------------------------------------------------


# Rows per tile of a residual flush's active rows (_write_flush_kernel's RT) by depth: 0 (whole
# groups) at depth 1, which keeps every row; at depths >= 2 about the rows of a 64-row group that
# token-sparse prefill keeps at its default retention (a quarter at depth 2, a tenth after). One
# 32K site on an H100, each depth alone (RESULTS.md "The packed write, one site", 2026-12-05):
# depth 2 0.917 ms at 16 against 1.036 at 8; depth 3 0.645 at 8 against 0.754 at 16. Whole groups
# (depths 0-1) run on 4 warps (0.632 / 1.179 ms against 0.684 / 1.310 at 8 warps, 0.863 / 1.410
# at 2); active-row tiles on one warp: a tile is a few rows, and a program's time is its chain of
# dependent loads, so what counts is programs in flight per SM (8 at one warp and ~245 registers
# against 2 at four): depth 2 0.898 -> 0.579 ms, depth 3 0.642 -> 0.347 (2 warps: 0.688 / 0.428;
# 2026-12-06, H100, benchmarks/results/2026-12-06/packed-write-ab/wsite.py).
ACTIVE_ROWS_TILE = {2: 16, 3: 8}


def active_rows_tile(depth: int, group: int) -> int:
    """The flush's active-row tile at ``depth`` (0: the whole group)."""
    if depth < 2:
        return 0
    return min(ACTIVE_ROWS_TILE.get(depth, ACTIVE_ROWS_TILE[max(ACTIVE_ROWS_TILE)]), group)


def launch_packed_kv_write(tensors, k, v, positions, depth: int, *, wrap=no_wrap, chunks: int | None = None,
                           rows_tile: int | None = None) -> None:
    """Write depth ``depth`` of tokens k/v [B, H, T, D] at positions [B, T] (see packed_ops).

    Flush programs per (batch, head): one per group a write of T tokens can move out of the tail
    window (fewer than T / G + 1 at depth 0, which the later depths follow; the ring keeps under
    2G unflushed positions), each a contiguous range of the groups; one for a decode token.
    ``chunks`` overrides that count (tests: ranges of several groups); ``rows_tile`` the active
    rows' tile at depth >= 1 (0: whole groups; default :func:`active_rows_tile`)."""
    c = PackedTensors(*tensors)
    B, H, S, D, G, R, NB, CAPT = _geometry(tensors)
    Bc, _, Tn, _ = k.shape
    if Tn == 0 and depth == 0:
        return
    dev = k.device
    scratch = torch.empty(Bc, 2, dtype=torch.int32, device=dev)
    one_token = isinstance(Tn, int) and Tn == 1
    if one_token:  # decode: no search keys and no run test (two small launches per write, ~2 us)
        skey = contig = positions
    elif Tn:
        skey, _ = running_extrema(positions, wrap=wrap, max_len=S)  # torch.cummax's values, one launch
        first = positions[:, :1]
        steps = torch.arange(Tn, device=dev, dtype=positions.dtype)
        contig = ((positions == first + steps).all(1) & (first >= 0).all(1)).to(torch.int32)
    else:
        skey = torch.zeros(Bc, 1, dtype=torch.int64, device=dev)
        contig = torch.zeros(Bc, dtype=torch.int32, device=dev)
    # binary-search steps over the call's positions; a symbolic token count (a dynamic prefill
    # traced by Inductor) must not be specialized: bound it by the static context instead
    nsearch = max(1, (Tn if isinstance(Tn, int) else S).bit_length())
    chunks = 1 if one_token else (Tn + G - 1) // G + 1 if chunks is None else max(1, int(chunks))
    nbp = next_pow2(NB)
    base = depth == 0
    counted = not base and not one_token  # ranges after the first need the rows allocated before them
    counts = torch.empty(Bc, nbp if counted else 1, dtype=torch.int32, device=dev)
    rt = active_rows_tile(depth, G) if rows_tile is None else 0 if base else int(rows_tile)
    if rt and (rt & (rt - 1) or rt > G):
        raise ValueError(f"rows_tile must be 0 or a power of two up to the group ({G}), got {rt}")
    # the active-row flush's rank inversion: 2 G entries per program (rows_tile > 0 only)
    compact = torch.empty(Bc * H * chunks * 2 * G if rt else 1, dtype=torch.int32, device=dev)
    args = (
        c.k_base, c.k_base_min, c.k_base_scale, c.v_base, c.v_base_min, c.v_base_scale,
        c.k_res, c.k_res_min, c.k_res_scale, c.v_res, c.v_res_min, c.v_res_scale,
        c.k_tail, c.v_tail, c.flushed, c.row_count, c.rows, c.depth_count, c.res_layout, c.overflow,
        k, v, positions, skey, contig, counts, scratch, compact,
        *k.stride(), *v.stride(), *positions.stride(),
        Tn, depth + DEPTH_BIAS, B, H, S, NB, CAPT, R,
    )
    meta = dict(NCH=chunks, D=D, G=G, NSEARCH=nsearch, NBP=nbp, BASE=base, PRED=max(0, depth - 1), ONE_TOKEN=one_token)
    if counted:
        wrap(_write_flush_kernel)[(Bc, 1, chunks)](*args, COUNT=True, RT=0, **meta, num_warps=2)
    wrap(_write_flush_kernel)[(Bc, H, chunks)](*args, COUNT=False, RT=rt, **meta, num_warps=(1 if rt else 4))
    bt = 32
    wrap(_write_tail_kernel)[(Bc, H, max(1, triton.cdiv(Tn, bt)))](
        c.k_tail, c.v_tail, c.flushed, c.row_count, c.depth_count,
        k, v, positions, scratch,
        *k.stride(), *v.stride(), *positions.stride(),
        Tn, depth + DEPTH_BIAS, H, S, R,
        D=D, G=G, DP=next_pow2(D), BT=bt, num_warps=4,
    )
