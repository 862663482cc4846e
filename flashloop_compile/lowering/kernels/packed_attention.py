"""Triton kernels of ``flashloop::packed_attention`` (conventions in packed_codec.py).

``_attn_kernel`` [B*H, splits, query tiles]: causal attention over the packed store (positions <
P0) and the in-flight keys: split-K partials (flash-decoding) for decode, merged by
packed_decode's ``_combine_kernel``, and a fused single pass per query tile for prefill chunks.
One query row per kv head takes packed_decode's ``_decode_bulk_kernel`` for the flushed bulk and
``_attn_kernel`` for the tail and in-flight keys only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashloop_compile.lowering.kernels import common
from flashloop_compile.lowering.kernels.common import next_pow2, no_wrap, stored_end
from flashloop_compile.lowering.kernels.packed_codec import DEPTH_BIAS, _CDTYPE_CODE, _DEPTH_BIAS, _flushed_min, _geometry, _reconstruct, _round_to, residual_unroll
from flashloop_compile.lowering.kernels.packed_decode import (
    FAST_DECODE, FP32_ONE_BITS, _combine_kernel, _decode_bulk_kernel, bulk_lanes, decode_splits,
)
from flashloop_compile.lowering.kernels.packed_read import launch_packed_read
from flashloop_compile.lowering.kernels.running_extrema import running_extrema
from flashloop_compile.lowering.packed_layout import PackedTensors

__all__ = ["launch_packed_attention", "inflight_bounds", "PACKED_PREFILL"]


@triton.jit
def _inflight_tile(in_positions, b, sip_b, sip_t, t0, Ti, BNI: tl.constexpr):
    """In-flight keys t0..t0+BNI-1 of row b: indices, positions, validity, smallest valid position
    (a tile whose keys all lie after every query is skipped by the caller)."""
    tk = t0 + tl.arange(0, BNI)
    tkm = tk < Ti
    kpos = tl.load(in_positions + b * sip_b + tk * sip_t, mask=tkm, other=-1)
    kvalid = tkm & (kpos >= 0)
    kmin = tl.min(tl.where(kvalid, kpos, 9223372036854775807), 0)
    return tk, kpos, kvalid, kmin


@triton.jit
def _dot_t(a, b, DOT_T: tl.constexpr):
    """a @ b^T (fp32 result) in the compute dtype's MMA (FP32 IEEE for DOT_T 0)."""
    if DOT_T == 1:
        return tl.dot(a.to(tl.bfloat16), tl.trans(b.to(tl.bfloat16)))
    elif DOT_T == 2:
        return tl.dot(a.to(tl.float16), tl.trans(b.to(tl.float16)))
    else:
        return tl.dot(a, tl.trans(b), input_precision="ieee")


@triton.jit
def _dot(p, v, DOT_T: tl.constexpr):
    """p @ v (fp32 result), p rounded to the compute dtype as the PV product of dense attention."""
    if DOT_T == 1:
        return tl.dot(p.to(tl.bfloat16), v.to(tl.bfloat16))
    elif DOT_T == 2:
        return tl.dot(p.to(tl.float16), v.to(tl.float16))
    else:
        return tl.dot(p, v, input_precision="ieee")


_LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _inflight_step(q, k_ptrs, v_ptrs, kmask, tk, kpos, qpos, qvalid, m_i, l_i, acc, qk_scale,
                   DOT_T: tl.constexpr, MASKED: tl.constexpr):
    """One online-softmax step of prefill over in-flight keys as whole rows (k/v_ptrs [BNI, D]),
    in base-2 units (qk_scale = scale * log2 e; m_i in the same units). MASKED: key tk (position
    kpos, -1 = padding) is visible to a row at or after it; otherwise every key of the tile is
    visible to every valid row (the launcher's bounds guarantee it; invalid rows are dropped at
    the store)."""
    kt = tl.load(k_ptrs, mask=kmask, other=0.0)
    vt = tl.load(v_ptrs, mask=kmask, other=0.0)
    if DOT_T == 0:
        kt = kt.to(tl.float32)
        vt = vt.to(tl.float32)
    s = _dot_t(q, kt, DOT_T) * qk_scale
    if MASKED:
        vis = (kpos >= 0)[None, :] & (kpos[None, :] <= qpos[:, None]) & qvalid[:, None]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row without a visible key yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p, vt, DOT_T)
    return m_new, l_i, acc


