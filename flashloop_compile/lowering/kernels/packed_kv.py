"""Triton kernels for the packed KV cache (DESIGN.md "Packed KV storage").

Launchers take the cache tensors in :data:`flashloop_compile.runtime.packed_kv.LAYER_TENSOR_NAMES`
+ ``MODEL_TENSOR_NAMES`` order and a ``wrap`` callable applied to each kernel before launch
(``torch.library.wrap_triton`` inside ``triton_op`` bodies, identity otherwise: then the kernels
also run on CPU tensors under ``TRITON_INTERPRET=1``). Launchers never sync with the host: grids
and compile-time constants come from static shapes, everything data dependent is read on device.

Layout conventions (all cache tensors contiguous): a D-channel vector is handled as two halves of
D/2 "pairs" -- pair i holds channels 2i (low nibble, "even") and 2i+1 (high nibble, "odd") -- so a
row of packed codes is loaded once as [*, D/2] bytes and never interleaved in registers.

Kernels:
- ``_write_flush_kernel`` [B, H, ranges]: quantize the whole G-token blocks a write moves out of
  the tail window (base at depth 0, residuals against the reconstructed predecessor at depth >= 1);
  values of earlier calls come from the ring, values of this call from k/v (at p - first when the
  call's positions are consecutive, else found by binary search). Each range of blocks first
  counts the residual rows allocated before it. Writes the position -> row map (h == 0) and the
  new counters to a scratch.
- ``_write_tail_kernel`` [B, H, tiles of T]: the call's tokens past the new boundary go to the
  ring; depth_count and the counters are committed (separate launch: the flush must read the ring
  before it is overwritten).
- ``_read_kernel`` [B, H, tiles of P]: logical values at given positions, shared by the heads or
  per head (resolution rule).
- ``_attn_kernel`` [B*H, splits, query tiles] + ``_combine_kernel``: causal attention over the
  packed store (positions < P0) and the in-flight keys; split-K partials (flash-decoding) for
  decode, a fused single pass for prefill chunks.

Quantization matches :mod:`flashloop_compile.reference.codec` bit for bit: FP32 min/max,
scale = fp16((max - min) / 15) with a correctly rounded division (``div_rn``), codes =
clamp(round_half_even((x - fp16 min) / fp16 scale), 0, 15) (round-half-even written out),
constant groups scale 0 / codes 0; decode min + scale * code in FP32 (scale * code is exact, so
an FMA contraction cannot change it). Compute-dtype outputs are rounded to nearest even
explicitly (the interpreter truncates float32 -> bfloat16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashloop_compile.lowering.kernels.common import first_inflight, next_pow2, no_wrap, sm_count, stored_end

__all__ = [
    "launch_packed_kv_write",
    "launch_packed_read",
    "launch_packed_attention",
    "stored_end",
    "decode_splits",
]

_CDTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}

# Kernels take the loop depth as ``depth + DEPTH_BIAS``: an int argument equal to 1 is specialized
# to a constant (Triton's JIT, and Inductor's launch of user kernels, which ignores
# do_not_specialize), and a kernel compiled with depth == 1 as a constant failed in
# TritonGPUCoalesce (triton 3.6: the compiled quant decode step on the H200). Biased, the
# argument is never 1 and stays a runtime value.
DEPTH_BIAS = 2
_DEPTH_BIAS = tl.constexpr(DEPTH_BIAS)  # the kernels' copy (Triton globals must be constexpr)


def _cpu_semantics(t: torch.Tensor) -> bool:
    """Launch choices for the interpreter (FP32 dots, larger tiles), which runs the kernels on CPU
    tensors. scripts/kernel_report.py replaces it to compile the GPU's launches on CPU tensors."""
    return t.device.type != "cuda"


# ------------------------------------------------------------------------------------------------
# device helpers
# ------------------------------------------------------------------------------------------------


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
    """INT4 codes (int32) of x (fp32) against fp16 parameters (broadcastable)."""
    m32 = mn.to(tl.float32)
    s32 = sc.to(tl.float32)
    pos = s32 > 0.0
    safe = tl.where(pos, s32, 1.0)
    q = tl.math.div_rn(x - m32, safe)
    f = tl.floor(q)
    diff = q - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
    r = tl.where((diff > 0.5) | ((diff == 0.5) & odd), f + 1.0, f)
    r = tl.minimum(tl.maximum(r, 0.0), 15.0)
    return tl.where(pos, r, 0.0).to(tl.int32)


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
    RP: a power of two >= R (residuals 1..RP-1 unrolled, those past r masked off).

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


# ------------------------------------------------------------------------------------------------
# write
# ------------------------------------------------------------------------------------------------


@triton.jit
def _group_active(s, b, depth, Tn, first, consecutive, positions, skey, depth_count, sp_b, sp_t, S,
                  G: tl.constexpr, NSEARCH: tl.constexpr):
    """The G positions p of the group starting at s: each one's index in this call's positions
    (idx, valid where inb), whether the call writes it (in_call), and whether the flush stores it
    (act: every position at depth 0; at depth d > 0 those written now or written at a later depth
    before, i.e. the tokens with a residual at d)."""
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
    if depth == 0:
        act = p >= 0
    else:
        dcv = tl.load(depth_count + b * S + p).to(tl.int32)
        act = in_call | (dcv > depth)
    return p, idx, inb, in_call, act


