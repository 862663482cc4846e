"""One-query-row decode over the packed store's flushed bulk (conventions in packed_codec.py):
``_decode_bulk_kernel`` [B*H, splits] computes flash-decoding split-K partials in the code domain
(one warp per program, codes converted by bit operations, the parameters folded per tile);
``_combine_kernel`` merges every split's partials (the bulk's and packed_attention's tail and
in-flight splits) into the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashloop_compile.lowering.kernels.common import sm_count
from flashloop_compile.lowering.kernels.packed_codec import _bulk_tiles, _round_to

__all__ = ["FAST_DECODE", "FP32_ONE_BITS", "bulk_lanes", "decode_splits"]

FP32_ONE_BITS = 0x3F800000
"""1.0f's bits: _decode_bulk_kernel's ONE, a runtime argument so that the mask and the OR of a
code's conversion compile to one LOP3 (two constants do not fit one instruction)."""


def bulk_lanes(head_dim: int, block_n: int) -> int:
    """Key lanes of _decode_bulk_kernel's [NREP, LANES] tile: a row's code words in 16-byte runs,
    one thread each, so 32 threads cover 128 // (head_dim / 8) keys at once; the NREP keys a
    thread holds sum in registers."""
    return max(1, min(block_n, 128 // max(head_dim // 8, 1)))


@triton.jit
def _unit_pair(w, K: tl.constexpr, ONE):
    """Nibbles 2K and 2K + 1 of int32 code words w as FP32 1 + code/256 and 1 + code/16: one shift
    puts nibble 2K + 1 at bits 19..22 (the top of the mantissa) and nibble 2K at bits 15..18, each
    masked and ORed into 1.0f's bits (ONE, a runtime argument: with the mask, one LOP3): a shift
    per two codes and a logic op per code, no int -> float conversion."""
    if 8 * K <= 15:
        x = w << (15 - 8 * K)
    else:
        x = w >> (8 * K - 15)
    lo = ((x & 0x00078000) | ONE).to(tl.float32, bitcast=True)
    hi = ((x & 0x00780000) | ONE).to(tl.float32, bitcast=True)
    return lo, hi


@triton.jit
def _half(w, HI: tl.constexpr):
    """The low (HI False) or high half of int32 words w as FP32 of an fp16 bit pattern."""
    if HI:
        w = w >> 16
    return w.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _pair(ptr, pw, K: tl.constexpr):
    """FP32 per-channel parameters of channels 2K and 2K + 1 of code words whose first pair word in
    the fp16 table ptr is pw [...]: one 4-byte load of pw's shape (smaller than the program's
    threads, no layout anchor: it takes the code tile's layout)."""
    w = tl.load(ptr.to(tl.pointer_type(tl.int32), bitcast=True) + pw + K)
    return _half(w, False), _half(w, True)


@triton.jit
def _group_params(ptr, r, g, NG: tl.constexpr, rmask=None):
    """FP32 V parameters [NG, LANES, NREP, 1] of rows r [1, LANES, NREP, 1] (0 where rmask is
    False) for groups g [NG, 1, 1, 1]: a row's fp16 pair read as one 4-byte word (both halves loaded per group: the copy
    hits L1) when NG is even (cp.async needs 4 bytes), else as fp16."""
    if NG % 2 == 0:
        words = ptr.to(tl.pointer_type(tl.int32), bitcast=True) + r * (NG // 2) + g // 2
        if rmask is None:
            w = tl.load(words)
        else:
            w = tl.load(words, mask=rmask, other=0)
        return (w >> ((g % 2) * 16)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        if rmask is None:
            v = tl.load(ptr + r * NG + g)
        else:
            v = tl.load(ptr + r * NG + g, mask=rmask, other=0.0)
        return v.to(tl.float32)


@triton.jit
def _dot_words(s, c, k0, k1, k2, k3, k4, k5, k6, k7, ONE):
    """s + sum_n k_n u_n over the 8 nibbles n of code words c (_unit_pair's u): one FMA chain per
    word."""
    u0, u1 = _unit_pair(c, 0, ONE)
    s += k0 * u0
    s += k1 * u1
    u2, u3 = _unit_pair(c, 1, ONE)
    s += k2 * u2
    s += k3 * u3
    u4, u5 = _unit_pair(c, 2, ONE)
    s += k4 * u4
    s += k5 * u5
    u6, u7 = _unit_pair(c, 3, ONE)
    s += k6 * u6
    s += k7 * u7
    return s


@triton.jit
def _k_params(q16, qq, scale, mn, pk, K: tl.constexpr):
    """Channels 2K, 2K + 1 of a code word: their folded scales (256 and 16) q scale and their share
    q min - (256 and 16) q scale of the word's bias (q16: q times 256 and 16, _unit_pair's u)."""
    s0, s1 = _pair(scale, pk, K)
    m0, m1 = _pair(mn, pk, K)
    a = q16[0] * s0
    b = q16[1] * s1
    return a, b, qq[0] * m0 + qq[1] * m1 - a - b


@triton.jit
def _decode_bulk_kernel(
    q, q_positions, p0, flushed,
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
    rows, res_layout, part_ml, part_acc,
    sq_b, sq_h, sq_d, sqp_b, scale, ONE, B, H, S, NB, CAPT, R,
    D: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, LANES: tl.constexpr, NSTORED: tl.constexpr,
    RP: tl.constexpr, STAGES: tl.constexpr, DEPTH: tl.constexpr, NTAIL: tl.constexpr = 1,
):
    """The packed bulk of one-query-row decode (flash-decoding split-K, the FAST_DECODE path):
    program (b*H + h, z), z < NSTORED, takes a contiguous range of the key tiles of BN keys (BN
    divides G: one K parameter block per tile) below every depth's flushed boundary and the
    stored end. There every position holds its base and residual j (1 <= j <= DEPTH) is present
    exactly where rows_j >= 0: no per-token resolution, no data-dependent branch.

    In the code domain: codes become u = 1 + code/f, f = 256 for even nibbles and 16 for odd ones
    (_unit_pair: a shift per two codes, no int -> float conversion) and the affine parameters
    leave the per-code work. K: q . k = sum_c ks_c u_c + bias with ks = f q scale_c (per tile) and
    bias = q . (min - f scale) (per code word and tile, the start of the word's FMA chain), q in
    the exp2 domain (scale * log2 e folded in). V: p v_c = f (p scale_g) u_c + p (min_g - f
    scale_g) per token and group: one FMA per code into acc (the factor f after the loop), the
    minima per group. Each of a word's 8 nibbles is its own tensor (FMA chains, no join trees).
    The even nibbles' 1 + code/256 costs about 4 bits of the FP32 sums (the constant part f q
    scale that the bias takes back is 256x, not 16x, a code step). A tile is [NREP, LANES]
    keys (key rep * LANES + lane); online softmax per lane, reduced over the NREP keys a thread
    holds, and merged across lanes once per split. Partials (m in natural-log units) in
    _attn_kernel's layout for _combine_kernel; NTAIL: _attn_kernel's programs after these
    (NSTORED + NTAIL partials per row). The attention of the exact reconstruction up to FP32
    rounding."""
    W: tl.constexpr = D // 8  # int32 code words per row
    NG: tl.constexpr = D // G
    WG: tl.constexpr = W // NG  # words per V group
    HD: tl.constexpr = D // 2
    NREP: tl.constexpr = BN // LANES
    NSPL: tl.constexpr = NSTORED + NTAIL
    LOG2E: tl.constexpr = 1.4426950408889634
    qk = tl.cast(scale, tl.float32) * LOG2E  # Inductor passes Python floats as fp64
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    z = tl.program_id(1)
    nfast = _bulk_tiles(q_positions, sqp_b, p0, flushed, b, R, DEPTH, RP, BN)
    lo = (z * nfast) // NSTORED
    hi = ((z + 1) * nfast) // NSTORED
    # A tile as [NG, LANES, NREP, WG] code words: V group, key lane, key rep (key rep * LANES +
    # lane), word of the group. The dims after the words are in the order threads fill them
    # (the codes' load is the layout anchor; Triton orders equally non-contiguous dims by index):
    # words, groups, lanes, so a thread holds all NREP keys of its lane and the sums over them
    # stay in registers.
    kr = tl.arange(0, LANES)[:, None] + tl.arange(0, NREP)[None, :] * LANES  # [LANES, NREP]
    gg = tl.arange(0, NG)[:, None, None, None]  # [NG, 1, 1, 1]
    ii = tl.arange(0, WG)[None, None, None, :]
    word = gg * WG + ii  # [NG, 1, 1, WG]: word of the row
    pw = 4 * word  # its first K parameter pair word in a block
    # q by nibble n (channel 8 word + n), in loads of the code words' shape like the K parameters
    qc = q + b * sq_b + h * sq_h + (8 * word) * sq_d
    q0 = tl.load(qc).to(tl.float32) * qk
    q1 = tl.load(qc + sq_d).to(tl.float32) * qk
    q2 = tl.load(qc + 2 * sq_d).to(tl.float32) * qk
    q3 = tl.load(qc + 3 * sq_d).to(tl.float32) * qk
    q4 = tl.load(qc + 4 * sq_d).to(tl.float32) * qk
    q5 = tl.load(qc + 5 * sq_d).to(tl.float32) * qk
    q6 = tl.load(qc + 6 * sq_d).to(tl.float32) * qk
    q7 = tl.load(qc + 7 * sq_d).to(tl.float32) * qk
    acc0 = tl.zeros([NG, LANES, WG], tl.float32)  # per nibble: channel 8 word + n
    acc1 = tl.zeros([NG, LANES, WG], tl.float32)
    acc2 = tl.zeros([NG, LANES, WG], tl.float32)
    acc3 = tl.zeros([NG, LANES, WG], tl.float32)
    acc4 = tl.zeros([NG, LANES, WG], tl.float32)
    acc5 = tl.zeros([NG, LANES, WG], tl.float32)
    acc6 = tl.zeros([NG, LANES, WG], tl.float32)
    acc7 = tl.zeros([NG, LANES, WG], tl.float32)
    # accs: sum_t p_t scale_tg u_tc (16x and 256x that for odd and even nibbles: nibble n's bias
    # p (min - 16 scale) or p (min - 256 scale)), with per group and lane pm = sum p min and
    # ps = sum p scale
    pm = tl.zeros([NG, LANES, 1], tl.float32)
    ps = tl.zeros([NG, LANES, 1], tl.float32)
    m_l = tl.full([LANES], float("-inf"), tl.float32)  # log2 units
    l_l = tl.zeros([LANES], tl.float32)
    kb_words = (k_base + bh * S * HD).to(tl.pointer_type(tl.int32), bitcast=True)
    vb_words = (v_base + bh * S * HD).to(tl.pointer_type(tl.int32), bitcast=True)
    kb_min = k_base_min + bh * NB * D
    kb_scale = k_base_scale + bh * NB * D
    vb_min = v_base_min + bh * S * NG
    vb_scale = v_base_scale + bh * S * NG
    kr_words = (k_res + bh * CAPT * HD).to(tl.pointer_type(tl.int32), bitcast=True)
    vr_words = (v_res + bh * CAPT * HD).to(tl.pointer_type(tl.int32), bitcast=True)
    vr_min = v_res_min + bh * CAPT * NG
    vr_scale = v_res_scale + bh * CAPT * NG
    for tile in tl.range(lo, hi, num_stages=STAGES):
        p2 = tile * BN + kr  # [LANES, NREP], int32: positions < S
        p = p2[None, :, :, None]
        pk = ((tile * BN) // G) * HD + pw  # the block's K parameter words
        # K: q . k in the exp2 domain, per word sum_n ks_n u_n + sum_n (qq_n min_n - ks_n)
        k0, k1, e0 = _k_params((256.0 * q0, 16.0 * q1), (q0, q1), kb_scale, kb_min, pk, 0)
        k2, k3, e1 = _k_params((256.0 * q2, 16.0 * q3), (q2, q3), kb_scale, kb_min, pk, 1)
        k4, k5, e2 = _k_params((256.0 * q4, 16.0 * q5), (q4, q5), kb_scale, kb_min, pk, 2)
        k6, k7, e3 = _k_params((256.0 * q6, 16.0 * q7), (q6, q7), kb_scale, kb_min, pk, 3)
        sw = _dot_words((e0 + e1) + (e2 + e3), tl.load(kb_words + p * W + word), k0, k1, k2, k3, k4, k5, k6, k7, ONE)
        for j in tl.static_range(1, DEPTH + 1):
            rj = tl.load(rows + ((j - 1) * B + b) * S + p2)
            has = (rj >= 0)[None, :, :, None]
            gr = (tl.load(res_layout + j) + tl.where(rj >= 0, rj, 0))[None, :, :, None]
            pr = (((j - 1) * B + b) * H + h) * NB * D  # residual j's K parameter table
            k0, k1, e0 = _k_params((256.0 * q0, 16.0 * q1), (q0, q1), k_res_scale + pr, k_res_min + pr, pk, 0)
            k2, k3, e1 = _k_params((256.0 * q2, 16.0 * q3), (q2, q3), k_res_scale + pr, k_res_min + pr, pk, 1)
            k4, k5, e2 = _k_params((256.0 * q4, 16.0 * q5), (q4, q5), k_res_scale + pr, k_res_min + pr, pk, 2)
            k6, k7, e3 = _k_params((256.0 * q6, 16.0 * q7), (q6, q7), k_res_scale + pr, k_res_min + pr, pk, 3)
            # an absent row loads code words 0 (u = 1 everywhere): its sum_n ks_n is taken back
            ksum = ((k0 + k1) + (k2 + k3)) + ((k4 + k5) + (k6 + k7))
            c = tl.load(kr_words + gr * W + word, mask=has, other=0)
            sw = _dot_words(sw + tl.where(has, (e0 + e1) + (e2 + e3), -ksum), c, k0, k1, k2, k3, k4, k5, k6, k7, ONE)
        s = tl.sum(tl.sum(sw, 3), 0)  # [LANES, NREP]
        m_new = tl.maximum(m_l, tl.max(s, 1))  # the bulk has no masked key: s is finite
        alpha = tl.exp2(m_l - m_new)
        pe = tl.exp2(s - m_new[:, None])  # [LANES, NREP]
        l_l = l_l * alpha + tl.sum(pe, 1)
        m_l = m_new
        # V: sum_t p_t v_tc = sum_t (16 p_t scale_tg) u_tc + sum_t p_t (min_tg - 16 scale_tg)
        p4 = pe[None, :, :, None]
        vsc = _group_params(vb_scale, p, gg, NG)
        wv = p4 * vsc  # [NG, LANES, NREP, 1]
        c = tl.load(vb_words + p * W + word)
        pmt = p4 * _group_params(vb_min, p, gg, NG)
        pst = wv
        a3 = alpha[None, :, None]
        u0, u1 = _unit_pair(c, 0, ONE)
        acc0 = acc0 * a3 + tl.sum(wv * u0, 2)
        acc1 = acc1 * a3 + tl.sum(wv * u1, 2)
        u2, u3 = _unit_pair(c, 1, ONE)
        acc2 = acc2 * a3 + tl.sum(wv * u2, 2)
        acc3 = acc3 * a3 + tl.sum(wv * u3, 2)
        u4, u5 = _unit_pair(c, 2, ONE)
        acc4 = acc4 * a3 + tl.sum(wv * u4, 2)
        acc5 = acc5 * a3 + tl.sum(wv * u5, 2)
        u6, u7 = _unit_pair(c, 3, ONE)
        acc6 = acc6 * a3 + tl.sum(wv * u6, 2)
        acc7 = acc7 * a3 + tl.sum(wv * u7, 2)
        for j in tl.static_range(1, DEPTH + 1):
            rj = tl.load(rows + ((j - 1) * B + b) * S + p2)
            has = (rj >= 0)[None, :, :, None]
            gr = (tl.load(res_layout + j) + tl.where(rj >= 0, rj, 0))[None, :, :, None]
            # an absent row loads parameters 0: no term
            rsc = _group_params(vr_scale, gr, gg, NG, has)
            wr = p4 * rsc
            c = tl.load(vr_words + gr * W + word, mask=has, other=0)
            u0, u1 = _unit_pair(c, 0, ONE)
            acc0 += tl.sum(wr * u0, 2)
            acc1 += tl.sum(wr * u1, 2)
            u2, u3 = _unit_pair(c, 1, ONE)
            acc2 += tl.sum(wr * u2, 2)
            acc3 += tl.sum(wr * u3, 2)
            u4, u5 = _unit_pair(c, 2, ONE)
            acc4 += tl.sum(wr * u4, 2)
            acc5 += tl.sum(wr * u5, 2)
            u6, u7 = _unit_pair(c, 3, ONE)
            acc6 += tl.sum(wr * u6, 2)
            acc7 += tl.sum(wr * u7, 2)
            pmt += p4 * _group_params(vr_min, gr, gg, NG, has)
            pst += wr
        pm = pm * a3 + tl.sum(pmt, 2)
        ps = ps * a3 + tl.sum(pst, 2)
    prow = bh * NSPL + z
    one = tl.arange(0, 1)
    # merge the lanes: m_i is -inf (and l_i 0) for a split without tiles
    m_i = tl.max(m_l, 0)
    wl = tl.exp2(m_l - tl.where(m_i > float("-inf"), m_i, 0.0))
    l_i = tl.sum(l_l * wl, 0)
    tl.store(part_ml + prow * 2 + one, tl.full([1], 0.0, tl.float32) + m_i * 0.6931471805599453)
    tl.store(part_ml + prow * 2 + 1 + one, tl.full([1], 0.0, tl.float32) + l_i)
    w3 = wl[None, :, None]
    vb = pm - 16.0 * ps  # odd nibbles' bias, even nibbles': pm - 256 ps
    vbl = pm - 256.0 * ps
    out = part_acc + prow * D + 8 * (tl.arange(0, NG)[:, None] * WG + tl.arange(0, WG)[None, :])  # [NG, WG]: channel 8 word
    tl.store(out, tl.sum((256.0 * acc0 + vbl) * w3, 1))
    tl.store(out + 1, tl.sum((16.0 * acc1 + vb) * w3, 1))
    tl.store(out + 2, tl.sum((256.0 * acc2 + vbl) * w3, 1))
    tl.store(out + 3, tl.sum((16.0 * acc3 + vb) * w3, 1))
    tl.store(out + 4, tl.sum((256.0 * acc4 + vbl) * w3, 1))
    tl.store(out + 5, tl.sum((16.0 * acc5 + vb) * w3, 1))
    tl.store(out + 6, tl.sum((256.0 * acc6 + vbl) * w3, 1))
    tl.store(out + 7, tl.sum((16.0 * acc7 + vb) * w3, 1))


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


# One-query-row decode: _decode_bulk_kernel over the flushed bulk, _attn_kernel's NTAIL programs
# for the tail. block_n: keys per tile at depth 0 (min(group, block_n): one K parameter block per
# tile), block_n_residual at depths >= 1 (64-key tiles with a residual stream spill at one warp:
# scripts/kernel_report.py); one warp per program (the per-tile parameter work shared by more
# keys per thread: 68% of copy bandwidth at 1 warp, 55% at 2, 42% at 4 in a plain-Triton probe of
# this format on the H200); 3 cp.async stages; waves: programs per SM the splits aim at (1056
# programs at B1 x 32K, 1024 at B4). On the H200 at 32K, depth 0: the bulk 43.4 / 122.6 us at
# B1 / B4, 41% / 59% of 4.2 TB/s (bench_packed_decode.py --loop1, 2026-12-03, 612d9ea).
# tail_programs: the tail's 2-5 per-token tiles spread over 4 programs per row (_attn_kernel 13.1 /
# 13.7 us at B1 / B4 x 32K, same run; 21.6 / 21.8 with one program, measured with the 4-warp bulk).
FAST_DECODE = {"block_n": 64, "block_n_residual": 32, "num_warps": 1, "num_stages": 3, "waves": 8, "tail_programs": 4}
