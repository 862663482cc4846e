"""One-query-row decode over the packed store's flushed bulk (conventions in packed_codec.py):
``_decode_bulk_kernel`` [B*H, splits] computes split-K partials with the code-domain scores and
PV (packed_code_domain.py); ``_combine_kernel`` merges every split's partials (the bulk's and
packed_attention's tail and in-flight splits) into the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashloop_compile.lowering.kernels.common import sm_count
from flashloop_compile.lowering.kernels.packed_codec import _bulk_tiles, _round_to, _row_bases
from flashloop_compile.lowering.kernels.packed_code_domain import _linear_pv, _linear_scores, _word_pairs

__all__ = ["FAST_DECODE", "decode_splits"]


@triton.jit
def _decode_bulk_kernel(
    q, q_positions, p0, flushed,
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
    rows, res_layout, part_ml, part_acc,
    sq_b, sq_h, sq_d, sqp_b, scale, B, H, S, NB, CAPT, R,
    D: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, NSTORED: tl.constexpr, RP: tl.constexpr,
    STAGES: tl.constexpr, DEPTH: tl.constexpr, HALF: tl.constexpr = False, NTAIL: tl.constexpr = 1,
):
    """The packed bulk of one-query-row decode (the FAST_DECODE path): splits z < NSTORED of the
    key tiles of BN keys below every depth's flushed boundary and the stored end. There the
    resolution rule needs no per-token state: every position holds its base, and residual j
    (1 <= j <= depth) is present exactly where rows_j >= 0 (nested sets: a token computed at
    depth j was computed at every earlier depth), so the loads have no data-dependent branches.
    A kernel of its own so that its registers are not the generic tail's (_attn_kernel with FAST
    takes split NSTORED: the unflushed tail, the ring and the in-flight keys). Per tile, K first
    (base + residuals 1..depth where present, scores, online-softmax update), then V. Partials in
    _attn_kernel's layout for _combine_kernel. The depth is a constexpr (one compiled variant per
    loop of the model): the residual loops unroll without masks and the tile loop's loads are
    software-pipelined. Dequantization is affine, so scores and the PV product are
    taken in the code domain (_linear_scores, _linear_pv) instead of on reconstructed K/V rounded
    to the compute dtype: per element and stream a nibble conversion and one FMA, the parameters
    applied per tile (K) or per token and group (V), V kept as per-row partials summed once per
    split. The attention of the exact reconstruction up to FP32 rounding (the compute-dtype
    rounding of K/V is not applied). HALF: the scores on K rebuilt in fp16 (_linear_scores).
    NTAIL: _attn_kernel's programs after these (the row's partials are NSTORED + NTAIL)."""
    HD: tl.constexpr = D // 2
    NSPL: tl.constexpr = NSTORED + NTAIL
    scale = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    z = tl.program_id(1)
    nfast = _bulk_tiles(q_positions, sqp_b, p0, flushed, b, R, DEPTH, RP, BN)
    lo = (z * nfast) // NSTORED
    hi = ((z + 1) * nfast) // NSTORED
    # rows in _code_units' order, q in the codes' unit; per-row V partials (_linear_pv)
    ch = 2 * _word_pairs(D)[:, :, :, None] + tl.arange(0, 2)[None, None, None, :]  # [D/8, 2, 2, 2]
    # q's even and odd channels as two loads of D/2: fewer than a program's threads, no layout anchor
    qc = q + b * sq_b + h * sq_h + (2 * _word_pairs(D))[None] * sq_d
    q24 = tl.join(tl.load(qc).to(tl.float32), tl.load(qc + sq_d).to(tl.float32)) * 16777216.0
    y = tl.zeros([BN, D // 8, 2, 2, 2], tl.float32)
    yb = tl.zeros([BN, D // 8], tl.float32)
    # online softmax per key lane (a lane: one key index of the tile, the row of y it feeds),
    # merged once per split: no reduction across the program's threads per tile
    m_v = tl.full([BN], float("-inf"), tl.float32)
    l_v = tl.zeros([BN], tl.float32)
    kb_codes, kb_min, kb_scale, vb_codes, vb_min, vb_scale, kr_codes, vr_codes, vr_min, vr_scale = _row_bases(
        k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, v_res, v_res_min, v_res_scale,
        bh, S, NB, CAPT, D, G,
    )
    for tile in tl.range(lo, hi, num_stages=STAGES):
        p = tile * BN + tl.arange(0, BN)  # int32: positions < S
        s = _linear_scores(kb_codes, kb_min, kb_scale, kr_codes, k_res_min, k_res_scale, rows, res_layout, p,
                           (tile * BN) // G, q24, b, h, B, H, S, NB, D, DEPTH, HALF) * scale
        m_new = tl.maximum(m_v, s)  # the bulk has no masked key: s is finite
        alpha = tl.exp(m_v - m_new)
        pr = tl.exp(s - m_new)
        l_v = l_v * alpha + pr
        m_v = m_new
        y, yb = _linear_pv(y * alpha[:, None, None, None, None], yb * alpha[:, None], vb_codes, vb_min, vb_scale,
                           vr_codes, vr_min, vr_scale, rows, res_layout, p, pr[:, None], b, B, S, D, G, DEPTH)
    prow = bh * NSPL + z
    one = tl.arange(0, 1)
    # merge the lanes: m_i is -inf (and l_i 0) for a split without tiles
    m_i = tl.max(m_v, 0)
    w = tl.exp(m_v - tl.where(m_i > float("-inf"), m_i, 0.0))
    l_i = tl.sum(l_v * w, 0)
    tl.store(part_ml + prow * 2 + one, tl.full([1], 0.0, tl.float32) + m_i)
    tl.store(part_ml + prow * 2 + 1 + one, tl.full([1], 0.0, tl.float32) + l_i)
    tl.store(part_acc + prow * D + ch, tl.sum((y + yb[:, :, None, None, None]) * w[:, None, None, None, None], 0))


@triton.jit
def _combine_kernel(part_ml, part_acc, out, NSPL: tl.constexpr, NSP2: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, CD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    zz = tl.arange(0, NSP2)
    zm = zz < NSPL
    mz = tl.load(part_ml + (row * NSPL + zz) * 2, mask=zm, other=float("-inf"))
    lz = tl.load(part_ml + (row * NSPL + zz) * 2 + 1, mask=zm, other=0.0)
    mx = tl.max(mz, 0)
    ms = tl.where(mx == float("-inf"), 0.0, mx)
    w = tl.where(zm, tl.exp(mz - ms), 0.0)
    lsum = tl.sum(lz * w, 0)
    c = tl.arange(0, DP)
    cm = c < D
    acc = tl.load(part_acc + (row * NSPL + zz)[:, None] * D + c[None, :], mask=zm[:, None] & cm[None, :], other=0.0)
    o = tl.sum(acc * w[:, None], 0)
    inv = tl.where(lsum > 0.0, 1.0 / tl.where(lsum > 0.0, lsum, 1.0), 0.0)
    tl.store(out + row * D + c, _round_to(o * inv, CD).to(out.dtype.element_ty), mask=cm)


# ------------------------------------------------------------------------------------------------
# launch parameters
# ------------------------------------------------------------------------------------------------


def decode_splits(batch: int, kv_heads: int, m_tiles: int, max_seq: int, block_n: int, device: torch.device | None = None,
                  waves: int = 2) -> int:
    """Splits of the stored key range for the decode kernel: enough programs for about ``waves``
    waves of the device's SMs (static: depends on shapes only), at least 4 key tiles per split."""
    sms = sm_count(device) if device is not None and device.type == "cuda" else 132
    programs = batch * kv_heads * m_tiles
    want = max(1, (waves * sms) // max(programs, 1))
    return max(1, min(want, max_seq // (4 * block_n), 128))


# One-query-row decode: _decode_bulk_kernel over the flushed bulk (code-domain scores and PV, K
# rebuilt in fp16 for 16-bit caches), _attn_kernel's NTAIL programs for the tail. 32-key tiles, 4
# warps, 3 cp.async stages, splits for 3 waves of programs: the best of
# `benchmarks/bench_packed_decode.py --sweep` on the H200 (B1/B4 x 32K, depths 0/1: 90.1 / 216.0 /
# 130.7 / 371.3 us). tail_programs: the tail's 2-5 per-token tiles spread over 4 programs per row
# (_attn_kernel 13.0 / 13.4 us at B1 / B4 x 32K against 21.6 / 21.8 with one).
FAST_DECODE = {"block_n": 32, "num_warps": 4, "num_stages": 3, "waves": 3, "tail_programs": 4}