@triton.jit(do_not_specialize=["depth_arg"])
def _write_flush_kernel(
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
    k_tail, v_tail, flushed, row_count, rows, depth_count, res_layout, overflow,
    k, v, positions, skey, contig, scratch,
    sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d, sp_b, sp_t,
    Tn, depth_arg, B, H, S, NB, CAPT, R,
    D: tl.constexpr, G: tl.constexpr, NSEARCH: tl.constexpr, BT: tl.constexpr, NCH: tl.constexpr = 1,
    RP: tl.constexpr = 4, ONE_TOKEN: tl.constexpr = False,
):
    depth = depth_arg - _DEPTH_BIAS
    HD: tl.constexpr = D // 2
    NG: tl.constexpr = D // G
    HG: tl.constexpr = G // 2
    RING: tl.constexpr = 2 * G
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    bh = b * H + h
    F = tl.load(flushed + b * R + depth)
    if depth == 0:
        # length of the row = max valid position + 1 of this call
        lmax = tl.full([BT], -1, tl.int64)
        t0 = 0
        while t0 < Tn:
            t = t0 + tl.arange(0, BT)
            pt = tl.load(positions + b * sp_b + t * sp_t, mask=t < Tn, other=-1)
            lmax = tl.maximum(lmax, pt)
            t0 += BT
        L = tl.max(lmax, 0) + 1
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
    # NCH programs per (b, h) split the row's groups into contiguous ranges; each first counts
    # the rows the groups before its range allocate (depth > 0 allocates residual rows in order)
    n_groups = (T_new - F + G - 1) // G  # F, T_new: multiples of G (max_seq is one)
    c = tl.program_id(2)
    g_lo = (c * n_groups) // NCH
    s = F + g_lo * G
    s_end = F + ((c + 1) * n_groups) // NCH * G
    if NCH > 1:
        s2 = F
        while s2 < s:
            _p, _idx, _inb, _in_call, act = _group_active(
                s2, b, depth, Tn, first, consecutive, positions, skey, depth_count, sp_b, sp_t, S, G, NSEARCH,
            )
            row += tl.sum(act.to(tl.int32), 0)
            s2 += G
    while s < s_end:
        p, idx, inb, in_call, act = _group_active(
            s, b, depth, Tn, first, consecutive, positions, skey, depth_count, sp_b, sp_t, S, G, NSEARCH,
        )
        n_act = tl.sum(act.to(tl.int32), 0)
        if n_act > 0:
            local = row + tl.cumsum(act.to(tl.int32), 0) - 1
            fits = act & (local < cap)
            if depth > 0:
                tl.store(rows + ((depth - 1) * B + b) * S + p, local, mask=fits & (h == 0))
                tl.store(overflow + tl.zeros([G], tl.int32), tl.full([G], 1, tl.int32), mask=act & (local >= cap))
            grow = tl.where(fits, off + local, 0).to(tl.int64)
            blk = s // G
            for g in tl.static_range(NG):
                i = g * HG + tl.arange(0, HG)
                mc = (in_call & act)[:, None]
                mr = ((in_call == 0) & act)[:, None]
                kc = (b * sk_b + h * sk_h + idx * sk_t)[:, None] + (2 * i)[None, :] * sk_d
                vc = (b * sv_b + h * sv_h + idx * sv_t)[:, None] + (2 * i)[None, :] * sv_d
                tp = (((b * R + depth) * H + h) * RING + p % RING)[:, None] * D + 2 * i[None, :]
                xke = tl.where(mc, tl.load(k + kc, mask=mc, other=0.0).to(tl.float32),
                               tl.load(k_tail + tp, mask=mr, other=0.0).to(tl.float32))
                xko = tl.where(mc, tl.load(k + kc + sk_d, mask=mc, other=0.0).to(tl.float32),
                               tl.load(k_tail + tp + 1, mask=mr, other=0.0).to(tl.float32))
                xve = tl.where(mc, tl.load(v + vc, mask=mc, other=0.0).to(tl.float32),
                               tl.load(v_tail + tp, mask=mr, other=0.0).to(tl.float32))
                xvo = tl.where(mc, tl.load(v + vc + sv_d, mask=mc, other=0.0).to(tl.float32),
                               tl.load(v_tail + tp + 1, mask=mr, other=0.0).to(tl.float32))
                if depth > 0:
                    rke, rko, rve, rvo, _ok = _reconstruct(
                        p, act, b, h, depth - 1,
                        k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
                        k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
                        k_tail, v_tail, flushed, rows, depth_count, res_layout,
                        B, H, S, NB, CAPT, R, D, G, g * HG, HG, True, RP,
                    )
                    xke = xke - rke
                    xko = xko - rko
                    xve = xve - rve
                    xvo = xvo - rvo
                am = act[:, None]
                # K: one group per channel over the block's (active) rows
                mne, sce = _params(tl.min(tl.where(am, xke, float("inf")), 0), tl.max(tl.where(am, xke, float("-inf")), 0))
                mno, sco = _params(tl.min(tl.where(am, xko, float("inf")), 0), tl.max(tl.where(am, xko, float("-inf")), 0))
                kbyte = (_codes(xke, mne[None, :], sce[None, :]) | (_codes(xko, mno[None, :], sco[None, :]) << 4)).to(tl.uint8)
                # V: one group per row over these G channels
                vlo = tl.minimum(tl.min(xve, 1), tl.min(xvo, 1))
                vhi = tl.maximum(tl.max(xve, 1), tl.max(xvo, 1))
                vmn, vsc = _params(vlo, vhi)
                vbyte = (_codes(xve, vmn[:, None], vsc[:, None]) | (_codes(xvo, vmn[:, None], vsc[:, None]) << 4)).to(tl.uint8)
                if depth == 0:
                    kpp = (bh * NB + blk) * D + 2 * i
                    tl.store(k_base_min + kpp, mne)
                    tl.store(k_base_scale + kpp, sce)
                    tl.store(k_base_min + kpp + 1, mno)
                    tl.store(k_base_scale + kpp + 1, sco)
                    cpos = (bh * S + p)[:, None] * HD + i[None, :]
                    tl.store(k_base + cpos, kbyte)
                    tl.store(v_base + cpos, vbyte)
                    vpp = (bh * S + p) * NG + g
                    tl.store(v_base_min + vpp, vmn)
                    tl.store(v_base_scale + vpp, vsc)
                else:
                    kpp = ((((depth - 1) * B + b) * H + h) * NB + blk) * D + 2 * i
                    tl.store(k_res_min + kpp, mne)
                    tl.store(k_res_scale + kpp, sce)
                    tl.store(k_res_min + kpp + 1, mno)
                    tl.store(k_res_scale + kpp + 1, sco)
                    fm = fits[:, None]
                    cpos = (bh * CAPT + grow)[:, None] * HD + i[None, :]
                    tl.store(k_res + cpos, kbyte, mask=fm)
                    tl.store(v_res + cpos, vbyte, mask=fm)
                    vpp = (bh * CAPT + grow) * NG + g
                    tl.store(v_res_min + vpp, vmn, mask=fits)
                    tl.store(v_res_scale + vpp, vsc, mask=fits)
            row += n_act
        s += G
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
# read
# ------------------------------------------------------------------------------------------------


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
            B, H, S, NB, D: tl.constexpr, DEPTH: tl.constexpr):
    """FP32 K halves [BP, D/2] (not rounded) of positions p in the flushed bulk of row (b, h):
    the base plus residuals 1..DEPTH where present. Pointers are the (b, h) bases of the codes
    and of the base parameters; kw: the K parameters' pair-word offsets in a block table ([1, D/2]
    for a tile in one block, [BP, D/2] per position)."""
    HD: tl.constexpr = D // 2
    i = tl.arange(0, HD)
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
            D: tl.constexpr, G: tl.constexpr, BP: tl.constexpr, DEPTH: tl.constexpr):
    """FP32 V halves [BP, D/2] (not rounded) of positions p in the flushed bulk of row (b, h),
    as _bulk_k; the pointers are the (b, h) bases of codes and per-row parameters."""
    HD: tl.constexpr = D // 2
    NG: tl.constexpr = D // G
    i = tl.arange(0, HD)
    c = tl.load(vb_codes + p[:, None] * HD + i[None, :]).to(tl.int32)
    vmn, vsc = _row_group_params(vb_min, vb_scale, p, p >= 0, BP, NG, G, HD)
    ve = vmn + vsc * (c & 15).to(tl.float32)
    vo = vmn + vsc * (c >> 4).to(tl.float32)
    for j in tl.static_range(1, DEPTH + 1):
        has, g = _bulk_residual_rows(rows, res_layout, j, b, B, S, p)
        c = tl.load(vr_codes + g[:, None] * HD + i[None, :], mask=has[:, None], other=0).to(tl.int32)
        vmn, vsc = _row_group_params(vr_min, vr_scale, g, has, BP, NG, G, HD)
        ve = tl.where(has[:, None], ve + (vmn + vsc * (c & 15).to(tl.float32)), ve)
        vo = tl.where(has[:, None], vo + (vmn + vsc * (c >> 4).to(tl.float32)), vo)
    return ve, vo


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
    NP: tl.constexpr, SPLIT: tl.constexpr,
):
    """packed_read of the tiles _bulk_read_tile admits (sparse decode's loop-2 reference reads
    the whole history, its corrections the selected keys: almost all such tiles). No per-token resolution, the depth a constexpr (unrolled residuals), K
    parameters as 32-bit pair words, V group parameters selected in registers, and rows stored
    whole (even/odd halves interleaved in registers). Same arithmetic, in the same order, as
    _reconstruct: the two kernels write identical values. A tile the test refuses is read here too, by _read_tile on SPLIT sub-tiles of BP / SPLIT positions in
    turn (the generic kernel's tile), so no second launch is needed (the in-flight tensors and
    strides are read only then)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    t = tl.program_id(2) * BP + tl.arange(0, BP)
    tm = t < P
    p = tl.load(positions + b * sp_b + h * sp_h + t * sp_t, mask=tm, other=-1)
    if _bulk_read_tile(p, tm, flushed + b * R, lim + b, DEPTH, BP, RP):
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
def _attend_tile(qe, qo, ke, ko, ve, vo, valid, scale):
    """One query row against a tile of keys (even / odd halves [BP, D/2], valid [BP]): the tile's
    softmax partial -- the score maximum (-inf with no valid key), the sum of exp(score - max)
    and the exp-weighted V halves [D/2]."""
    s = tl.where(valid, (tl.sum(ke * qe, 1) + tl.sum(ko * qo, 1)) * scale, float("-inf"))
    m = tl.max(s, 0)
    pr = tl.exp(s - tl.where(m > float("-inf"), m, 0.0))
    return m, tl.sum(pr, 0), tl.sum(pr[:, None] * ve, 0), tl.sum(pr[:, None] * vo, 0)


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
    RP: tl.constexpr, DEPTH: tl.constexpr, SPLIT: tl.constexpr,
):
    """Sparse decode's correction for one query row per kv head (row b * H + h), read and attended
    in one pass: program z (counted from the last tile, so that the row's per-token tile,
    which holds its highest positions, starts in the first wave instead of the last) takes the
    selected keys [z * BP, (z + 1) * BP) of the row (keys
    [B, H, P] global positions, the first count[b, h] valid), reconstructs them in registers as
    packed_read does (a tile _bulk_read_tile's rule admits: _bulk_k / _bulk_v, no per-token state;
    any other: _resolve_tile on SPLIT sub-tiles, the in-flight tokens included; the bulk bound
    takes the row's first in-flight position from in_positions, no launch of its own) and writes the
    tile's softmax partial (max, sum, weighted V) for _correction_combine_kernel. The values
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
    fl_min = _flushed_min(flushed + b * R, DEPTH, RP)
    lim = tl.zeros([], tl.int64) + S  # the row's first in-flight position (common.first_inflight)
    u = 0
    while u < Ti:
        ipu = tl.load(in_positions + b * sip_b + u * sip_t)
        lim = tl.where(ipu >= 0, tl.minimum(lim, ipu), lim)
        u += 1
    p_lo = tl.min(tl.where(valid, p, 2147483647), 0)
    p_hi = tl.max(tl.where(valid, p, -1), 0)
    if (p_lo >= 0) & (p_hi < fl_min) & (p_hi < lim):  # the flushed bulk (_bulk_read_tile)
        pc = tl.where(valid, p, 0).to(tl.int32)
        kw = ((pc // G) * HD)[:, None] + tl.arange(0, HD)[None, :]
        kb_codes, kb_min, kb_scale, vb_codes, vb_min, vb_scale, kr_codes, vr_codes, vr_min, vr_scale = _row_bases(
            k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, v_res, v_res_min, v_res_scale,
            b * H + h, S, NB, CAPT, D, G,
        )
        ke, ko = _bulk_k(kb_codes, kb_min, kb_scale, kr_codes, k_res_min, k_res_scale, rows, res_layout, pc, kw, b, h,
                         B, H, S, NB, D, DEPTH)
        ve, vo = _bulk_v(vb_codes, vb_min, vb_scale, vr_codes, vr_min, vr_scale, rows, res_layout, pc, b, B, S, D, G,
                         BP, DEPTH)
        m_i, l_i, acc_e, acc_o = _attend_tile(qe, qo, _round_to(ke, CD), _round_to(ko, CD), _round_to(ve, CD),
                                              _round_to(vo, CD), valid, scale)
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
# attention
# ------------------------------------------------------------------------------------------------


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


@triton.jit
def _row_group_params(v_min, v_scale, r, rmask, BN: tl.constexpr, NG: tl.constexpr, G: tl.constexpr, HD: tl.constexpr):
    """FP32 V (minimum, scale) [BN, HD] of rows r [BN]: one load of a row's NG groups (contiguous),
    broadcast over each group's G / 2 channel pairs. One or two groups per row (head_dim 64 or
    128 at G = 64) select in registers; more go through a reshape (a shared-memory shuffle)."""
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
def _fp16_halves(c):
    """The low and high 16-bit halves of int32 words c as FP32 values of fp16 bit patterns, [..., 2]."""
    return tl.join(c.to(tl.uint16), (c >> 16).to(tl.uint16)).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _word_pairs(D: tl.constexpr):
    """Pair index 4i + 2x + y at [i, x, y] of a [D/8, 2, 2] tensor (pair p: channels 2p, 2p + 1):
    the order in which the linear decode holds a row, one 32-bit code word (four pairs) per i,
    so that the codes and every per-channel vector line up without a layout conversion."""
    return (tl.arange(0, D // 8) * 4)[:, None, None] + (tl.arange(0, 2) * 2)[None, :, None] + tl.arange(0, 2)[None, None, :]


@triton.jit
def _code_units(w):
    """The INT4 codes of int32 code words w [BN, D/8] as exact FP32 code * 2^-24, [BN, D/8, 2, 2,
    2]: channel 8i + 4x + 2y + z at [:, i, x, y, z] (nibble k of word i is channel 8i + k).
    Masked to one nibble per 16-bit half, a word is two fp16 subnormals code * 2^-24: a shift
    and an AND per two codes and an fp16 -> fp32 conversion per code, where a byte extract, a
    nibble shift or mask and an int -> float conversion cost an instruction each. Callers fold
    2^24 into a per-tile factor."""
    m = 0x000F000F
    return tl.join(tl.join(_fp16_halves(w & m), _fp16_halves((w >> 8) & m)),
                   tl.join(_fp16_halves((w >> 4) & m), _fp16_halves((w >> 12) & m)))


@triton.jit
def _code_values(w):
    """The INT4 codes of int32 code words w [BN, D/8] as exact fp16 integers, [BN, D/8, 2, 2, 2] in
    _code_units' order: a nibble pair masked into the mantissas of an fp16 pair 1024 (0x6400: the
    pair reads 1024 + code, exact), one LOP3, then 1024 subtracted, one packed HADD2 per pair."""
    m = 0x000F000F
    e = 0x64006400
    return tl.join(tl.join(_fp16_pairs((w & m) | e), _fp16_pairs(((w >> 8) & m) | e)),
                   tl.join(_fp16_pairs(((w >> 4) & m) | e), _fp16_pairs(((w >> 12) & m) | e))) - 1024.0


@triton.jit
def _channel_params_fp16(ptr, pw, D: tl.constexpr):
    """Per-channel parameters [1, D/8, 2, 2, 2] (in _code_units' order) of the fp16 table ptr from
    pair word pw on, as stored: D/2 contiguous 32-bit words (128-bit loads), split as _word_pairs.
    Fewer elements than a program's threads, they are no layout anchor: they take the code tile's
    layout instead of converting it every tile."""
    w = tl.load(ptr.to(tl.pointer_type(tl.int32), bitcast=True) + pw + tl.arange(0, D // 2)[None, :])
    return _fp16_pairs(tl.reshape(w, [1, D // 8, 2, 2]))


@triton.jit
def _channel_params(ptr, pw, D: tl.constexpr):
    """_channel_params_fp16 in FP32."""
    return _channel_params_fp16(ptr, pw, D).to(tl.float32)


@triton.jit
def _row_sums(x):
    """Sums over the channels of x [BN, D/8, 2, 2, 2]: [BN]."""
    return tl.sum(tl.sum(tl.sum(tl.sum(x, 4), 3), 2), 1)


@triton.jit
def _word_groups(ptr, r, D: tl.constexpr, G: tl.constexpr, rmask=None):
    """FP32 V parameters [BN, D/8] of rows r [BN] (0 where rmask is False), one per code word:
    its group's. One load of a row's D/G groups (fewer elements than a program's threads: no
    layout anchor), broadcast over the words of each group."""
    NG: tl.constexpr = D // G
    if NG % 2 == 0:
        # a row's groups as 32-bit words (fp16 pairs): loads of 4 bytes per thread, which the
        # software pipeliner turns into cp.async like the codes; 2-byte loads it leaves
        # synchronous, a full memory latency in every key tile
        NW2: tl.constexpr = NG // 2
        wp = r[:, None] * NW2 + tl.arange(0, NW2)[None, :]
        words = ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        if rmask is None:
            w = tl.load(words + wp)
        else:
            w = tl.load(words + wp, mask=rmask[:, None], other=0)
        v = tl.reshape(_fp16_halves(w), [r.shape[0], NG])[:, :, None]
    else:
        vp = r[:, None, None] * NG + tl.arange(0, NG)[None, :, None]
        if rmask is None:
            v = tl.load(ptr + vp).to(tl.float32)
        else:
            v = tl.load(ptr + vp, mask=rmask[:, None, None], other=0.0).to(tl.float32)
    return tl.reshape(tl.broadcast_to(v, [r.shape[0], NG, G // 8]), [r.shape[0], D // 8])


@triton.jit
def _linear_scores(kb_codes, kb_min, kb_scale, kr_codes, k_res_min, k_res_scale, rows, res_layout, p, blk, q24,
                   b, h, B, H, S, NB, D: tl.constexpr, DEPTH: tl.constexpr, HALF: tl.constexpr = False):
    """q . k [BN] of positions p (in K block blk) of the flushed bulk of row (b, h) without
    reconstructing k; pointers as _bulk_k's, q24: q * 2^24 in _code_units' order. With codes c
    in units of 2^-24 and the tile's K parameters its block's,
        q . k = q24 . (min_0 / 2^24 + sum_s scale_s c_s) + sum_{present s >= 1} q . min_s:
    one FMA per element and stream into x (the base is present everywhere: its minimum is the
    addend of its FMA), one reduction over channels per tile, and per residual a bias q . min_s
    once per tile, dropped by absent rows (whose codes load as 0). HALF (FAST_DECODE["half"]):
    k = min_0 + sum_s scale_s c_s in fp16 instead (_code_values, one packed FMA per channel pair
    and stream with the parameters as stored, rounded to fp16 per stream: 3 bits finer than a
    bf16 K), then q . k in FP32; the residual minima stay the per-tile bias."""
    W: tl.constexpr = D // 8
    words = tl.arange(0, W)[None, :]
    pw = blk * (D // 2)  # the block's parameters
    kb_words = kb_codes.to(tl.pointer_type(tl.int32), bitcast=True)
    kr_words = kr_codes.to(tl.pointer_type(tl.int32), bitcast=True)
    if HALF:
        qn = q24 * (1.0 / 16777216.0)
        k = tl.fma(_code_values(tl.load(kb_words + p[:, None] * W + words)), _channel_params_fp16(kb_scale, pw, D),
                   _channel_params_fp16(kb_min, pw, D))
        hbias = tl.zeros(p.shape, tl.float32)
        for j in tl.static_range(1, DEPTH + 1):
            has, g = _bulk_residual_rows(rows, res_layout, j, b, B, S, p)
            c = _code_values(tl.load(kr_words + g[:, None] * W + words, mask=has[:, None], other=0))
            pk = (((j - 1) * B + b) * H + h) * NB * D
            k = tl.fma(c, _channel_params_fp16(k_res_scale + pk, pw, D), k)
            hbias += tl.where(has, _row_sums(qn * _channel_params(k_res_min + pk, pw, D)), 0.0)
        return _row_sums(k.to(tl.float32) * qn) + hbias
    x = (_code_units(tl.load(kb_words + p[:, None] * W + words)) * _channel_params(kb_scale, pw, D)
         + _channel_params(kb_min, pw, D) * (1.0 / 16777216.0))
    bias = tl.zeros(p.shape, tl.float32)
    for j in tl.static_range(1, DEPTH + 1):
        has, g = _bulk_residual_rows(rows, res_layout, j, b, B, S, p)
        c = _code_units(tl.load(kr_words + g[:, None] * W + words, mask=has[:, None], other=0))
        pk = (((j - 1) * B + b) * H + h) * NB * D
        x += c * _channel_params(k_res_scale + pk, pw, D)
        bias += tl.where(has, _row_sums(q24 * _channel_params(k_res_min + pk, pw, D)), 0.0)
    return _row_sums(x * q24) + bias * (1.0 / 16777216.0)


@triton.jit
def _linear_pv(y, yb, vb_codes, vb_min, vb_scale, vr_codes, vr_min, vr_scale, rows, res_layout, p, pr, b, B, S,
               D: tl.constexpr, G: tl.constexpr, DEPTH: tl.constexpr):
    """y [BN, D/8, 2, 2, 2] (_code_units' order) and yb [BN, D/8] plus the values of positions p
    of the flushed bulk weighted by pr [BN, 1], without reconstructing v; pointers as _bulk_v's.
    Per stream, pr (min_g + scale_g code) = pr min_g + w_g code with w = pr * scale per token and
    group: y takes one FMA per element and stream (a code word lies in one group: w is loaded per
    word and broadcast over its channels, no select), yb the minima per word. Per-row partials:
    the caller rescales them per tile and sums the rows (y + yb) once per split. An absent
    residual loads codes and minima 0 (its scale then multiplies nothing)."""
    W: tl.constexpr = D // 8
    words = tl.arange(0, W)[None, :]
    pr24 = pr * 16777216.0  # the codes come as code * 2^-24
    mn = _word_groups(vb_min, p, D, G)
    w = pr24 * _word_groups(vb_scale, p, D, G)
    vb_words = vb_codes.to(tl.pointer_type(tl.int32), bitcast=True)
    y += _code_units(tl.load(vb_words + p[:, None] * W + words)) * w[:, :, None, None, None]
    vr_words = vr_codes.to(tl.pointer_type(tl.int32), bitcast=True)
    for j in tl.static_range(1, DEPTH + 1):
        has, g = _bulk_residual_rows(rows, res_layout, j, b, B, S, p)
        mn += _word_groups(vr_min, g, D, G, has)
        w = pr24 * _word_groups(vr_scale, g, D, G)
        c = _code_units(tl.load(vr_words + g[:, None] * W + words, mask=has[:, None], other=0))
        y += c * w[:, :, None, None, None]
    return y, yb + pr * mn


@triton.jit
def _fp16_pairs(c):
    """The low and high 16-bit halves of int32 words c as fp16 (bit patterns), [..., 2]."""
    return tl.join(c.to(tl.uint16), (c >> 16).to(tl.uint16)).to(tl.float16, bitcast=True)


@triton.jit(do_not_specialize=["depth_arg"])
def _attn_kernel(
    q, k_in, v_in, q_positions, in_positions, p0,
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
    k_tail, v_tail, flushed, rows, depth_count, res_layout,
    out, part_ml, part_acc, bounds,
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
    in-flight keys). FUSED (prefill): bounds [B, query tiles, 2] int32 from inflight_bounds: the
    in-flight keys [0, bounds[0]) are visible to every valid row of the tile (no mask), the rest
    up to bounds[1] are masked by position, none after it is visible; query tiles run heaviest
    first (the last tile has the latest positions when they ascend)."""
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
    else:
        ntiles = (P0 + BN - 1) // BN
        tile = (z * ntiles) // NSTORED
        t_hi = ((z + 1) * ntiles) // NSTORED
        if z >= NSTORED:
            t_hi = tile
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
        # hi_end) masked by position; the stored tiles' even/odd halves are joined first
        c = tl.arange(0, 2 * NP)
        cmask = c < D
        acc_w = tl.reshape(tl.join(acc_e, acc_o), [BM, 2 * NP])
        m_i = m_i * _LOG2E  # -inf stays -inf
        qk_scale = scale * _LOG2E
        q_w = tl.load(q + (b * sq_b + hq * sq_h + t * sq_t)[:, None] + c[None, :] * sq_d,
                      mask=qvalid[:, None] & cmask[None, :], other=0.0)
        if DOT_T == 0:
            q_w = q_w.to(tl.float32)
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
        return
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
# launchers
# ------------------------------------------------------------------------------------------------


def _geometry(tensors):
    k_base, k_res, k_tail = tensors[0], tensors[6], tensors[12]
    B, H, S, HD = k_base.shape
    R = k_tail.shape[1]
    G = k_tail.shape[3] // 2
    D = 2 * HD
    NB = S // G
    CAPT = k_res.shape[2]
    return B, H, S, D, G, R, NB, CAPT


def inflight_bounds(q_positions, inflight_positions, qpk: int, block_m: int, block_n: int):
    """[B, query tiles, 2] int32 for prefill's whole-row loop over the in-flight keys (index order):
    per tile of block_m query rows (row m is query token m // qpk), a_end: the in-flight keys
    before it are valid and at or before every valid row's position (attended without a mask),
    rounded down to block_n; hi_end: no key from it on is at or before any row's position (the
    loop stops there). Correct for any order of positions (padding -1 anywhere); with ascending
    positions (a prompt) the masked band is the causal diagonal. On device, no host sync."""
    B, T = q_positions.shape
    big = torch.iinfo(torch.int64).max
    kk = torch.where(inflight_positions >= 0, inflight_positions, big)
    sufmin = kk.flip(1).cummin(1).values.flip(1).contiguous()  # non-decreasing: min position from key i on
    premax = kk.cummax(1).values.contiguous()  # non-decreasing: big after the first padding key
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

# Flush programs per (batch, head), each a contiguous range of the row's groups: 16 is the best of
# bench_packed_prefill --sweep on the H200 (loop-2 write of a 4K / 8K prompt: 0.76 / 1.43 ms; 1
# chunk 3.74 / 7.19, 64 chunks 1.11 / 1.58).
PACKED_WRITE = {"chunks": 16}

# Prefill (one fused pass per query tile, the in-flight keys as whole rows in flash attention's
# loop): query rows per program, in-flight key tile, warps, stages. bm128 bni64 w8 s3 ties bm64
# bni64 w4 s3 at 32K (11.48 / 11.49 ms) without spilling (scripts/kernel_report.py: 247
# registers); two stages lose at 32K (15.18 ms).
PACKED_PREFILL = {"block_m": 128, "block_n_inflight": 64, "num_warps": 8, "num_stages": 3}

# packed_read: tiles below the flushed boundaries take _read_bulk_kernel's path (no per-token
# resolution), the others _read_tile on generic_split sub-tiles in the same launch (8 positions:
# 158 registers at depth 3; 4x32K window read 24 us against 102 us at 32 positions). block_p:
# positions per program (None: 32 at D <= 128, 16 above). attend_block_p: keys per program of the
# read-and-attend correction by depth (the last entry for deeper ones; H200, 32K, per site: 32 at
# depth 2 58.8 / 149.0 us at B1 / B4 against 71.5 / 177.1 at 16; 16 at depth 3). window_block_p:
# positions per program of the code-domain reference's window read (all per-token tiles), one
# sub-tile each (8.7 / 21.3 us against 15.6 / 25.5 at B1 / B4 x 32K).
PACKED_READ = {"num_warps": 4, "block_p": None, "generic_split": 4, "attend_block_p": (32, 32, 32, 16),
               "window_block_p": 8}


def launch_packed_kv_write(tensors, k, v, positions, depth: int, *, wrap=no_wrap, chunks: int | None = None) -> None:
    """Write depth ``depth`` of tokens k/v [B, H, T, D] at positions [B, T] (see packed_ops).
    ``chunks``: flush programs per (batch, head) (default PACKED_WRITE["chunks"])."""
    (k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
     k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
     k_tail, v_tail, flushed, row_count, rows, depth_count, res_layout, overflow) = tensors
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
        skey = torch.cummax(positions, dim=1).values.contiguous()
        first = positions[:, :1]
        steps = torch.arange(Tn, device=dev, dtype=positions.dtype)
        contig = ((positions == first + steps).all(1) & (first >= 0).all(1)).to(torch.int32)
    else:
        skey = torch.zeros(Bc, 1, dtype=torch.int64, device=dev)
        contig = torch.zeros(Bc, dtype=torch.int32, device=dev)
    # binary-search steps over the call's positions; a symbolic token count (a dynamic prefill
    # traced by Inductor) must not be specialized: bound it by the static context instead
    nsearch = max(1, (Tn if isinstance(Tn, int) else S).bit_length())
    chunks = max(1, int(PACKED_WRITE["chunks"] if chunks is None else chunks))
    wrap(_write_flush_kernel)[(Bc, H, chunks)](
        k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
        k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
        k_tail, v_tail, flushed, row_count, rows, depth_count, res_layout, overflow,
        k, v, positions, skey, contig, scratch,
        *k.stride(), *v.stride(), *positions.stride(),
        Tn, depth + DEPTH_BIAS, B, H, S, NB, CAPT, R,
        D=D, G=G, NSEARCH=nsearch, BT=128, NCH=chunks, RP=next_pow2(R), ONE_TOKEN=one_token, num_warps=8,
    )
    bt = 32
    wrap(_write_tail_kernel)[(Bc, H, max(1, triton.cdiv(Tn, bt)))](
        k_tail, v_tail, flushed, row_count, depth_count,
        k, v, positions, scratch,
        *k.stride(), *v.stride(), *positions.stride(),
        Tn, depth + DEPTH_BIAS, H, S, R,
        D=D, G=G, DP=next_pow2(D), BT=bt, num_warps=4,
    )


def launch_packed_read(tensors, positions, depth: int, out_k, out_v, *, inflight=None, wrap=no_wrap,
                       bulk: bool | None = None, block_p: int | None = None, split: int | None = None) -> None:
    """Logical K/V at ``depth`` of positions [B, P] (every head) or [B, H, P] (per head) into
    out_k/out_v [B, H, P, D] (contiguous). ``inflight``: (positions [B, Ti], k [B, H, Ti, D], v)
    of this step's tokens: a position equal to one of them reads its row (see packed_ops).
    A power-of-two head_dim with an even group reads in one launch of _read_bulk_kernel (tiles below
    the flushed boundaries without per-token resolution, the others on ``split`` sub-tiles, default
    PACKED_READ["generic_split"]); other shapes take _read_kernel. ``bulk`` False: _read_kernel for
    any shape (tests compare the two). ``block_p``: positions per program (tests)."""
    (k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
     k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
     k_tail, v_tail, flushed, row_count, rows, depth_count, res_layout, overflow) = tensors
    B, H, S, D, G, R, NB, CAPT = _geometry(tensors)
    Bc, P = positions.shape[0], positions.shape[-1]
    sp_b, sp_h, sp_t = (positions.stride(0), 0, positions.stride(1)) if positions.dim() == 2 else positions.stride()
    if P == 0 or Bc == 0:
        return
    np_ = next_pow2(D // 2)
    interp = _cpu_semantics(positions)
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
            k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
            k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
            flushed, rows, res_layout, positions, out_k, out_v, lim,
            sp_b, sp_h, sp_t, P, B, H, S, NB, CAPT, R,
            k_tail, v_tail, depth_count, ip, k_in, v_in, *ip.stride(), *k_in.stride(), *v_in.stride(), ip.shape[1],
            D=D, G=G, BP=bp, CD=cd, RP=next_pow2(R), DEPTH=depth, NP=np_, SPLIT=bp // bpg,
            num_warps=PACKED_READ["num_warps"],
        )
        return
    wrap(_read_kernel)[(Bc, H, triton.cdiv(P, bpg))](
        k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
        k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
        k_tail, v_tail, flushed, rows, depth_count, res_layout,
        positions, out_k, out_v, lim, ip, k_in, v_in,
        sp_b, sp_h, sp_t, *ip.stride(), *k_in.stride(), *v_in.stride(),
        P, ip.shape[1], depth + DEPTH_BIAS, B, H, S, NB, CAPT, R,
        D=D, G=G, NP=np_, BP=bpg, CD=cd, RP=next_pow2(R), num_warps=4,
    )


def read_attend_fits(q, tensors) -> bool:
    """Whether launch_packed_read_attend takes a correction: one query row per kv head and a
    power-of-two head_dim with an even group (the bulk read's layout)."""
    B, H, S, D, G, R, NB, CAPT = _geometry(tensors)
    return q.shape[1] == H and q.shape[2] == 1 and q.shape[3] == D and not (D & (D - 1) or G % 2)


def launch_packed_read_attend(tensors, q, keys, count, depth: int, scale: float, *, inflight, wrap=no_wrap,
                              block_p: int | None = None) -> tuple:
    """Sparse decode's correction partials at ``depth`` for q [B, H, 1, D] (one query row per kv
    head) over the selected keys [B, H, 1, P] (global positions, the first count [B, H, 1] valid)
    of the packed history, the step's in-flight tokens ``inflight`` = (positions [B, Ti], k, v)
    included: _read_attend_kernel, one program per tile of ``block_p`` keys (default
    PACKED_READ["attend_block_p"] at this depth). Returns (part_m, part_l [B * H, NT], part_acc [B * H, NT, D],
    NT) in _correction_combine_kernel's layout."""
    (k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
     k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
     k_tail, v_tail, flushed, row_count, rows, depth_count, res_layout, overflow) = tensors
    B, H, S, D, G, R, NB, CAPT = _geometry(tensors)
    if not read_attend_fits(q, tensors):
        raise ValueError(f"the read-and-attend correction needs q [B, {H}, 1, {D}] (one query row per kv head) and a "
                         f"power-of-two head_dim with an even group; got q {tuple(q.shape)}, head_dim {D}, group {G}")
    Bc, P = q.shape[0], keys.shape[-1]
    np_ = next_pow2(D // 2)
    by_depth = PACKED_READ["attend_block_p"]
    bp = block_p or by_depth[min(depth, len(by_depth) - 1)]
    if bp < 1 or bp & (bp - 1):
        raise ValueError(f"the read-and-attend tile must be a power of two, got {bp} keys")
    if _cpu_semantics(q) and not block_p:
        bp = 128  # fewer, larger programs: the interpreter's cost is per operation, not per element
    split = max(1, min(bp, int(PACKED_READ["generic_split"])))
    nt = max(1, triton.cdiv(P, bp))
    dev = q.device
    part_m = torch.empty(Bc * H, nt, dtype=torch.float32, device=dev)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(Bc * H, nt, D, dtype=torch.float32, device=dev)
    ip, k_in, v_in = inflight  # the kernel takes the first in-flight position of its row itself
    wrap(_read_attend_kernel)[(Bc, H, nt)](
        k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
        k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
        k_tail, v_tail, flushed, rows, depth_count, res_layout,
        q, keys, count, ip, k_in, v_in, part_m, part_l, part_acc,
        q.stride(0), q.stride(1), q.stride(3), keys.stride(0), keys.stride(1), keys.stride(3),
        count.stride(0), count.stride(1),
        *ip.stride(), *k_in.stride(), *v_in.stride(),
        float(scale), P, ip.shape[1], nt, B, H, S, NB, CAPT, R,
        D=D, G=G, NP=np_, BP=bp, CD=_CDTYPE_CODE[k_tail.dtype], RP=next_pow2(R), DEPTH=depth, SPLIT=split,
        num_warps=PACKED_READ["num_warps"],
    )
    return part_m, part_l, part_acc, nt


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
    (k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
     k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
     k_tail, v_tail, flushed, row_count, rows, depth_count, res_layout, overflow) = tensors
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
    interp = _cpu_semantics(q)
    cd = _CDTYPE_CODE[q.dtype]
    dot_t = 0 if (interp or q.dtype == torch.float32) else cd  # the interpreter's bf16 dot is wrong: FP32 there
    p0 = stored_end(q_positions, inflight_positions, S)
    unknown = sorted(set(tuning or {}) - set(FAST_DECODE) - set(PACKED_PREFILL))
    if unknown:
        raise ValueError(f"unknown launch parameters {unknown}; known: {sorted({**FAST_DECODE, **PACKED_PREFILL})}")
    tune = {**FAST_DECODE, **(tuning or {})}
    tune["block_n"] = min(tune["block_n"], G)
    fast_fits = mode == "decode" and mrows == 1 and G % tune["block_n"] == 0 and not (D & (D - 1) or G % 2)
    if fast is None:
        fast = fast_fits  # other shapes: the generic decode kernel
    elif fast and not fast_fits:
        raise ValueError(f"the fast decode path needs decode mode, one query row per kv head, a power-of-two head_dim "
                         f"and an even group that block_n divides; got mode {mode}, {mrows} rows, head_dim {D}, "
                         f"group {G}, block_n {tune['block_n']}")
    bnf = tune["block_n"]
    stages = tune["num_stages"]
    bounds, stages_opt = p0, {}  # bounds: read by prefill's whole-row path only
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
        bounds = inflight_bounds(q_positions, inflight_positions, qpk, bm, bni)
        stages_opt = {} if interp else {"num_stages": int(ptune["num_stages"])}
    else:
        raise ValueError(f"mode must be 'decode' or 'prefill', got {mode!r}")
    if fast:
        wrap(_decode_bulk_kernel)[(Bc * H, ns)](
            q, q_positions, p0, flushed,
            k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
            k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
            rows, res_layout, part_ml, part_acc,
            q.stride(0), q.stride(1), q.stride(3), q_positions.stride(0), float(scale),
            B, H, S, NB, CAPT, R,
            D=D, G=G, BN=bnf, NSTORED=ns, RP=next_pow2(R), STAGES=stages, DEPTH=depth, NTAIL=ntail,
            HALF=q.dtype != torch.float32, num_warps=tune["num_warps"],
        )
        grid = (Bc * H, ntail, m_tiles)  # _attn_kernel takes splits NSTORED on only: the tail and in-flight keys
    wrap(_attn_kernel)[grid](
        q, k_inflight, v_inflight, q_positions, inflight_positions, p0,
        k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
        k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
        k_tail, v_tail, flushed, rows, depth_count, res_layout,
        out, part_ml, part_acc, bounds,
        *q.stride(), *k_inflight.stride(), *v_inflight.stride(),
        *q_positions.stride(), *inflight_positions.stride(),
        T, Ti, Hq, depth + DEPTH_BIAS, float(scale), B, H, S, NB, CAPT, R,
        D=D, G=G, NP=np_, QPK=qpk, BM=bm, BN=bn, NSTORED=ns, FUSED=fused, NTAIL=ntail,
        USE_DOT=bm >= 16, DOT_T=dot_t, CD=cd, FAST=fast, RP=next_pow2(R), BNF=bnf, BNI=bni,
        num_warps=warps, **stages_opt,
    )
    if not fused:
        wrap(_combine_kernel)[(Bc * Hq * T,)](
            part_ml, part_acc, out, NSPL=nspl, NSP2=next_pow2(nspl), D=D, DP=next_pow2(D), CD=cd, num_warps=4,
        )
