"""Triton kernels of ``flashloop::correction_attention`` (SPEC.md section 2).

``_correction_kernel`` grid (R, SPLIT_K) gathers the selected K/V rows of each query row, runs an
online softmax and, with one split, writes ``O_ref - C_ref + m * local`` directly; with several
splits ``_correction_combine_kernel`` merges the partials. :func:`correction_attention_triton`
returns what ``ops._correction_attention_aten`` returns; host-sync free, as the reference's
launchers (reference_attention.py).

``_reuse_correction_kernel`` grid (R, SPLIT_K) is the V-only correction of
``reuse_selected_probabilities``: sum_j probs[j] * V[keys[j]] per query row (loop 2's
probabilities, no K, no softmax), written as ``O_ref - C_ref + sum`` with one split, else summed
by ``_reuse_combine_kernel``. :func:`reuse_correction_triton` returns what
``ops._reuse_correction_attention_aten`` returns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashloop_compile.lowering.kernels import sparse_config as sc
from flashloop_compile.lowering.kernels.common import next_pow2, sm_count
from flashloop_compile.lowering.kernels.sparse_config import KernelConfig, Launcher, cdiv, split_range

__all__ = ["correction_attention_triton", "correction_combine_triton", "reuse_correction_triton", "reuse_combine_triton"]


@triton.jit
def _correction_kernel(
    q_ptr, k_ptr, v_ptr, keys_ptr, count_ptr, mass_ptr, oref_ptr, cref_ptr, out_ptr,
    pm_ptr, pl_ptr, pacc_ptr,
    HQ, T, G, KMAX, CHUNK, SPLIT, scale,
    sqb, sqh, sqt, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    sob, soh, sot, sod,
    D: tl.constexpr, BLOCK_K: tl.constexpr, FINAL: tl.constexpr, STAGES: tl.constexpr = 1,
):
    """STAGES (KernelConfig.num_stages_corr): software-pipelined key tiles (cp.async gathers, the
    index load a stage ahead of the K/V rows it addresses); 1: a plain loop."""
    row = tl.program_id(0)
    pid_s = tl.program_id(1)
    scale_f = tl.cast(scale, tl.float32)  # Inductor passes Python floats as fp64
    t = row % T
    h = (row // T) % HQ
    b = (row // (T * HQ)).to(tl.int64)
    hk = (h // G).to(tl.int64)
    row64 = row.to(tl.int64)
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + b * sqb + h * sqh + t * sqt + dd * sqd).to(tl.float32)
    cnt = tl.minimum(tl.load(count_ptr + row64), KMAX)
    start = pid_s * CHUNK
    end = tl.minimum(start + CHUNK, cnt)
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.zeros([], tl.float32)
    acc = tl.zeros([D], tl.float32)
    k_base = k_ptr + b * skb + hk * skh
    v_base = v_ptr + b * svb + hk * svh
    for j0 in tl.range(start, end, BLOCK_K, num_stages=STAGES):
        j = j0 + tl.arange(0, BLOCK_K)
        j_ok = j < end
        idx = tl.maximum(tl.load(keys_ptr + row64 * KMAX + j, mask=j_ok, other=0), 0).to(tl.int64)
        kt = tl.load(k_base + idx[:, None] * sks + dd[None, :] * skd, mask=j_ok[:, None], other=0.0).to(tl.float32)
        s = tl.sum(kt * q[None, :], 1) * scale_f
        s = tl.where(j_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp(m_i - m_new)  # m_new is finite: the block holds a valid key
        p = tl.exp(s - m_new)
        vt = tl.load(v_base + idx[:, None] * svs + dd[None, :] * svd, mask=j_ok[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * vt, 0)
        l_i = l_i * alpha + tl.sum(p, 0)
        m_i = m_new
    if FINAL:
        local = tl.where(l_i > 0.0, acc / tl.maximum(l_i, 1e-30), 0.0)
        o = tl.load(oref_ptr + row64 * D + dd) - tl.load(cref_ptr + row64 * D + dd) + tl.load(mass_ptr + row64) * local
        tl.store(out_ptr + b * sob + h * soh + t * sot + dd * sod, o.to(out_ptr.dtype.element_ty))
    else:
        tl.store(pm_ptr + row64 * SPLIT + pid_s, m_i)
        tl.store(pl_ptr + row64 * SPLIT + pid_s, l_i)
        tl.store(pacc_ptr + (row64 * SPLIT + pid_s) * D + dd, acc)


@triton.jit
def _correction_combine_kernel(
    pm_ptr, pl_ptr, pacc_ptr, mass_ptr, oref_ptr, cref_ptr, out_ptr,
    HQ, T, SPLIT,
    sob, soh, sot, sod,
    D: tl.constexpr, SPLIT_P2: tl.constexpr,
):
    row = tl.program_id(0)
    t = row % T
    h = (row // T) % HQ
    b = (row // (T * HQ)).to(tl.int64)
    row64 = row.to(tl.int64)
    sp = tl.arange(0, SPLIT_P2)
    sp_ok = sp < SPLIT
    dd = tl.arange(0, D)
    pm = tl.load(pm_ptr + row64 * SPLIT + sp, mask=sp_ok, other=float("-inf"))
    pl = tl.load(pl_ptr + row64 * SPLIT + sp, mask=sp_ok, other=0.0)
    pacc = tl.load(pacc_ptr + (row64 * SPLIT + sp[:, None]) * D + dd[None, :], mask=sp_ok[:, None], other=0.0)
    m = tl.max(pm, 0)
    w = tl.exp(pm - tl.where(m > float("-inf"), m, 0.0))
    l = tl.sum(pl * w, 0)
    acc = tl.sum(pacc * w[:, None], 0)
    local = tl.where(l > 0.0, acc / tl.maximum(l, 1e-30), 0.0)
    o = tl.load(oref_ptr + row64 * D + dd) - tl.load(cref_ptr + row64 * D + dd) + tl.load(mass_ptr + row64) * local
    tl.store(out_ptr + b * sob + h * soh + t * sot + dd * sod, o.to(out_ptr.dtype.element_ty))


# ------------------------------------------------------------------------------------------------
# launchers
# ------------------------------------------------------------------------------------------------


def correction_combine_triton(part_m, part_l, part_acc, mass, o_ref, c_ref, out, *, wrap: bool = False,
                              num_warps: int = 4) -> None:
    """O_ref - C_ref + m * local into out [B, Hq, T, D] from a correction's softmax partials
    (part_m / part_l [rows, SPLIT], part_acc [rows, SPLIT, D] per row b * Hq * T + h * T + t):
    _correction_combine_kernel, one program per row."""
    b, hq, t, d = out.shape
    rows, split = part_m.shape
    Launcher(wrap)(_correction_combine_kernel, (rows,))(
        part_m, part_l, part_acc, mass.reshape(rows).contiguous(), o_ref.reshape(rows, d).contiguous(),
        c_ref.reshape(rows, d).contiguous(), out,
        hq, t, split,
        *out.stride(),
        D=d, SPLIT_P2=next_pow2(split),
        num_warps=num_warps,
    )


def correction_attention_triton(q, k, v, keys, count, mass, o_ref, c_ref, scale, *, wrap: bool = False, config: KernelConfig | None = None):
    """Triton body of ``flashloop::correction_attention``; same output as the ATen body."""
    launch = Launcher(wrap)
    sc.check_runnable(_correction_kernel, q.device)
    cfg = sc.config_for(q.device, config)
    dev = q.device
    b, hq, t, d = q.shape
    hkv = k.shape[1]
    kmax = keys.shape[-1]
    rows = b * hq * t
    keys_c = keys.reshape(rows, kmax).contiguous()
    count_c = count.reshape(rows).contiguous()
    mass_c = mass.reshape(rows).contiguous()
    oref_c = o_ref.reshape(rows, d).contiguous()
    cref_c = c_ref.reshape(rows, d).contiguous()
    out = torch.empty_like(q)
    # a gather per key tile: latency-bound, so many programs per SM. At least 32 splits per row
    # (H200, 32K, 10%: 97 -> 60 us at B4 and 32 -> 19 us at B1 against about 2 programs per SM;
    # benchmarks/RESULTS.md), fewer where the selection has fewer tiles (split_range)
    want = cfg.split_corr or max(32, cdiv(2 * sm_count(dev), rows))
    chunk, split = split_range(max(kmax, 1), cfg.block_k, want)
    final = split == 1
    if final:
        pm = pl = pacc = mass_c  # unused
    else:
        pm = torch.empty(rows, split, dtype=torch.float32, device=dev)
        pl = torch.empty(rows, split, dtype=torch.float32, device=dev)
        pacc = torch.empty(rows, split, d, dtype=torch.float32, device=dev)
    launch(_correction_kernel, (rows, split))(
        q, k, v, keys_c, count_c, mass_c, oref_c, cref_c, out,
        pm, pl, pacc,
        hq, t, hq // hkv, kmax, chunk, split, float(scale),
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        D=d, BLOCK_K=cfg.block_k, FINAL=final, STAGES=cfg.num_stages_corr,
        num_warps=cfg.num_warps_corr,
    )
    if not final:
        correction_combine_triton(pm, pl, pacc, mass_c, oref_c, cref_c, out, wrap=launch.wrap)
    return out


@triton.jit
def _reuse_correction_kernel(
    v_ptr, keys_ptr, count_ptr, probs_ptr, oref_ptr, cref_ptr, out_ptr, pacc_ptr,
    HQ, T, G, KMAX, CHUNK, SPLIT,
    svb, svh, svs, svd,
    sob, soh, sot, sod,
    D: tl.constexpr, BLOCK_K: tl.constexpr, FINAL: tl.constexpr,
):
    """Keys [pid_s * CHUNK, +CHUNK) of query row `row` (b * Hq * T + h * T + t): the sum of loop 2's
    probabilities times this loop's V rows; with one split (FINAL) O_ref - C_ref + that sum."""
    row = tl.program_id(0)
    pid_s = tl.program_id(1)
    t = row % T
    h = (row // T) % HQ
    b = (row // (T * HQ)).to(tl.int64)
    hk = (h // G).to(tl.int64)
    row64 = row.to(tl.int64)
    dd = tl.arange(0, D)
    cnt = tl.minimum(tl.load(count_ptr + row64), KMAX)
    start = pid_s * CHUNK
    end = tl.minimum(start + CHUNK, cnt)
    acc = tl.zeros([D], tl.float32)
    v_base = v_ptr + b * svb + hk * svh
    for j0 in range(start, end, BLOCK_K):
        j = j0 + tl.arange(0, BLOCK_K)
        j_ok = j < end
        idx = tl.maximum(tl.load(keys_ptr + row64 * KMAX + j, mask=j_ok, other=0), 0).to(tl.int64)
        p = tl.load(probs_ptr + row64 * KMAX + j, mask=j_ok, other=0.0)
        vt = tl.load(v_base + idx[:, None] * svs + dd[None, :] * svd, mask=j_ok[:, None], other=0.0).to(tl.float32)
        acc += tl.sum(p[:, None] * vt, 0)
    if FINAL:
        o = tl.load(oref_ptr + row64 * D + dd) - tl.load(cref_ptr + row64 * D + dd) + acc
        tl.store(out_ptr + b * sob + h * soh + t * sot + dd * sod, o.to(out_ptr.dtype.element_ty))
    else:
        tl.store(pacc_ptr + (row64 * SPLIT + pid_s) * D + dd, acc)


@triton.jit
def _reuse_combine_kernel(
    pacc_ptr, oref_ptr, cref_ptr, out_ptr,
    HQ, T, SPLIT,
    sob, soh, sot, sod,
    D: tl.constexpr, SPLIT_P2: tl.constexpr,
):
    row = tl.program_id(0)
    t = row % T
    h = (row // T) % HQ
    b = (row // (T * HQ)).to(tl.int64)
    row64 = row.to(tl.int64)
    sp = tl.arange(0, SPLIT_P2)
    dd = tl.arange(0, D)
    pacc = tl.load(pacc_ptr + (row64 * SPLIT + sp[:, None]) * D + dd[None, :], mask=(sp < SPLIT)[:, None], other=0.0)
    o = tl.load(oref_ptr + row64 * D + dd) - tl.load(cref_ptr + row64 * D + dd) + tl.sum(pacc, 0)
    tl.store(out_ptr + b * sob + h * soh + t * sot + dd * sod, o.to(out_ptr.dtype.element_ty))


def reuse_combine_triton(part_acc, o_ref, c_ref, out, *, wrap: bool = False, num_warps: int = 4) -> None:
    """O_ref - C_ref + the sum of the split partials part_acc [rows, SPLIT, D] into out [B, Hq, T, D]:
    _reuse_combine_kernel, one program per row (also the packed V-only correction's combine)."""
    b, hq, t, d = out.shape
    rows, split = part_acc.shape[:2]
    Launcher(wrap)(_reuse_combine_kernel, (rows,))(
        part_acc, o_ref.reshape(rows, d).contiguous(), c_ref.reshape(rows, d).contiguous(), out,
        hq, t, split,
        *out.stride(),
        D=d, SPLIT_P2=next_pow2(split),
        num_warps=num_warps,
    )


def reuse_correction_triton(v, keys, count, probs, o_ref, c_ref, *, wrap: bool = False, config: KernelConfig | None = None):
    """Triton body of ``flashloop::reuse_correction_attention``; same output as the ATen body."""
    launch = Launcher(wrap)
    sc.check_runnable(_reuse_correction_kernel, v.device)
    cfg = sc.config_for(v.device, config)
    dev = v.device
    b, hq, t, d = o_ref.shape
    hkv = v.shape[1]
    kmax = keys.shape[-1]
    rows = b * hq * t
    keys_c = keys.reshape(rows, kmax).contiguous()
    probs_c = probs.reshape(rows, kmax).contiguous()
    count_c = count.reshape(rows).contiguous()
    oref_c = o_ref.reshape(rows, d).contiguous()
    cref_c = c_ref.reshape(rows, d).contiguous()
    out = torch.empty(o_ref.shape, dtype=v.dtype, device=dev)
    # a gather per key tile, as the correction's: many programs per row (split_corr)
    want = cfg.split_corr or max(32, cdiv(2 * sm_count(dev), rows))
    chunk, split = split_range(max(kmax, 1), cfg.block_k, want)
    final = split == 1
    pacc = oref_c if final else torch.empty(rows, split, d, dtype=torch.float32, device=dev)  # unused when final
    launch(_reuse_correction_kernel, (rows, split))(
        v, keys_c, count_c, probs_c, oref_c, cref_c, out, pacc,
        hq, t, hq // hkv, kmax, chunk, split,
        *v.stride(), *out.stride(),
        D=d, BLOCK_K=cfg.block_k, FINAL=final,
        num_warps=cfg.num_warps_corr,
    )
    if not final:
        reuse_combine_triton(pacc, oref_c, cref_c, out, wrap=launch.wrap)
    return out
