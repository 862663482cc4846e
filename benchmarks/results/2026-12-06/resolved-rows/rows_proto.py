"""Prototype: the correction's bulk tiles with each selected key's residual rows resolved beforehand
(selrows [B, H, P, 3] int32: res_layout[j] + rows[j-1][b, p], -1 where absent), so the codes' and V
parameters' addresses need the keys' positions and these rows, both loaded at once, instead of
position -> rows -> codes. The resolve runs outside the timed region: the upper bound of the gain
of resolving rows once per step at selection time."""
import torch
import triton
import triton.language as tl
from flashloop_compile.lowering.kernels import packed_read as PR
from flashloop_compile.lowering.kernels.packed_codec import (
    _CDTYPE_CODE, _flushed_min, _geometry, _round_to, _row_bases, _pair_words, _row_group_params, residual_unroll)
from flashloop_compile.lowering.kernels.packed_read import _attend_tile, _resolve_tile
from flashloop_compile.lowering.packed_layout import PackedTensors


@triton.jit
def _proto_kernel(
    k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale,
    k_res, k_res_min, k_res_scale, v_res, v_res_min, v_res_scale,
    k_tail, v_tail, flushed, rows, depth_count, res_layout,
    q, keys, count, in_positions, k_in, v_in, part_m, part_l, part_acc, selrows,
    sq_b, sq_h, sq_d, skey_b, skey_h, skey_t, sc_b, sc_h,
    sip_b, sip_t, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    scale, P, Ti, NT, B, H, S, NB, CAPT, R,
    D: tl.constexpr, G: tl.constexpr, NP: tl.constexpr, BP: tl.constexpr, CD: tl.constexpr,
    RP: tl.constexpr, DEPTH: tl.constexpr, SPLIT: tl.constexpr,
):
    HD: tl.constexpr = D // 2
    NG: tl.constexpr = D // G
    scale = tl.cast(scale, tl.float32)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    z = tl.program_id(2)
    z = NT - 1 - z
    out = (b * H + h) * NT + z
    i = tl.arange(0, NP)
    cnt = tl.minimum(tl.load(count + b * sc_b + h * sc_h), P)
    if z * BP >= cnt:
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
    lim = tl.zeros([], tl.int64) + S
    u = 0
    while u < Ti:
        ipu = tl.load(in_positions + b * sip_b + u * sip_t)
        lim = tl.where(ipu >= 0, tl.minimum(lim, ipu), lim)
        u += 1
    p_lo = tl.min(tl.where(valid, p, 2147483647), 0)
    p_hi = tl.max(tl.where(valid, p, -1), 0)
    if (p_lo >= 0) & (p_hi < fl_min) & (p_hi < lim):
        pc = tl.where(valid, p, 0).to(tl.int32)
        bh = b * H + h
        kw = ((pc // G) * HD)[:, None] + tl.arange(0, HD)[None, :]
        kb_codes, kb_min, kb_scale, vb_codes, vb_min, vb_scale, kr_codes, vr_codes, vr_min, vr_scale = _row_bases(
            k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, v_res, v_res_min, v_res_scale,
            bh, S, NB, CAPT, D, G)
        ii = tl.arange(0, HD)
        sr = selrows + (bh * P + t) * 3
        c = tl.load(kb_codes + pc[:, None] * HD + ii[None, :]).to(tl.int32)
        mn_e, mn_o = _pair_words(kb_min, kw, HD)
        sc_e, sc_o = _pair_words(kb_scale, kw, HD)
        ke = mn_e + sc_e * (c & 15).to(tl.float32)
        ko = mn_o + sc_o * (c >> 4).to(tl.float32)
        cv = tl.load(vb_codes + pc[:, None] * HD + ii[None, :]).to(tl.int32)
        vmn, vsc = _row_group_params(vb_min, vb_scale, pc, pc >= 0, BP, NG, G, HD)
        ve = vmn + vsc * (cv & 15).to(tl.float32)
        vo = vmn + vsc * (cv >> 4).to(tl.float32)
        for j in tl.static_range(1, DEPTH + 1):
            g = tl.load(sr + (j - 1), mask=valid, other=-1)
            has = g >= 0
            g = tl.where(has, g, 0)
            c = tl.load(kr_codes + g[:, None] * HD + ii[None, :], mask=has[:, None], other=0).to(tl.int32)
            pk = (((j - 1) * B + b) * H + h) * NB * D
            mn_e, mn_o = _pair_words(k_res_min + pk, kw, HD)
            sc_e, sc_o = _pair_words(k_res_scale + pk, kw, HD)
            ke = tl.where(has[:, None], ke + (mn_e + sc_e * (c & 15).to(tl.float32)), ke)
            ko = tl.where(has[:, None], ko + (mn_o + sc_o * (c >> 4).to(tl.float32)), ko)
            cv = tl.load(vr_codes + g[:, None] * HD + ii[None, :], mask=has[:, None], other=0).to(tl.int32)
            vmn, vsc = _row_group_params(vr_min, vr_scale, g, has, BP, NG, G, HD)
            ve = tl.where(has[:, None], ve + (vmn + vsc * (cv & 15).to(tl.float32)), ve)
            vo = tl.where(has[:, None], vo + (vmn + vsc * (cv >> 4).to(tl.float32)), vo)
        m_i, l_i, acc_e, acc_o = _attend_tile(qe, qo, _round_to(ke, CD), _round_to(ko, CD), _round_to(ve, CD),
                                              _round_to(vo, CD), valid, scale)
    else:
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


def resolve_rows(tensors, keys, depth):
    """selrows [B, H, P, 3]: each selected key's global residual row per depth 1..3 (-1: none)."""
    c = PackedTensors(*tensors)
    B, H, S, D, G, R, NB, CAPT = _geometry(tensors)
    Bc, _, _, P = keys.shape
    k = keys[:, :, 0, :].long()
    out = torch.full((Bc, H, P, 3), -1, dtype=torch.int32, device=keys.device)
    ok = (k >= 0) & (k < S)
    kc = torch.where(ok, k, 0)
    for j in range(1, min(depth, 3) + 1):
        rj = torch.gather(c.rows[j - 1][:Bc, None, :].expand(Bc, H, S), 2, kc)
        g = torch.where(ok & (rj >= 0), c.res_layout[0, j] + rj, -1)
        out[..., j - 1] = g.int()
    return out


def launch(tensors, q, keys, count, depth, scale, *, inflight, selrows, maxnreg=0, wrap=None):
    c = PackedTensors(*tensors)
    B, H, S, D, G, R, NB, CAPT = _geometry(tensors)
    Bc, P = q.shape[0], keys.shape[-1]
    np_ = 64 if D == 128 else triton.next_power_of_2(D // 2)
    bp = PR.PACKED_READ["attend_block_p"][min(depth, 3)]
    split = max(1, min(bp, int(PR.PACKED_READ["generic_split"])))
    nt = max(1, triton.cdiv(P, bp))
    part_m = torch.empty(Bc * H, nt, dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty(Bc * H, nt, D, dtype=torch.float32, device=q.device)
    ip, k_in, v_in = inflight
    (wrap(_proto_kernel) if wrap else _proto_kernel)[(Bc, H, nt)](
        c.k_base, c.k_base_min, c.k_base_scale, c.v_base, c.v_base_min, c.v_base_scale,
        c.k_res, c.k_res_min, c.k_res_scale, c.v_res, c.v_res_min, c.v_res_scale,
        c.k_tail, c.v_tail, c.flushed, c.rows, c.depth_count, c.res_layout,
        q, keys, count, ip, k_in, v_in, part_m, part_l, part_acc, selrows,
        q.stride(0), q.stride(1), q.stride(3), keys.stride(0), keys.stride(1), keys.stride(3),
        count.stride(0), count.stride(1),
        *ip.stride(), *k_in.stride(), *v_in.stride(),
        float(scale), P, ip.shape[1], nt, B, H, S, NB, CAPT, R,
        D=D, G=G, NP=np_, BP=bp, CD=_CDTYPE_CODE[c.k_tail.dtype], RP=residual_unroll(depth), DEPTH=depth, SPLIT=split,
        num_warps=PR.PACKED_READ["num_warps"], **({"maxnreg": maxnreg} if maxnreg else {}),
    )
    return part_m, part_l, part_acc, nt
