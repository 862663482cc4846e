"""Sparse decode's ``flashloop`` ops over the packed KV cache (SPEC.md sections 2-3): loop 2's
reference over the whole packed history and the corrections of loops 3..R over the keys it
selected. Conventions as :mod:`.packed_ops` (registered on import; ``triton_op`` CUDA bodies
launching :mod:`.kernels` through ``wrap_triton``; ATen bodies, the oracle, on CPU; fake
implementations stating the contract; ``*_aten`` twins for CPU traces; ``<cache>`` the 20 cache
tensors).

- ``packed_reference_attention(q, inflight_positions, k_inflight, v_inflight, depth, <cache>,
  mask, scale, fractions, capacities)``: ``reference_attention`` over the history as
  ``packed_read`` returns it, this step's tokens exactly.
- ``packed_correction_attention(q [B,Hq,T,D], keys [B,Hq,T,K] int32, count [B,Hq,T], mass,
  o_ref, c_ref, inflight_positions, k_inflight, v_inflight, depth, <cache>, scale) -> out``: sparse
  decode's correction at ``depth`` (``correction_attention``) over the history as ``packed_read``
  returns it at the selected keys: equal to ``packed_read`` of ``selected_positions`` then
  ``correction_attention`` over that compact read with ``local_keys``. Its CUDA body for one
  query row per kv head reconstructs and attends the selected keys in registers
  (``correction_read_attend``), without a BF16 copy of them; several query rows or heads per kv
  head run the read then the correction inside the op.

Under ``sparse_decode_attention.reuse_selected_probabilities``:
- ``packed_reference_attention_probs(<packed_reference_attention's arguments>)``: its outputs plus
  the selected keys' probabilities (``reference_attention_probs``).
- ``packed_reuse_correction_attention(keys, count, probs, o_ref, c_ref, inflight_positions,
  v_inflight, depth, <cache>) -> out`` [B, Hq, T, D] compute dtype: ``reuse_correction_attention``
  over the history as ``packed_read`` returns it at the selected keys (V only). Its CUDA body for
  one query row per kv head reads the V planes of the selected keys and sums in registers
  (``packed_read.launch_packed_read_values``); other shapes read the keys, then the dense op.

"""

from __future__ import annotations

import torch
from torch import Tensor

from flashloop_compile.lowering.kernels import common
from flashloop_compile.lowering.kernels.common import wrap_triton
from flashloop_compile.lowering.ops import (
    _correction_attention_aten, _reference_attention_aten, _reuse_correction_attention_aten, check_reuse_state, reference_fake,
)
from flashloop_compile.lowering.packed_layout import PackedCache, PackedTensors
from flashloop_compile.lowering.packed_ops import (
    LIB, T_, _check_cache, _check_depth, _check_positions, _check_tokens, _read_fake, _twin_schema, packed_read_aten,
)

__all__ = [
    "packed_reference_attention",
    "packed_correction_attention",
    "packed_reference_attention_probs",
    "packed_reuse_correction_attention",
    "selected_positions",
    "local_keys",
    "packed_reference_attention_aten",
    "packed_correction_attention_aten",
    "packed_reference_attention_probs_aten",
    "packed_reuse_correction_attention_aten",
]


def _reference_fake(q, inflight_positions, k_inflight, v_inflight, depth, *rest):
    *cache, mask, scale, fractions, capacities = rest
    B, H, S, D, G, R, NB, CAPT = _check_cache(tuple(cache))
    torch._check(q.dim() == 4 and q.shape[0] <= B, lambda: f"q must be [B <= {B}, Hq, T, D], got {tuple(q.shape)}")
    whole = torch.empty(q.shape[0], S, dtype=torch.int64, device=q.device)
    k, _ = _read_fake(*cache, whole, depth, inflight_positions, k_inflight, v_inflight)
    return reference_fake(q, k, k, mask, scale, fractions, capacities)


def _reference_probs_fake(q, inflight_positions, k_inflight, v_inflight, depth, *rest):
    out = _reference_fake(q, inflight_positions, k_inflight, v_inflight, depth, *rest)
    return out + (torch.empty(out[1].shape, dtype=torch.float32, device=q.device),)


