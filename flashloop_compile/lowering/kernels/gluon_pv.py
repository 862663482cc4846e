"""The loop-2 reference's PV products in the code domain (O_ref, C_ref, the mass) on fp16 tensor
cores, in Gluon: the twin of ``gluon_scores.py`` for ``reference_attention._pv_linear_kernel``.

Per (row = b * Hkv + hk, split of the history) the kernel computes, for slot 0 (every key) and
slot 1 (the selected keys: key(p) > thr, or == thr at positions <= cut), sum_n p_slot[n] v[n] with
v = min[n, group] + scale[n, group] * code[n, ch] summed over the streams (base, residuals 1..DEPTH
where present). As one MMA (m16n8k16, one warp per program) per stream and 64-key tile:

    out^T [128 channels, 8] = codes^T [channels, keys] x W [keys, 8],
    W[n, col] = p_slot(col)[n] * scale[n, group(col)] * f,   col = 2 * group + slot (cols 4..7: 0)

* the codes are the A operand, the contraction runs over keys: a 32-bit register of the fragment
  holds one channel of two keys (k, k + 1). Thread (g, c) of the warp (lane = 4g + c) owns the
  8 code bytes 8g..8g+7 (16 channels) of the 16 keys 16c..16c+15: one 64-bit load per key, and for
  each key pair one PRMT puts byte j of both keys in one word, one AND per nibble masks it into two
  fp16 subnormals code * 2^-24 (high nibble: 16 code * 2^-24): 0.75 instructions per code. The
  fragment's row (channel) and contraction (key) indices are relabelled so that these registers
  are the fragment as they stand: row m holds channel 16 (m mod 8) + m // 8, contraction index k
  key 32 k3 + ... (``_codes_operand``; W takes the same key relabel). The relabels are reshapes
  and permutes of the logical indices, no data moves (convert_layout checks it on W's side).
* W is rounded to fp16 after a per-tile power-of-two factor f puts its largest entry in
  [2^14, 2^15): each product code * W is exact in the
  FP32 accumulator and 2^24 / f comes out after the MMA. Keys without residual j get W = 0.
* the minima and the masses are per key and column: summed in registers over the split
  (sum p_slot min[n, group]), reduced once per split.
* the window (positions from lo[b] on, BF16 rows in packed_read's buffer) is a few tiles per row:
  FMAs on CUDA cores.

Output: the split partials in ``_pv_linear_kernel``'s layout for ``_pv_combine_kernel``. Exact up
to W's fp16 rounding (11 bits; the tl kernel keeps p * scale in FP32). Gluon does not run under the
Triton interpreter: on CPU the tl kernel runs, and this one's sum is checked by an emulation of its
operands (tests/test_gluon_pv.py) and its compile for sm_90 (tests/test_kernel_report.py); on the
GPU against the tl kernel (tests/gpu/test_packed_gpu.py). Launched from the opaque custom op
``flashloop::mma_linear_pv`` wherever it fits (1.8x the tl kernel per site at B4 x 32K on the
H200, the 4x32K decode step 28.5 vs 30.9 ms).
"""

from __future__ import annotations

import torch

try:  # Gluon ships with triton >= 3.4
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
except ImportError:  # pragma: no cover - older triton: the tl kernel runs
    gluon = None

HEAD_DIM, GROUP, TILE = 128, 64, 64  # the one shape the layouts below are built for (V groups of 64 channels)
WINDOW_TILE = 16  # keys per tile of the window's BF16 loop

