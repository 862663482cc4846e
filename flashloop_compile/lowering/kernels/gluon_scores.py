"""The code-domain reference scores (loop 2 under quantization) on fp16 tensor cores, in Gluon.

``reference_attention._scores_linear_kernel`` (Triton ``tl``) spends about 7.6 instructions per INT4 code:
``tl`` picks the register layout, and every thread holds a few channels of a few keys, so the
unpack, an fp16 -> fp32 conversion and an FMA are paid per code. Here the product
q . k is an fp16 MMA (m16n8k16) computing scores^T [keys, 8] = codes [keys, D] x q' [D, 8]:

* the codes are the A operand. Its fragment holds channel pairs (k, k+1) of keys g and g+8; the
  contraction index is free to relabel (q' takes the same relabel), and relabelled, thread c of a
  lane quad holds the 16 contiguous bytes 16c..16c+15 of each of its keys: one 128-bit load, and
  the unpacked operand is in the MMA's layout without moving data;
* four code bytes become eight fp16 operands in eight instructions (inline PTX: a PRMT spreads a
  byte to both halves of a word, a LOP3 masks its nibbles into the mantissas of fp16 1024, 0x6400:
  1024 + low nibble and 1024 + 16 * high nibble, exact);
* q' = fp16(q * scale) per K block (64 keys, the tile) and stream (base, residuals 1..DEPTH), the
  odd channels' / 16, is prepared for every block by ``_prep_kernel``, with one bias per block:
  q . min_0 - 1024 * sum over streams of sum(q') (every key), q . min_s (keys with residual s);
* each thread gets its keys' scores from the accumulator (the 8 columns are equal) without a
  reduction over query rows.

Per key tile (64 keys, depth 1) the loop is about 300 SASS instructions against the tl kernel's 980
(``scripts/kernel_report.py --only sparse``, checked in tests/test_kernel_report.py). q'
is rounded to fp16 (11 bits) where the tl kernel keeps q in FP32: scores differ by about 1e-3 at
scores of a few units, inside the bf16 tolerance; the selection may reorder near-ties.

Gluon does not run under the Triton interpreter: on CPU tensors the tl kernel runs (``fits``), and
the arithmetic of this one is checked there by an emulation (``emulate_scores``) and its compile
for sm_90. The launch is an opaque custom op (``flashloop::mma_linear_scores``, packed_sparse_ops.py):
Inductor's user-defined Triton kernel support (``wrap_triton``) analyses ``tl`` kernels, not Gluon
ones. It runs wherever it fits: 1.9x the tl kernel per site, and the 4x32K decode step 30.8 ms
against 34.1 ms with the tl kernel in the same device call (H200).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # Gluon ships with triton >= 3.4
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - older triton: the tl kernel runs
    gluon = None

HEAD_DIM, GROUP, TILE, WARPS = 128, 64, 64, 4  # the one shape the layouts below are built for

if gluon is not None:
    D = gl.constexpr(HEAD_DIM)
    BN = gl.constexpr(TILE)
    # accumulator [BN keys, 8] (warps split the keys), codes operand [BN, D], q' operand [D, 8]
    MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 8]))
    A_OP = gl.constexpr(gl.DotOperandLayout(0, MMA, 2))
    B_OP = gl.constexpr(gl.DotOperandLayout(1, MMA, 2))
    # The code bytes [BN (key), D/2 (byte p)]: A_OP's lanes and warps with the register bits on p,
    # so that lane c (lane bits 0-1) holds bytes 16c..16c+15 of keys g and g + 8 (lane bits 2-4).
    # A_OP [64, 128] (gl.to_linear_layout): regs [0,1] [8,0] [0,8] [0,16] [0,32] [0,64];
    # lanes [0,2] [0,4] [1,0] [2,0] [4,0]; warps [16,0] [32,0]
    BYTES = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
        lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[TILE, HEAD_DIM // 2]))
    # q' [D (channel), 8] in load order: lane c holds channels 32c..32c+31. B_OP [128, 8]: regs
    # [1,0] [8,0] [16,0] [32,0] [64,0]; lanes [2,0] [4,0] [0,1] [0,2] [0,4]; warps broadcast
    Q_LOAD = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]],
        lane_bases=[[32, 0], [64, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[HEAD_DIM, 8]))
    KEYS = gl.constexpr(gl.SliceLayout(1, MMA))  # per-key vectors: the accumulator's rows
    CH = gl.constexpr(gl.SliceLayout(1, Q_LOAD))
    # the window's BF16 rows [BN, D] (packed_read's buffer: a few tiles per row)
    WIN = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8], warps_per_cta=[WARPS, 1],
                                        order=[1, 0]))

    @gluon.jit
    def _nibbles(y):
        """fp16 codes of code bytes y, four bytes b0..b3 (consecutive registers) at a time, as two
        tensors: (lo b0, hi b0, lo b1, hi b1) and (lo b2, hi b2, lo b3, hi b3); lo = 1024 + low
        nibble, hi = 1024 + 16 * high nibble, exact."""
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, t2, t3;
            prmt.b32 t0, $4, 0, 0x4040;
            prmt.b32 t1, $4, 0, 0x4141;
            prmt.b32 t2, $4, 0, 0x4242;
            prmt.b32 t3, $4, 0, 0x4343;
            lop3.b32 $0, t0, 0x00F0000F, 0x64006400, 0xEA;
            lop3.b32 $1, t1, 0x00F0000F, 0x64006400, 0xEA;
            lop3.b32 $2, t2, 0x00F0000F, 0x64006400, 0xEA;
            lop3.b32 $3, t3, 0x00F0000F, 0x64006400, 0xEA;
            }""",
            "=r,=r,=r,=r,r", [y], dtype=(gl.float16, gl.float16), is_pure=True, pack=4)

    @gluon.jit
    def _codes_operand(y):
        """The MMA's A operand [BN, D] (fp16 codes, contraction index relabelled) of code bytes y
        [BN, D/2] (BYTES)."""
        x0, x1 = _nibbles(y)
        # x_s[., 4u + v] is nibble v % 2 of byte 4u + 2s + v // 2: channel 8u + 4s + v
        x = gl.reshape(gl.permute(gl.reshape(gl.join(x0, x1), [BN, 16, 4, 2]), [0, 1, 3, 2]), [BN, D])
        # relabel channel = 32c + 2a + t (c: lane, a: register) to A_OP's k = 8a + 2c + t: no data moves
        x = gl.reshape(gl.permute(gl.reshape(x, [BN, 4, 16, 2]), [0, 2, 1, 3]), [BN, D])
        return gl.convert_layout(x, A_OP)

    @gluon.jit
    def _q_operand(a_ptr):
        """q' [D, 8] (the B operand) from a prepared row of D fp16 in channel order, broadcast over
        the 8 columns and relabelled as _codes_operand."""
        ch = gl.arange(0, D, layout=CH)
        a = gl.expand_dims(gl.load(a_ptr + ch), 1).broadcast_to(D, 8)
        a = gl.reshape(gl.permute(gl.reshape(a, [4, 16, 2, 8]), [1, 0, 2, 3]), [D, 8])
        return gl.convert_layout(a, B_OP, assert_trivial=True)

    @gluon.jit
    def _tile_bytes(codes, n, p, ok):
        """Code bytes [BN, D/2] (BYTES) of rows n of a codes table (0 where not ok)."""
        return gl.load(codes + gl.expand_dims(n.to(gl.int64) * (D // 2), 1) + gl.expand_dims(p, 0),
                       mask=gl.expand_dims(ok, 1) & gl.expand_dims(p >= 0, 0), other=0)

    @gluon.jit
    def _softmax_step(m_v, l_v, s):
        """Per-key-lane online softmax: the running max and sum of exp after scores s (-inf: none)."""
        m_new = gl.maximum(m_v, s)
        alpha = gl.where(m_new > float("-inf"), gl.exp(m_v - m_new), 0.0)
        return m_new, l_v * alpha + gl.where(m_new > float("-inf"), gl.exp(s - m_new), 0.0)

    @gluon.jit
    def _store_partials(pm_ptr, pl_ptr, m_v, l_v, at):
        """The lanes' online-softmax state reduced to the split's (max, sum of exp), stored at ``at``."""
        m_i = gl.max(m_v, 0)
        gl.store(pm_ptr + at, m_i)
        gl.store(pl_ptr + at, gl.sum(l_v * gl.exp(m_v - gl.where(m_i > float("-inf"), m_i, 0.0)), 0))

    @gluon.jit
    def _mma_scores_kernel(
        q_ptr, k_ptr, mask_ptr, s_ptr, pm_ptr, pl_ptr, lo_ptr, a_ptr, bias_ptr,
        S, HKV, scale, NW, sqb, sqh, skb, skh, sks, smb, smh, sms, CHUNK, SPLIT,
        k_base, k_res, rows, res_layout, B, NB, CAPT, ROWS,
        DEPTH: gl.constexpr,
    ):
        """_scores_linear_kernel (one query row per kv head, row = b * HKV + hk) with the keys below
        lo[b] on tensor cores: per split, the probability row's scores (scaled, -inf where masked)
        and the online-softmax partials (max, sum of exp)."""
        pid_bh = gl.program_id(0)
        pid_s = gl.program_id(1)
        b = (pid_bh // HKV).to(gl.int64)
        hk = (pid_bh % HKV).to(gl.int64)
        row = pid_bh.to(gl.int64)
        bh = b * HKV + hk
        kb = k_base + bh * S * (D // 2)
        kr = k_res + bh * CAPT * (D // 2)
        p = gl.arange(0, D // 2, layout=gl.SliceLayout(0, BYTES))
        nb_ = gl.arange(0, BN, layout=gl.SliceLayout(1, BYTES))
        nk = gl.arange(0, BN, layout=KEYS)
        m_base = mask_ptr + b * smb + hk * smh
        lo = gl.load(lo_ptr + b).to(gl.int32)
        start = pid_s * CHUNK
        end = gl.minimum(start + CHUNK, S)
        mid = gl.maximum(gl.minimum(lo, end), start)
        m_v = gl.full([BN], float("-inf"), gl.float32, layout=KEYS)
        l_v = gl.zeros([BN], gl.float32, layout=KEYS)
        a_row = a_ptr + row * NB * D
        b_row = bias_ptr + row * NB
        for n0 in range(start, mid, BN):
            blk = n0 // BN
            n = n0 + nb_
            acc = mma_v2(_codes_operand(_tile_bytes(kb, n, p, n >= 0)), _q_operand(a_row + blk * D),
                         gl.zeros([BN, 8], gl.float32, layout=MMA))
            nn = n0 + nk
            bias = gl.zeros([BN], gl.float32, layout=KEYS) + gl.load(b_row + blk)
            for j in gl.static_range(1, DEPTH + 1):
                rows_j = rows + ((j - 1) * B + b) * S
                rj = gl.load(rows_j + n)
                has = rj >= 0
                g = gl.load(res_layout + j) + gl.where(has, rj, 0)
                acc = mma_v2(_codes_operand(_tile_bytes(kr, g, p, has)), _q_operand(a_row + j * ROWS * NB * D + blk * D),
                             acc)
                has_k = gl.load(rows_j + nn) >= 0  # again in the accumulator's layout: an L1 hit, no conversion
                bias += gl.where(has_k, gl.load(b_row + j * ROWS * NB + blk), 0.0)
            s = (gl.max(acc, 1) + bias) * scale
            s = gl.where(gl.load(m_base + nn.to(gl.int64) * sms) != 0, s, float("-inf"))
            gl.store(s_ptr + row * S + nn, s)
            m_v, l_v = _softmax_step(m_v, l_v, s)
        # the window: BF16 rows lo .. lo + NW - 1 of packed_read's buffer k_ptr [B, HKV, NW, D]
        wn = gl.arange(0, BN, layout=gl.SliceLayout(1, WIN))
        wd = gl.arange(0, D, layout=gl.SliceLayout(0, WIN))
        qw = gl.load(q_ptr + b * sqb + hk * sqh + wd).to(gl.float32)
        k_row = k_ptr + b * skb + hk * skh
        for n0 in range(mid, end, BN):
            n = n0 + wn
            n_ok = n < end
            idx = (n - lo).to(gl.int64)
            in_buf = n_ok & (idx < NW)
            kt = gl.load(k_row + gl.expand_dims(idx * sks, 1) + gl.expand_dims(wd, 0),
                         mask=gl.expand_dims(in_buf, 1) & gl.expand_dims(wd >= 0, 0), other=0.0).to(gl.float32)
            s = gl.sum(kt * gl.expand_dims(qw, 0), 1) * scale
            vis = gl.load(m_base + n.to(gl.int64) * sms, mask=n_ok, other=0) != 0
            s = gl.where(vis & in_buf, s, float("-inf"))
            gl.store(s_ptr + row * S + n, s, mask=n_ok)
            s = gl.convert_layout(s, KEYS)
            m_v, l_v = _softmax_step(m_v, l_v, s)
        _store_partials(pm_ptr, pl_ptr, m_v, l_v, row * SPLIT + pid_s)


@triton.jit
def _prep_kernel(q_ptr, sqb, sqh, k_base_min, k_base_scale, k_res_min, k_res_scale, a_ptr, bias_ptr,
                 HKV, B, NB, D: tl.constexpr, DEPTH: tl.constexpr, BLK: tl.constexpr):
    """Per (row = b * HKV + hk, K block blk) and stream s (0: base, j: residual j): q'_s =
    fp16(q * scale_s) (odd channels / 16: their codes come as 16 * code) into a_ptr
    [DEPTH + 1, rows, NB, D], and the biases into bias_ptr [DEPTH + 1, rows, NB]: q . min_0 - 1024 *
    sum_s sum(q'_s) for every key (codes come as 1024 + code; a key without residual s loads code
    bytes 0, which read 1024), q . min_j for the keys with residual j."""
    row = tl.program_id(0).to(tl.int64)
    rows = tl.num_programs(0)
    b = row // HKV
    hk = row % HKV
    blk = tl.program_id(1) * BLK + tl.arange(0, BLK)
    ok = blk[:, None] < NB
    ch = tl.arange(0, D)
    qm = tl.load(q_ptr + b * sqb + hk * sqh + ch).to(tl.float32)
    q = qm * tl.where(ch % 2 == 1, 0.0625, 1.0)
    par = (blk[:, None] * D + ch[None, :]).to(tl.int64)
    a = (q[None, :] * tl.load(k_base_scale + (b * HKV + hk) * NB * D + par, mask=ok, other=0.0).to(tl.float32)
         ).to(tl.float16)
    tl.store(a_ptr + row * NB * D + par, a, mask=ok)
    total = tl.sum(a.to(tl.float32), 1)
    base = tl.sum(qm[None, :] * tl.load(k_base_min + (b * HKV + hk) * NB * D + par, mask=ok, other=0.0).to(tl.float32), 1)
    for j in tl.static_range(1, DEPTH + 1):
        pk = (((j - 1) * B + b) * HKV + hk) * NB * D
        a = (q[None, :] * tl.load(k_res_scale + pk + par, mask=ok, other=0.0).to(tl.float32)).to(tl.float16)
        tl.store(a_ptr + (j * rows + row) * NB * D + par, a, mask=ok)
        total += tl.sum(a.to(tl.float32), 1)
        res = tl.sum(qm[None, :] * tl.load(k_res_min + pk + par, mask=ok, other=0.0).to(tl.float32), 1)
        tl.store(bias_ptr + (j * rows + row) * NB + blk, res, mask=blk < NB)
    tl.store(bias_ptr + row * NB + blk, base - 1024.0 * total, mask=blk < NB)


PREP_BLOCKS = 16  # K blocks per _prep_kernel program


def fits(q: torch.Tensor, head_dim: int, group: int, block_n: int, depth: int) -> bool:
    """Whether the tensor-core scores apply: Gluon, mma.sync (sm_80+ where q is on CUDA; the
    caller keeps CPU tensors on the tl kernel, except scripts/kernel_report.py's sm_90 compile),
    and the shape the layouts are built for (head_dim 128, K blocks of 64 keys, 64-key tiles)."""
    if gluon is None or depth < 0:
        return False
    if q.device.type == "cuda" and torch.cuda.get_device_capability(q.device) < (8, 0):
        return False
    return head_dim == HEAD_DIM and group == GROUP and block_n == TILE


def _run(kernel, grid):
    return kernel[grid]


def _prepare(q, k_base_min, k_base_scale, k_res_min, k_res_scale, nb: int, cache_b: int, depth: int, run):
    """_prep_kernel's tables for q [B, Hkv, 1, D]: q' [depth + 1, B * Hkv, nb, D] fp16 and the
    biases [depth + 1, B * Hkv, nb] FP32, every K block and stream."""
    bsz, hkv = q.shape[0], q.shape[1]
    rows_n = bsz * hkv
    a = torch.empty(depth + 1, rows_n, nb, HEAD_DIM, dtype=torch.float16, device=q.device)
    bias = torch.empty(depth + 1, rows_n, nb, dtype=torch.float32, device=q.device)
    run(_prep_kernel, (rows_n, triton.cdiv(nb, PREP_BLOCKS)))(
        q, q.stride(0), q.stride(1), k_base_min, k_base_scale, k_res_min, k_res_scale, a, bias,
        hkv, cache_b, nb, D=HEAD_DIM, DEPTH=depth, BLK=PREP_BLOCKS, num_warps=4)
    return a, bias


def launch_scores(q, k, mask, probs, part_m, part_l, lo, k_base, k_base_min, k_base_scale, k_res, k_res_min,
                  k_res_scale, rows, res_layout, scale: float, chunk: int, split: int, depth: int, run=None):
    """The body of ``flashloop::mma_linear_scores`` (registered in packed_sparse_ops.py): fills probs
    [B * Hkv, S] (scaled scores, -inf where masked) and the split partials part_m / part_l
    [B * Hkv, split] as _scores_linear_kernel does. k: packed_read's window buffer [B, Hkv, NW, D]
    from lo[b] on (unit channel stride), mask [B, Hkv, 1, S] (any strides), q [B, Hkv, 1, D] (unit
    channel stride), the cache tensors as packed_kv's. Launches through ``run(kernel, grid)``
    (default: the module's ``_run``, ``kernel[grid]``; scripts/kernel_report.py replaces it to
    compile for sm_90 on CPU tensors)."""
    run = run or _run
    bsz, hkv = q.shape[0], q.shape[1]
    cache_b, _, s, _ = k_base.shape  # [B, H, S, D/2]
    nb = s // GROUP
    capt = k_res.shape[2]  # [B, H, CAPT, D/2]
    rows_n = bsz * hkv
    a, bias = _prepare(q, k_base_min, k_base_scale, k_res_min, k_res_scale, nb, cache_b, depth, run)
    return run(_mma_scores_kernel, (rows_n, split))(
        q, k, mask, probs, part_m, part_l, lo, a, bias,
        s, hkv, scale, k.shape[2], q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        mask.stride(0), mask.stride(1), mask.stride(3), chunk, split,
        k_base, k_res, rows, res_layout, cache_b, nb, capt, rows_n,
        DEPTH=depth, num_warps=WARPS)