def _reuse_fake(keys, count, probs, o_ref, c_ref, inflight_positions, v_inflight, depth, *cache):
    B, H, S, D, G, R, NB, CAPT = _check_cache(tuple(cache))
    _check_depth(depth, R)
    c = PackedTensors(*cache)
    cdt, dev = c.k_tail.dtype, c.k_base.device
    check_reuse_state(keys, count, probs, o_ref, c_ref)
    torch._check(o_ref.shape[0] <= B and o_ref.shape[3] == D and o_ref.shape[1] % H == 0,
                 lambda: f"o_ref must be [B <= {B}, Hq (a multiple of {H}), T, {D}], got {tuple(o_ref.shape)}")
    _check_tokens("v_inflight", v_inflight, B, H, D, cdt, dev)
    _check_positions("inflight_positions", inflight_positions, o_ref.shape[0], v_inflight.shape[2])
    return torch.empty(o_ref.shape, dtype=cdt, device=dev)


def _correction_fake(q, keys, count, mass, o_ref, c_ref, inflight_positions, k_inflight, v_inflight, depth, *rest):
    *cache, scale = rest
    B, H, S, D, G, R, NB, CAPT = _check_cache(tuple(cache))
    _check_depth(depth, R)
    c = PackedTensors(*cache)
    cdt, dev = c.k_tail.dtype, c.k_base.device
    torch._check(q.dim() == 4 and q.dtype == cdt and q.shape[3] == D and q.shape[0] <= B,
                 lambda: f"q must be [B <= {B}, Hq, T, {D}] {cdt}, got {q.dtype} {tuple(q.shape)}")
    torch._check(q.shape[1] % H == 0, lambda: f"query heads {q.shape[1]} must be a multiple of kv heads {H}")
    torch._check(keys.dtype == torch.int32 and keys.dim() == 4 and keys.shape[:3] == q.shape[:3],
                 lambda: f"keys must be [B, Hq, T, K] int32, got {keys.dtype} {tuple(keys.shape)}")
    torch._check(count.shape == q.shape[:3] and mass.shape == q.shape[:3], lambda: "count and mass are [B, Hq, T]")
    torch._check(o_ref.shape == q.shape and c_ref.shape == q.shape, lambda: "o_ref and c_ref are [B, Hq, T, D]")
    torch._check(o_ref.dtype == torch.float32 and c_ref.dtype == torch.float32 and mass.dtype == torch.float32,
                 lambda: "the reference state (mass, o_ref, c_ref) is FP32")
    _check_tokens("k_inflight", k_inflight, B, H, D, cdt, dev)
    _check_tokens("v_inflight", v_inflight, B, H, D, cdt, dev)
    _check_positions("inflight_positions", inflight_positions, q.shape[0], k_inflight.shape[2])
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def packed_reference_attention_aten(q, inflight_positions, k_inflight, v_inflight, depth, *rest):
    """ATen body of ``flashloop::packed_reference_attention``: sparse decode's loop-2 reference
    (``reference_attention``) over the whole history at ``depth`` as ``packed_read`` returns it
    (positions 0..S-1, this step's tokens in flight)."""
    *cache, mask, scale, fractions, capacities = rest
    grid = torch.arange(PackedTensors(*cache).k_base.shape[2], device=q.device)[None].expand(q.shape[0], -1)
    k, v = packed_read_aten(*cache, grid, depth, inflight_positions, k_inflight, v_inflight)
    return _reference_attention_aten(q, k, v, mask, scale, fractions, capacities)


def packed_reference_attention_probs_aten(q, inflight_positions, k_inflight, v_inflight, depth, *rest):
    """ATen body of ``flashloop::packed_reference_attention_probs``: as packed_reference_attention_aten,
    with the selected keys' probabilities."""
    *cache, mask, scale, fractions, capacities = rest
    grid = torch.arange(PackedTensors(*cache).k_base.shape[2], device=q.device)[None].expand(q.shape[0], -1)
    k, v = packed_read_aten(*cache, grid, depth, inflight_positions, k_inflight, v_inflight)
    return _reference_attention_aten(q, k, v, mask, scale, fractions, capacities, keep_probs=True)


