"""Scores and PV products on the packed INT4 codes without reconstructing K/V (the "code domain"):
q . (min + scale * code) as per-channel sums over the codes, for the code-domain sparse reference
(reference_attention.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from flashloop_compile.lowering.kernels.packed_codec import _bulk_residual_rows


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
def _channel_params(ptr, pw, D: tl.constexpr):
    """FP32 per-channel parameters [1, D/8, 2, 2, 2] (in _code_units' order) of the fp16 table ptr
    from pair word pw on, as stored: D/2 contiguous 32-bit words (128-bit loads), split as
    _word_pairs. Fewer elements than a program's threads, they are no layout anchor: they take
    the code tile's layout instead of converting it every tile."""
    w = tl.load(ptr.to(tl.pointer_type(tl.int32), bitcast=True) + pw + tl.arange(0, D // 2)[None, :])
    return _fp16_halves(tl.reshape(w, [1, D // 8, 2, 2]))


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
                   b, h, B, H, S, NB, D: tl.constexpr, DEPTH: tl.constexpr):
    """q . k [BN] of positions p (in K block blk) of the flushed bulk of row (b, h) without
    reconstructing k; pointers as _bulk_k's, q24: q * 2^24 in _code_units' order. With codes c
    in units of 2^-24 and the tile's K parameters its block's,
        q . k = q24 . (min_0 / 2^24 + sum_s scale_s c_s) + sum_{present s >= 1} q . min_s:
    one FMA per element and stream into x (the base is present everywhere: its minimum is the
    addend of its FMA), one reduction over channels per tile, and per residual a bias q . min_s
    once per tile, dropped by absent rows (whose codes load as 0)."""
    W: tl.constexpr = D // 8
    words = tl.arange(0, W)[None, :]
    pw = blk * (D // 2)  # the block's parameters
    kb_words = kb_codes.to(tl.pointer_type(tl.int32), bitcast=True)
    kr_words = kr_codes.to(tl.pointer_type(tl.int32), bitcast=True)
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