@triton.jit
def _attend(qe, qo, ke, ko, ve, vo, kpos, kvalid, qpos, qvalid, m_i, l_i, acc_e, acc_o, scale,
            USE_DOT: tl.constexpr, DOT_T: tl.constexpr):
    """One online-softmax step over a key tile (keys already rounded to the compute dtype); q,
    keys, values and accumulator as even/odd channel halves (the packed layout). Prefill's
    in-flight keys as whole rows: _inflight_step."""
    if USE_DOT:
        s = _dot_t(qe, ke, DOT_T) + _dot_t(qo, ko, DOT_T)
    else:
        s = (tl.sum(ke * qe, 1) + tl.sum(ko * qo, 1))[None, :]
    s = s * scale
    vis = kvalid[None, :] & qvalid[:, None] & (kpos[None, :] <= qpos[:, None])
    s = tl.where(vis, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_safe)
    pr = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(pr, 1)
    if USE_DOT:
        acc_e = acc_e * alpha[:, None] + _dot(pr, ve, DOT_T)
        acc_o = acc_o * alpha[:, None] + _dot(pr, vo, DOT_T)
    else:
        pc = tl.trans(pr)  # [BN, 1]
        acc_e = acc_e * alpha[:, None] + tl.sum(pc * ve, 0)[None, :]
        acc_o = acc_o * alpha[:, None] + tl.sum(pc * vo, 0)[None, :]
    return m_new, l_i, acc_e, acc_o