def selected_positions(keys: Tensor, count: Tensor, kv_heads: int) -> Tensor:
    """The positions a correction reads, per kv head: keys [B, Hq, T, K] (loop 2's selection, the
    first count [B, Hq, T] valid) as [B, Hkv, (Hq/Hkv)*T*K] int64, -1 where unused. Query head hq
    uses kv head hq // (Hq/Hkv), so a kv head's query heads are contiguous in ``keys``."""
    b, hq, t, k = keys.shape
    valid = torch.arange(k, device=keys.device) < count[..., None]
    pos = torch.where(valid, keys.long(), torch.full_like(keys, -1, dtype=torch.long))
    return pos.reshape(b, kv_heads, (hq // kv_heads) * t * k)


def local_keys(keys: Tensor, kv_heads: int) -> Tensor:
    """Indices [B, Hq, T, K] int32 of each query head's keys in the compact read of
    :func:`selected_positions` (its kv head's row block (g, t, :) for query head g of the group)."""
    b, hq, t, k = keys.shape
    group = hq // kv_heads
    idx = torch.arange(group * t * k, dtype=torch.int32, device=keys.device).view(group, t, k)
    return idx.repeat(kv_heads, 1, 1)[None].expand(b, -1, -1, -1)


def packed_correction_attention_aten(q, keys, count, mass, o_ref, c_ref, inflight_positions, k_inflight, v_inflight,
                                     depth, *rest) -> Tensor:
    """The correction over the packed history: packed_read of the selected keys, then
    correction_attention over that compact read."""
    *cache, scale = rest
    kv_heads = PackedTensors(*cache).k_base.shape[1]
    k_sel, v_sel = packed_read_aten(*cache, selected_positions(keys, count, kv_heads), depth, inflight_positions,
                                    k_inflight, v_inflight)
    return _correction_attention_aten(q, k_sel, v_sel, local_keys(keys, kv_heads), count, mass, o_ref, c_ref, scale)


def packed_reuse_correction_attention_aten(keys, count, probs, o_ref, c_ref, inflight_positions, v_inflight, depth,
                                           *cache) -> Tensor:
    """The V-only correction over the packed history: packed_read of the selected keys, then
    reuse_correction_attention over that compact read."""
    kv_heads = PackedTensors(*cache).k_base.shape[1]
    _k, v_sel = packed_read_aten(*cache, selected_positions(keys, count, kv_heads), depth, inflight_positions,
                                 v_inflight, v_inflight)
    return _reuse_correction_attention_aten(v_sel, local_keys(keys, kv_heads), count, probs, o_ref, c_ref)


def reuse_read_values(keys, count, probs, o_ref, c_ref, inflight, depth: int, cache: tuple, *,
                      block_p: int | None = None) -> Tensor:
    """packed_reuse_correction_attention's body for one query row per kv head: the selected keys'
    V planes read and weighted in registers (``packed_read.launch_packed_read_values``), then
    O_ref - C_ref + the sum (``correction.reuse_combine_triton``). Runs the Triton kernels (the
    interpreter's on CPU tensors: tests); ``block_p``: keys per program (tests)."""
    from flashloop_compile.lowering.kernels.correction import reuse_combine_triton
    from flashloop_compile.lowering.kernels.packed_read import launch_packed_read_values

    part_acc = launch_packed_read_values(cache, keys, count, probs, depth, inflight=inflight, wrap=wrap_triton,
                                         block_p=block_p)
    out = torch.empty(o_ref.shape, dtype=PackedTensors(*cache).k_tail.dtype, device=o_ref.device)
    reuse_combine_triton(part_acc, o_ref, c_ref, out, wrap=True, num_warps=4 if part_acc.shape[1] <= 32 else 8)
    return out


def _read_window(cache: tuple, depth: int, inflight: tuple, batch: int) -> tuple[Tensor, Tensor, Tensor]:
    """The code-domain kernels' window at ``depth``: (lo [B], k, v [B, Hkv, NW, D]) with the
    positions lo[b] .. lo[b] + NW - 1 (the ring and this step's tokens, ``reference_attention.linear_window``)
    read as packed_read returns them; below lo[b] the kernels read the codes themselves."""
    from flashloop_compile.lowering.kernels import packed_read
    from flashloop_compile.lowering.kernels.reference_attention import linear_window

    lo, window = linear_window(cache, depth, inflight[0])
    c = PackedTensors(*cache)
    k_base, k_tail = c.k_base, c.k_tail
    kw = torch.empty(batch, k_base.shape[1], window.shape[1], 2 * k_base.shape[3], dtype=k_tail.dtype,
                     device=k_base.device)
    vw = torch.empty_like(kw)
    # every tile of the window is per-token (the ring, the step's tokens): a chain of dependent
    # loads per sub-tile. PACKED_READ["window_block_p"] positions per program, one sub-tile each,
    # instead of the read's generic_split sub-tiles in turn (the launch as long as that many chains)
    wb = packed_read.PACKED_READ["window_block_p"]
    tiles = dict(block_p=wb, split=1) if not common.cpu_semantics(k_base.device) else {}
    packed_read.launch_packed_read(cache, window, depth, kw, vw, inflight=inflight, wrap=wrap_triton, **tiles)
    return lo, kw, vw


@torch.library.triton_op(f"{LIB}::packed_reference_attention", mutates_args=())
def _packed_reference_attention(
    q: T_, inflight_positions: T_, k_inflight: T_, v_inflight: T_, depth: int,
    k_base: T_, k_base_min: T_, k_base_scale: T_, v_base: T_, v_base_min: T_, v_base_scale: T_,
    k_res: T_, k_res_min: T_, k_res_scale: T_, v_res: T_, v_res_min: T_, v_res_scale: T_,
    k_tail: T_, v_tail: T_, flushed: T_, row_count: T_,
    rows: T_, depth_count: T_, res_layout: T_, overflow: T_,
    mask: T_, scale: float, fractions: list[float], capacities: list[int],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    cache = (k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, k_res_min, k_res_scale,
             v_res, v_res_min, v_res_scale, k_tail, v_tail, flushed, row_count, rows, depth_count, res_layout, overflow)
    inflight = (inflight_positions, k_inflight, v_inflight)
    if q.device.type != "cuda":
        return torch.ops.flashloop.packed_reference_attention_aten(q, *inflight, depth, *cache, mask, scale, fractions, capacities)
    return _packed_reference_cuda(q, inflight, depth, cache, mask, scale, fractions, capacities, keep_probs=False)


def _packed_reference_cuda(q, inflight, depth, cache, mask, scale, fractions, capacities, *, keep_probs: bool):
    """The CUDA body of packed_reference_attention (keep_probs: of packed_reference_attention_probs)."""
    from flashloop_compile.lowering.kernels import reference_attention as ra
    from flashloop_compile.lowering.kernels.packed_read import launch_packed_read

    c = PackedTensors(*cache)
    k_base, k_tail = c.k_base, c.k_tail
    S, D = k_base.shape[2], 2 * k_base.shape[3]
    if ra.linear_fits(q, k_base.shape[1], D, k_tail.shape[3] // 2, fractions):
        # one query row per kv head: the bulk in the code domain, a window of the ring and
        # in-flight tokens read
        lo, kw, vw = _read_window(cache, depth, inflight, q.shape[0])
        return ra.reference_attention_triton(q, kw, vw, mask, scale, fractions, capacities, wrap=True,
                                             linear=(cache, depth, lo), keep_probs=keep_probs)
    # other shapes: the whole history read, then the reference over it
    grid = torch.arange(S, device=q.device)[None].expand(q.shape[0], -1)
    k = torch.empty(q.shape[0], k_base.shape[1], S, D, dtype=k_tail.dtype, device=q.device)
    v = torch.empty_like(k)
    launch_packed_read(cache, grid, depth, k, v, inflight=inflight, wrap=wrap_triton)
    return ra.reference_attention_triton(q, k, v, mask, scale, fractions, capacities, wrap=True, keep_probs=keep_probs)


@torch.library.triton_op(f"{LIB}::packed_reference_attention_probs", mutates_args=())
def _packed_reference_attention_probs(
    q: T_, inflight_positions: T_, k_inflight: T_, v_inflight: T_, depth: int,
    k_base: T_, k_base_min: T_, k_base_scale: T_, v_base: T_, v_base_min: T_, v_base_scale: T_,
    k_res: T_, k_res_min: T_, k_res_scale: T_, v_res: T_, v_res_min: T_, v_res_scale: T_,
    k_tail: T_, v_tail: T_, flushed: T_, row_count: T_,
    rows: T_, depth_count: T_, res_layout: T_, overflow: T_,
    mask: T_, scale: float, fractions: list[float], capacities: list[int],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    cache = (k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, k_res_min, k_res_scale,
             v_res, v_res_min, v_res_scale, k_tail, v_tail, flushed, row_count, rows, depth_count, res_layout, overflow)
    inflight = (inflight_positions, k_inflight, v_inflight)
    if q.device.type != "cuda":
        return torch.ops.flashloop.packed_reference_attention_probs_aten(q, *inflight, depth, *cache, mask, scale,
                                                                         fractions, capacities)
    return _packed_reference_cuda(q, inflight, depth, cache, mask, scale, fractions, capacities, keep_probs=True)


@torch.library.triton_op(f"{LIB}::packed_reuse_correction_attention", mutates_args=())
def _packed_reuse_correction_attention(
    keys: T_, count: T_, probs: T_, o_ref: T_, c_ref: T_, inflight_positions: T_, v_inflight: T_, depth: int,
    k_base: T_, k_base_min: T_, k_base_scale: T_, v_base: T_, v_base_min: T_, v_base_scale: T_,
    k_res: T_, k_res_min: T_, k_res_scale: T_, v_res: T_, v_res_min: T_, v_res_scale: T_,
    k_tail: T_, v_tail: T_, flushed: T_, row_count: T_,
    rows: T_, depth_count: T_, res_layout: T_, overflow: T_,
) -> Tensor:
    cache = (k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, k_res_min, k_res_scale,
             v_res, v_res_min, v_res_scale, k_tail, v_tail, flushed, row_count, rows, depth_count, res_layout, overflow)
    if keys.device.type != "cuda":
        return torch.ops.flashloop.packed_reuse_correction_attention_aten(keys, count, probs, o_ref, c_ref,
                                                                          inflight_positions, v_inflight, depth, *cache)
    from flashloop_compile.lowering.kernels.correction import reuse_correction_triton
    from flashloop_compile.lowering.kernels.packed_read import launch_packed_read

    hkv, D, G = k_base.shape[1], 2 * k_base.shape[3], k_tail.shape[3] // 2
    if keys.shape[1] == hkv and keys.shape[2] == 1 and not (D & (D - 1) or G % 2):
        return reuse_read_values(keys, count, probs, o_ref, c_ref, (inflight_positions, v_inflight), depth, cache)
    # several query rows or query heads per kv head: the compact read, then the V-only correction over it
    sel = selected_positions(keys, count, hkv)
    k_sel = torch.empty((keys.shape[0], hkv, sel.shape[-1], D), dtype=k_tail.dtype, device=keys.device)
    v_sel = torch.empty_like(k_sel)
    launch_packed_read(cache, sel, depth, k_sel, v_sel, inflight=(inflight_positions, v_inflight, v_inflight), wrap=wrap_triton)
    return reuse_correction_triton(v_sel, local_keys(keys, hkv), count, probs, o_ref, c_ref, wrap=True)


def correction_read_attend(q, keys, count, mass, o_ref, c_ref, inflight, depth: int, cache: tuple, scale: float, *,
                           block_p: int | None = None) -> Tensor:
    """packed_correction_attention's body for one query row per kv head (the default): the
    selected keys reconstructed and attended in registers, one softmax partial per tile
    (``packed_read.launch_packed_read_attend``), then combined with O_ref - C_ref
    (``correction.correction_combine_triton``): the read-then-correct values without the BF16
    copy of the selected keys. Runs the Triton kernels (the interpreter's on CPU tensors: tests);
    ``block_p``: keys per program (tests)."""
    from flashloop_compile.lowering.kernels.correction import correction_combine_triton

    part_m, part_l, part_acc = torch.ops.flashloop.packed_read_attend(q, keys, count, *inflight, depth, *cache,
                                                                      float(scale), block_p or 0)
    nt = part_m.shape[1]
    out = torch.empty_like(q)
    # 8 warps past 32 partials per row (103 at 32K): the [partials, D] tile stays in registers
    correction_combine_triton(part_m, part_l, part_acc, mass, o_ref, c_ref, out, wrap=True,
                                 num_warps=4 if nt <= 32 else 8)
    return out


@torch.library.triton_op(f"{LIB}::packed_correction_attention", mutates_args=())
def _packed_correction_attention(
    q: T_, keys: T_, count: T_, mass: T_, o_ref: T_, c_ref: T_,
    inflight_positions: T_, k_inflight: T_, v_inflight: T_, depth: int,
    k_base: T_, k_base_min: T_, k_base_scale: T_, v_base: T_, v_base_min: T_, v_base_scale: T_,
    k_res: T_, k_res_min: T_, k_res_scale: T_, v_res: T_, v_res_min: T_, v_res_scale: T_,
    k_tail: T_, v_tail: T_, flushed: T_, row_count: T_,
    rows: T_, depth_count: T_, res_layout: T_, overflow: T_,
    scale: float,
) -> Tensor:
    cache = (k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, k_res_min, k_res_scale,
             v_res, v_res_min, v_res_scale, k_tail, v_tail, flushed, row_count, rows, depth_count, res_layout, overflow)
    inflight = (inflight_positions, k_inflight, v_inflight)
    if q.device.type != "cuda":
        return torch.ops.flashloop.packed_correction_attention_aten(q, keys, count, mass, o_ref, c_ref, *inflight,
                                                                    depth, *cache, scale)
    from flashloop_compile.lowering.kernels.correction import correction_attention_triton
    from flashloop_compile.lowering.kernels.packed_read import launch_packed_read, read_attend_fits

    hkv, D = k_base.shape[1], 2 * k_base.shape[3]
    if read_attend_fits(q, cache):
        return correction_read_attend(q, keys, count, mass, o_ref, c_ref, inflight, depth, cache, scale)
    # several query rows or query heads per kv head: the compact read, then the correction over it
    sel = selected_positions(keys, count, hkv)
    shape = (q.shape[0], hkv, sel.shape[-1], D)
    k_sel = torch.empty(shape, dtype=k_tail.dtype, device=q.device)
    v_sel = torch.empty_like(k_sel)
    launch_packed_read(cache, sel, depth, k_sel, v_sel, inflight=inflight, wrap=wrap_triton)
    return correction_attention_triton(q, k_sel, v_sel, local_keys(keys, hkv), count, mass, o_ref, c_ref, scale,
                                          wrap=True)


@torch.library.custom_op(f"{LIB}::packed_read_attend", mutates_args=())
def _packed_read_attend(
    q: T_, keys: T_, count: T_, inflight_positions: T_, k_inflight: T_, v_inflight: T_, depth: int,
    k_base: T_, k_base_min: T_, k_base_scale: T_, v_base: T_, v_base_min: T_, v_base_scale: T_,
    k_res: T_, k_res_min: T_, k_res_scale: T_, v_res: T_, v_res_min: T_, v_res_scale: T_,
    k_tail: T_, v_tail: T_, flushed: T_, row_count: T_,
    rows: T_, depth_count: T_, res_layout: T_, overflow: T_,
    scale: float, block_p: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """The read-and-attend correction's partials (part_m, part_l [B * H, NT], part_acc [B * H, NT, D]:
    ``packed_read.launch_packed_read_attend``; block_p 0: the depth's default tile), launched by
    correction_read_attend. An opaque op, not a ``wrap_triton`` launch, because Inductor compiles a
    user kernel with num_warps and num_stages only and drops ``maxnreg``
    (``PACKED_READ["attend_maxnreg"]``; DESIGN.md, "A register cap reaches a compiled graph through an
    opaque op"); launched here directly, the cap holds inside the compiled step. Registered on
    import, as mma_linear_scores."""
    from flashloop_compile.lowering.kernels.packed_read import launch_packed_read_attend

    cache = (k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, k_res_min, k_res_scale,
             v_res, v_res_min, v_res_scale, k_tail, v_tail, flushed, row_count, rows, depth_count, res_layout, overflow)
    part_m, part_l, part_acc, _ = launch_packed_read_attend(
        cache, q, keys, count, depth, scale, inflight=(inflight_positions, k_inflight, v_inflight),
        block_p=block_p or None)
    return part_m, part_l, part_acc


@_packed_read_attend.register_fake
def _(q, keys, count, inflight_positions, k_inflight, v_inflight, depth, k_base, *rest):
    from flashloop_compile.lowering.kernels.packed_read import correction_tiles

    block_p = rest[-1]
    _, nt = correction_tiles(keys, depth, block_p or None)
    rows_ = q.shape[0] * q.shape[1]
    part_m = q.new_empty(rows_, nt, dtype=torch.float32)
    return part_m, torch.empty_like(part_m), q.new_empty(rows_, nt, q.shape[-1], dtype=torch.float32)


@torch.library.custom_op(f"{LIB}::mma_linear_scores", mutates_args=("probs", "part_m", "part_l"))
def _mma_linear_scores(q: T_, k: T_, mask: T_, probs: T_, part_m: T_, part_l: T_, lo: T_,
                       k_base: T_, k_base_min: T_, k_base_scale: T_, k_res: T_, k_res_min: T_, k_res_scale: T_,
                       rows: T_, res_layout: T_, scale: float, chunk: int, split: int, depth: int) -> None:
    """The code-domain reference scores on tensor cores (kernels/gluon_scores.py, a Gluon kernel:
    opaque to Inductor, whose wrap_triton analyses tl kernels only), launched by
    reference_attention.reference_attention_triton: fills probs [B * Hkv, S] and the split partials
    part_m / part_l [B * Hkv, split] as _scores_linear_kernel does. Registered here with the other
    ops, on import: Inductor's cached code calls it by name, in a process that may never have traced
    the reference's body."""
    from flashloop_compile.lowering.kernels.gluon_scores import launch_scores

    launch_scores(q, k, mask, probs, part_m, part_l, lo, k_base, k_base_min, k_base_scale, k_res, k_res_min,
                  k_res_scale, rows, res_layout, scale, chunk, split, depth)


@_mma_linear_scores.register_fake
def _(*args):
    return None


@torch.library.custom_op(f"{LIB}::mma_linear_pv", mutates_args=("part_o", "part_mass"))
def _mma_linear_pv(probs: T_, v: T_, thr: T_, cut: T_, part_o: T_, part_mass: T_, lo: T_,
                   v_base: T_, v_base_min: T_, v_base_scale: T_, v_res: T_, v_res_min: T_, v_res_scale: T_,
                   rows: T_, res_layout: T_, chunk: int, split: int, depth: int) -> None:
    """The code-domain reference PV on tensor cores (kernels/gluon_pv.py, Gluon: opaque to
    Inductor), launched by reference_attention.reference_attention_triton: fills the split partials
    part_o [split, 2 R, D] / part_mass [split, 2 R] as _pv_linear_kernel does. Registered on
    import, as mma_linear_scores."""
    from flashloop_compile.lowering.kernels.gluon_pv import launch_pv

    launch_pv(probs, v, thr, cut, part_o, part_mass, lo, v_base, v_base_min, v_base_scale, v_res, v_res_min,
              v_res_scale, rows, res_layout, chunk, split, depth)


@_mma_linear_pv.register_fake
def _(*args):
    return None


_packed_reference_aten_op = torch.library.custom_op(
    f"{LIB}::packed_reference_attention_aten", packed_reference_attention_aten, mutates_args=(),
    schema=_twin_schema(_packed_reference_attention),
)


_packed_correction_aten_op = torch.library.custom_op(
    f"{LIB}::packed_correction_attention_aten", packed_correction_attention_aten, mutates_args=(),
    schema=_twin_schema(_packed_correction_attention),
)


_packed_reference_probs_aten_op = torch.library.custom_op(
    f"{LIB}::packed_reference_attention_probs_aten", packed_reference_attention_probs_aten, mutates_args=(),
    schema=_twin_schema(_packed_reference_attention_probs),
)


_packed_reuse_aten_op = torch.library.custom_op(
    f"{LIB}::packed_reuse_correction_attention_aten", packed_reuse_correction_attention_aten, mutates_args=(),
    schema=_twin_schema(_packed_reuse_correction_attention),
)


for _op, _aten, _fake in (
    (_packed_reference_attention, packed_reference_attention_aten, _reference_fake),
    (_packed_correction_attention, packed_correction_attention_aten, _correction_fake),
    (_packed_reference_attention_probs, packed_reference_attention_probs_aten, _reference_probs_fake),
    (_packed_reuse_correction_attention, packed_reuse_correction_attention_aten, _reuse_fake),
):
    _op.register_kernel("cpu")(_aten)
    _op.register_fake(_fake)
for _op, _fake in ((_packed_reference_aten_op, _reference_fake), (_packed_correction_aten_op, _correction_fake),
                   (_packed_reference_probs_aten_op, _reference_probs_fake), (_packed_reuse_aten_op, _reuse_fake)):
    _op.register_fake(_fake)


# ------------------------------------------------------------------------------------------------
# wrappers
# ------------------------------------------------------------------------------------------------


def packed_reference_attention(
    cache: PackedCache, layer: int, q: Tensor, inflight: tuple[Tensor, Tensor, Tensor], depth: int, mask: Tensor,
    scale: float, fractions: list[float], capacities: list[int],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Sparse decode's loop-2 reference (``reference_attention``'s outputs) over ``cache``'s whole
    history at ``depth``, this step's tokens ``inflight`` = (positions [B, Ti], k, v) exactly."""
    return torch.ops.flashloop.packed_reference_attention(
        q, *inflight, int(depth), *cache.op_tensors(layer), mask, float(scale), list(fractions), list(capacities)
    )


def packed_correction_attention(
    cache: PackedCache, layer: int, q: Tensor, keys: Tensor, count: Tensor, mass: Tensor, o_ref: Tensor,
    c_ref: Tensor, inflight: tuple[Tensor, Tensor, Tensor], depth: int, scale: float,
) -> Tensor:
    """Sparse decode's correction at ``depth`` over ``cache``'s history at the selected keys (keys
    [B, Hq, T, K] of one key fraction, count valid; mass, o_ref, c_ref: loop 2's reference state),
    this step's tokens ``inflight`` = (positions [B, Ti], k, v) exactly."""
    return torch.ops.flashloop.packed_correction_attention(
        q, keys, count, mass, o_ref, c_ref, *inflight, int(depth), *cache.op_tensors(layer), float(scale))


def packed_reference_attention_probs(
    cache: PackedCache, layer: int, q: Tensor, inflight: tuple[Tensor, Tensor, Tensor], depth: int, mask: Tensor,
    scale: float, fractions: list[float], capacities: list[int],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``packed_reference_attention`` plus the selected keys' probabilities (reuse_selected_probabilities)."""
    return torch.ops.flashloop.packed_reference_attention_probs(
        q, *inflight, int(depth), *cache.op_tensors(layer), mask, float(scale), list(fractions), list(capacities)
    )


def packed_reuse_correction_attention(
    cache: PackedCache, layer: int, keys: Tensor, count: Tensor, probs: Tensor, o_ref: Tensor, c_ref: Tensor,
    inflight: tuple[Tensor, Tensor], depth: int,
) -> Tensor:
    """reuse_selected_probabilities' correction at ``depth``: loop 2's probabilities probs over the
    selected keys (keys [B, Hq, T, K] of one key fraction, count valid) times ``cache``'s V there,
    this step's tokens ``inflight`` = (positions [B, Ti], v) exactly."""
    return torch.ops.flashloop.packed_reuse_correction_attention(
        keys, count, probs, o_ref, c_ref, *inflight, int(depth), *cache.op_tensors(layer))
