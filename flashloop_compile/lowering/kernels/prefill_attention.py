"""Triton kernel for token-sparse prefill attention (SPEC.md section 1): the CUDA body of
``flashloop::position_attention`` (see :mod:`flashloop_compile.lowering.prefill_ops`).

Loops 3..R run on a subset of the prompt's tokens. The active queries sit at non-consecutive
absolute positions ``q_pos[b, i]`` and attend to every key ``j <= q_pos[b, i]`` of the loop's
full logical KV cache (key j sits at absolute position j). Instead of a materialized boolean
mask ``[B, 1, Tq, S]`` the kernel reads the query positions directly.

``_position_attention_kernel`` grid ``(cdiv(Tq, BLOCK_M), B * Hq)``; one program handles
BLOCK_M query rows of one (batch, query head) and reads kv head ``h // (Hq // Hkv)``:

1. load the block's positions (rows past Tq read as -1); clamp them to S - 1 (keys past the
   cache do not exist); rows at position < 0 are padding: their q is loaded as zeros and their
   output is stored as zeros;
2. ``hi = max(pos) + 1``: key blocks at or above ``hi`` are never loaded (with sorted positions
   this is the causal block skipping of flash attention); ``lo = min(valid pos) + 1``: keys
   below ``lo`` are visible to every valid row;
3. loop A over key blocks ``[0, lo // BLOCK_N * BLOCK_N)`` without the position mask, loop B
   over ``[that, hi)`` with the per-element mask ``key <= pos[i]``; online softmax in base 2
   (``scale * log2(e)`` folded into the FP32 scores), FP32 statistics and accumulator; P is
   rounded to the input dtype for the PV product (bf16/fp16 tensor cores), as in flash
   attention;
4. ``out = acc / l`` for valid rows, 0 for padding rows, stored in q's dtype.

Correctness never depends on the order of the positions (any order, repeats allowed); only the
amount of skipped work does. Query blocks are visited last-first (the heavy blocks of sorted
positions start first). Every load and store is masked.

The launcher :func:`position_attention_triton` is host-sync free (grid and constants come from
shapes only), takes a ``wrap`` callable (``torch.library.wrap_triton`` inside the ``triton_op``
body; identity otherwise, so the kernel also runs on CPU tensors under ``TRITON_INTERPRET=1``,
where bf16/fp16 operands are upcast to FP32 before the dots: the interpreter's low-precision
dots are not reliable). With NumPy >= 2.4 Triton 3.6's interpreter needs the scalar-index fix
that tests/lowering/test_position_attention.py applies (the key loops' bounds are read from
the positions).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from flashloop_compile.lowering.kernels.common import SUPPORTED_HEAD_DIMS, no_wrap, sm_count

__all__ = ["position_attention_triton", "PrefillConfig", "default_config", "SUPPORTED_HEAD_DIMS"]

LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(q, k_ptrs, v_ptrs, n, n_ok, qpos, m_i, l_i, acc, qk_scale,
                         MASKED: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key block (rows ``n``): scores, (optional) position mask, online-softmax update of
    (m, l, acc)."""
    kt = tl.load(k_ptrs, mask=n_ok[:, None], other=0.0)
    if UPCAST:
        kt = kt.to(tl.float32)
    s = tl.dot(q, tl.trans(kt), input_precision=DOT_PRECISION) * qk_scale  # [BM, BN], log2 units
    if MASKED:
        s = tl.where(n[None, :] <= qpos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row without visible keys yet
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new  # every score of the block is finite
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    vt = tl.load(v_ptrs, mask=n_ok[:, None], other=0.0)
    if UPCAST:
        vt = vt.to(tl.float32)
    acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _position_attention_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr,
    Tq, S, HQ, G, qk_scale,
    sqb, sqh, sqt, sqd,
    skb, skh, sks, skd,
    svb, svh, svs, svd,
    spb, spt,
    sob, soh, sot, sod,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    qk_scale = tl.cast(qk_scale, tl.float32)  # Inductor passes Python floats as fp64
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)  # heavy (late-position) blocks first
    pid_bh = tl.program_id(1)
    b = (pid_bh // HQ).to(tl.int64)
    h = pid_bh % HQ
    hk = (h // G).to(tl.int64)
    h = h.to(tl.int64)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < Tq
    offs_m64 = offs_m.to(tl.int64)
    qpos = tl.load(pos_ptr + b * spb + offs_m64 * spt, mask=m_ok, other=-1)
    qpos = tl.minimum(tl.maximum(qpos, -1), S - 1).to(tl.int32)  # in [-1, S-1]
    valid = m_ok & (qpos >= 0)
    qpos = tl.where(valid, qpos, -1)
    hi = tl.max(qpos, 0) + 1  # keys [0, hi) are visible to some row
    lo = tl.min(tl.where(valid, qpos, S - 1), 0) + 1  # keys [0, lo) are visible to every valid row
    lo = tl.minimum(lo, hi)
    full_end = (lo // BLOCK_N) * BLOCK_N

    dd = tl.arange(0, D)
    q = tl.load(
        q_ptr + b * sqb + h * sqh + offs_m64[:, None] * sqt + dd[None, :] * sqd,
        mask=valid[:, None], other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    offs_n = tl.arange(0, BLOCK_N)
    # scalar bases + loop-invariant tile offsets (carrying pointer tensors through the loops
    # costs registers); a block's pointers are base + start_n * stride + offsets
    k_head = k_ptr + b * skb + hk * skh
    v_head = v_ptr + b * svb + hk * svh
    k_off = offs_n[:, None] * sks + dd[None, :] * skd
    v_off = offs_n[:, None] * svs + dd[None, :] * svd
    zero64 = tl.zeros([], tl.int64)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)

    # A: key blocks visible to every valid row (padding rows see zeros and are dropped below)
    for start_n in range(0, full_end, BLOCK_N):
        n = start_n + offs_n
        n64 = zero64 + start_n  # 64-bit row offsets (the interpreter's loop index is an int)
        m_i, l_i, acc = _online_softmax_step(
            q, k_head + n64 * sks + k_off, v_head + n64 * svs + v_off, n, n < S, qpos, m_i, l_i, acc, qk_scale,
            MASKED=False, UPCAST=UPCAST, DOT_PRECISION=DOT_PRECISION,
        )
    # B: the remaining blocks up to the largest position, masked per element (key <= pos[i])
    for start_n in range(full_end, hi, BLOCK_N):
        n = start_n + offs_n
        n64 = zero64 + start_n  # 64-bit row offsets (the interpreter's loop index is an int)
        m_i, l_i, acc = _online_softmax_step(
            q, k_head + n64 * sks + k_off, v_head + n64 * svs + v_off, n, n < S, qpos, m_i, l_i, acc, qk_scale,
            MASKED=True, UPCAST=UPCAST, DOT_PRECISION=DOT_PRECISION,
        )

    keep = valid & (l_i > 0.0)
    inv = 1.0 / tl.where(keep, l_i, 1.0)
    o = tl.where(keep[:, None], acc * inv[:, None], 0.0)
    tl.store(
        o_ptr + b * sob + h * soh + offs_m64[:, None] * sot + dd[None, :] * sod,
        o.to(o_ptr.dtype.element_ty),
        mask=m_ok[:, None],
    )


# ------------------------------------------------------------------------------------------
# launcher
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int




def default_config(q: torch.Tensor) -> PrefillConfig:
    """Static tile choice from shapes, dtype and device (no host sync). Flash-attention tutorial
    sizes, checked only by compiling for sm_90a without a GPU (ptxas: no register spills for
    bf16/fp16, a few hundred bytes for fp32 at D=128); not timed.
    ``benchmarks/bench_position_attention.py --sweep`` measures alternatives."""
    b, hq, tq, d = q.shape
    if q.device.type != "cuda":  # interpreter: cost is per operation, so few, large programs
        return PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    if q.dtype == torch.float32:  # 4-byte tiles and 3 tf32 dots per product: small tiles
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    if d >= 128:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    elif d >= 64:
        block_m, block_n, warps, stages = 128, 64, 4, 3
    else:
        block_m, block_n, warps, stages = 128, 64, 4, 2
    # too few programs to fill the device: halve the query tile (few active queries, long cache)
    if triton.cdiv(tq, block_m) * b * hq < sm_count(q.device):
        block_m, warps = 64, 4
    return PrefillConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)




def position_attention_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float,
    *, wrap=no_wrap, config: PrefillConfig | None = None, out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[b, h, i] = softmax_j(q[b, h, i] . k[b, h // G, j] * scale, j <= q_pos[b, i]) @ V;
    0 for rows with q_pos < 0. q [B, Hq, Tq, D], k/v [B, Hkv, S, D] (any strides, same dtype
    in bf16/fp16/fp32), q_pos [B, Tq] int64 (any order, repeats allowed). Returns ``out``
    ([B, Hq, Tq, D] in q's dtype, contiguous when allocated here)."""
    b, hq, tq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    if d not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"position_attention_triton supports head_dim in {SUPPORTED_HEAD_DIMS}, got {d}")
    if out is None:
        out = torch.empty((b, hq, tq, d), dtype=q.dtype, device=q.device)
    if b == 0 or hq == 0 or tq == 0:
        return out
    if s == 0:
        return out.zero_()
    cfg = config if config is not None else default_config(q)
    upcast = q.device.type != "cuda"
    precision = "tf32x3" if q.dtype == torch.float32 else "tf32"  # FP32 operands need more than tf32
    grid = (triton.cdiv(tq, cfg.block_m), b * hq)
    wrap(_position_attention_kernel)[grid](
        q, k, v, q_pos, out,
        tq, s, hq, hq // hkv, float(scale) * LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *q_pos.stride(), *out.stride(),
        D=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
