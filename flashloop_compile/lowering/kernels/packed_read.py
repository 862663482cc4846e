"""Triton kernels of ``flashloop::packed_read`` and of the read-and-attend correction (conventions
in packed_codec.py).

- ``_read_kernel`` [B, H, tiles of P]: logical values at given positions, shared by the heads or
  per head (resolution rule).
- ``_read_bulk_kernel``: the same, tiles below the flushed boundaries read without per-token
  resolution.
- ``_read_attend_kernel``: sparse decode's correction partials over the selected keys,
  reconstructed and attended in registers.
- ``_read_values_kernel``: the V-only correction partials of reuse_selected_probabilities
  (loop 2's probabilities times the selected keys' V).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashloop_compile.lowering.kernels import common
from flashloop_compile.lowering.kernels.common import first_inflight, next_pow2, no_wrap
from flashloop_compile.lowering.kernels.packed_codec import (
    DEPTH_BIAS, _CDTYPE_CODE, _DEPTH_BIAS, _bulk_k, _bulk_residual_rows, _bulk_v, _flushed_min, _geometry, _pair_words,
    _reconstruct, _round_to, _row_bases,
    residual_unroll,
)
from flashloop_compile.lowering.packed_layout import PackedTensors

__all__ = ["launch_packed_read", "launch_packed_read_attend", "correction_tiles", "launch_packed_read_values", "read_attend_fits", "PACKED_READ"]


@triton.jit
def _resolve_tile(
    p, tm, b, h, depth,
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
    k_tail, v_tail, flushed, rows, depth_count, res_layout,
    in_positions, k_in, v_in,
    sip_b, sip_t, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    Ti, B, H, S, NB, CAPT, R,
    D: tl.constexpr, G: tl.constexpr, NP: tl.constexpr, CD: tl.constexpr, RP: tl.constexpr,
):
    """K/V (fp32 even / odd halves [BP, NP], rounded to the compute dtype) of positions p (tm:
    inside the read) of row (b, h) with per-token resolution (_reconstruct), the positions equal
    to one of the row's Ti in-flight positions replaced by that token's K/V."""
    pm = tm & (p >= 0) & (p < S)
    ke, ko, ve, vo, _ok = _reconstruct(
        p, pm, b, h, depth,
        k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
        k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
        k_tail, v_tail, flushed, rows, depth_count, res_layout,
        B, H, S, NB, CAPT, R, D, G, 0, NP, False, RP,
    )
    i = tl.arange(0, NP)
    imask = i < D // 2
    u = 0
    while u < Ti:  # this step's tokens (Ti is small: decode's query rows); no branch on loads (see _reconstruct)
        ip = tl.load(in_positions + b * sip_b + u * sip_t)
        hit = ((p == ip) & (ip >= 0))[:, None]
        ko_ = b * sk_b + h * sk_h + u * sk_t + 2 * i * sk_d
        vo_ = b * sv_b + h * sv_h + u * sv_t + 2 * i * sv_d
        ke = tl.where(hit, tl.load(k_in + ko_, mask=imask, other=0.0).to(tl.float32)[None, :], ke)
        ko = tl.where(hit, tl.load(k_in + ko_ + sk_d, mask=imask, other=0.0).to(tl.float32)[None, :], ko)
        ve = tl.where(hit, tl.load(v_in + vo_, mask=imask, other=0.0).to(tl.float32)[None, :], ve)
        vo = tl.where(hit, tl.load(v_in + vo_ + sv_d, mask=imask, other=0.0).to(tl.float32)[None, :], vo)
        u += 1
    return _round_to(ke, CD), _round_to(ko, CD), _round_to(ve, CD), _round_to(vo, CD)


@triton.jit
def _read_tile(
    p, t, tm, b, h, depth,
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
    k_tail, v_tail, flushed, rows, depth_count, res_layout,
    out_k, out_v, in_positions, k_in, v_in,
    sip_b, sip_t, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    P, Ti, B, H, S, NB, CAPT, R,
    D: tl.constexpr, G: tl.constexpr, NP: tl.constexpr, CD: tl.constexpr, RP: tl.constexpr,
):
    """packed_read of positions p (read-list indices t, tm: inside P) of row (b, h): the generic
    read of one tile (_resolve_tile), stored at slots t."""
    ke, ko, ve, vo = _resolve_tile(
        p, tm, b, h, depth,
        k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
        k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
        k_tail, v_tail, flushed, rows, depth_count, res_layout,
        in_positions, k_in, v_in,
        sip_b, sip_t, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
        Ti, B, H, S, NB, CAPT, R, D, G, NP, CD, RP,
    )
    i = tl.arange(0, NP)
    m2 = tm[:, None] & (i < D // 2)[None, :]
    o = ((b * H + h) * P + t)[:, None] * D + 2 * i[None, :]
    ty = out_k.dtype.element_ty
    tl.store(out_k + o, ke.to(ty), mask=m2)
    tl.store(out_k + o + 1, ko.to(ty), mask=m2)
    tl.store(out_v + o, ve.to(ty), mask=m2)
    tl.store(out_v + o + 1, vo.to(ty), mask=m2)


@triton.jit(do_not_specialize=["depth_arg"])
def _read_kernel(
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
    k_tail, v_tail, flushed, rows, depth_count, res_layout,
    positions, out_k, out_v, lim, in_positions, k_in, v_in,
    sp_b, sp_h, sp_t, sip_b, sip_t, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    P, Ti, depth_arg, B, H, S, NB, CAPT, R,
    D: tl.constexpr, G: tl.constexpr, NP: tl.constexpr, BP: tl.constexpr, CD: tl.constexpr,
    RP: tl.constexpr = 4,
):
    """packed_read of positions [BP] of row (b, h) (_read_tile): the shapes the bulk read does not
    take (a head_dim that is not a power of two, an odd group)."""
    depth = depth_arg - _DEPTH_BIAS
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    t = tl.program_id(2) * BP + tl.arange(0, BP)
    tm = t < P
    p = tl.load(positions + b * sp_b + h * sp_h + t * sp_t, mask=tm, other=-1)
    _read_tile(p, t, tm, b, h, depth,
               k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
               k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
               k_tail, v_tail, flushed, rows, depth_count, res_layout,
               out_k, out_v, in_positions, k_in, v_in,
               sip_b, sip_t, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
               P, Ti, B, H, S, NB, CAPT, R, D, G, NP, CD, RP)


@triton.jit
def _bulk_read_tile(p, tm, flushed_b, lim_b, depth, BP: tl.constexpr, RP: tl.constexpr):
    """Whether every entry of a read tile (positions p [BP], tm: inside P) is a position below
    every depth's flushed boundary (0..depth) and below the row's first in-flight position
    (lim_b), in any order: there every position holds its base and residual j is present exactly
    where rows_j >= 0, so no per-token state is needed. A prefix (the loop-2 reference's whole
    history) and the selected keys of a correction (sparse decode's top-k, scattered) are almost
    all such tiles; a tile with padding (-1), a position in the ring or beyond, or the end of P
    goes to _read_kernel."""
    fl_min = _flushed_min(flushed_b, depth, RP)
    p_lo = tl.min(tl.where(tm, p, -1), 0)
    p_hi = tl.max(p, 0)
    return (p_lo >= 0) & (p_hi < fl_min) & (p_hi < tl.load(lim_b))


@triton.jit
def _write_bulk_tile(k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
                     k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
                     rows, res_layout, out_k, out_v, pc, t, b, h, P, B, H, S, NB, CAPT,
                     D: tl.constexpr, G: tl.constexpr, BP: tl.constexpr, CD: tl.constexpr, DEPTH: tl.constexpr):
    """K/V rows of a bulk tile (positions pc [BP], int32, every one below the flushed boundaries)
    of row (b, h) into out_k/out_v at read slots t [BP]: K parameters as 32-bit pair words, V group
    parameters selected in registers, rows stored whole (even/odd halves interleaved in registers);
    the arithmetic and order of _reconstruct."""
    HD: tl.constexpr = D // 2
    bh = b * H + h
    kw = ((pc // G) * HD)[:, None] + tl.arange(0, HD)[None, :]  # each position's block of K parameters
    kb_codes, kb_min, kb_scale, vb_codes, vb_min, vb_scale, kr_codes, vr_codes, vr_min, vr_scale = _row_bases(
        k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, v_res, v_res_min, v_res_scale,
        bh, S, NB, CAPT, D, G,
    )
    ke, ko = _bulk_k(kb_codes, kb_min, kb_scale, kr_codes, k_res_min, k_res_scale, rows, res_layout, pc, kw, b, h,
                     B, H, S, NB, D, DEPTH)
    ve, vo = _bulk_v(vb_codes, vb_min, vb_scale, vr_codes, vr_min, vr_scale, rows, res_layout, pc, b, B, S, D, G, BP, DEPTH)
    ty = out_k.dtype.element_ty
    o = ((bh * P + t) * D)[:, None] + tl.arange(0, D)[None, :]
    k_rows = tl.reshape(tl.join(_round_to(ke, CD), _round_to(ko, CD)), [BP, D]).to(ty)
    v_rows = tl.reshape(tl.join(_round_to(ve, CD), _round_to(vo, CD)), [BP, D]).to(ty)
    tl.store(out_k + o, k_rows)
    tl.store(out_v + o, v_rows)


@triton.jit
def _read_bulk_kernel(
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
    flushed, rows, res_layout, positions, out_k, out_v, lim,
    sp_b, sp_h, sp_t, P, B, H, S, NB, CAPT, R,
    k_tail, v_tail, depth_count, in_positions, k_in, v_in,
    sip_b, sip_t, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, Ti,
    D: tl.constexpr, G: tl.constexpr, BP: tl.constexpr, CD: tl.constexpr, RP: tl.constexpr, DEPTH: tl.constexpr,
    NP: tl.constexpr, SPLIT: tl.constexpr, SKIP_PADDING: tl.constexpr = False,
):
    """packed_read of the tiles _bulk_read_tile admits (sparse decode's loop-2 reference reads
    the whole history, its corrections the selected keys: almost all such tiles). No per-token resolution, the depth a constexpr (unrolled residuals), K
    parameters as 32-bit pair words, V group parameters selected in registers, and rows stored
    whole (even/odd halves interleaved in registers). Same arithmetic, in the same order, as
    _reconstruct: the two kernels write identical values. A tile the test refuses is read here too, by _read_tile on SPLIT sub-tiles of BP / SPLIT positions in
    turn (the generic kernel's tile), so no second launch is needed (the in-flight tensors and
    strides are read only then). SKIP_PADDING: a tile of padding alone (-1) is left unwritten
    (a reader that bounds what it reads by position, as prefill's packed attention)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    t = tl.program_id(2) * BP + tl.arange(0, BP)
    tm = t < P
    p = tl.load(positions + b * sp_b + h * sp_h + t * sp_t, mask=tm, other=-1)
    if SKIP_PADDING and tl.max(p, 0) < 0:
        pass
    elif _bulk_read_tile(p, tm, flushed + b * R, lim + b, DEPTH, BP, RP):
        _write_bulk_tile(k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
                         k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
                         rows, res_layout, out_k, out_v, p.to(tl.int32), t, b, h, P, B, H, S, NB, CAPT,
                         D, G, BP, CD, DEPTH)
    else:
        BS: tl.constexpr = BP // SPLIT
        for sub in range(SPLIT):
            ts = tl.program_id(2) * BP + sub * BS + tl.arange(0, BS)
            tms = ts < P
            ps = tl.load(positions + b * sp_b + h * sp_h + ts * sp_t, mask=tms, other=-1)
            _read_tile(ps, ts, tms, b, h, DEPTH,
                       k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
                       k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
                       k_tail, v_tail, flushed, rows, depth_count, res_layout,
                       out_k, out_v, in_positions, k_in, v_in,
                       sip_b, sip_t, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
                       P, Ti, B, H, S, NB, CAPT, R, D, G, NP, CD, RP)


@triton.jit
def _selected_in_bulk(p, valid, flushed_b, in_positions_b, sip_t, Ti, S, DEPTH: tl.constexpr, RP: tl.constexpr):
    """Whether a correction's tile of selected keys (positions p [BP], valid: inside the row's
    selection) lies in the flushed bulk: every valid key below every depth's flushed boundary
    (0..DEPTH; flushed_b: the row's R entries) and below the row's first in-flight position (the
    smallest of its Ti positions in_positions_b, -1 = padding; common.first_inflight, taken here
    rather than by a launch of its own). _bulk_read_tile's rule: such a tile is read by _bulk_k /
    _bulk_v, with no per-token state."""
    fl_min = _flushed_min(flushed_b, DEPTH, RP)
    lim = tl.zeros([], tl.int64) + S
    u = 0
    while u < Ti:
        ipu = tl.load(in_positions_b + u * sip_t)
        lim = tl.where(ipu >= 0, tl.minimum(lim, ipu), lim)
        u += 1
    p_lo = tl.min(tl.where(valid, p, 2147483647), 0)
    p_hi = tl.max(tl.where(valid, p, -1), 0)
    return (p_lo >= 0) & (p_hi < fl_min) & (p_hi < lim)


@triton.jit
def _attend_tile(qe, qo, ke, ko, ve, vo, valid, scale):
    """One query row against a tile of keys (even / odd halves [BP, D/2], valid [BP]): the tile's
    softmax partial -- the score maximum (-inf with no valid key), the sum of exp(score - max)
    and the exp-weighted V halves [D/2]."""
    s = tl.where(valid, (tl.sum(ke * qe, 1) + tl.sum(ko * qo, 1)) * scale, float("-inf"))
    m = tl.max(s, 0)
    pr = tl.exp(s - tl.where(m > float("-inf"), m, 0.0))
    return m, tl.sum(pr, 0), tl.sum(pr[:, None] * ve, 0), tl.sum(pr[:, None] * vo, 0)


@triton.jit
def _attend_bulk_tile(
    qe, qo, p, valid, b, h, scale,
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale, rows, res_layout,
    B, H, S, NB, CAPT,
    D: tl.constexpr, G: tl.constexpr, BP: tl.constexpr, CD: tl.constexpr, DEPTH: tl.constexpr, VW: tl.constexpr,
):
    """The softmax partial of a bulk tile (positions p [BP], valid: inside the selection) of row
    (b, h) against the query halves qe, qo [1, NC, VW]: (max, sum of exp, weighted V halves [NC, VW]).
    The tile is [BP, NC, VW]: a key's code row split into NC chunks of VW bytes (channel pairs c * VW
    .. c * VW + VW - 1; 2 VW <= G, so a chunk lies in one V group), so that Triton lays the keys
    over a warp's lanes and the chunks over the warps. The reductions over a tile's keys (softmax, PV) then stay inside each warp (shuffles);
    only the scores' sum over the chunks crosses warps. The arithmetic and rounding of
    _bulk_k / _bulk_v (the readers' values, rounded to the compute dtype)."""
    HD: tl.constexpr = D // 2
    NC: tl.constexpr = HD // VW
    NG: tl.constexpr = D // G
    bh = b * H + h
    pc = tl.where(valid, p, 0).to(tl.int32)
    k3 = pc[:, None, None]
    pair = tl.arange(0, NC)[None, :, None] * VW + tl.arange(0, VW)[None, None, :]  # [1, NC, VW]
    grp = (tl.arange(0, NC)[None, :, None] * (2 * VW)) // G  # each chunk's V group (a chunk lies in one)
    kw = (k3 // G) * HD + pair  # the key's block of K parameters, one 32-bit word per pair
    c = tl.load(k_base + bh * S * HD + k3 * HD + pair).to(tl.int32)
    mn_e, mn_o = _pair_words(k_base_min + bh * NB * D, kw, HD)
    sc_e, sc_o = _pair_words(k_base_scale + bh * NB * D, kw, HD)
    ke = mn_e + sc_e * (c & 15).to(tl.float32)
    ko = mn_o + sc_o * (c >> 4).to(tl.float32)
    c = tl.load(v_base + bh * S * HD + k3 * HD + pair).to(tl.int32)
    vmn = tl.load(v_base_min + (bh * S + k3) * NG + grp).to(tl.float32)
    vsc = tl.load(v_base_scale + (bh * S + k3) * NG + grp).to(tl.float32)
    ve = vmn + vsc * (c & 15).to(tl.float32)
    vo = vmn + vsc * (c >> 4).to(tl.float32)
    for j in tl.static_range(1, DEPTH + 1):
        has, g = _bulk_residual_rows(rows, res_layout, j, b, B, S, k3)
        g = bh * CAPT + g
        c = tl.load(k_res + g * HD + pair, mask=has, other=0).to(tl.int32)
        pk = (((j - 1) * B + b) * H + h) * NB * D
        mn_e, mn_o = _pair_words(k_res_min + pk, kw, HD)
        sc_e, sc_o = _pair_words(k_res_scale + pk, kw, HD)
        ke = tl.where(has, ke + (mn_e + sc_e * (c & 15).to(tl.float32)), ke)
        ko = tl.where(has, ko + (mn_o + sc_o * (c >> 4).to(tl.float32)), ko)
        c = tl.load(v_res + g * HD + pair, mask=has, other=0).to(tl.int32)
        vmn = tl.load(v_res_min + g * NG + grp, mask=has, other=0.0).to(tl.float32)
        vsc = tl.load(v_res_scale + g * NG + grp, mask=has, other=0.0).to(tl.float32)
        ve = tl.where(has, ve + (vmn + vsc * (c & 15).to(tl.float32)), ve)
        vo = tl.where(has, vo + (vmn + vsc * (c >> 4).to(tl.float32)), vo)
    ke = _round_to(ke, CD)
    ko = _round_to(ko, CD)
    sk = tl.sum(tl.sum(ke * qe + ko * qo, 2), 1)  # [BP]: the chunks' partial dots summed across warps
    s = tl.where(valid, sk * scale, float("-inf"))
    m = tl.max(s, 0)
    pr = tl.exp(s - tl.where(m > float("-inf"), m, 0.0))
    w = pr[:, None, None]
    return m, tl.sum(pr, 0), tl.sum(w * _round_to(ve, CD), 0), tl.sum(w * _round_to(vo, CD), 0)


@triton.jit
def _read_attend_kernel(
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
    k_tail, v_tail, flushed, rows, depth_count, res_layout,
    q, keys, count, in_positions, k_in, v_in, part_m, part_l, part_acc,
    sq_b, sq_h, sq_d, skey_b, skey_h, skey_t, sc_b, sc_h,
    sip_b, sip_t, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    scale, P, Ti, NT, B, H, S, NB, CAPT, R,
    D: tl.constexpr, G: tl.constexpr, NP: tl.constexpr, BP: tl.constexpr, CD: tl.constexpr,
    RP: tl.constexpr, DEPTH: tl.constexpr, SPLIT: tl.constexpr, VW: tl.constexpr,
):
    """Sparse decode's correction for one query row per kv head (row b * H + h), read and attended
    in one pass: program z (counted from the last tile, so that the row's per-token tile,
    which holds its highest positions, starts in the first wave instead of the last) takes the
    selected keys [z * BP, (z + 1) * BP) of the row (keys
    [B, H, P] global positions, the first count[b, h] valid), reconstructs them in registers as
    packed_read does (a tile _bulk_read_tile's rule admits: _attend_bulk_tile, no per-token state,
    keys on a warp's lanes and chunks of VW channel pairs on the warps; any other: _resolve_tile on
    SPLIT sub-tiles, the in-flight tokens included; the bulk bound takes the row's first in-flight
    position from in_positions, no launch of its own) and writes the tile's softmax partial (max,
    sum, weighted V) for _correction_combine_kernel. The values
    attended are packed_read's, rounded to the compute dtype: the correction over the BF16 copy
    without the copy (its write and its re-read)."""
    HD: tl.constexpr = D // 2
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    z = tl.program_id(2)
    z = NT - 1 - z
    out = (b * H + h) * NT + z
    i = tl.arange(0, NP)
    cnt = tl.minimum(tl.load(count + b * sc_b + h * sc_h), P)
    if z * BP >= cnt:  # past the row's selection: an empty partial
        tl.store(part_m + out, float("-inf"))
        tl.store(part_l + out, 0.0)
        tl.store(part_acc + out * D + 2 * i, tl.zeros([NP], tl.float32), mask=i < HD)
        tl.store(part_acc + out * D + 2 * i + 1, tl.zeros([NP], tl.float32), mask=i < HD)
        return
    qn = q + b * sq_b + h * sq_h + 2 * i * sq_d
    qe = tl.load(qn, mask=i < HD, other=0.0).to(tl.float32)[None, :]
    qo = tl.load(qn + sq_d, mask=i < HD, other=0.0).to(tl.float32)[None, :]
    kr = keys + b * skey_b + h * skey_h
    t = z * BP + tl.arange(0, BP)
    valid = t < cnt
    p = tl.load(kr + t * skey_t, mask=valid, other=-1).to(tl.int64)
    if _selected_in_bulk(p, valid, flushed + b * R, in_positions + b * sip_b, sip_t, Ti, S, DEPTH, RP):
        pair = tl.arange(0, HD // VW)[None, :, None] * VW + tl.arange(0, VW)[None, None, :]
        qe3 = tl.load(q + b * sq_b + h * sq_h + 2 * pair * sq_d).to(tl.float32)
        qo3 = tl.load(q + b * sq_b + h * sq_h + (2 * pair + 1) * sq_d).to(tl.float32)
        m_b, l_b, a_e, a_o = _attend_bulk_tile(
            qe3, qo3, p, valid, b, h, scale,
            k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
            k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale, rows, res_layout,
            B, H, S, NB, CAPT, D, G, BP, CD, DEPTH, VW,
        )
        tl.store(part_m + out, m_b)
        tl.store(part_l + out, l_b)
        pair2 = tl.arange(0, HD // VW)[:, None] * VW + tl.arange(0, VW)[None, :]
        tl.store(part_acc + out * D + 2 * pair2, a_e)
        tl.store(part_acc + out * D + 2 * pair2 + 1, a_o)
    else:  # the ring, the in-flight tokens, an unflushed depth: per-token resolution, sub-tile by sub-tile
        BS: tl.constexpr = BP // SPLIT
        m_i = tl.full([], float("-inf"), tl.float32)
        l_i = tl.zeros([], tl.float32)
        acc_e = tl.zeros([NP], tl.float32)
        acc_o = tl.zeros([NP], tl.float32)
        for sub in range(SPLIT):
            ts = z * BP + sub * BS + tl.arange(0, BS)
            vs = ts < cnt
            ps = tl.load(kr + ts * skey_t, mask=vs, other=-1).to(tl.int64)
            ke, ko, ve, vo = _resolve_tile(
                ps, vs, b, h, DEPTH,
                k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
                k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
                k_tail, v_tail, flushed, rows, depth_count, res_layout,
                in_positions, k_in, v_in,
                sip_b, sip_t, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
                Ti, B, H, S, NB, CAPT, R, D, G, NP, CD, RP,
            )
            m_s, l_s, a_e, a_o = _attend_tile(qe, qo, ke, ko, ve, vo, vs, scale)
            m_new = tl.maximum(m_i, m_s)
            m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
            w_old = tl.exp(m_i - m_use)
            w_new = tl.exp(m_s - m_use)
            l_i = l_i * w_old + l_s * w_new
            acc_e = acc_e * w_old + a_e * w_new
            acc_o = acc_o * w_old + a_o * w_new
            m_i = m_new
        tl.store(part_m + out, m_i)
        tl.store(part_l + out, l_i)
        tl.store(part_acc + out * D + 2 * i, acc_e, mask=i < HD)
        tl.store(part_acc + out * D + 2 * i + 1, acc_o, mask=i < HD)


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------


# packed_read: tiles below the flushed boundaries take _read_bulk_kernel's path (no per-token
# resolution), the others _read_tile on generic_split sub-tiles in the same launch (8 positions:
# 158 registers at depth 3; 4x32K window read 24 us against 102 us at 32 positions). block_p:
# positions per program (None: 32 at D <= 128, 16 above). attend_block_p: keys per program of the
# read-and-attend correction by depth (the last entry for deeper ones; H200, 32K, per site: 32 at
# depth 2 58.8 / 149.0 us at B1 / B4 against 71.5 / 177.1 at 16; 16 at depth 3). window_block_p:
# positions per program of the code-domain reference's window read (all per-token tiles), one
# sub-tile each (8.7 / 21.3 us against 15.6 / 25.5 at B1 / B4 x 32K). attend_maxnreg: the
# read-and-attend correction's register cap by depth (0: the compiler's choice). The kernel waits on
# dependent loads, so programs in flight beat spills: 128 registers at depths 2-3 (4 programs per
# SM against 3 at 168), per B1 x 32K site 45.3 against 46.1 us at depth 2 and 48.8 against 51.3 at
# depth 3 (capped at 96 there before), 122.3 against 124.4 at B4 depth 2 (H100, 2026-12-07,
# results/2026-12-07/correction-chunk-layout). The cap reaches the compiled step because the kernel
# is launched by the opaque op flashloop::packed_read_attend, not through wrap_triton, whose
# Inductor compile drops maxnreg (DESIGN.md, "A register cap reaches a compiled graph through an
# opaque op"); caps on the V-only kernel lose (results/2026-12-06/register-caps).
PACKED_READ = {"num_warps": 4, "block_p": None, "generic_split": 4, "attend_block_p": (32, 32, 32, 16),
               "window_block_p": 8, "attend_maxnreg": (0, 0, 128, 128)}


def _by_depth(key: str, depth: int) -> int:
    """PACKED_READ[key]'s entry for ``depth`` (its last entry for deeper ones)."""
    values = PACKED_READ[key]
    return values[min(depth, len(values) - 1)]


def launch_packed_read(tensors, positions, depth: int, out_k, out_v, *, inflight=None, wrap=no_wrap,
                       bulk: bool | None = None, block_p: int | None = None, split: int | None = None,
                       skip_padding: bool = False) -> None:
    """Logical K/V at ``depth`` of positions [B, P] (every head) or [B, H, P] (per head) into
    out_k/out_v [B, H, P, D] (contiguous). ``inflight``: (positions [B, Ti], k [B, H, Ti, D], v)
    of this step's tokens: a position equal to one of them reads its row (see packed_ops).
    A power-of-two head_dim with an even group reads in one launch of _read_bulk_kernel (tiles below
    the flushed boundaries without per-token resolution, the others on ``split`` sub-tiles, default
    PACKED_READ["generic_split"]); other shapes take _read_kernel. ``bulk`` False: _read_kernel for
    any shape (tests compare the two). ``block_p``: positions per program (tests). ``skip_padding``:
    the bulk kernel leaves a tile of padding alone unwritten instead of zeroing it (prefill's packed
    attention reads the cache's whole capacity, mostly padding for a fresh prompt)."""
    c = PackedTensors(*tensors)
    B, H, S, D, G, R, NB, CAPT = _geometry(tensors)
    Bc, P = positions.shape[0], positions.shape[-1]
    sp_b, sp_h, sp_t = (positions.stride(0), 0, positions.stride(1)) if positions.dim() == 2 else positions.stride()
    if P == 0 or Bc == 0:
        return
    np_ = next_pow2(D // 2)
    interp = common.cpu_semantics(positions.device)
    bp = int(PACKED_READ["block_p"] or (32 if np_ <= 64 else 16))
    if interp:
        bp = 128  # fewer, larger programs: the interpreter's cost is per operation, not per element
    bp = block_p or bp
    grid = (Bc, H, triton.cdiv(P, bp))
    bulk_fits = not (D & (D - 1) or G % 2)  # other shapes: the generic kernel reads everything
    if bulk is None:
        bulk = bulk_fits
    elif bulk and not bulk_fits:
        raise ValueError(f"the bulk read needs a power-of-two head_dim and an even group, got {D}, {G}")
    cd = _CDTYPE_CODE[out_k.dtype]
    if inflight is None:
        ip = positions.new_empty(Bc, 0)
        k_in = v_in = out_k.new_empty(Bc, H, 0, D)
    else:
        ip, k_in, v_in = inflight
    lim = positions  # read only by the bulk tile test
    if bulk:  # below the first in-flight position a tile needs no overlay (decode: its tokens are past every stored one)
        lim = first_inflight(ip, S)
    # the generic kernel resolves every token with all residual depths in flight at once (latency-
    # bound: see _reconstruct): tiles of bp / generic_split positions keep it within the registers
    # (sm_90, D 128, depth 3: 228 registers at 16, 254 spill ops at 32; scripts/kernel_report.py)
    split = max(1, int(split or PACKED_READ["generic_split"]))
    if interp:
        split = min(split, 2)  # the interpreter's cost is per program and operation: fewer, larger tiles
    bpg = max(1, bp // split)
    if bp % bpg:
        raise ValueError(f"generic_split {split} must divide the read tile {bp}")
    if bulk:
        wrap(_read_bulk_kernel)[grid](
            c.k_base, c.k_base_min, c.k_base_scale, c.v_base, c.v_base_min, c.v_base_scale,
            c.k_res, c.k_res_min, c.k_res_scale, c.v_res, c.v_res_min, c.v_res_scale,
            c.flushed, c.rows, c.res_layout, positions, out_k, out_v, lim,
            sp_b, sp_h, sp_t, P, B, H, S, NB, CAPT, R,
            c.k_tail, c.v_tail, c.depth_count, ip, k_in, v_in, *ip.stride(), *k_in.stride(), *v_in.stride(), ip.shape[1],
            D=D, G=G, BP=bp, CD=cd, RP=residual_unroll(depth), DEPTH=depth, NP=np_, SPLIT=bp // bpg,
            SKIP_PADDING=skip_padding, num_warps=PACKED_READ["num_warps"],
        )
        return
    wrap(_read_kernel)[(Bc, H, triton.cdiv(P, bpg))](
        c.k_base, c.k_base_min, c.k_base_scale, c.v_base, c.v_base_min, c.v_base_scale,
        c.k_res, c.k_res_min, c.k_res_scale, c.v_res, c.v_res_min, c.v_res_scale,
        c.k_tail, c.v_tail, c.flushed, c.rows, c.depth_count, c.res_layout,
        positions, out_k, out_v, lim, ip, k_in, v_in,
        sp_b, sp_h, sp_t, *ip.stride(), *k_in.stride(), *v_in.stride(),
        P, ip.shape[1], depth + DEPTH_BIAS, B, H, S, NB, CAPT, R,
        D=D, G=G, NP=np_, BP=bpg, CD=cd, RP=residual_unroll(depth), num_warps=4,
    )


def read_attend_fits(q, tensors) -> bool:
    """Whether launch_packed_read_attend takes a correction: one query row per kv head and a
    power-of-two head_dim with an even group (the bulk read's layout)."""
    B, H, S, D, G, R, NB, CAPT = _geometry(tensors)
    return q.shape[1] == H and q.shape[2] == 1 and q.shape[3] == D and not (D & (D - 1) or G % 2)


def correction_tiles(keys, depth: int, block_p: int | None = None) -> tuple[int, int]:
    """(keys per program, programs per row) of the packed corrections (launch_packed_read_attend,
    launch_packed_read_values): ``block_p`` or PACKED_READ["attend_block_p"] at ``depth`` (128 on
    the interpreter), over the P = keys.shape[-1] selected slots."""
    bp = block_p or _by_depth("attend_block_p", depth)
    if bp < 1 or bp & (bp - 1):
        raise ValueError(f"a packed correction's tile must be a power of two, got {bp} keys")
    if common.cpu_semantics(keys.device) and not block_p:
        bp = 128  # fewer, larger programs: the interpreter's cost is per operation, not per element
    return bp, max(1, triton.cdiv(keys.shape[-1], bp))


def launch_packed_read_attend(tensors, q, keys, count, depth: int, scale: float, *, inflight, wrap=no_wrap,
                              block_p: int | None = None) -> tuple:
    """Sparse decode's correction partials at ``depth`` for q [B, H, 1, D] (one query row per kv
    head) over the selected keys [B, H, 1, P] (global positions, the first count [B, H, 1] valid)
    of the packed history, the step's in-flight tokens ``inflight`` = (positions [B, Ti], k, v)
    included: _read_attend_kernel, one program per tile of ``block_p`` keys (default
    PACKED_READ["attend_block_p"] at this depth). Returns (part_m, part_l [B * H, NT], part_acc [B * H, NT, D],
    NT) in _correction_combine_kernel's layout."""
    c = PackedTensors(*tensors)
    B, H, S, D, G, R, NB, CAPT = _geometry(tensors)
    if not read_attend_fits(q, tensors):
        raise ValueError(f"the read-and-attend correction needs q [B, {H}, 1, {D}] (one query row per kv head) and a "
                         f"power-of-two head_dim with an even group; got q {tuple(q.shape)}, head_dim {D}, group {G}")
    Bc, P = q.shape[0], keys.shape[-1]
    np_ = next_pow2(D // 2)
    bp, nt = correction_tiles(keys, depth, block_p)
    split = max(1, min(bp, int(PACKED_READ["generic_split"])))
    dev = q.device
    part_m = torch.empty(Bc * H, nt, dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(Bc * H, nt, D, dtype=torch.float32, device=dev)
    ip, k_in, v_in = inflight  # the kernel takes the first in-flight position of its row itself
    nreg = _by_depth("attend_maxnreg", depth)
    wrap(_read_attend_kernel)[(Bc, H, nt)](
        c.k_base, c.k_base_min, c.k_base_scale, c.v_base, c.v_base_min, c.v_base_scale,
        c.k_res, c.k_res_min, c.k_res_scale, c.v_res, c.v_res_min, c.v_res_scale,
        c.k_tail, c.v_tail, c.flushed, c.rows, c.depth_count, c.res_layout,
        q, keys, count, ip, k_in, v_in, part_m, part_l, part_acc,
        q.stride(0), q.stride(1), q.stride(3), keys.stride(0), keys.stride(1), keys.stride(3),
        count.stride(0), count.stride(1),
        *ip.stride(), *k_in.stride(), *v_in.stride(),
        float(scale), P, ip.shape[1], nt, B, H, S, NB, CAPT, R,
        D=D, G=G, NP=np_, BP=bp, CD=_CDTYPE_CODE[c.k_tail.dtype], RP=residual_unroll(depth), DEPTH=depth, SPLIT=split,
        VW=min(16, D // 2, G // 2), num_warps=PACKED_READ["num_warps"], **({"maxnreg": nreg} if nreg else {}),
    )
    return part_m, part_l, part_acc, nt


# ------------------------------------------------------------------------------------------------
# the V-only correction of reuse_selected_probabilities
# ------------------------------------------------------------------------------------------------


@triton.jit
def _read_values_kernel(
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
    k_tail, v_tail, flushed, rows, depth_count, res_layout,
    keys, probs, count, in_positions, v_in, part_acc,
    skey_b, skey_h, skey_t, spr_b, spr_h, spr_t, sc_b, sc_h,
    sip_b, sip_t, sv_b, sv_h, sv_t, sv_d,
    P, Ti, NT, B, H, S, NB, CAPT, R,
    D: tl.constexpr, G: tl.constexpr, NP: tl.constexpr, BP: tl.constexpr, CD: tl.constexpr,
    RP: tl.constexpr, DEPTH: tl.constexpr, SPLIT: tl.constexpr,
):
    """reuse_selected_probabilities' correction for one query row per kv head (row b * H + h):
    program z takes the selected keys [z * BP, (z + 1) * BP) of the row (keys [B, H, P] global
    positions, the first count[b, h] valid; probs: loop 2's probability of each) and writes the
    partial sum of probs * V [D] for correction.reuse_combine_triton. V only: a tile of the flushed
    bulk (_bulk_read_tile's rule) reads the V planes alone (_bulk_v); any other (ring, in-flight,
    unflushed depth) resolves its tokens with _resolve_tile on SPLIT sub-tiles (which resolves K
    too: a few tiles per row). The values are packed_read's, rounded to the compute dtype."""
    HD: tl.constexpr = D // 2
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    z = NT - 1 - tl.program_id(2)  # the per-token tile (highest positions) in the first wave
    out = (b * H + h) * NT + z
    i = tl.arange(0, NP)
    cnt = tl.minimum(tl.load(count + b * sc_b + h * sc_h), P)
    acc_e = tl.zeros([NP], tl.float32)
    acc_o = tl.zeros([NP], tl.float32)
    if z * BP < cnt:
        kr = keys + b * skey_b + h * skey_h
        pr = probs + b * spr_b + h * spr_h
        t = z * BP + tl.arange(0, BP)
        valid = t < cnt
        p = tl.load(kr + t * skey_t, mask=valid, other=-1).to(tl.int64)
        if _selected_in_bulk(p, valid, flushed + b * R, in_positions + b * sip_b, sip_t, Ti, S, DEPTH, RP):
            # the flushed bulk: the V planes only
            pc = tl.where(valid, p, 0).to(tl.int32)
            kb_codes, kb_min, kb_scale, vb_codes, vb_min, vb_scale, kr_codes, vr_codes, vr_min, vr_scale = _row_bases(
                k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, v_res, v_res_min, v_res_scale,
                b * H + h, S, NB, CAPT, D, G,
            )
            ve, vo = _bulk_v(vb_codes, vb_min, vb_scale, vr_codes, vr_min, vr_scale, rows, res_layout, pc, b, B, S, D, G,
                             BP, DEPTH)
            w = tl.load(pr + t * spr_t, mask=valid, other=0.0)[:, None]
            acc_e = tl.sum(w * _round_to(ve, CD), 0)
            acc_o = tl.sum(w * _round_to(vo, CD), 0)
        else:
            BS: tl.constexpr = BP // SPLIT
            for sub in range(SPLIT):
                ts = z * BP + sub * BS + tl.arange(0, BS)
                vs = ts < cnt
                ps = tl.load(kr + ts * skey_t, mask=vs, other=-1).to(tl.int64)
                _ke, _ko, ve, vo = _resolve_tile(
                    ps, vs, b, h, DEPTH,
                    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
                    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
                    k_tail, v_tail, flushed, rows, depth_count, res_layout,
                    in_positions, v_in, v_in,
                    sip_b, sip_t, sv_b, sv_h, sv_t, sv_d, sv_b, sv_h, sv_t, sv_d,
                    Ti, B, H, S, NB, CAPT, R, D, G, NP, CD, RP,
                )
                w = tl.load(pr + ts * spr_t, mask=vs, other=0.0)[:, None]
                acc_e += tl.sum(w * ve, 0)
                acc_o += tl.sum(w * vo, 0)
    tl.store(part_acc + out * D + 2 * i, acc_e, mask=i < HD)
    tl.store(part_acc + out * D + 2 * i + 1, acc_o, mask=i < HD)


def launch_packed_read_values(tensors, keys, count, probs, depth: int, *, inflight, wrap=no_wrap,
                              block_p: int | None = None):
    """reuse_selected_probabilities' correction partials at ``depth`` over the selected keys
    [B, H, 1, P] (global positions, the first count [B, H, 1] valid; probs [B, H, 1, P] loop 2's
    probabilities) of the packed history, one query row per kv head, the step's in-flight tokens
    ``inflight`` = (positions [B, Ti], v [B, H, Ti, D]) included: _read_values_kernel, one program
    per tile of ``block_p`` keys (default PACKED_READ["attend_block_p"] at this depth). Returns
    part_acc [B * H, NT, D] for correction.reuse_combine_triton."""
    c = PackedTensors(*tensors)
    B, H, S, D, G, R, NB, CAPT = _geometry(tensors)
    if keys.shape[1] != H or keys.shape[2] != 1 or D & (D - 1) or G % 2:
        raise ValueError(f"the V-only correction needs keys [B, {H}, 1, P] (one query row per kv head) and a "
                         f"power-of-two head_dim with an even group; got keys {tuple(keys.shape)}, head_dim {D}, group {G}")
    Bc, P = keys.shape[0], keys.shape[-1]
    bp, nt = correction_tiles(keys, depth, block_p)
    split = max(1, min(bp, int(PACKED_READ["generic_split"])))
    part_acc = torch.empty(Bc * H, nt, D, dtype=torch.float32, device=keys.device)
    ip, v_in = inflight
    wrap(_read_values_kernel)[(Bc, H, nt)](
        c.k_base, c.k_base_min, c.k_base_scale, c.v_base, c.v_base_min, c.v_base_scale,
        c.k_res, c.k_res_min, c.k_res_scale, c.v_res, c.v_res_min, c.v_res_scale,
        c.k_tail, c.v_tail, c.flushed, c.rows, c.depth_count, c.res_layout,
        keys, probs, count, ip, v_in, part_acc,
        keys.stride(0), keys.stride(1), keys.stride(3), probs.stride(0), probs.stride(1), probs.stride(3),
        count.stride(0), count.stride(1),
        *ip.stride(), *v_in.stride(),
        P, ip.shape[1], nt, B, H, S, NB, CAPT, R,
        D=D, G=G, NP=next_pow2(D // 2), BP=bp, CD=_CDTYPE_CODE[c.k_tail.dtype], RP=residual_unroll(depth), DEPTH=depth,
        SPLIT=split, num_warps=PACKED_READ["num_warps"],
    )
    return part_acc
