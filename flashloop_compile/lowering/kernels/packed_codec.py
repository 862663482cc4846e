"""Device helpers shared by the packed KV cache's kernels (DESIGN.md "Packed KV storage"): rounding,
quantization codes and parameters, the per-token reconstruction, and the loads of the flushed bulk.

Launchers (packed_write, packed_read, packed_attention) take the cache tensors in
:data:`flashloop_compile.lowering.packed_layout.CACHE_NAMES` order and a ``wrap`` callable applied
to each kernel before launch (``torch.library.wrap_triton`` inside ``triton_op`` bodies, identity
otherwise: then the kernels also run on CPU tensors under ``TRITON_INTERPRET=1``). Launchers never
sync with the host: grids and compile-time constants come from static shapes, everything data
dependent is read on device.

Layout conventions (all cache tensors contiguous): a D-channel vector is handled as two halves of
D/2 "pairs" -- pair i holds channels 2i (low nibble, "even") and 2i+1 (high nibble, "odd") -- so a
row of packed codes is loaded once as [*, D/2] bytes and never interleaved in registers.

Quantization matches :mod:`flashloop_compile.reference.codec` bit for bit: FP32 min/max,
scale = fp16((max - min) / 15) with a correctly rounded division (``div_rn``), codes =
clamp(round_half_even((x - fp16 min) / fp16 scale), 0, 15) (decided without a division per
element: ``_codes``), constant groups scale 0 / codes 0; decode min + scale * code in FP32
(scale * code is exact, so an FMA contraction cannot change it). Compute-dtype outputs are
rounded to nearest even explicitly (the interpreter truncates float32 -> bfloat16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashloop_compile.lowering.kernels.common import next_pow2
from flashloop_compile.lowering.packed_layout import PackedTensors

_CDTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


# Kernels take the loop depth as ``depth + DEPTH_BIAS``: an int argument equal to 1 is specialized
# to a constant (Triton's JIT, and Inductor's launch of user kernels, which ignores
# do_not_specialize), and a kernel compiled with depth == 1 as a constant failed in
# TritonGPUCoalesce (triton 3.6: the compiled quant decode step on the H200). Biased, the
# argument is never 1 and stays a runtime value.
DEPTH_BIAS = 2


_DEPTH_BIAS = tl.constexpr(DEPTH_BIAS)  # the kernels' copy (Triton globals must be constexpr)


def residual_unroll(depth: int) -> int:
    """RP of a launch at ``depth``: the residual levels the per-token code (_reconstruct) unrolls
    (1..RP-1, those past the depth masked off) and the flushed boundaries it reads, a power of two
    > depth. Kernels whose depth is a constexpr (the bulk read, the corrections) fold the levels
    past it away anyway; the ones that take the depth at run time (_attn_kernel's tail, the
    generic read) compiled every level of the cache. Loop 1's tail (depth 0) now compiles no
    residual code: sm_90, 1934 -> 879 SASS instructions per tile, 244 -> 176 registers
    (scripts/kernel_report.py --only decode --depth 0); depth 1: 1246 instructions, 224 registers."""
    return next_pow2(depth + 1)


def _geometry(tensors):
    c = PackedTensors(*tensors)
    k_base, k_res, k_tail = c.k_base, c.k_res, c.k_tail
    B, H, S, HD = k_base.shape
    R = k_tail.shape[1]
    G = k_tail.shape[3] // 2
    D = 2 * HD
    NB = S // G
    CAPT = k_res.shape[2]
    return B, H, S, D, G, R, NB, CAPT


@triton.jit
def _round_to(x, CD: tl.constexpr):
    """FP32 -> nearest-even value of the compute dtype (returned as FP32, exactly representable)."""
    if CD == 1:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16) << 16
        return bits.to(tl.float32, bitcast=True)
    elif CD == 2:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _codes(x, mn, sc):
    """INT4 codes (int32) of x (fp32) against fp16 parameters (broadcastable): clamp(round_half_even(
    div_rn(x - min, scale)), 0, 15), the reference codec's codes bit for bit, with no division per
    element (a correctly rounded one costs a range check and a slow-path branch per element: FCHK
    + CALL in the SASS). The quotient q = d / scale (d = x - min) is estimated through the scale's
    reciprocal (one division per parameter); the estimate is far within 0.5 of q, so the code is f
    or f + 1 for f = floor(estimate), decided by where fl(q) lies against c = f + 0.5. With f
    clamped to [-1, 15] (codes clamp anyway), c has at most 5 significant bits and the fp16 scale
    11, so c * scale is exact and the sign of e = d - c * scale (rounded or fused) is exact. And
    fl(q) == c only where d == c * scale: FP32 values next to c * scale lie more than half an ulp
    of c (times the scale) away from it. So e > 0 means above c (f + 1), e < 0 below (f), e == 0 a
    tie (to even). tests/lowering/test_codes_rounding.py checks ties, their neighbours and random
    groups against the reference."""
    m32 = mn.to(tl.float32)
    s32 = sc.to(tl.float32)
    pos = s32 > 0.0
    safe = tl.where(pos, s32, 1.0)
    inv = 1.0 / safe
    d = x - m32
    f = tl.minimum(tl.maximum(tl.floor(d * inv), -1.0), 15.0)
    e = d - (f + 0.5) * safe
    fi = f.to(tl.int32)
    code = fi + (e > 0.0).to(tl.int32) + ((e == 0.0) & ((fi & 1) != 0)).to(tl.int32)
    code = tl.minimum(tl.maximum(code, 0), 15)
    return tl.where(pos, code, 0)


@triton.jit
def _params(lo, hi):
    """fp16 (minimum, scale) of groups with fp32 extrema lo, hi."""
    fifteen = tl.full(lo.shape, 15.0, tl.float32)
    return lo.to(tl.float16), tl.math.div_rn(hi - lo, fifteen).to(tl.float16)


@triton.jit
def _reconstruct(
    p, pmask, b, h, r,
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
    k_tail, v_tail, flushed, rows, depth_count, res_layout,
    B, H, S, NB, CAPT, R,
    D: tl.constexpr, G: tl.constexpr, PAIR0: tl.constexpr, NP: tl.constexpr, ALIGNED: tl.constexpr,
    RP: tl.constexpr = 4,
):
    """Logical K/V (fp32, even and odd channel halves [BP, NP]) at depth r of positions p [BP]
    (rows with pmask False read as 0) for pairs PAIR0..PAIR0+NP-1, and which rows hold a written
    token. e = min(r, depth_count - 1); p < flushed[e]: base + residuals 1..e present; otherwise
    the ring at depth e. ALIGNED: every p lies in the block of p[0] (K parameters loaded once).
    RP: a power of two > r (residuals 1..RP-1 unrolled, those past r masked off; residual_unroll).

    No branch depends on a loaded value, and every load's address depends on p, depth_count or a
    residual row map only, so a tile costs about three memory latencies (p; depth_count, the
    base, the row maps; the flushed boundary, the residuals, the ring) instead of one or two per
    residual and the ring: a small read (the ring, a window, a correction's last tile) is latency-
    bound. Loads whose rows turn out not to be needed (a ring token's codes) are selected away;
    the arithmetic, and its order, is that of the per-branch version: the values are identical.

    b, h are int64 scalars; per-(b, h) bases are applied to the pointers as scalars so that tile
    offsets stay int32 (fewer registers)."""
    HD: tl.constexpr = D // 2
    NG: tl.constexpr = D // G
    RING: tl.constexpr = 2 * G
    pc = tl.where(pmask, p, 0).to(tl.int32)
    bh = b * H + h
    dc = tl.load(depth_count + b * S + pc, mask=pmask, other=0).to(tl.int32)
    valid = pmask & (dc > 0)
    e = tl.maximum(tl.minimum(dc - 1, r), 0)
    fl = tl.load(flushed + b * R + e, mask=valid, other=0)
    packed = valid & (pc < fl)
    ring = valid & (pc >= fl)
    i = PAIR0 + tl.arange(0, NP)
    imask = i < HD
    m2 = pmask[:, None] & imask[None, :]  # loads: every addressable row (the selection is below)
    if ALIGNED:
        blk = tl.max(pc, 0) // G  # masked rows read position 0: the max is in the block
        kp = (blk * D + 2 * i)[None, :]
        km = imask[None, :]
    else:
        blk = pc // G
        kp = blk[:, None] * D + 2 * i[None, :]
        km = m2

    kb_min = k_base_min + bh * NB * D
    kb_scale = k_base_scale + bh * NB * D
    c = tl.load(k_base + bh * S * HD + pc[:, None] * HD + i[None, :], mask=m2, other=0).to(tl.int32)
    ke = tl.load(kb_min + kp, mask=km, other=0.0).to(tl.float32) + tl.load(kb_scale + kp, mask=km, other=0.0).to(
        tl.float32
    ) * (c & 15).to(tl.float32)
    ko = tl.load(kb_min + kp + 1, mask=km, other=0.0).to(tl.float32) + tl.load(kb_scale + kp + 1, mask=km, other=0.0).to(
        tl.float32
    ) * (c >> 4).to(tl.float32)
    c = tl.load(v_base + bh * S * HD + pc[:, None] * HD + i[None, :], mask=m2, other=0).to(tl.int32)
    vp = pc[:, None] * NG + (i // (G // 2))[None, :]
    vmn = tl.load(v_base_min + bh * S * NG + vp, mask=m2, other=0.0).to(tl.float32)
    vsc = tl.load(v_base_scale + bh * S * NG + vp, mask=m2, other=0.0).to(tl.float32)
    ve = vmn + vsc * (c & 15).to(tl.float32)
    vo = vmn + vsc * (c >> 4).to(tl.float32)

    for j in tl.static_range(1, RP):
        live = pmask & (j <= r)  # rows map j exists (r <= R - 1 < RP)
        rj = tl.load(rows + ((j - 1) * B + b) * S + pc, mask=live, other=-1)
        fetch = live & (rj >= 0)
        has = packed & fetch & (j <= e)
        grow = tl.where(fetch, tl.load(res_layout + j, mask=j <= r, other=0) + rj, 0)
        f2 = fetch[:, None] & imask[None, :]
        h2 = has[:, None] & imask[None, :]
        if ALIGNED:
            hk = imask[None, :] & (j <= r)
        else:
            hk = f2
        kr_min = k_res_min + (((j - 1) * B + b) * H + h) * NB * D
        kr_scale = k_res_scale + (((j - 1) * B + b) * H + h) * NB * D
        c = tl.load(k_res + bh * CAPT * HD + grow[:, None] * HD + i[None, :], mask=f2, other=0).to(tl.int32)
        de = tl.load(kr_min + kp, mask=hk, other=0.0).to(tl.float32) + tl.load(kr_scale + kp, mask=hk, other=0.0).to(
            tl.float32
        ) * (c & 15).to(tl.float32)
        do = tl.load(kr_min + kp + 1, mask=hk, other=0.0).to(tl.float32) + tl.load(
            kr_scale + kp + 1, mask=hk, other=0.0
        ).to(tl.float32) * (c >> 4).to(tl.float32)
        ke = tl.where(h2, ke + de, ke)
        ko = tl.where(h2, ko + do, ko)
        c = tl.load(v_res + bh * CAPT * HD + grow[:, None] * HD + i[None, :], mask=f2, other=0).to(tl.int32)
        vp = grow[:, None] * NG + (i // (G // 2))[None, :]
        vmn = tl.load(v_res_min + bh * CAPT * NG + vp, mask=f2, other=0.0).to(tl.float32)
        vsc = tl.load(v_res_scale + bh * CAPT * NG + vp, mask=f2, other=0.0).to(tl.float32)
        ve = tl.where(h2, ve + (vmn + vsc * (c & 15).to(tl.float32)), ve)
        vo = tl.where(h2, vo + (vmn + vsc * (c >> 4).to(tl.float32)), vo)

    p2 = packed[:, None] & imask[None, :]
    r2 = ring[:, None] & imask[None, :]
    t2 = valid[:, None] & imask[None, :]  # the ring row at depth e: known from depth_count alone
    tb = (b * R * H + h) * RING * D
    tp = ((e * H) * RING + pc % RING)[:, None] * D + 2 * i[None, :]
    ke = tl.where(r2, tl.load(k_tail + tb + tp, mask=t2, other=0.0).to(tl.float32), tl.where(p2, ke, 0.0))
    ko = tl.where(r2, tl.load(k_tail + tb + tp + 1, mask=t2, other=0.0).to(tl.float32), tl.where(p2, ko, 0.0))
    ve = tl.where(r2, tl.load(v_tail + tb + tp, mask=t2, other=0.0).to(tl.float32), tl.where(p2, ve, 0.0))
    vo = tl.where(r2, tl.load(v_tail + tb + tp + 1, mask=t2, other=0.0).to(tl.float32), tl.where(p2, vo, 0.0))
    return ke, ko, ve, vo, valid


@triton.jit
def _flushed_min(flushed_b, depth, RP: tl.constexpr):
    """The smallest flushed boundary of depths 0..depth of one row (flushed_b: its R entries):
    below it every position holds its base and residual j is present exactly where rows_j >= 0."""
    e_ = tl.arange(0, RP)
    return tl.min(tl.load(flushed_b + e_, mask=e_ <= depth, other=2147483647), 0)


@triton.jit
def _bulk_tiles(q_positions, sqp_b, p0, flushed, b, R, DEPTH: tl.constexpr, RP: tl.constexpr, BN: tl.constexpr):
    """Key tiles of BN positions a one-query-row decode of row b takes from the flushed bulk (0
    when its query is padding): the tiles below every depth's flushed boundary and the stored end."""
    qpos = tl.load(q_positions + b * sqp_b + tl.arange(0, 1))
    nfast = tl.minimum(_flushed_min(flushed + b * R, DEPTH, RP), tl.load(p0 + b)) // BN
    return tl.where(tl.max((qpos >= 0).to(tl.int32), 0) > 0, nfast, 0)


@triton.jit
def _pair_words(ptr, word_off, HD: tl.constexpr):
    """FP32 (even, odd) channel parameters of fp16 pairs read as 32-bit words at word offsets
    ``word_off`` (broadcast against the HD pairs) from ptr (fp16, 4-byte aligned)."""
    w = tl.load(ptr.to(tl.pointer_type(tl.uint32), bitcast=True) + word_off)
    e = (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    o = (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return e, o


@triton.jit
def _row_bases(k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, v_res, v_res_min, v_res_scale,
               bh, S, NB, CAPT, D: tl.constexpr, G: tl.constexpr):
    """The packed store's per-(batch, head) base pointers (bh = b * H + h): base codes, base K
    parameters per block, base V parameters per row, residual codes and residual V parameters
    per row (residual K parameters are per depth: the caller offsets k_res_min/k_res_scale)."""
    HD: tl.constexpr = D // 2
    NG: tl.constexpr = D // G
    return (k_base + bh * S * HD, k_base_min + bh * NB * D, k_base_scale + bh * NB * D,
            v_base + bh * S * HD, v_base_min + bh * S * NG, v_base_scale + bh * S * NG,
            k_res + bh * CAPT * HD, v_res + bh * CAPT * HD, v_res_min + bh * CAPT * NG, v_res_scale + bh * CAPT * NG)


@triton.jit
def _bulk_residual_rows(rows, res_layout, j, b, B, S, p):
    """Residual j of positions p in the flushed bulk: where present, and its global row (0 where not)."""
    rj = tl.load(rows + ((j - 1) * B + b) * S + p)
    has = rj >= 0
    return has, tl.load(res_layout + j) + tl.where(has, rj, 0)


@triton.jit
def _bulk_k(kb_codes, kb_min, kb_scale, kr_codes, k_res_min, k_res_scale, rows, res_layout, p, kw, b, h,
            B, H, S, NB, D: tl.constexpr, DEPTH: tl.constexpr, PAIR0: tl.constexpr = 0, NP: tl.constexpr = 0,
            VEC: tl.constexpr = 0):
    """FP32 K halves [BP, NP] (not rounded) of positions p in the flushed bulk of row (b, h), for
    the channel pairs PAIR0 .. PAIR0 + NP - 1 (NP = 0: all D/2): the base plus residuals 1..DEPTH
    where present. Pointers are the (b, h) bases of the codes and of the base parameters; kw: the
    K parameters' pair-word offsets in a block table ([1, NP] for a tile in one block, [BP, NP]
    per position). VEC > 0: the codes load in vectors of VEC bytes at most, so that their tile
    takes the layout of the caller's FP32 tiles of VEC-wide vectors (packed_write's flush: with
    16-byte vectors of codes Triton moved four FP32 tiles through shared memory instead)."""
    HD: tl.constexpr = D // 2
    W: tl.constexpr = HD if NP == 0 else NP
    if VEC > 0:
        i = PAIR0 + tl.max_contiguous(tl.arange(0, W), VEC)
    else:
        i = PAIR0 + tl.arange(0, W)
    c = tl.load(kb_codes + p[:, None] * HD + i[None, :]).to(tl.int32)
    mn_e, mn_o = _pair_words(kb_min, kw, HD)
    sc_e, sc_o = _pair_words(kb_scale, kw, HD)
    ke = mn_e + sc_e * (c & 15).to(tl.float32)
    ko = mn_o + sc_o * (c >> 4).to(tl.float32)
    for j in tl.static_range(1, DEPTH + 1):
        has, g = _bulk_residual_rows(rows, res_layout, j, b, B, S, p)
        c = tl.load(kr_codes + g[:, None] * HD + i[None, :], mask=has[:, None], other=0).to(tl.int32)
        pk = (((j - 1) * B + b) * H + h) * NB * D
        mn_e, mn_o = _pair_words(k_res_min + pk, kw, HD)
        sc_e, sc_o = _pair_words(k_res_scale + pk, kw, HD)
        ke = tl.where(has[:, None], ke + (mn_e + sc_e * (c & 15).to(tl.float32)), ke)
        ko = tl.where(has[:, None], ko + (mn_o + sc_o * (c >> 4).to(tl.float32)), ko)
    return ke, ko


@triton.jit
def _bulk_v(vb_codes, vb_min, vb_scale, vr_codes, vr_min, vr_scale, rows, res_layout, p, b, B, S,
            D: tl.constexpr, G: tl.constexpr, BP: tl.constexpr, DEPTH: tl.constexpr, GROUP: tl.constexpr = -1,
            VEC: tl.constexpr = 0):
    """FP32 V halves [BP, D/2] (not rounded) of positions p in the flushed bulk of row (b, h),
    as _bulk_k; the pointers are the (b, h) bases of codes and per-row parameters. GROUP >= 0:
    only that group's G channels ([BP, G/2] halves, one parameter pair per row). VEC: as
    _bulk_k's, for GROUP >= 0."""
    HD: tl.constexpr = D // 2
    NG: tl.constexpr = D // G
    if GROUP < 0:
        i = tl.arange(0, HD)
    else:
        i = GROUP * (G // 2) + (tl.max_contiguous(tl.arange(0, G // 2), VEC) if VEC > 0 else tl.arange(0, G // 2))
    c = tl.load(vb_codes + p[:, None] * HD + i[None, :]).to(tl.int32)
    vmn, vsc = _row_group_params(vb_min, vb_scale, p, p >= 0, BP, NG, G, HD, GROUP)
    ve = vmn + vsc * (c & 15).to(tl.float32)
    vo = vmn + vsc * (c >> 4).to(tl.float32)
    for j in tl.static_range(1, DEPTH + 1):
        has, g = _bulk_residual_rows(rows, res_layout, j, b, B, S, p)
        c = tl.load(vr_codes + g[:, None] * HD + i[None, :], mask=has[:, None], other=0).to(tl.int32)
        vmn, vsc = _row_group_params(vr_min, vr_scale, g, has, BP, NG, G, HD, GROUP)
        ve = tl.where(has[:, None], ve + (vmn + vsc * (c & 15).to(tl.float32)), ve)
        vo = tl.where(has[:, None], vo + (vmn + vsc * (c >> 4).to(tl.float32)), vo)
    return ve, vo


@triton.jit
def _row_group_params(v_min, v_scale, r, rmask, BN: tl.constexpr, NG: tl.constexpr, G: tl.constexpr, HD: tl.constexpr,
                      GROUP: tl.constexpr = -1):
    """FP32 V (minimum, scale) [BN, HD] of rows r [BN]: one load of a row's NG groups (contiguous),
    broadcast over each group's G / 2 channel pairs. One or two groups per row (head_dim 64 or
    128 at G = 64) select in registers; more go through a reshape (a shared-memory shuffle).
    GROUP >= 0: that group's parameters alone, [BN, 1]."""
    if GROUP >= 0:
        mn = tl.load(v_min + r * NG + GROUP, mask=rmask, other=0.0).to(tl.float32)
        sc = tl.load(v_scale + r * NG + GROUP, mask=rmask, other=0.0).to(tl.float32)
        return mn[:, None], sc[:, None]
    else:
        gi = tl.arange(0, NG)
        vp = r[:, None] * NG + gi[None, :]
        mn = tl.load(v_min + vp, mask=rmask[:, None], other=0.0).to(tl.float32)
        sc = tl.load(v_scale + vp, mask=rmask[:, None], other=0.0).to(tl.float32)
        if NG == 1:
            return tl.broadcast_to(mn, [BN, HD]), tl.broadcast_to(sc, [BN, HD])
        elif NG == 2:
            first = (tl.arange(0, HD) < G // 2)[None, :]
            mn0, mn1 = tl.split(mn)
            sc0, sc1 = tl.split(sc)
            return tl.where(first, mn0[:, None], mn1[:, None]), tl.where(first, sc0[:, None], sc1[:, None])
        else:
            mn = tl.reshape(tl.broadcast_to(mn[:, :, None], [BN, NG, G // 2]), [BN, HD])
            sc = tl.reshape(tl.broadcast_to(sc[:, :, None], [BN, NG, G // 2]), [BN, HD])
            return mn, sc