if gluon is not None:
    D = gl.constexpr(HEAD_DIM)
    BN = gl.constexpr(TILE)
    BNW = gl.constexpr(WINDOW_TILE)
    # one warp: the accumulator out^T [D, 8], the codes operand [D, BN], W [BN, 8]
    MMA = gl.constexpr(gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]))
    A_OP = gl.constexpr(gl.DotOperandLayout(0, MMA, 2))
    B_OP = gl.constexpr(gl.DotOperandLayout(1, MMA, 2))
    # A_OP [128, 64] (gl.to_linear_layout): regs [0,1] [8,0] [0,8] [0,16] [0,32] [16,0] [32,0] [64,0];
    # lanes [0,2] [0,4] [1,0] [2,0] [4,0]. The code bytes [BN keys n, D/2 bytes p]: thread (g, c)
    # holds bytes 8g..8g+7 (registers, one 64-bit load) of keys 16c..16c+15 (registers).
    BYTES = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [1, 0], [2, 0], [4, 0], [8, 0]],
        lane_bases=[[16, 0], [32, 0], [0, 8], [0, 16], [0, 32]],
        warp_bases=[], block_bases=[], shape=[TILE, HEAD_DIM // 2]))
    # W and the per-key sums [BN keys n, 8 columns]: thread (g, c) holds column g of keys
    # 16c..16c+15 (registers: 128-bit loads of p and of the V parameters)
    WN = gl.constexpr(gl.DistributedLinearLayout(
        reg_bases=[[1, 0], [2, 0], [4, 0], [8, 0]],
        lane_bases=[[16, 0], [32, 0], [0, 1], [0, 2], [0, 4]],
        warp_bases=[], block_bases=[], shape=[TILE, 8]))
    KEYS = gl.constexpr(gl.SliceLayout(1, WN))
    # WN as [4, BN / 4, 8] (lane c, register, column) summed over the registers
    KSUM = gl.constexpr(gl.SliceLayout(1, gl.DistributedLinearLayout(
        reg_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0]],
        lane_bases=[[1, 0, 0], [2, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
        warp_bases=[], block_bases=[], shape=[4, TILE // 4, 8])))  # per-key vectors (the same threads as BYTES' keys)
    COLS = gl.constexpr(gl.SliceLayout(0, WN))
    # the window's BF16 rows [BNW, D] and per-channel vectors
    WIN = gl.constexpr(gl.BlockedLayout(size_per_thread=[1, 4], threads_per_warp=[4, 8], warps_per_cta=[1, 1],
                                        order=[1, 0]))
    CH = gl.constexpr(gl.SliceLayout(0, WIN))

    @gluon.jit
    def _pair_nibbles(a, b):
        """The codes of bytes a (key k) and b (key k + 1), four bytes j = 0..3 of each at a time, as
        fp16 subnormals code * 2^-24 (low nibble) and 16 code * 2^-24 (high nibble), one register
        per nibble and byte holding both keys: (lo j0, lo j1), (hi j0, hi j1), (lo j2, lo j3),
        (hi j2, hi j3), each element pair = (key k, key k + 1)."""
        return gl.inline_asm_elementwise(
            """{
            .reg .b32 t0, t1, t2, t3;
            prmt.b32 t0, $8, $9, 0x5410;
            prmt.b32 t1, $8, $9, 0x5511;
            prmt.b32 t2, $8, $9, 0x6622;
            prmt.b32 t3, $8, $9, 0x7733;
            and.b32 $0, t0, 0x000F000F;
            and.b32 $1, t1, 0x000F000F;
            and.b32 $2, t0, 0x00F000F0;
            and.b32 $3, t1, 0x00F000F0;
            and.b32 $4, t2, 0x000F000F;
            and.b32 $5, t3, 0x000F000F;
            and.b32 $6, t2, 0x00F000F0;
            and.b32 $7, t3, 0x00F000F0;
            }""",
            "=r,=r,=r,=r,=r,=r,=r,=r,r,r", [a, b], dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
            is_pure=True, pack=4)

    @gluon.jit
    def _codes_operand(y):
        """The A operand [D, BN] (rows and keys relabelled, see the module) of code bytes y [BN, D/2]
        (BYTES)."""
        a, b = gl.split(gl.permute(gl.reshape(y, [BN // 2, 2, D // 2]), [0, 2, 1]))  # keys 2i, 2i + 1
        o0, o1, o2, o3 = _pair_nibbles(a, b)
        # z[i, 4u + e, h, q] = nibble h of byte 4u + 2q + e // 2 of key 2i + e % 2:
        # channel 8u + 4q + 2 (e // 2) + h, key 2i + e % 2
        z = gl.reshape(gl.join(gl.join(o0, o1), gl.join(o2, o3)), [BN // 2, 16, 2, 2, 2, 2])  # i, u, e1, e0, h, q
        x = gl.reshape(gl.permute(z, [1, 5, 2, 4, 0, 3]), [D, BN])  # [channel, key]
        # rows m = 8 (channel mod 16) + channel // 16; k = 32 n3 + 16 n2 + 8 n1 + 4 n5 + 2 n4 + n0
        x = gl.permute(gl.reshape(x, [8, 16, 2, 2, 2, 2, 2, 2]), [1, 0, 4, 5, 6, 2, 3, 7])
        return gl.convert_layout(gl.reshape(x, [D, BN]), A_OP)

    @gluon.jit
    def _w_operand(w):
        """The B operand [BN, 8] of fp16 weights w [BN keys, 8] (WN), keys relabelled as the codes'."""
        w = gl.permute(gl.reshape(w, [2, 2, 2, 2, 2, 2, 8]), [2, 3, 4, 0, 1, 5, 6])
        return gl.convert_layout(gl.reshape(w, [BN, 8]), B_OP, assert_trivial=True)

    @gluon.jit
    def _group_half(w, grp1):
        """FP32 value of the fp16 half of int32 words w [BN, 1] (two V groups per word: group 0 low)
        that each column's group takes, [BN, 8] (grp1 [1, 8]: the column's group is 1)."""
        h = gl.where(grp1, gl.expand_dims(w, 1) >> 16, gl.expand_dims(w, 1))
        return h.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)

    @gluon.jit
    def _key_sum(x):
        """x [BN, 8] (WN) summed over each thread's 16 keys, [4, 8] (lane c, column): no shuffles."""
        return gl.sum(gl.reshape(x, [4, BN // 4, 8]), 1)

    @gluon.jit
    def _add_stream(acc, ymin, p2, grp1, y, scale_w, min_w):
        """Adds one stream's tile to the running sums: acc [D, 8] (MMA) and ymin [4, 8] (KSUM: sum of
        p_slot * min per lane c and column), from its code bytes y [BN, D/2] (BYTES) and V parameter
        words [BN] (KEYS)."""
        w = p2 * _group_half(scale_w, grp1)
        ymin += _key_sum(p2 * _group_half(min_w, grp1))
        # f = 2^(141 - e) for the largest entry's biased exponent e: max * f in [2^14, 2^15); 2^24 / f
        e = (gl.max(gl.max(w, 0), 0).to(gl.int32, bitcast=True) >> 23) & 255  # keys in registers first
        e = gl.minimum(gl.maximum(e, 14), 244)
        f = ((268 - e) << 23).to(gl.float32, bitcast=True)
        unit = ((e + 10) << 23).to(gl.float32, bitcast=True)
        part = mma_v2(_codes_operand(y), _w_operand((w * f).to(gl.float16)), gl.zeros([D, 8], gl.float32, layout=MMA))
        return acc + part * unit, ymin

    @gluon.jit
    def _add_rows(acc, ymin, p2, grp1, codes, scale_w, min_w, p, g, has):
        """_add_stream for code rows g [BN] (KEYS; 32- or 64-bit row indices) of a code table [., D/2]
        and its parameter words, gathered where has (absent rows: codes and parameters 0)."""
        gb = gl.convert_layout(g, gl.SliceLayout(1, BYTES), assert_trivial=True)
        hb = gl.convert_layout(has, gl.SliceLayout(1, BYTES), assert_trivial=True)
        y = gl.load(codes + gl.expand_dims(gb * (D // 2), 1) + gl.expand_dims(p, 0),
                    mask=gl.expand_dims(hb, 1) & gl.expand_dims(p >= 0, 0), other=0)
        return _add_stream(acc, ymin, p2, grp1, y, gl.load(scale_w + g, mask=has, other=0),
                           gl.load(min_w + g, mask=has, other=0))

    @gluon.jit
    def _selected(pv, n, thr, cut):
        """selection._prob_key(pv) > thr, or == thr at positions n <= cut."""
        bits = pv.to(gl.int32, bitcast=True)
        key = gl.where(pv >= 0.0, gl.minimum(bits, (1 << 30) - 2) + 1, 0)
        return (key > thr) | ((key == thr) & (n <= cut))

    @gluon.jit
    def _v_tables(v_base, v_base_min, v_base_scale, v_res, v_res_min, v_res_scale, row, S, CAPT):
        """Row ``row``'s V codes (base [S, D/2], residual rows [CAPT, D/2]) and their parameters as
        one 32-bit word (two fp16 groups) per code row: (vb, vr, vbm, vbs, vrm, vrs)."""
        words = gl.pointer_type(gl.int32)
        return (v_base + row * S * (D // 2), v_res + row * CAPT * (D // 2),
                (v_base_min + row * S * 2).to(words, bitcast=True), (v_base_scale + row * S * 2).to(words, bitcast=True),
                (v_res_min + row * CAPT * 2).to(words, bitcast=True), (v_res_scale + row * CAPT * 2).to(words, bitcast=True))

    @gluon.jit
    def _slot_sums(acc, ymin, msum, slot: gl.constexpr):
        """A slot's split sums from the running sums: sum p v per channel [D] (CH) -- out^T's row m is
        channel 16 (m mod 8) + m // 8, odd channels carry 16 code, plus sum p min of the channel's
        group -- and sum p."""
        m = gl.arange(0, D, layout=gl.SliceLayout(1, MMA))
        cm = gl.expand_dims(gl.arange(0, 8, layout=gl.SliceLayout(0, MMA)), 0)
        c_of_m = 16 * (m % 8) + m // 8
        unit = gl.where(c_of_m % 2 == 1, 0.0625, 1.0)
        grp_m = gl.expand_dims(c_of_m // (D // 2), 1)
        out = gl.sum(gl.where(cm == 2 * grp_m + slot, acc, 0.0), 1) * unit
        out = gl.convert_layout(gl.reshape(gl.permute(gl.reshape(out, [16, 8]), [1, 0]), [D]), CH)
        cmin = gl.sum(ymin, 0)  # [8]: column 2 group + slot
        c8 = gl.arange(0, 8, layout=gl.SliceLayout(0, KSUM))
        g1 = gl.arange(0, D, layout=CH) >= D // 2
        out += gl.where(g1, gl.sum(gl.where(c8 == 2 + slot, cmin, 0.0), 0), gl.sum(gl.where(c8 == slot, cmin, 0.0), 0))
        return out, gl.sum(gl.where(c8 == slot, gl.sum(msum, 0), 0.0), 0)

    @gluon.jit
    def _mma_pv_kernel(
        p_ptr, v_ptr, thr_ptr, cut_ptr, po_ptr, pmass_ptr, lo_ptr,
        S, HKV, R, E_TOTAL, NW, svb, svh, svs, CHUNK,
        v_base, v_base_min, v_base_scale, v_res, v_res_min, v_res_scale, rows, res_layout, B, CAPT,
        DEPTH: gl.constexpr,
    ):
        """_pv_linear_kernel (one query row per kv head, row = b * HKV + hk, one fraction) with the
        keys below lo[b] on tensor cores; partials [split, slot, row] for _pv_combine_kernel. p and
        the selection test are computed in W's layout: every lane of a column group repeats them
        (once per key through shared memory took 1.6-1.8x as long on the H200)."""
        pid_bh = gl.program_id(0)
        pid_s = gl.program_id(1)
        b = (pid_bh // HKV).to(gl.int64)
        hk = (pid_bh % HKV).to(gl.int64)
        row = pid_bh.to(gl.int64)
        thr = gl.load(thr_ptr + row)
        cut = gl.load(cut_ptr + row)
        vb, vr, vbm, vbs, vrm, vrs = _v_tables(v_base, v_base_min, v_base_scale, v_res, v_res_min, v_res_scale, row, S,
                                               CAPT)
        p = gl.arange(0, D // 2, layout=gl.SliceLayout(0, BYTES))
        nk = gl.arange(0, BN, layout=KEYS)
        col = gl.expand_dims(gl.arange(0, 8, layout=COLS), 0)
        grp1 = (col // 2) == 1
        lo = gl.load(lo_ptr + b).to(gl.int32)
        start = pid_s * CHUNK
        end = gl.minimum(start + CHUNK, S)
        mid = gl.maximum(gl.minimum(lo, end), start)
        acc = gl.zeros([D, 8], gl.float32, layout=MMA)
        ymin = gl.zeros([4, 8], gl.float32, layout=KSUM)  # per lane c and column: sum p_slot * min
        msum = gl.zeros([4, 8], gl.float32, layout=KSUM)  # ... and sum p_slot
        tile_off = gl.expand_dims(gl.arange(0, BN, layout=gl.SliceLayout(1, BYTES)) * (D // 2), 1) + gl.expand_dims(p, 0)
        p_row = p_ptr + row * S
        for n0 in range(start, mid, BN):
            n = n0 + nk
            pv = gl.load(p_row + n0 + nk)
            pa = gl.maximum(pv, 0.0)  # probabilities, < 0 where invisible
            ps = gl.where(_selected(pv, n, thr, cut), pa, 0.0)
            p2 = gl.where(col < 4, gl.where(col % 2 == 0, gl.expand_dims(pa, 1), gl.expand_dims(ps, 1)), 0.0)
            msum += _key_sum(p2)
            # the base: whole tiles, addresses from the tile's pointer and loop-invariant offsets
            acc, ymin = _add_stream(acc, ymin, p2, grp1, gl.load(vb + n0.to(gl.int64) * (D // 2) + tile_off),
                                    gl.load(vbs + n0 + nk), gl.load(vbm + n0 + nk))
            for j in gl.static_range(1, DEPTH + 1):  # residual j: gathered rows where present
                rj = gl.load(rows + ((j - 1) * B + b) * S + n0 + nk)
                has = rj >= 0
                g = (gl.load(res_layout + j) + gl.where(has, rj, 0)).to(gl.int64)
                acc, ymin = _add_rows(acc, ymin, p2, grp1, vr, vrs, vrm, p, g, has)
        # the window: BF16 rows lo .. lo + NW - 1 of packed_read's buffer v_ptr [B, HKV, NW, D]
        wn = gl.arange(0, BNW, layout=gl.SliceLayout(1, WIN))
        ch = gl.arange(0, D, layout=CH)
        v_row = v_ptr + b * svb + hk * svh
        yw0 = gl.zeros([D], gl.float32, layout=CH)
        yw1 = gl.zeros([D], gl.float32, layout=CH)
        mw0 = gl.zeros([BNW], gl.float32, layout=gl.SliceLayout(1, WIN))
        mw1 = gl.zeros([BNW], gl.float32, layout=gl.SliceLayout(1, WIN))
        for n0 in range(mid, end, BNW):
            n = n0 + wn
            n_ok = n < end
            idx = (n - lo).to(gl.int64)
            in_buf = n_ok & (idx < NW)
            vt = gl.load(v_row + gl.expand_dims(idx * svs, 1) + gl.expand_dims(ch, 0),
                         mask=gl.expand_dims(in_buf, 1) & gl.expand_dims(ch >= 0, 0), other=0.0).to(gl.float32)
            pv = gl.load(p_ptr + row * S + n, mask=n_ok, other=-1.0)
            pa = gl.where(in_buf, gl.maximum(pv, 0.0), 0.0)
            ps = gl.where(_selected(pv, n, thr, cut), pa, 0.0)
            mw0 += pa
            mw1 += ps
            yw0 += gl.sum(vt * gl.expand_dims(pa, 1), 0)
            yw1 += gl.sum(vt * gl.expand_dims(ps, 1), 0)
        out0, mass0 = _slot_sums(acc, ymin, msum, 0)
        out1, mass1 = _slot_sums(acc, ymin, msum, 1)
        o0 = pid_s * E_TOTAL + row  # [slot, row] in the 2 x R partial layout
        o1 = o0 + R
        gl.store(po_ptr + o0 * D + ch, out0 + yw0)
        gl.store(po_ptr + o1 * D + ch, out1 + yw1)
        gl.store(pmass_ptr + o0, mass0 + gl.sum(mw0, 0))
        gl.store(pmass_ptr + o1, mass1 + gl.sum(mw1, 0))


def fits(p: torch.Tensor, head_dim: int, group: int, depth: int) -> bool:
    """Whether the tensor-core PV applies: Gluon, mma.sync (sm_80+ where p is on CUDA; the caller
    keeps CPU tensors on the tl kernel, except scripts/kernel_report.py's sm_90 compile), head_dim
    128 and V groups of 64 channels (two per row)."""
    if gluon is None or depth < 0:
        return False
    if p.device.type == "cuda" and torch.cuda.get_device_capability(p.device) < (8, 0):
        return False
    return head_dim == HEAD_DIM and group == GROUP


# one-warp _mma_pv_kernel programs per SM at its sm_90 register count (168: scripts/kernel_report.py),
# the split's target
RESIDENT = 12


def splits(n_sm: int, rows: int, s: int, resident: int = RESIDENT) -> tuple[int, int]:
    """(chunk, split) of s keys (the history, or a correction's selected list) for ``rows`` rows:
    as many whole 64-key-tile chunks per row as fill one wave of ``resident`` programs per SM
    (_mma_pv_kernel takes 168 registers: 12 one-warp programs per SM), at most one wave, so that
    no partial second wave trails."""
    want = max(1, min((resident * n_sm) // rows, -(-s // TILE)))
    chunk = -(-(-(-s // want)) // TILE) * TILE
    return chunk, -(-s // chunk)


def _run(kernel, grid):
    return kernel[grid]


def launch_pv(probs, v, thr, cut, part_o, part_mass, lo, v_base, v_base_min, v_base_scale, v_res, v_res_min,
              v_res_scale, rows, res_layout, chunk: int, split: int, depth: int, run=None):
    """The body of ``flashloop::mma_linear_pv`` (registered in packed_sparse_ops.py): fills the split
    partials part_o [split, 2 R, D] and part_mass [split, 2 R] (R = B * Hkv rows, slot 0 then
    slot 1) from probs [R, S] (normalized probabilities, < 0 where invisible), the selection's
    thr / cut [R], the window buffer v [B, Hkv, NW, D] from lo[b] on (unit channel stride) and the
    packed cache's V tensors."""
    run = run or _run
    bsz, hkv, nw = v.shape[0], v.shape[1], v.shape[2]
    cache_b, _, s, _ = v_base.shape  # [B, H, S, D/2]
    capt = v_res.shape[2]
    r = bsz * hkv
    return run(_mma_pv_kernel, (r, split))(
        probs, v, thr, cut, part_o, part_mass, lo,
        s, hkv, r, 2 * r, nw, v.stride(0), v.stride(1), v.stride(2), chunk,
        v_base, v_base_min, v_base_scale, v_res, v_res_min, v_res_scale, rows, res_layout, cache_b, capt,
        DEPTH=depth, num_warps=1)  # (maxnreg 144 or 128 spill at depth 1: 168 registers, 12 programs per SM)


