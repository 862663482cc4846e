"""Probe: the code-domain reference scores (loop 2 under quantization) on tensor cores, written in
Gluon (explicit register layouts), against the production Triton kernel on the same packed data.

Why (benchmarks/RESULTS.md, sessions 9-12): the code-domain kernels are bound by instruction issue,
about 7.6 instructions per INT4 code, because Triton's `tl` picks the register layout: every thread
holds a few channels of a few keys, so the unpack, the fp16 -> fp32 conversion and one FMA are paid
per code. Here the product q . k runs as an fp16 MMA (m16n8k16) whose B operand (channels x keys)
is built in registers straight from the loaded code bytes:

* a thread's B fragment holds channel pairs (k, k+1) of one key: a code byte's two nibbles. Its
  16-channel chunks sit at k = 2c + {0,1} + {0, 8}; relabelling the contraction index (the A
  operand, q, takes the same relabel) gives thread c the 16 contiguous bytes 16c..16c+15 of its key:
  one 128-bit load, no layout conversion (asserted: `convert_layout(..., assert_trivial=True)`);
* four bytes become eight fp16 operands in six instructions (two PRMT, four LOP3; inline PTX): a
  nibble masked into the mantissa of fp16 1024 (0x6400) reads 1024 + code (the high nibble
  1024 + 16 code: its 1/16 goes into A), exact;
* per K block (64 keys, the tile) A = q * scale per channel in fp16; 1024 * sum(A) and q . min
  are one bias per tile and stream (the residual's where the key has one).

Run on the GPU: `python3 benchmarks/probe_gluon_scores.py` (checks both kernels against a torch
reference, then times them: median of CUDA-event repeats, L2 flushed). On a machine without a GPU:
`python3 benchmarks/probe_gluon_scores.py --compile-only` compiles both for sm_90 and prints
registers and the SASS count of each key-tile loop (scripts/kernel_report.py's helpers).
Not wired into the ops: the probe decides whether the kernels are worth porting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashloop_compile.lowering.kernels import sparse_decode as SD  # noqa: E402

HEAD_DIM, GROUP, TILE = 128, 64, 64  # head_dim, K block (keys), keys per tile (= the block)
D, GP, BN, NW = gl.constexpr(HEAD_DIM), gl.constexpr(GROUP), gl.constexpr(TILE), gl.constexpr(4)  # for the kernels

# The MMA computes scores^T [BN keys, 8] = codes [BN, D] x q' [D, 8] (q' in all 8 columns): the
# codes are the A operand, whose 16 x 16 fragments hold distinct codes of keys g and g + 8 in every
# register (as B operand with q as A, q's 16 identical rows cost a register copy per value), and
# each thread gets its keys' scores without a reduction over query rows. Warps split the keys.
MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1], instr_shape=[16, 8]))
A_OP = gl.constexpr(gl.DotOperandLayout(0, MMA, 2))
B_OP = gl.constexpr(gl.DotOperandLayout(1, MMA, 2))
# The code bytes [BN (key), D/2 (byte p)]: lane c (lane bits 0-1) holds bytes 16c..16c+15 of keys
# g and g + 8 (g: lane bits 2-4): A_OP's lanes and warps with the register bits on p.
# A_OP [64, 128] (gl.to_linear_layout): regs [0,1] [8,0] [0,8] [0,16] [0,32] [0,64];
# lanes [0,2] [0,4] [1,0] [2,0] [4,0]; warps [16,0] [32,0]
BYTES = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8], [8, 0]],
    lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
    warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[BN, D // 2]))
# q' [D (channel), 8] in load order: lane c holds channels 32c..32c+31. B_OP [128, 8]: regs [1,0]
# [8,0] [16,0] [32,0] [64,0]; lanes [2,0] [4,0] [0,1] [0,2] [0,4]; warps broadcast
Q_LOAD = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[1, 0], [2, 0], [4, 0], [8, 0], [16, 0]],
    lane_bases=[[32, 0], [64, 0], [0, 1], [0, 2], [0, 4]],
    warp_bases=[[0, 0], [0, 0]], block_bases=[], shape=[D, 8]))
KEYS = gl.constexpr(gl.SliceLayout(1, MMA))  # per-key vectors, as the accumulator's rows
CH = gl.constexpr(gl.SliceLayout(1, Q_LOAD))  # per-channel vectors in load order


@gluon.jit
def _nibbles(y):
    """fp16 codes of code bytes y, four bytes (b0..b3, a thread's consecutive registers) at a
    time, as two tensors: (lo b0, hi b0, lo b1, hi b1) and (lo b2, hi b2, lo b3, hi b3), lo = 1024 +
    low nibble, hi = 1024 + 16 * high nibble, exact; one PRMT and one LOP3 per byte."""
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
    """The A operand [BN, D] (fp16 codes, contraction index relabelled) of code bytes y [BN, D/2]
    (BYTES)."""
    x0, x1 = _nibbles(y)
    # x_s[., 4u + v] is nibble v % 2 of byte 4u + 2s + v // 2: channel 8u + 4s + v
    x = gl.reshape(gl.permute(gl.reshape(gl.join(x0, x1), [BN, 16, 4, 2]), [0, 1, 3, 2]), [BN, D])
    # relabel channel = 32c + 2a + t (c: lane, a: register) to A_OP's k = 8a + 2c + t
    x = gl.reshape(gl.permute(gl.reshape(x, [BN, 4, 16, 2]), [0, 2, 1, 3]), [BN, D])
    return gl.convert_layout(x, A_OP)


@gluon.jit
def _tile_bytes(kb, kr, rows_b, off_r, n, p, live):
    """The base and residual code bytes [BN, D/2] of keys n (BYTES rows; all absent where not live)."""
    rj = gl.load(rows_b + n, mask=live, other=-1)
    has = rj >= 0
    g = off_r + gl.where(has, rj, 0)
    yb = gl.load(kb + gl.expand_dims(n.to(gl.int64) * (D // 2), 1) + gl.expand_dims(p, 0),
                 mask=gl.expand_dims(live, 1) & gl.expand_dims(p >= 0, 0), other=0)
    yr = gl.load(kr + gl.expand_dims(g.to(gl.int64) * (D // 2), 1) + gl.expand_dims(p, 0),
                 mask=gl.expand_dims(has, 1) & gl.expand_dims(p >= 0, 0), other=0)
    return yb, yr


@gluon.jit
def _q_operand(a_ptr):
    """q' [D, 8] from a prepared row of D fp16 in channel order (prep_kernel), broadcast over the
    8 columns and relabelled as _codes_operand."""
    ch = gl.arange(0, D, layout=CH)
    a = gl.expand_dims(gl.load(a_ptr + ch), 1).broadcast_to(D, 8)
    a = gl.reshape(gl.permute(gl.reshape(a, [4, 16, 2, 8]), [1, 0, 2, 3]), [D, 8])
    return gl.convert_layout(a, B_OP, assert_trivial=True)


@triton.jit
def prep_kernel(q_ptr, sqb, sqh, k_base_min, k_base_scale, k_res_min, k_res_scale, a_ptr, bias_ptr,
                HKV, NB, D: tl.constexpr, BLK: tl.constexpr):
    """Per (row, K block): A_s = fp16(q * scale_s) per stream s (odd channels / 16: their codes
    come as 16 * code) and two biases: bias_0 = q . min_0 - 1024 * (sum(A_0) + sum(A_1)) (every
    key: codes come as 1024 + code, an absent residual's as 1024), bias_1 = q . min_1 (keys with a
    residual). a_ptr [2, rows, NB, D] fp16, bias_ptr [2, rows, NB] fp32."""
    row = tl.program_id(0).to(tl.int64)
    b = row // HKV
    hk = row % HKV
    blk = tl.program_id(1) * BLK + tl.arange(0, BLK)
    ok = blk < NB
    ch = tl.arange(0, D)
    qm = tl.load(q_ptr + b * sqb + hk * sqh + ch).to(tl.float32)
    q = qm * tl.where(ch % 2 == 1, 0.0625, 1.0)
    off = (row * NB + blk)[:, None] * D + ch[None, :]
    rows = tl.num_programs(0)
    a0 = (q[None, :] * tl.load(k_base_scale + off, mask=ok[:, None], other=0.0).to(tl.float32)).to(tl.float16)
    a1 = (q[None, :] * tl.load(k_res_scale + off, mask=ok[:, None], other=0.0).to(tl.float32)).to(tl.float16)
    tl.store(a_ptr + off, a0, mask=ok[:, None])
    tl.store(a_ptr + rows * NB * D + off, a1, mask=ok[:, None])
    bias0 = (tl.sum(qm[None, :] * tl.load(k_base_min + off, mask=ok[:, None], other=0.0).to(tl.float32), 1)
             - 1024.0 * tl.sum(a0.to(tl.float32) + a1.to(tl.float32), 1))
    bias1 = tl.sum(qm[None, :] * tl.load(k_res_min + off, mask=ok[:, None], other=0.0).to(tl.float32), 1)
    tl.store(bias_ptr + row * NB + blk, bias0, mask=ok)
    tl.store(bias_ptr + rows * NB + row * NB + blk, bias1, mask=ok)


@gluon.jit
def gluon_scores_kernel(mask_ptr, s_ptr, pm_ptr, pl_ptr, a_ptr, bias_ptr,
                        S, HKV, scale, smb, smh, CHUNK, SPLIT,
                        k_base, k_res, rows, res_layout, NB, CAPT, ROWS,
                        PREFETCH: gl.constexpr):
    """Scores q . k * scale of one query row per kv head (row = b * HKV + hk) over the flushed bulk
    of a packed history at depth 1 (base + one residual, token-sparse), with the online-softmax
    partials per split: _scores_linear_kernel's bulk loop (DEPTH 1) on tensor cores, the
    per-block A operands and biases from prep_kernel."""
    pid_bh = gl.program_id(0)
    pid_s = gl.program_id(1)
    b = (pid_bh // HKV).to(gl.int64)
    hk = (pid_bh % HKV).to(gl.int64)
    row = pid_bh.to(gl.int64)
    kb = k_base + row * S * (D // 2)
    kr = k_res + row * CAPT * (D // 2)
    ab_ptr = a_ptr + row * NB * D
    ar_ptr = a_ptr + (ROWS + row) * NB * D
    bb_ptr = bias_ptr + row * NB
    br_ptr = bias_ptr + (ROWS + row) * NB
    off_r = gl.load(res_layout + 1)
    rows_b = rows + b * S
    p = gl.arange(0, D // 2, layout=gl.SliceLayout(0, BYTES))
    nb_ = gl.arange(0, BN, layout=gl.SliceLayout(1, BYTES))
    nk = gl.arange(0, BN, layout=KEYS)
    m_base = mask_ptr + b * smb + hk * smh
    m_v = gl.full([BN], float("-inf"), gl.float32, layout=KEYS)
    l_v = gl.zeros([BN], gl.float32, layout=KEYS)
    start = pid_s * CHUNK
    end = gl.minimum(start + CHUNK, S)
    yb, yr = _tile_bytes(kb, kr, rows_b, off_r, start + nb_, p, start + nb_ < end)
    for n0 in range(start, end, BN):
        blk = n0 // GP
        if PREFETCH:  # the next tile's loads in flight while this one computes
            nxt = n0 + BN + nb_
            yb_n, yr_n = _tile_bytes(kb, kr, rows_b, off_r, nxt, p, nxt < end)
        else:
            yb, yr = _tile_bytes(kb, kr, rows_b, off_r, n0 + nb_, p, n0 + nb_ < end)
        acc = mma_v2(_codes_operand(yb), _q_operand(ab_ptr + blk * D), gl.zeros([BN, 8], gl.float32, layout=MMA))
        acc = mma_v2(_codes_operand(yr), _q_operand(ar_ptr + blk * D), acc)
        nn = n0 + nk
        has_k = gl.load(rows_b + nn) >= 0
        s = (gl.max(acc, 1) + gl.load(bb_ptr + blk) + gl.where(has_k, gl.load(br_ptr + blk), 0.0)) * scale
        s = gl.where(gl.load(m_base + nn) != 0, s, float("-inf"))
        gl.store(s_ptr + row * S + nn, s)
        m_new = gl.maximum(m_v, s)
        alpha = gl.where(m_new > float("-inf"), gl.exp(m_v - m_new), 0.0)
        l_v = l_v * alpha + gl.where(m_new > float("-inf"), gl.exp(s - m_new), 0.0)
        m_v = m_new
        if PREFETCH:
            yb, yr = yb_n, yr_n
    m_i = gl.max(m_v, 0)
    l_i = gl.sum(l_v * gl.exp(m_v - gl.where(m_i > float("-inf"), m_i, 0.0)), 0)
    gl.store(pm_ptr + row * SPLIT + pid_s, m_i)
    gl.store(pl_ptr + row * SPLIT + pid_s, l_i)


def make_inputs(B: int, H: int, S: int, device, seed: int = 0, residual_share: float = 0.5):
    """Packed depth-1 history (flushed bulk only) at the production layout: base codes and K block
    parameters, a token-sparse residual (about residual_share of the keys), a causal mask."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    NB = S // GROUP
    CAPT = S
    t = {}
    t["q"] = torch.randn(B, H, 1, HEAD_DIM, generator=g).to(torch.bfloat16)
    t["k_base"] = torch.randint(0, 256, (B * H, S, HEAD_DIM // 2), generator=g, dtype=torch.uint8)
    t["k_base_scale"] = (torch.rand(B * H, NB, HEAD_DIM, generator=g) * 0.2 + 0.01).half()
    t["k_base_min"] = (-torch.rand(B * H, NB, HEAD_DIM, generator=g) * 1.5).half()
    t["k_res"] = torch.randint(0, 256, (B * H, CAPT, HEAD_DIM // 2), generator=g, dtype=torch.uint8)
    t["k_res_scale"] = (torch.rand(1, B, H, NB, HEAD_DIM, generator=g) * 0.02 + 0.001).half()
    t["k_res_min"] = (-torch.rand(1, B, H, NB, HEAD_DIM, generator=g) * 0.15).half()
    has = torch.rand(B, S, generator=g) < residual_share
    rows = torch.full((3, B, S), -1, dtype=torch.int32)  # R - 1 = 3 depths
    for bi in range(B):
        idx = has[bi].nonzero().flatten()
        rows[0, bi, idx] = torch.arange(idx.numel(), dtype=torch.int32)
    t["rows"] = rows
    t["res_layout"] = torch.tensor([[0, 0, 0, 0], [CAPT, CAPT, CAPT, CAPT]], dtype=torch.int32)
    lengths = torch.randint(S - S // 8, S + 1, (B,), generator=g)
    lengths[0] = S
    t["mask"] = (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :].expand(B, H, 1, S).to(torch.uint8).contiguous()
    t = {k: v.to(device) for k, v in t.items()}
    t["dims"] = dict(B=B, H=H, S=S, NB=NB, CAPT=CAPT)
    return t


def reference_scores(t, scale):
    """Scores in FP64 from the decoded keys (base + residual where present), masked."""
    dims = t["dims"]
    B, H, S, NB = dims["B"], dims["H"], dims["S"], dims["NB"]

    def codes(x):  # [.., D/2] bytes -> [.., D] codes (low nibble = even channel)
        x = x.long()
        return torch.stack([x & 15, x >> 4], -1).flatten(-2).double()

    kb = codes(t["k_base"]).view(B, H, S, HEAD_DIM)
    sc = t["k_base_scale"].double().view(B, H, NB, 1, HEAD_DIM).expand(B, H, NB, GROUP, HEAD_DIM).reshape(B, H, S, HEAD_DIM)
    mn = t["k_base_min"].double().view(B, H, NB, 1, HEAD_DIM).expand(B, H, NB, GROUP, HEAD_DIM).reshape(B, H, S, HEAD_DIM)
    k = mn + sc * kb
    rows = t["rows"][0].long()  # [B, S]
    has = rows >= 0
    kr_all = codes(t["k_res"]).view(B, H, -1, HEAD_DIM)
    kr = torch.gather(kr_all, 2, rows.clamp_min(0)[:, None, :, None].expand(B, H, S, HEAD_DIM))
    rsc = t["k_res_scale"][0].double().view(B, H, NB, 1, HEAD_DIM).expand(B, H, NB, GROUP, HEAD_DIM).reshape(B, H, S, HEAD_DIM)
    rmn = t["k_res_min"][0].double().view(B, H, NB, 1, HEAD_DIM).expand(B, H, NB, GROUP, HEAD_DIM).reshape(B, H, S, HEAD_DIM)
    k = k + torch.where(has[:, None, :, None], rmn + rsc * kr, 0.0)
    s = torch.einsum("bhd,bhsd->bhs", t["q"][:, :, 0].double(), k) * scale
    return torch.where(t["mask"][:, :, 0] != 0, s, float("-inf")).view(B * H, S)


def emulate_scores(t, scale):
    """The Gluon kernel's arithmetic in torch (prep_kernel run as written, under the interpreter on
    CPU; the MMA as an FP64 sum of the fp16 operands): A . (1024 + code) + biases."""
    dims = t["dims"]
    B, H, S, NB = dims["B"], dims["H"], dims["S"], dims["NB"]
    rows_n = B * H
    a_tab = torch.empty(2, rows_n, NB, HEAD_DIM, dtype=torch.float16)
    bias = torch.empty(2, rows_n, NB, dtype=torch.float32)
    prep_kernel[(rows_n, -(-NB // 8))](t["q"], t["q"].stride(0), t["q"].stride(1), t["k_base_min"], t["k_base_scale"],
                                        t["k_res_min"], t["k_res_scale"], a_tab, bias, H, NB, D=HEAD_DIM, BLK=8)

    def values(x):  # bytes -> (1024 + low, 1024 + 16 high) per channel
        x = x.long()
        return torch.stack([1024 + (x & 15), 1024 + 16 * (x >> 4)], -1).flatten(-2).double()

    a = a_tab.double().view(2, B, H, NB, 1, HEAD_DIM).expand(2, B, H, NB, GROUP, HEAD_DIM).reshape(2, B, H, S, HEAD_DIM)
    vb = values(t["k_base"]).view(B, H, S, HEAD_DIM)
    rows = t["rows"][0].long()
    has = rows >= 0
    vr_all = values(t["k_res"]).view(B, H, -1, HEAD_DIM)
    vr = torch.gather(vr_all, 2, rows.clamp_min(0)[:, None, :, None].expand(B, H, S, HEAD_DIM))
    vr = torch.where(has[:, None, :, None], vr, 1024.0)  # absent: codes load as 0
    acc = (a[0] * vb).sum(-1) + (a[1] * vr).sum(-1)
    bs = bias.double().view(2, B, H, NB, 1).expand(2, B, H, NB, GROUP).reshape(2, B, H, S)
    s = (acc + bs[0] + torch.where(has[:, None, :], bs[1], 0.0)) * scale
    return torch.where(t["mask"][:, :, 0] != 0, s, float("-inf")).view(B * H, S)


def launch(kind: str, t, scale, split: int, grid_only=False):
    dims = t["dims"]
    B, H, S, NB, CAPT = dims["B"], dims["H"], dims["S"], dims["NB"], dims["CAPT"]
    rows_n = B * H
    chunk = -(-S // split)
    chunk = -(-chunk // TILE) * TILE
    split = -(-S // chunk)
    dev = t["q"].device
    probs = torch.empty(rows_n, S, dtype=torch.float32, device=dev)
    pm = torch.empty(rows_n, split, dtype=torch.float32, device=dev)
    pl = torch.empty(rows_n, split, dtype=torch.float32, device=dev)
    q, mask = t["q"], t["mask"]
    if kind.startswith("gluon"):
        a_tab = torch.empty(2, rows_n, NB, HEAD_DIM, dtype=torch.float16, device=dev)
        bias = torch.empty(2, rows_n, NB, dtype=torch.float32, device=dev)
        blk = 8
        pargs = (q, q.stride(0), q.stride(1), t["k_base_min"], t["k_base_scale"], t["k_res_min"], t["k_res_scale"],
                 a_tab, bias, H, NB)
        args = (mask, probs, pm, pl, a_tab, bias, S, H, scale, mask.stride(0), mask.stride(1),
                chunk, split, t["k_base"], t["k_res"], t["rows"], t["res_layout"], NB, CAPT, rows_n)

        def prep():
            prep_kernel[(rows_n, -(-NB // blk))](*pargs, D=HEAD_DIM, BLK=blk, num_warps=4)

        def main_kernel():
            gluon_scores_kernel[(rows_n, split)](*args, PREFETCH=kind == "gluon_prefetch", num_warps=4)

        def fn():
            prep()
            main_kernel()

        if kind == "gluon_main":  # the scores kernel alone (prep_kernel's tables filled once)
            if not grid_only:
                prep()
            fn = main_kernel  # noqa: F811

        def warm():
            prep_kernel.warmup(*pargs, D=HEAD_DIM, BLK=blk, grid=(rows_n, -(-NB // blk)), num_warps=4)
            return gluon_scores_kernel.warmup(*args, PREFETCH=kind == "gluon_prefetch", grid=(rows_n, split), num_warps=4)
    else:
        cfg = SD.DEFAULT_CONFIG
        lo = torch.full((B,), S, dtype=torch.int32, device=dev)
        kwin = torch.zeros(B, H, 1, HEAD_DIM, dtype=q.dtype, device=dev)
        vb = t["k_base"]
        vpar = torch.zeros(B * H, S, 2, dtype=torch.float16, device=dev)
        args = (q, kwin, mask, probs, pm, pl, lo, S, H, scale, 0,
                q.stride(0), q.stride(1), q.stride(3), *kwin.stride(), mask.stride(0), mask.stride(1), mask.stride(3),
                chunk, split, t["k_base"], t["k_base_min"], t["k_base_scale"], vb, vpar, vpar,
                t["k_res"], t["k_res_min"], t["k_res_scale"], t["k_res"], vpar, vpar, t["rows"], t["res_layout"],
                B, NB, CAPT)
        kw = dict(D=HEAD_DIM, GP=GROUP, BN=cfg.block_n_linear, DEPTH=1, STAGES=cfg.num_stages_linear,
                  num_warps=cfg.num_warps_linear)
        fn = lambda: SD._scores_linear_kernel[(rows_n, split)](*args, **kw)  # noqa: E731
        warm = lambda: SD._scores_linear_kernel.warmup(*args, grid=(rows_n, split), **kw)  # noqa: E731
    return (warm if grid_only else fn), probs, pm, pl


def compile_only():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    os.environ["TRITON_INTERPRET"] = "0"
    import kernel_report as KR
    from triton.runtime.driver import driver
    driver.set_active(KR._AheadOfTimeDriver())
    t = make_inputs(4, 16, 4096, "cpu")
    for kind in ("triton", "gluon", "gluon_prefetch"):
        warm, *_ = launch(kind, t, 0.088, 32, grid_only=True)
        c = warm()
        st = KR._sass_stats(c.asm["cubin"], Path("/tmp/probe_sass"), kind)
        print(kind, json.dumps({k: st[k] for k in ("regs", "spill_ops", "instructions", "bar_sync", "shfl", "mma", "loop", "loads")}))


def emulate():
    """CPU check of the arithmetic (run with TRITON_INTERPRET=1): emulation vs the FP64 reference."""
    t = make_inputs(2, 4, 1024, "cpu")
    ref, emu = reference_scores(t, 0.088), emulate_scores(t, 0.088)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(emu))
    err = (emu - ref)[fin].abs().max().item()
    print(f"emulation vs reference: max abs {err:.2e} (scores up to {ref[fin].abs().max().item():.2f})")
    assert err < 5e-3, err


def bench(args):
    dev = torch.device("cuda")
    n_sm = torch.cuda.get_device_properties(dev).multi_processor_count
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    rows_out = []
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    cms = []
    for i in range(13):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dst.copy_(src)
        e1.record()
        torch.cuda.synchronize()
        if i >= 3:
            cms.append(e0.elapsed_time(e1))
    copy_gbs = 2 * src.numel() / statistics.median(cms) / 1e6
    del src, dst
    print(f"copy bandwidth {copy_gbs:.0f} GB/s (read + write of 1 GiB, median of 10)")
    for B in args.batch:
        t = make_inputs(B, 16, args.seq, dev)
        scale = float(HEAD_DIM) ** -0.5
        ref = reference_scores(t, scale)
        default_split = SD._linear_splits(SD.DEFAULT_CONFIG, n_sm, B * 16)
        # bytes the scores must read: codes, K parameters (FP16 scale + min per block, channel and
        # stream), the residual row map, the mask; and write: the scores
        NB = args.seq // GROUP
        bytes_ = (t["k_base"].numel() + int((t["rows"][0] >= 0).sum()) * 16 * (HEAD_DIM // 2)
                  + B * 16 * NB * HEAD_DIM * 2 * 2 * 2 + B * args.seq * 4 + B * 16 * args.seq * (1 + 4))
        points = [("triton", default_split)] + [(k, sp) for k in args.kinds for sp in (args.splits or [default_split])]
        for kind, split in points:
            fn, probs, pm, pl = launch(kind, t, scale, split)
            fn()
            torch.cuda.synchronize()
            fin = torch.isfinite(ref)
            err = ((probs.double() - ref).abs()[fin]).max().item()
            inf_ok = bool(torch.equal(torch.isinf(probs), ~fin))
            # the split partials against the scores they summarize
            lse = torch.logsumexp(ref, 1)
            got = (pm + torch.log(pl)).double()
            lse_err = (torch.logsumexp(got, 1) - lse).abs().max().item()
            ms = []
            for i in range(args.warmup + args.repeats):
                flush.zero_()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                fn()
                e1.record()
                torch.cuda.synchronize()
                if i >= args.warmup:
                    ms.append(e0.elapsed_time(e1))
            us = statistics.median(ms) * 1000
            row = dict(kind=kind, batch=B, seq=args.seq, split=split, us=us, max_abs_err=err, lse_err=lse_err,
                       inf_pattern_ok=inf_ok, gbs=bytes_ / us / 1e3, copy_gbs=copy_gbs,
                       floor_us=bytes_ / copy_gbs / 1e3)
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe_gluon_scores.json").write_text(json.dumps(rows_out, indent=1))
    print(f"{'kind':14} {'B':>2} {'split':>5} {'us':>8} {'floor us':>8} {'GB/s':>6} {'max err':>9} {'lse err':>9}")
    for r in rows_out:
        print(f"{r['kind']:14} {r['batch']:>2} {r['split']:>5} {r['us']:8.1f} {r['floor_us']:8.1f} {r['gbs']:6.0f} "
              f"{r['max_abs_err']:9.2e} {r['lse_err']:9.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--emulate", action="store_true", help="CPU check of the arithmetic (TRITON_INTERPRET=1)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--kinds", nargs="+", default=["gluon", "gluon_main"],
                    choices=["gluon", "gluon_main", "gluon_prefetch"], help="Gluon variants timed after the Triton kernel")
    ap.add_argument("--splits", type=int, nargs="*", help="split counts of the Gluon variants (default: the production's)")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if args.emulate:
        emulate()
    elif args.compile_only:
        compile_only()
    else:
        bench(args)


if __name__ == "__main__":
    main()
