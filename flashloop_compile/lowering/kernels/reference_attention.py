"""Triton kernels of sparse decode's loop-2 reference (SPEC.md section 2): the CUDA body of
``flashloop::reference_attention``, over dense K/V or, in the code domain, over the packed cache.

Launchers (plain Python, host-sync free: only ``kernel[grid](...)`` launches and torch ops
that never read device values on the host, so they run inside CUDA graphs and, through
``wrap=True``, inside ``torch.library.triton_op`` via ``torch.library.wrap_triton``):

- :func:`reference_attention_triton` returns exactly what ``ops._reference_attention_aten``
  returns: ``(out, keys, count, mass, o_ref, c_ref)``.

Reference pipeline (R = B * Hq * T query rows, M = (Hq // Hkv) * T rows per kv head):

1. ``_scores_kernel``  grid (B*Hkv, SPLIT_A, cdiv(M, BLOCK_M)): one read of K; for every query
   row of the kv group computes FP32 scores ``s = q.k * scale`` (-inf where the mask hides the
   key) into a scratch ``[R, S]`` buffer plus per-split online-softmax partials (max, sumexp).
2. Top-k selection: selection.py's radix select over the scratch row.
3. ``_pv_kernel`` grid (B*Hkv, SPLIT_C, cdiv((F+1)*M, BLOCK_E)): one read of V; the rows of the
   dot are (slot, query row) pairs, slot 0 = all keys (O_ref), slot 1+f = the keys of fraction
   f (C_ref and mass), so O_ref and every C_ref come out of the same pass over V. For bf16 V the
   FP32 probabilities enter the MMA as three bf16 terms (hi + mid + lo, 24 bits); otherwise as
   tf32x3.
4. ``_pv_combine_kernel`` grid ((F+1)*R,): sums the split partials (the probabilities are
   already normalized, so no rescaling) and writes out / o_ref / c_ref / mass.

Bytes (bf16, T=1, Hq=Hkv, D=128): K and V are read once (512 B per key and kv head, as dense
decode attention); the FP32 score/probability row adds 4 B per key and query row, written once
and re-read by the selection passes and the PV pass (~28 B per key and row, mostly L2 hits).

Semantics decided here (identical to the ATen bodies whenever ``count <= capacity``, which the
passes guarantee by using ``capacity = ceil(f * S)``): fraction f selects
``min(count_f, capacity_f)`` keys, ranked by probability (descending), equal probabilities to
the lower index, invisible keys after all visible ones (so never taken while ``f <= 1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashloop_compile.lowering.kernels import common, gluon_pv, gluon_scores
from flashloop_compile.lowering.kernels import sparse_config as sc
from flashloop_compile.lowering.kernels.common import first_inflight, key_counts, next_pow2, sm_count
from flashloop_compile.lowering.kernels.packed_codec import _bulk_residual_rows, _geometry, _row_bases
from flashloop_compile.lowering.kernels.packed_code_domain import _code_units, _linear_scores, _row_sums, _word_groups, _word_pairs
from flashloop_compile.lowering.kernels.selection import _prob_key, radix_digits, radix_select
from flashloop_compile.lowering.kernels.sparse_config import KernelConfig, Launcher, cdiv, split_range
from flashloop_compile.lowering.packed_layout import PackedTensors

__all__ = ["reference_attention_triton", "linear_fits", "linear_window"]


@triton.jit
def _scores_kernel(
    q_ptr, k_ptr, mask_ptr, s_ptr, pm_ptr, pl_ptr,
    S, HKV, R_GROUP, scale,
    sqb, sqh, sqt, sqd,
    skb, skh, sks, skd,
    smb, smh, smt, sms,
    CHUNK, SPLIT,
    G: tl.constexpr, T: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_m = tl.program_id(2)
    scale_f = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    b = (pid_bh // HKV).to(tl.int64)
    hk = (pid_bh % HKV).to(tl.int64)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = r < G * T
    h = hk * G + (r // T)
    t = r % T
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + b * sqb + h[:, None] * sqh + t[:, None] * sqt + dd[None, :] * sqd, mask=r_ok[:, None], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    row = pid_bh.to(tl.int64) * R_GROUP + r  # global query row (b, h, t)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    start = pid_s * CHUNK
    end = tl.minimum(start + CHUNK, S)
    k_row = k_ptr + b * skb + hk * skh
    m_base = mask_ptr + b * smb + h[:, None] * smh + t[:, None] * smt
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        kt = tl.load(k_row + n[:, None].to(tl.int64) * sks + dd[None, :] * skd, mask=n_ok[:, None], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        s = tl.dot(q, tl.trans(kt), input_precision=DOT_PRECISION) * scale_f
        ok = r_ok[:, None] & n_ok[None, :]
        vis = tl.load(m_base + n[None, :].to(tl.int64) * sms, mask=ok, other=0) != 0
        s = tl.where(vis, s, float("-inf"))
        tl.store(s_ptr + row[:, None] * S + n[None, :], s, mask=ok)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # no (-inf) - (-inf)
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    tl.store(pm_ptr + row * SPLIT + pid_s, m_i, mask=r_ok)
    tl.store(pl_ptr + row * SPLIT + pid_s, l_i, mask=r_ok)


@triton.jit
def _lane_softmax(m_v, l_v, s):
    """One tile's scores s [BN] into per-lane online-softmax partials (running max m_v, sum of
    exponentials l_v relative to it); -inf scores add nothing."""
    m_new = tl.maximum(m_v, s)
    m_use = tl.where(m_new > float("-inf"), m_new, 0.0)  # no (-inf) - (-inf)
    return m_new, l_v * tl.exp(m_v - m_use) + tl.exp(s - m_use)


@triton.jit
def _window_rows(row_ptr, n, lo, end, NW, ch, s_n, s_d):
    """FP32 rows [BN, D/8, 2, 2, 2] (_code_units' order) of positions n < end from a window buffer
    holding positions lo .. lo + NW - 1 (0 outside it), with the masks (n < end, inside the window)."""
    n_ok = n < end
    idx = (n - lo).to(tl.int64)
    in_buf = n_ok & (idx < NW)
    rows = tl.load(row_ptr + idx[:, None, None, None, None] * s_n + ch[None] * s_d,
                   mask=in_buf[:, None, None, None, None], other=0.0).to(tl.float32)
    return rows, n_ok, in_buf


@triton.jit
def _scores_linear_kernel(
    q_ptr, k_ptr, mask_ptr, s_ptr, pm_ptr, pl_ptr, lo_ptr,
    S, HKV, scale, NW,
    sqb, sqh, sqd,
    skb, skh, sks, skd,
    smb, smh, sms,
    CHUNK, SPLIT,
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale, rows, res_layout,
    B, NB, CAPT,
    D: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr, DEPTH: tl.constexpr, STAGES: tl.constexpr,
):
    """_scores_kernel for one query row per kv head (row = b * HKV + hk) over a packed history:
    the keys below lo[b] (a multiple of BN at or below every depth's flushed boundary and the
    first in-flight position) in the code domain (_linear_scores: no reconstructed K, one pass
    over the codes), the NW keys from lo[b] on from the buffer k_ptr [B, HKV, NW, D] that
    packed_read filled (tail, ring, in-flight tokens)."""
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    scale_f = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    b = (pid_bh // HKV).to(tl.int64)
    hk = (pid_bh % HKV).to(tl.int64)
    row = pid_bh.to(tl.int64)
    ch = 2 * _word_pairs(D)[:, :, :, None] + tl.arange(0, 2)[None, None, None, :]  # [D/8, 2, 2, 2]
    # q's even and odd channels as two loads of D/2 (as the linear decode kernel): fewer elements
    # than the program's threads, so no layout anchor that the code tiles would be converted to
    qc = q_ptr + b * sqb + hk * sqh + (2 * _word_pairs(D))[None] * sqd
    q24 = tl.join(tl.load(qc).to(tl.float32), tl.load(qc + sqd).to(tl.float32)) * 16777216.0
    qn = q24 * (1.0 / 16777216.0)
    kb_codes, kb_min, kb_scale, vb_codes, vb_min, vb_scale, kr_codes, vr_codes, vr_min, vr_scale = _row_bases(
        k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, v_res, v_res_min, v_res_scale,
        b * HKV + hk, S, NB, CAPT, D, GP,
    )
    lo = tl.load(lo_ptr + b).to(tl.int32)
    start = pid_s * CHUNK
    end = tl.minimum(start + CHUNK, S)
    mid = tl.maximum(tl.minimum(lo, end), start)
    m_base = mask_ptr + b * smb + hk * smh
    # online-softmax partials per key lane (lane = key index within a tile), merged once at the
    # end: no reduction across the program's threads per tile
    m_v = tl.full([BN], float("-inf"), tl.float32)
    l_v = tl.zeros([BN], tl.float32)
    for n0 in tl.range(start, mid, BN, num_stages=STAGES):
        n = n0 + tl.arange(0, BN)
        s = _linear_scores(kb_codes, kb_min, kb_scale, kr_codes, k_res_min, k_res_scale, rows, res_layout, n,
                           n0 // GP, q24, b, hk, B, HKV, S, NB, D, DEPTH) * scale_f
        s = tl.where(tl.load(m_base + n.to(tl.int64) * sms) != 0, s, float("-inf"))
        tl.store(s_ptr + row * S + n, s)
        m_v, l_v = _lane_softmax(m_v, l_v, s)
    k_row = k_ptr + b * skb + hk * skh
    for n0 in range(mid, end, BN):
        n = n0 + tl.arange(0, BN)
        kt, n_ok, in_buf = _window_rows(k_row, n, lo, end, NW, ch, sks, skd)
        s = _row_sums(kt * qn) * scale_f
        vis = tl.load(m_base + n.to(tl.int64) * sms, mask=n_ok, other=0) != 0
        s = tl.where(vis & in_buf, s, float("-inf"))
        tl.store(s_ptr + row * S + n, s, mask=n_ok)
        m_v, l_v = _lane_softmax(m_v, l_v, s)
    m_i = tl.max(m_v, 0)
    l_i = tl.sum(l_v * tl.exp(m_v - tl.where(m_i > float("-inf"), m_i, 0.0)), 0)
    tl.store(pm_ptr + row * SPLIT + pid_s, m_i)
    tl.store(pl_ptr + row * SPLIT + pid_s, l_i)


@triton.jit
def _pv_kernel(
    p_ptr, v_ptr, thr_ptr, cut_ptr, po_ptr, pmass_ptr,
    S, HKV, R, R_GROUP, E_GROUP, E_TOTAL,
    svb, svh, svs, svd,
    CHUNK,
    D: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_P_BF16: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    pid_e = tl.program_id(2)
    b = (pid_bh // HKV).to(tl.int64)
    hk = (pid_bh % HKV).to(tl.int64)
    e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = e < E_GROUP
    slot = e // R_GROUP
    row = pid_bh.to(tl.int64) * R_GROUP + e % R_GROUP
    sel_row = e_ok & (slot > 0)
    thr = tl.load(thr_ptr + (slot - 1) * R + row, mask=sel_row, other=-1)  # slot 0: every key
    cut = tl.load(cut_ptr + (slot - 1) * R + row, mask=sel_row, other=-1)
    dd = tl.arange(0, D)
    acc = tl.zeros([BLOCK_E, D], tl.float32)
    msum = tl.zeros([BLOCK_E], tl.float32)
    start = pid_s * CHUNK
    end = tl.minimum(start + CHUNK, S)
    v_row = v_ptr + b * svb + hk * svh
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        p = tl.load(p_ptr + row[:, None] * S + n[None, :], mask=e_ok[:, None] & n_ok[None, :], other=-1.0)
        key = _prob_key(p)
        sel = (key > thr[:, None]) | ((key == thr[:, None]) & (n[None, :] <= cut[:, None]))
        p = tl.where(sel, tl.maximum(p, 0.0), 0.0)
        vt = tl.load(v_row + n[:, None].to(tl.int64) * svs + dd[None, :] * svd, mask=n_ok[:, None], other=0.0)
        if SPLIT_P_BF16:
            # bf16 V is exact; P = hi + mid + lo in bf16 keeps 24 bits: three bf16 MMAs on the
            # V tile as loaded instead of an FP32 (tf32x3) product that re-splits V every tile
            p_hi = p.to(tl.bfloat16)
            r1 = p - p_hi.to(tl.float32)
            p_mid = r1.to(tl.bfloat16)
            p_lo = (r1 - p_mid.to(tl.float32)).to(tl.bfloat16)
            acc = tl.dot(p_hi, vt, acc)
            acc = tl.dot(p_mid, vt, acc)
            acc = tl.dot(p_lo, vt, acc)
        else:
            acc = tl.dot(p, vt.to(tl.float32), acc, input_precision="tf32x3")
        msum += tl.sum(p, 1)
    out_row = slot.to(tl.int64) * R + row  # [slot, row] in the (F+1) x R partial layout
    tl.store(po_ptr + (pid_s * E_TOTAL + out_row[:, None]) * D + dd[None, :], acc, mask=e_ok[:, None])
    tl.store(pmass_ptr + pid_s * E_TOTAL + out_row, msum, mask=e_ok)


@triton.jit
def _pv_linear_kernel(
    p_ptr, v_ptr, thr_ptr, cut_ptr, po_ptr, pmass_ptr, lo_ptr,
    S, HKV, R, E_TOTAL, NW,
    svb, svh, svs, svd,
    CHUNK,
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale, rows, res_layout,
    B, NB, CAPT,
    D: tl.constexpr, GP: tl.constexpr, BN: tl.constexpr, DEPTH: tl.constexpr, STAGES: tl.constexpr,
):
    """_pv_kernel for one query row per kv head (row = b * HKV + hk) and one fraction over a
    packed history: slot 0 (every key: O_ref) and slot 1 (the selection: C_ref, mass) share one
    pass over V; the keys below lo[b] in the code domain (one
    code conversion, then one FMA per element and slot; V's minima per row and group), the rest
    from the buffer v_ptr [B, HKV, NW, D]. The probabilities are normalized: no rescaling.
    Partials in _pv_kernel's layout for _pv_combine_kernel."""
    W: tl.constexpr = D // 8
    pid_bh = tl.program_id(0)
    pid_s = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    hk = (pid_bh % HKV).to(tl.int64)
    row = pid_bh.to(tl.int64)
    thr = tl.load(thr_ptr + row)
    cut = tl.load(cut_ptr + row)
    words = tl.arange(0, W)[None, :]
    kb_codes, kb_min, kb_scale, vb_codes, vb_min, vb_scale, kr_codes, vr_codes, vr_min, vr_scale = _row_bases(
        k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, v_res, v_res_min, v_res_scale,
        b * HKV + hk, S, NB, CAPT, D, GP,
    )
    vb_words = vb_codes.to(tl.pointer_type(tl.int32), bitcast=True)
    vr_words = vr_codes.to(tl.pointer_type(tl.int32), bitcast=True)
    lo = tl.load(lo_ptr + b).to(tl.int32)
    start = pid_s * CHUNK
    end = tl.minimum(start + CHUNK, S)
    mid = tl.maximum(tl.minimum(lo, end), start)
    # per-row partials in _code_units' order (summed over rows once), slot 0 and slot 1
    y0 = tl.zeros([BN, W, 2, 2, 2], tl.float32)
    y1 = tl.zeros([BN, W, 2, 2, 2], tl.float32)
    yb0 = tl.zeros([BN, W], tl.float32)  # the minima's share, per word
    yb1 = tl.zeros([BN, W], tl.float32)
    m0 = tl.zeros([BN], tl.float32)  # masses per key lane, summed once at the end
    m1 = tl.zeros([BN], tl.float32)
    for n0 in tl.range(start, mid, BN, num_stages=STAGES):
        n = n0 + tl.arange(0, BN)
        pv = tl.load(p_ptr + row * S + n)
        key = _prob_key(pv)
        pa = tl.maximum(pv, 0.0)
        ps = tl.where((key > thr) | ((key == thr) & (n <= cut)), pa, 0.0)
        m0 += pa
        m1 += ps
        pa24 = pa[:, None] * 16777216.0  # the codes come as code * 2^-24
        ps24 = ps[:, None] * 16777216.0
        mn = _word_groups(vb_min, n, D, GP)
        sc = _word_groups(vb_scale, n, D, GP)
        c = _code_units(tl.load(vb_words + n[:, None] * W + words))
        y0 += c * (pa24 * sc)[:, :, None, None, None]
        y1 += c * (ps24 * sc)[:, :, None, None, None]
        for j in tl.static_range(1, DEPTH + 1):
            has, g = _bulk_residual_rows(rows, res_layout, j, b, B, S, n)
            mn += _word_groups(vr_min, g, D, GP, has)
            sc = _word_groups(vr_scale, g, D, GP)
            c = _code_units(tl.load(vr_words + g[:, None] * W + words, mask=has[:, None], other=0))
            y0 += c * (pa24 * sc)[:, :, None, None, None]
            y1 += c * (ps24 * sc)[:, :, None, None, None]
        yb0 += pa[:, None] * mn
        yb1 += ps[:, None] * mn
    ch = 2 * _word_pairs(D)[:, :, :, None] + tl.arange(0, 2)[None, None, None, :]  # [D/8, 2, 2, 2]
    v_row = v_ptr + b * svb + hk * svh
    for n0 in range(mid, end, BN):
        n = n0 + tl.arange(0, BN)
        vt, n_ok, in_buf = _window_rows(v_row, n, lo, end, NW, ch, svs, svd)
        pv = tl.load(p_ptr + row * S + n, mask=n_ok, other=-1.0)
        key = _prob_key(pv)
        pa = tl.where(in_buf, tl.maximum(pv, 0.0), 0.0)
        ps = tl.where((key > thr) | ((key == thr) & (n <= cut)), pa, 0.0)
        m0 += pa
        m1 += ps
        y0 += vt * pa[:, None, None, None, None]
        y1 += vt * ps[:, None, None, None, None]
    o0 = pid_s * E_TOTAL + row  # [slot, row] in the 2 x R partial layout
    o1 = o0 + R
    tl.store(po_ptr + o0 * D + ch, tl.sum(y0 + yb0[:, :, None, None, None], 0))
    tl.store(po_ptr + o1 * D + ch, tl.sum(y1 + yb1[:, :, None, None, None], 0))
    tl.store(pmass_ptr + o0, tl.sum(m0, 0))
    tl.store(pmass_ptr + o1, tl.sum(m1, 0))


@triton.jit
def _pv_combine_kernel(
    po_ptr, pmass_ptr, out_ptr, oref_ptr, cref_ptr, mass_ptr,
    R, E_TOTAL, SPLIT,
    D: tl.constexpr, SPLIT_P2: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64)  # (slot, row): slot 0 -> o_ref/out, slot 1+f -> c_ref[f]/mass[f]
    sp = tl.arange(0, SPLIT_P2)
    sp_ok = sp < SPLIT
    dd = tl.arange(0, D)
    acc = tl.sum(tl.load(po_ptr + (sp[:, None] * E_TOTAL + e) * D + dd[None, :], mask=sp_ok[:, None], other=0.0), 0)
    msum = tl.sum(tl.load(pmass_ptr + sp * E_TOTAL + e, mask=sp_ok, other=0.0), 0)
    if e < R:
        tl.store(oref_ptr + e * D + dd, acc)
        tl.store(out_ptr + e * D + dd, acc.to(out_ptr.dtype.element_ty))
    else:
        tl.store(cref_ptr + (e - R) * D + dd, acc)
        tl.store(mass_ptr + (e - R), msum)


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------


def _linear_splits(cfg: KernelConfig, n_sm: int, rows: int) -> int:
    """Splits of the history per row for the code-domain scores and PV kernels: about
    cfg.waves_linear programs per SM, and at least 32 per row (at most 128). H200, 32K, one
    site: at B1 (16 rows) 4 waves = 33 splits beat 66 by 2-4%; at B4 (64 rows) 9
    splits lost 5-7% to 17 and 33 (589/912 vs 624/975 us at depth 1/3)."""
    return min(128, max(32, cdiv(cfg.waves_linear * n_sm, rows)))


def _mma_scores_splits(cfg: KernelConfig, n_sm: int, rows: int) -> int:
    """Splits of the history per row for gluon_scores' kernel (4-warp programs, 56 registers):
    _linear_splits, and at least 8 programs per SM. Op-level (kernel alone, H200,
    32K, depth 1): B1 29.1 us at 66 splits against 38.9 at 33 (_linear_splits' 33) and 29.5 at
    132; B4 flat from 16 to 132 splits (104-111 us), where this keeps 32."""
    return min(128, max(_linear_splits(cfg, n_sm, rows), (8 * n_sm) // rows))


def _dot_precision(dtype: torch.dtype) -> str:
    # bf16/fp16 products are exact in FP32; FP32 operands need more than plain tf32.
    return "tf32x3" if dtype == torch.float32 else "tf32"


def _linear_args(linear):
    """The linear scores / PV kernels' packed-source arguments: ``linear`` = (cache tensors, depth, lo [B])."""

    tensors, depth, lo = linear
    c = PackedTensors(*tensors)
    B, H, S, D, G, R, NB, CAPT = _geometry(tensors)
    args = (c.k_base, c.k_base_min, c.k_base_scale, c.v_base, c.v_base_min, c.v_base_scale,
            c.k_res, c.k_res_min, c.k_res_scale, c.v_res, c.v_res_min, c.v_res_scale, c.rows, c.res_layout, B, NB, CAPT)
    return args, lo, G, depth


def linear_fits(q, k_heads: int, head_dim: int, group: int, fractions, config: KernelConfig | None = None) -> bool:
    """Whether the code-domain reference applies: one query row per kv head (q [B, Hq, T, D] with
    Hq == Hkv and T == 1), one key fraction, a power-of-two head_dim and a key tile that lies in
    one K block."""
    cfg = sc.config_for(q.device, config)
    return (q.shape[1] == k_heads and q.shape[2] == 1 and len(fractions) == 1
            and not head_dim & (head_dim - 1) and head_dim >= 8 and group % cfg.block_n_linear == 0 and cfg.block_n_linear % cfg.block_n_pv_linear == 0)


def linear_window(tensors, depth: int, inflight_positions, config: KernelConfig | None = None):
    """(lo [B], positions [B, NW]) of the code-domain reference over the packed cache ``tensors``
    at ``depth`` for a step whose tokens are at inflight_positions [B, Ti] (-1: padding): lo[b]
    is every depth's flushed boundary (0..depth) and the first in-flight position, whichever is
    smallest, rounded down to the key tile; below it the reference reads the codes, from it on
    the NW positions (-1 past the cache) that packed_read must return. NW covers the ring
    (< 2 * tail tokens, tail = group), the in-flight tokens and both roundings. Device ops only."""

    B, H, S, D, G, R, NB, CAPT = _geometry(tensors)
    flushed = PackedTensors(*tensors).flushed
    ip = inflight_positions
    bc, ti = ip.shape
    bn = sc.config_for(ip.device, config).block_n_linear
    lim = first_inflight(ip, S)
    bound = torch.minimum(flushed[:bc, : depth + 1].amin(1).to(lim.dtype), lim)
    lo = torch.div(bound, bn, rounding_mode="floor") * bn
    nw = min(cdiv(2 * G + ti + 2 * bn, bn) * bn, cdiv(S, bn) * bn)
    pos = lo[:, None] + torch.arange(nw, device=ip.device, dtype=lo.dtype)[None]
    return lo, torch.where(pos < S, pos, -1)


def reference_attention_triton(q, k, v, mask, scale, fractions, capacities, *, wrap: bool = False,
                               config: KernelConfig | None = None, linear=None, keep_probs: bool = False):
    """Triton body of ``flashloop::reference_attention``; same outputs as the ATen body.
    ``keep_probs``: ``flashloop::reference_attention_probs``'s body (one more output, the selected
    keys' probabilities, written by the selection's compaction).

    ``linear`` = (packed cache tensors, depth, lo [B]) (``linear_fits`` must hold): the keys below
    lo[b] (a multiple of the config's ``block_n_linear``, at or below every depth's flushed
    boundary up to ``depth`` and the first in-flight position) are attended in the code domain,
    without reconstructing K/V (the scores and PV products on the codes, as the linear decode
    kernel: the compute-dtype rounding of K/V is not applied there); k/v [B, Hkv, NW, D] hold the
    NW positions lo[b] .. lo[b] + NW - 1 (packed_read of those positions), which must cover every
    visible key from lo[b] on."""
    launch = Launcher(wrap)
    sc.check_runnable(_scores_kernel, q.device)
    cfg = sc.config_for(q.device, config)
    dev = q.device
    b, hq, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if linear is not None:  # k/v hold the NW positions from lo on; the history is the cache's
        s = linear[0][0].shape[2]
    g = hq // hkv
    f = len(fractions)
    kmax = max(capacities)
    rows = b * hq * t
    m_group = g * t
    n_sm = sm_count(dev)
    upcast = common.cpu_semantics(dev)  # the interpreter cannot run bf16 dots
    precision = _dot_precision(q.dtype)

    mask_full = mask.expand(b, hq, t, s)  # broadcast dims get stride 0; the kernel reads the strides
    visible = mask.sum(-1, dtype=torch.int32).expand(b, hq, t)  # summed before broadcasting
    if f == 1:  # (no stack copies for the common case)
        count = key_counts(fractions[0], visible).contiguous()[None]  # [F, B, Hq, T]
        kk = count.clamp_max(int(capacities[0])).view(1, rows)
    else:
        count = torch.stack([key_counts(fr, visible) for fr in fractions])
        kk = torch.stack([count[i].clamp_max(int(cap)) for i, cap in enumerate(capacities)]).view(f, rows)

    # 1. scores + softmax partials (one read of K)
    block_m = max(16, next_pow2(min(m_group, 64)))
    m_chunks = cdiv(m_group, block_m)
    want = cfg.split_kv or min(128, cdiv(4 * n_sm, b * hkv * m_chunks))
    bnl = cfg.block_n_linear
    scores_mma = False
    if linear is not None:
        largs, lo, gp, depth = _linear_args(linear)
        if not linear_fits(q, hkv, d, gp, fractions, cfg):
            raise ValueError(f"the code-domain reference needs one query row per kv head, one key fraction, a "
                             f"power-of-two head_dim and a group that block_n_linear={bnl} divides; got q "
                             f"{tuple(q.shape)}, {hkv} kv heads, {len(fractions)} fractions, group {gp}")
        # on tensor cores where the Gluon kernel fits (CUDA sm_80+, head_dim 128, K blocks of 64)
        scores_mma = not common.cpu_semantics(dev) and gluon_scores.fits(q, d, gp, bnl, depth)
        want = cfg.split_kv or (_mma_scores_splits if scores_mma else _linear_splits)(cfg, n_sm, b * hkv)
    chunk_a, split_a = split_range(s, bnl if linear is not None else cfg.block_n, want)
    probs = torch.empty(rows, s, dtype=torch.float32, device=dev)
    part_m = torch.empty(rows, split_a, dtype=torch.float32, device=dev)
    part_l = torch.empty(rows, split_a, dtype=torch.float32, device=dev)
    if linear is not None:
        nw = k.shape[2]
        if scores_mma:
            # the code-domain scores on tensor cores (Gluon; an opaque op: wrap_triton analyses tl kernels)
            (k_base, k_base_min, k_base_scale, _vb, _vbm, _vbs, k_res, k_res_min, k_res_scale,
             _vr, _vrm, _vrs, rows_map, res_layout, *_geo) = largs
            torch.ops.flashloop.mma_linear_scores(
                q if q.stride(3) == 1 else q.contiguous(), k if k.stride(3) == 1 else k.contiguous(), mask_full,
                probs, part_m, part_l, lo, k_base, k_base_min, k_base_scale, k_res, k_res_min, k_res_scale,
                rows_map, res_layout, float(scale), chunk_a, split_a, depth)
        else:
            launch(_scores_linear_kernel, (b * hkv, split_a))(
                q, k, mask_full, probs, part_m, part_l, lo,
                s, hkv, float(scale), nw,
                q.stride(0), q.stride(1), q.stride(3), *k.stride(),
                mask_full.stride(0), mask_full.stride(1), mask_full.stride(3),
                chunk_a, split_a, *largs,
                D=d, GP=gp, BN=bnl, DEPTH=depth, STAGES=cfg.num_stages_linear,
                num_warps=cfg.num_warps_linear,
            )
    else:
        launch(_scores_kernel, (b * hkv, split_a, m_chunks))(
            q, k, mask_full, probs, part_m, part_l,
            s, hkv, m_group, float(scale),
            *q.stride(), *k.stride(), *mask_full.stride(),
            chunk_a, split_a,
            G=g, T=t, D=d, BLOCK_M=block_m, BLOCK_N=cfg.block_n, UPCAST=upcast, DOT_PRECISION=precision,
            num_warps=cfg.num_warps_kv * (2 if block_m * d >= 64 * 128 else 1), num_stages=cfg.num_stages_kv,
        )

    # 2. radix select (probabilities written in place of the scores)
    digits = radix_digits()
    selected = radix_select(probs, part_m, part_l, kk, digits, s, rows, f, kmax, split_a, b, hq, t,
                            n_sm, cfg, launch, dev, keep_probs=keep_probs)
    keys, thr, cut = selected[:3]
    # 3. O_ref, C_ref and mass in one pass over V, then the split combine
    e_group = (f + 1) * m_group
    block_e = max(16, next_pow2(min(e_group, 64)))
    e_chunks = cdiv(e_group, block_e)
    want = cfg.split_kv or min(128, cdiv(4 * n_sm, b * hkv * e_chunks))
    if linear is not None:
        want = cfg.split_kv or _linear_splits(cfg, n_sm, b * hkv)
    block_n_pv = cfg.block_n_pv or cfg.block_n
    pv_mma = linear is not None and not common.cpu_semantics(dev) and gluon_pv.fits(probs, d, gp, depth)
    if pv_mma:  # one-warp programs
        chunk_c, split_c = gluon_pv.splits(n_sm, b * hkv, s)
    else:
        chunk_c, split_c = split_range(s, cfg.block_n_pv_linear if linear is not None else block_n_pv, want)
    e_total = (f + 1) * rows
    part_o = torch.empty(split_c, e_total, d, dtype=torch.float32, device=dev)
    part_mass = torch.empty(split_c, e_total, dtype=torch.float32, device=dev)
    if pv_mma:
        # the code-domain PV on tensor cores (Gluon; an opaque op as the scores)
        (_kb, _kbm, _kbs, v_base, v_base_min, v_base_scale, _kr, _krm, _krs,
         v_res, v_res_min, v_res_scale, rows_map, res_layout, *_geo) = largs
        torch.ops.flashloop.mma_linear_pv(
            probs, v if v.stride(3) == 1 else v.contiguous(), thr[0], cut[0], part_o, part_mass, lo,
            v_base, v_base_min, v_base_scale, v_res, v_res_min, v_res_scale, rows_map, res_layout,
            chunk_c, split_c, depth)
    elif linear is not None:
        launch(_pv_linear_kernel, (b * hkv, split_c))(
            probs, v, thr, cut, part_o, part_mass, lo,
            s, hkv, rows, e_total, nw,
            *v.stride(),
            chunk_c, *largs,
            D=d, GP=gp, BN=cfg.block_n_pv_linear, DEPTH=depth, STAGES=cfg.num_stages_linear,
            num_warps=cfg.num_warps_linear,
        )
    else:
        launch(_pv_kernel, (b * hkv, split_c, e_chunks))(
            probs, v, thr, cut, part_o, part_mass,
            s, hkv, rows, m_group, e_group, e_total,
            *v.stride(),
            chunk_c,
            D=d, BLOCK_E=block_e, BLOCK_N=block_n_pv, SPLIT_P_BF16=v.dtype == torch.bfloat16 and not upcast,
            num_warps=cfg.num_warps_pv * (2 if block_e * d >= 64 * 128 else 1), num_stages=cfg.num_stages_pv,
        )
    out = q.new_empty(b, hq, t, d)
    o_ref = torch.empty(b, hq, t, d, dtype=torch.float32, device=dev)
    c_ref = torch.empty(f, b, hq, t, d, dtype=torch.float32, device=dev)
    mass = torch.empty(f, b, hq, t, dtype=torch.float32, device=dev)
    launch(_pv_combine_kernel, (e_total,))(
        part_o, part_mass, out, o_ref, c_ref, mass,
        rows, e_total, split_c,
        D=d, SPLIT_P2=next_pow2(split_c),
        num_warps=4,
    )
    if keep_probs:
        return out, keys, count, mass, o_ref, c_ref, selected[3]
    return out, keys, count, mass, o_ref, c_ref