@triton.jit(do_not_specialize=["depth_arg"])
def _attn_kernel(
    q, k_in, v_in, q_positions, in_positions, p0,
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
    k_tail, v_tail, flushed, rows, depth_count, res_layout,
    out, part_ml, part_acc, bounds, k_st, v_st,
    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    sqp_b, sqp_t, sip_b, sip_t,
    T, Ti, Hq, depth_arg, scale, B, H, S, NB, CAPT, R,
    D: tl.constexpr, G: tl.constexpr, NP: tl.constexpr, QPK: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, NSTORED: tl.constexpr, FUSED: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_T: tl.constexpr, CD: tl.constexpr,
    FAST: tl.constexpr = False, RP: tl.constexpr = 4, BNF: tl.constexpr = 64,
    BNI: tl.constexpr = 32, NTAIL: tl.constexpr = 1,
):
    """NTAIL (FAST; 1 otherwise): programs per row for what the bulk kernel leaves (splits
    NSTORED .. NSTORED + NTAIL - 1, each taking every NTAIL-th tile of it; the first also the
    in-flight keys). FUSED (prefill): the stored keys come as whole rows, k_st/v_st [B, H, S, D]
    (the launcher's packed read of positions 0..P0-1), attended in flash attention's loop like
    the in-flight keys, masked by position (and by depth_count: a position never written is no
    key); bounds [B, query tiles, 2] int32 from inflight_bounds: the in-flight keys [0, bounds[0])
    are visible to every valid row of the tile (no mask), the rest up to bounds[1] are masked by
    position, none after it is visible; query tiles run heaviest first (the last tile has the
    latest positions when they ascend). Decode: k_st/v_st unused."""
    depth = depth_arg - _DEPTH_BIAS
    HD: tl.constexpr = D // 2
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    z = tl.program_id(1) + (NSTORED if FAST else 0)  # FAST: NTAIL programs per row, splits NSTORED on
    mt = tl.program_id(2)
    if FUSED:
        mt = tl.num_programs(2) - 1 - mt
    m = mt * BM + tl.arange(0, BM)
    mmask = m < T * QPK
    t = (m // QPK).to(tl.int64)
    hq = (h * QPK + m % QPK).to(tl.int64)
    qpos = tl.load(q_positions + b * sqp_b + t * sqp_t, mask=mmask, other=-1)
    qvalid = mmask & (qpos >= 0)
    i = tl.arange(0, NP)
    imask = i < HD
    qm = qvalid[:, None] & imask[None, :]
    qo_ = (b * sq_b + hq * sq_h + t * sq_t)[:, None] + (2 * i)[None, :] * sq_d
    qe = tl.load(q + qo_, mask=qm, other=0.0).to(tl.float32)
    qo = tl.load(q + qo_ + sq_d, mask=qm, other=0.0).to(tl.float32)

    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc_e = tl.zeros([BM, NP], tl.float32)
    acc_o = tl.zeros([BM, NP], tl.float32)
    qmax = tl.max(tl.where(qvalid, qpos, -1), 0)

    P0 = tl.load(p0 + b)
    if FAST:
        # one query row: splits 0..NSTORED-1 (the tiles of BNF keys below every depth's flushed
        # boundary) ran in _decode_bulk_kernel; this program is split NSTORED: the rest of the
        # stored prefix (per-token resolution, the ring) and the in-flight keys. Stored keys (< P0)
        # precede every query.
        # NTAIL programs take its tiles in turn (per-token tiles are chains of dependent loads: in
        # one program the ring's 2-5 tiles ran one after the other, after the bulk kernel)
        nfast = tl.minimum(_flushed_min(flushed + b * R, depth, RP), P0) // BNF
        nfast = tl.where(tl.max(qvalid.to(tl.int32), 0) > 0, nfast, 0)
        tile = (nfast * BNF) // BN + tl.program_id(1)
        t_hi = (P0 + BN - 1) // BN
    elif not FUSED:  # FUSED (prefill): the stored keys as whole rows, below
        ntiles = (P0 + BN - 1) // BN
        tile = (z * ntiles) // NSTORED
        t_hi = ((z + 1) * ntiles) // NSTORED
        if z >= NSTORED:
            t_hi = tile
    if not FUSED:
        while tile < t_hi:
            kpos = tile.to(tl.int64) * BN + tl.arange(0, BN)
            pm = kpos < P0
            ke, ko, ve, vo, kvalid = _reconstruct(
                kpos, pm, b, h, depth,
                k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
                k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
                k_tail, v_tail, flushed, rows, depth_count, res_layout,
                B, H, S, NB, CAPT, R, D, G, 0, NP, True, RP,
            )
            m_i, l_i, acc_e, acc_o = _attend(
                qe, qo, _round_to(ke, CD), _round_to(ko, CD), _round_to(ve, CD), _round_to(vo, CD),
                kpos, kvalid, qpos, qvalid, m_i, l_i, acc_e, acc_o, scale, USE_DOT, DOT_T,
            )
            tile += NTAIL
    if FUSED:
        # prefill: the in-flight keys (every prompt key of a fresh prefill) as whole rows, flash
        # attention's loop: contiguous loads, one MMA over D, base-2 exponentials, software
        # pipelined (range bounds, no branch in the body): keys [0, a_end) unmasked, [a_end,
        # hi_end) masked by position
        c = tl.arange(0, 2 * NP)
        cmask = c < D
        acc_w = tl.zeros([BM, 2 * NP], tl.float32)
        qk_scale = scale * _LOG2E
        q_w = tl.load(q + (b * sq_b + hq * sq_h + t * sq_t)[:, None] + c[None, :] * sq_d,
                      mask=qvalid[:, None] & cmask[None, :], other=0.0)
        if DOT_T == 0:
            q_w = q_w.to(tl.float32)
        # stored keys 0..P0-1 (positions = indices; a position the store never held is no key):
        # masked by position (a row without in-flight keys reads the store up to its own
        # position); a tile without a valid row reads none
        s_end = tl.where(qmax >= 0, P0, 0)
        rw = (b * H + h) * S
        cs = c[None, :]
        for t0 in range(0, s_end, BNI):
            tk = (t0 + tl.arange(0, BNI)).to(tl.int64)
            kin = tk < s_end
            held = tl.load(depth_count + b * S + tk, mask=kin, other=0) > 0
            m_i, l_i, acc_w = _inflight_step(q_w, k_st + (rw + tk)[:, None] * D + cs, v_st + (rw + tk)[:, None] * D + cs,
                                             cmask[None, :] & kin[:, None], tk, tl.where(held, tk, -1), qpos, qvalid,
                                             m_i, l_i, acc_w, qk_scale, DOT_T, True)
        bnd = bounds + (b * tl.num_programs(2) + mt) * 2
        a_end = tl.load(bnd)
        hi_end = tl.load(bnd + 1)
        kb = k_in + b * sk_b + h * sk_h
        vb = v_in + b * sv_b + h * sv_h
        ck = c[None, :] * sk_d
        cv = c[None, :] * sv_d
        for t0 in range(0, a_end, BNI):
            tk = (t0 + tl.arange(0, BNI)).to(tl.int64)
            m_i, l_i, acc_w = _inflight_step(q_w, kb + tk[:, None] * sk_t + ck, vb + tk[:, None] * sv_t + cv, cmask,
                                             tk, tk, qpos, qvalid, m_i, l_i, acc_w, qk_scale, DOT_T, False)
        for t0 in range(a_end, hi_end, BNI):
            tk = (t0 + tl.arange(0, BNI)).to(tl.int64)
            kpos = tl.load(in_positions + b * sip_b + tk * sip_t, mask=tk < Ti, other=-1)
            m_i, l_i, acc_w = _inflight_step(q_w, kb + tk[:, None] * sk_t + ck, vb + tk[:, None] * sv_t + cv,
                                             cmask & (tk < Ti)[:, None], tk, kpos, qpos, qvalid, m_i, l_i, acc_w,
                                             qk_scale, DOT_T, True)
        keep = qvalid & (l_i > 0.0)
        inv = 1.0 / tl.where(keep, l_i, 1.0)
        o = ((b * Hq + hq) * T + t)[:, None] * D + c[None, :]
        res = tl.where(keep[:, None], acc_w * inv[:, None], 0.0)
        tl.store(out + o, _round_to(res, CD).to(out.dtype.element_ty), mask=mmask[:, None] & cmask[None, :])
    else:
        # decode: split-K partials. In an else of the constexpr branch, not after a return: torch's
        # wrap_triton analysis reads every store in the TTIR, and prefill passes ``out`` as part_ml
        # and part_acc too (functionalization then clones a dynamic-shape buffer and Inductor's
        # decomposition of the launch fails)
        if z == NSTORED:
            t0 = 0
            while t0 < Ti:
                tk, kpos, kvalid, kmin = _inflight_tile(in_positions, b, sip_b, sip_t, t0, Ti, BNI)
                if kmin <= qmax:
                    km = kvalid[:, None] & imask[None, :]
                    ko_ = (b * sk_b + h * sk_h + tk * sk_t)[:, None] + (2 * i)[None, :] * sk_d
                    vo_ = (b * sv_b + h * sv_h + tk * sv_t)[:, None] + (2 * i)[None, :] * sv_d
                    ke = tl.load(k_in + ko_, mask=km, other=0.0).to(tl.float32)
                    ko = tl.load(k_in + ko_ + sk_d, mask=km, other=0.0).to(tl.float32)
                    ve = tl.load(v_in + vo_, mask=km, other=0.0).to(tl.float32)
                    vo = tl.load(v_in + vo_ + sv_d, mask=km, other=0.0).to(tl.float32)
                    m_i, l_i, acc_e, acc_o = _attend(
                        qe, qo, ke, ko, ve, vo, kpos, kvalid, qpos, qvalid, m_i, l_i, acc_e, acc_o, scale, USE_DOT, DOT_T,
                    )
                t0 += BNI

        orow = (b * Hq + hq) * T + t  # [BM]
        om = mmask[:, None] & imask[None, :]
        NSPL: tl.constexpr = NSTORED + NTAIL
        prow = orow * NSPL + z
        tl.store(part_ml + prow * 2, m_i, mask=mmask)
        tl.store(part_ml + prow * 2 + 1, l_i, mask=mmask)
        o = prow[:, None] * D + 2 * i[None, :]
        tl.store(part_acc + o, acc_e, mask=om)
        tl.store(part_acc + o + 1, acc_o, mask=om)


# ------------------------------------------------------------------------------------------------
# launcher
# ------------------------------------------------------------------------------------------------


def inflight_bounds(q_positions, inflight_positions, qpk: int, block_m: int, block_n: int, *, wrap=no_wrap,
                    max_len: int | None = None):
    """[B, query tiles, 2] int32 for prefill's whole-row loop over the in-flight keys (index order):
    per tile of block_m query rows (row m is query token m // qpk), a_end: the in-flight keys
    before it are valid and at or before every valid row's position (attended without a mask),
    rounded down to block_n; hi_end: no key from it on is at or before any row's position (the
    loop stops there). Correct for any order of positions (padding -1 anywhere); with ascending
    positions (a prompt) the masked band is the causal diagonal. On device, no host sync."""
    B, T = q_positions.shape
    big = torch.iinfo(torch.int64).max
    kk = torch.where(inflight_positions >= 0, inflight_positions, big)
    # both non-decreasing: premax is big after the first padding key, sufmin the min position from key i on
    premax, sufmin = running_extrema(kk, premax=True, sufmin=True, wrap=wrap, max_len=max_len)
    tiles = -(-(T * qpk) // block_m)
    rows = torch.arange(tiles * block_m, device=q_positions.device) // qpk
    qp = q_positions[:, rows.clamp_max(T - 1)]
    qvalid = (rows < T)[None, :] & (qp >= 0)
    qmax = torch.where(qvalid, qp, -1).view(B, tiles, block_m).amax(-1)
    qmin = torch.where(qvalid, qp, big).view(B, tiles, block_m).amin(-1)
    qmin = torch.where(qmax >= 0, qmin, -1)  # a tile without a valid row attends nothing
    hi = torch.searchsorted(sufmin, qmax, right=True)
    a = torch.minimum(torch.searchsorted(premax, qmin, right=True), hi)
    return torch.stack([a // block_n * block_n, hi], -1).to(torch.int32).contiguous()


# Prefill (one fused pass per query tile, the in-flight keys as whole rows in flash attention's
# loop): query rows per program, in-flight key tile, warps, stages. bm128 bni64 w8 s3 ties bm64
# bni64 w4 s3 at 32K (11.48 / 11.49 ms) without spilling (scripts/kernel_report.py: 247
# registers); two stages lose at 32K (15.18 ms).
PACKED_PREFILL = {"block_m": 128, "block_n_inflight": 64, "num_warps": 8, "num_stages": 3}


def launch_packed_attention(
    tensors, q, k_inflight, v_inflight, q_positions, inflight_positions, depth: int, scale: float, out,
    *, wrap=no_wrap, num_splits: int | None = None, mode: str | None = None, fast: bool | None = None,
    tuning: dict | None = None,
) -> None:
    """Causal attention at ``depth`` into out [B, Hq, T, D] (contiguous); see packed_ops.

    mode: "decode" (split-K partials + combine; default when T * Hq/H <= 64) or "prefill"
    (one fused pass per query tile). One query row per kv head with a power-of-two head_dim and an
    even group takes _decode_bulk_kernel for the flushed bulk (``fast`` False: _attn_kernel alone,
    tests). ``tuning``: entries of FAST_DECODE / PACKED_PREFILL to launch with instead (tests,
    sweeps)."""
    c = PackedTensors(*tensors)
    B, H, S, D, G, R, NB, CAPT = _geometry(tensors)
    Bc, Hq, T, _ = q.shape
    Ti = k_inflight.shape[2]
    if Bc == 0 or T == 0:
        return
    qpk = Hq // H
    mrows = T * qpk
    if mode is None:
        mode = "decode" if mrows <= 64 else "prefill"
    np_ = next_pow2(D // 2)
    interp = common.cpu_semantics(q.device)
    cd = _CDTYPE_CODE[q.dtype]
    dot_t = 0 if (interp or q.dtype == torch.float32) else cd  # the interpreter's bf16 dot is wrong: FP32 there
    p0 = stored_end(q_positions, inflight_positions, S)
    unknown = sorted(set(tuning or {}) - set(FAST_DECODE) - set(PACKED_PREFILL))
    if unknown:
        raise ValueError(f"unknown launch parameters {unknown}; known: {sorted({**FAST_DECODE, **PACKED_PREFILL})}")
    tune = {**FAST_DECODE, **(tuning or {})}
    bnf = tune["block_n"] = min(tune["block_n"] if depth == 0 else tune["block_n_residual"], G)
    pow2 = lambda n: n > 0 and not n & (n - 1)  # noqa: E731
    fast_fits = mode == "decode" and mrows == 1 and pow2(D) and pow2(G) and G >= 8 and pow2(bnf) and G % bnf == 0
    if fast is None:
        fast = fast_fits  # other shapes: the generic decode kernel
    elif fast and not fast_fits:
        raise ValueError(f"the fast decode path needs decode mode, one query row per kv head, a power-of-two head_dim "
                         f"and group (>= 8) and a power-of-two block_n dividing the group; got mode {mode}, {mrows} rows, head_dim {D}, "
                         f"group {G}, block_n {tune['block_n']}")
    stages = tune["num_stages"]
    bounds, stages_opt = p0, {}  # bounds: read by prefill's whole-row path only
    k_st = v_st = k_inflight  # the stored keys as rows: prefill only
    if mode == "decode":
        bm = 1 if mrows == 1 else max(16, next_pow2(mrows))
        bn = min(G, 32)  # a key tile lies in one block (K parameters loaded once per tile)
        bni = bn
        m_tiles = triton.cdiv(mrows, bm)
        if num_splits is not None:
            ns = num_splits
        elif fast:
            ns = decode_splits(Bc, H, m_tiles, S, bnf, q.device, waves=tune["waves"])
        else:
            ns = decode_splits(Bc, H, m_tiles, S, bn, q.device)
        ntail = max(1, int(tune["tail_programs"])) if fast else 1
        if interp and "tail_programs" not in (tuning or {}):
            ntail = 1  # the interpreter's cost is per program: one tail program unless a test asks
        nspl = ns + ntail
        part_ml = torch.empty(Bc * Hq * T * nspl * 2, dtype=torch.float32, device=q.device)
        part_acc = torch.empty(Bc * Hq * T * nspl * D, dtype=torch.float32, device=q.device)
        grid = (Bc * H, nspl, m_tiles)
        fused = False
        warps = 8  # _attn_kernel's generic tile code spills at 4 (scripts/kernel_report.py)
    elif mode == "prefill":
        ntail = 1
        ptune = {**PACKED_PREFILL, **(tuning or {})}
        bm = ptune["block_m"]
        bn = min(G, 64 if interp else 32)
        # the interpreter's cost is per operation: larger tiles unless a test asks for others
        bni = (tuning or {}).get("block_n_inflight", 64 if interp else ptune["block_n_inflight"])
        m_tiles = triton.cdiv(mrows, bm)
        ns = 1
        part_ml = part_acc = out  # unused
        grid = (Bc * H, 1, m_tiles)
        fused = True
        warps = ptune["num_warps"]
        for key, val in (("block_m", bm), ("block_n_inflight", bni)):
            if val < 16 or val & (val - 1):
                raise ValueError(f"prefill {key} must be a power of two >= 16 (a tensor-core tile); got {val}")
        bounds = inflight_bounds(q_positions, inflight_positions, qpk, bm, bni, wrap=wrap, max_len=S)
        stages_opt = {} if interp else {"num_stages": int(ptune["num_stages"])}
        # the stored keys read once as rows (a bandwidth-bound packed read) for every query tile's
        # flash loop, rather than reconstructed in every query tile (7.7x slower for a 4096-token
        # chunk over a stored 28K prefix: docs/DESIGN.md section 7). Sized by the cache's
        # capacity (P0 is on the device); the tiles from P0 on are left unread
        k_st = q.new_empty(Bc, H, S, D)
        v_st = q.new_empty(Bc, H, S, D)
        ar = torch.arange(S, device=q.device)[None, :]
        launch_packed_read(tensors, torch.where(ar < p0[:, None], ar, -1).expand(Bc, S), depth, k_st, v_st, wrap=wrap,
                           skip_padding=True)
    else:
        raise ValueError(f"mode must be 'decode' or 'prefill', got {mode!r}")
    if fast:
        wrap(_decode_bulk_kernel)[(Bc * H, ns)](
            q, q_positions, p0, c.flushed,
            c.k_base, c.k_base_min, c.k_base_scale, c.v_base, c.v_base_min, c.v_base_scale,
            c.k_res, c.k_res_min, c.k_res_scale, c.v_res, c.v_res_min, c.v_res_scale,
            c.rows, c.res_layout, part_ml, part_acc,
            q.stride(0), q.stride(1), q.stride(3), q_positions.stride(0), float(scale), FP32_ONE_BITS,
            B, H, S, NB, CAPT, R,
            D=D, G=G, BN=bnf, LANES=bulk_lanes(D, bnf), NSTORED=ns, RP=residual_unroll(depth), STAGES=stages, DEPTH=depth,
            NTAIL=ntail, num_warps=tune["num_warps"],
        )
        grid = (Bc * H, ntail, m_tiles)  # _attn_kernel takes splits NSTORED on only: the tail and in-flight keys
    wrap(_attn_kernel)[grid](
        q, k_inflight, v_inflight, q_positions, inflight_positions, p0,
        c.k_base, c.k_base_min, c.k_base_scale, c.v_base, c.v_base_min, c.v_base_scale,
        c.k_res, c.k_res_min, c.k_res_scale, c.v_res, c.v_res_min, c.v_res_scale,
        c.k_tail, c.v_tail, c.flushed, c.rows, c.depth_count, c.res_layout,
        out, part_ml, part_acc, bounds, k_st, v_st,
        *q.stride(), *k_inflight.stride(), *v_inflight.stride(),
        *q_positions.stride(), *inflight_positions.stride(),
        T, Ti, Hq, depth + DEPTH_BIAS, float(scale), B, H, S, NB, CAPT, R,
        D=D, G=G, NP=np_, QPK=qpk, BM=bm, BN=bn, NSTORED=ns, FUSED=fused, NTAIL=ntail,
        USE_DOT=bm >= 16, DOT_T=dot_t, CD=cd, FAST=fast, RP=residual_unroll(depth), BNF=bnf, BNI=bni,
        num_warps=warps, **stages_opt,
    )
    if not fused:
        wrap(_combine_kernel)[(Bc * Hq * T,)](
            part_ml, part_acc, out, NSPL=nspl, NSP2=next_pow2(nspl), D=D, DP=next_pow2(D), CD=cd, num_warps=4,
        )
