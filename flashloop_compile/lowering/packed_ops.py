"""``flashloop`` ops over the packed KV cache (SPEC.md section 3, DESIGN.md "Packed KV storage").

Registered on import, in the style of :mod:`.ops`: each op is a ``torch.library.triton_op`` whose
CUDA body launches the Triton kernels of :mod:`.kernels` (packed_write, packed_read,
packed_attention) through ``wrap_triton`` (so
Inductor sees them and they can be captured in CUDA graphs: no host syncs), with
``register_kernel("cpu")`` pointing at a plain-PyTorch ATen body written for clarity (the
oracle), and a fake implementation whose ``torch._check`` calls state the contract. Traced on a
non-CUDA device (torch.compile on CPU) a body calls the opaque ``flashloop::*_aten`` twin op.

The 20 cache tensors ``<cache>`` are ``PackedKVCache.op_tensors(layer)``: the layer's
``k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, k_res_min,
k_res_scale, v_res, v_res_min, v_res_scale, k_tail, v_tail, flushed, row_count`` and the model's
``rows, depth_count, res_layout, overflow`` (shapes in :mod:`flashloop_compile.runtime.packed_kv`).

- ``packed_kv_write(<cache>, k [B,H,T,D], v, positions [B,T] int64, depth)``: store depth
  ``depth`` of the tokens at ``positions`` (ascending per row; -1 = padding, ignored). Sets
  depth_count = depth + 1 for them; tokens not passed at depth d >= 1 are inactive there (no
  residual, readers inherit). Whole G-token blocks leaving the tail window are quantized now:
  depth 0 flushes while length - flushed >= 2G (length = max position + 1 of the call), depth
  d >= 1 flushes up to where depth d-1 stands (see below). Depth 0 blocks -> base codes; depth d
  blocks -> INT4 residuals of the block's tokens active at d (depth_count > d) against the
  reconstruction of depth d-1, in compact rows allocated from row_count (block-local K groups
  over the active rows, V per row); rows[d][pos] = row. Tokens at or past the new boundary go to
  the ring slot pos % 2G of depth d.
- ``packed_read(<cache>, positions [B,P], depth, inflight_positions [B,Ti], k_inflight
  [B,H,Ti,D], v_inflight) -> (k, v)`` [B,H,P,D] compute dtype: what a reader sees; e = min(depth,
  depth_count[p] - 1); p < flushed[e]: base + the residuals of depths 1..e present in rows;
  otherwise the ring at depth e. Unwritten or -1 positions read as 0. A position equal to one of
  the row's in-flight positions (>= 0: this step's tokens, not yet written at ``depth``) reads
  that token's in-flight K/V exactly, as ``packed_attention`` sees it (Ti = 0: none). Positions
  may also be [B,H,P] (each kv head its own: the keys sparse decode selected).
- ``packed_attention(q [B,Hq,T,D], k_inflight [B,H,Ti,D], v_inflight, q_positions [B,T],
  inflight_positions [B,Ti], depth, <cache>, scale) -> out [B,Hq,T,D]``: causal attention (key
  position <= query position) over the stored keys at positions < P0 (P0 = first valid in-flight
  position of the row) read as above, plus the in-flight keys exactly. FP32 softmax and
  accumulation; query rows at position -1 give 0.

Sparse decode's ops over the packed cache (loop 2's reference, the corrections) are in
:mod:`.packed_sparse_ops`.

Why depth d >= 1 flushes up to flushed[d-1] rather than from its own call's length: a write at
depth d passes only the tokens active at d, whose last position can lie far before the prompt's
end; the boundary of a step is the same for every depth (the reference flushes all depths of a
block at once), and depth 0 (which sees every token) has just set it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flashloop_compile.lowering.kernels.common import stored_end, wrap_triton
from flashloop_compile.reference.codec import dequantize, quantize
from flashloop_compile.lowering.packed_layout import CACHE_NAMES, PackedCache, PackedGeometry, PackedTensors, tensor_specs

__all__ = [
    "packed_kv_write",
    "packed_read",
    "packed_attention",
    "no_inflight",
    "overlay_inflight",
    "packed_kv_write_aten",
    "packed_read_aten",
    "packed_attention_aten",
]

LIB = "flashloop"
WRITE_MUTATES = tuple(n for n in CACHE_NAMES if n != "res_layout")


# ------------------------------------------------------------------------------------------------
# contracts (fake impls)
# ------------------------------------------------------------------------------------------------


def _check_cache(t: tuple[Tensor, ...]) -> tuple[int, ...]:
    """Check the 20 cache tensors against each other; return (B, H, S, D, G, R, NB, CAPT)."""
    torch._check(len(t) == len(CACHE_NAMES), lambda: f"expected {len(CACHE_NAMES)} cache tensors, got {len(t)}")
    c = dict(zip(CACHE_NAMES, t))
    kb, kt = c["k_base"], c["k_tail"]
    torch._check(kb.dim() == 4 and kb.dtype == torch.uint8, lambda: f"k_base must be uint8 [B, H, S, D/2], got {kb.dtype} {tuple(kb.shape)}")
    torch._check(kt.dim() == 5, lambda: f"k_tail must be [B, R, H, 2*tail, D], got {tuple(kt.shape)}")
    B, H, S, HD = kb.shape
    R, RING, D = kt.shape[1], kt.shape[3], kt.shape[4]
    G = RING // 2
    torch._check(D == 2 * HD, lambda: f"k_tail head_dim {D} != 2 * k_base's {HD}")
    torch._check(G >= 16 and D % G == 0 and S % G == 0, lambda: f"group size {G} must divide head_dim {D} and max_seq {S}")
    NB, CAPT = S // G, c["k_res"].shape[2]
    # the tensors' shapes do not depend on the layer count; the ring holds 2 * tail = 2 * G slots
    geometry = PackedGeometry(num_layers=1, num_loops=R, max_batch=B, max_seq=S, kv_heads=H, head_dim=D, group_size=G, tail=G)
    expected = {name: spec[:2] for name, spec in tensor_specs(geometry, CAPT, kt.dtype).items()}
    for name, (shape, dtype) in expected.items():
        x = c[name]
        torch._check(
            tuple(x.shape) == shape and x.dtype == dtype,
            lambda name=name, x=x, shape=shape, dtype=dtype: f"{name} must be {dtype} {list(shape)}, got {x.dtype} {list(x.shape)}",
        )
        torch._check(x.is_contiguous(), lambda name=name: f"cache tensor {name} must be contiguous")
        torch._check(x.device == kb.device, lambda name=name: f"cache tensor {name} is on {c[name].device}, k_base on {kb.device}")
    return B, H, S, D, G, R, NB, CAPT


def _check_depth(depth: int, R: int) -> None:
    torch._check(0 <= depth < R, lambda: f"depth must be in 0..{R - 1} (zero-based loop index), got {depth}")


def _check_tokens(name: str, x: Tensor, B: int, H: int, D: int, cdt: torch.dtype, dev) -> None:
    torch._check(x.dim() == 4, lambda: f"{name} must be [B, H, T, D], got {tuple(x.shape)}")
    torch._check(x.shape[0] <= B, lambda: f"{name} batch {x.shape[0]} exceeds the cache's max_batch {B}")
    torch._check(x.shape[1] == H and x.shape[3] == D, lambda: f"{name} must have {H} kv heads and head_dim {D}, got {tuple(x.shape)}")
    torch._check(x.dtype == cdt, lambda: f"{name} must have the cache's compute dtype {cdt}, got {x.dtype}")
    torch._check(x.device == dev, lambda: f"{name} is on {x.device}, the cache on {dev}")


def _check_positions(name: str, p: Tensor, b: int, t: int) -> None:
    torch._check(p.dtype == torch.int64, lambda: f"{name} must be int64, got {p.dtype}")
    torch._check(tuple(p.shape) == (b, t), lambda: f"{name} must be [{b}, {t}], got {tuple(p.shape)}")


def _write_fake(*args):
    *cache, k, v, positions, depth = args
    B, H, S, D, G, R, NB, CAPT = _check_cache(tuple(cache))
    _check_depth(depth, R)
    c = PackedTensors(*cache)
    cdt, dev = c.k_tail.dtype, c.k_base.device
    _check_tokens("k", k, B, H, D, cdt, dev)
    _check_tokens("v", v, B, H, D, cdt, dev)
    torch._check(k.shape == v.shape, lambda: f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    _check_positions("positions", positions, k.shape[0], k.shape[2])
    return None


def _read_fake(*args):
    *cache, positions, depth, inflight_positions, k_inflight, v_inflight = args
    B, H, S, D, G, R, NB, CAPT = _check_cache(tuple(cache))
    _check_depth(depth, R)
    c = PackedTensors(*cache)
    cdt, dev = c.k_tail.dtype, c.k_base.device
    _check_tokens("k_inflight", k_inflight, B, H, D, cdt, dev)
    _check_tokens("v_inflight", v_inflight, B, H, D, cdt, dev)
    torch._check(k_inflight.shape == v_inflight.shape, lambda: "k_inflight and v_inflight shapes differ")
    torch._check(k_inflight.shape[0] == positions.shape[0], lambda: "positions and k_inflight batch differ")
    _check_positions("inflight_positions", inflight_positions, positions.shape[0], k_inflight.shape[2])
    torch._check(
        positions.dim() in (2, 3) and positions.dtype == torch.int64,
        lambda: "positions must be int64 [B, P] (all heads) or [B, H, P] (per kv head)",
    )
    torch._check(positions.shape[0] <= B, lambda: f"positions batch {positions.shape[0]} exceeds max_batch {B}")
    if positions.dim() == 3:
        torch._check(positions.shape[1] == H, lambda: f"per-head positions need {H} kv heads, got {positions.shape[1]}")
    shape = (positions.shape[0], H, positions.shape[-1], D)
    return c.k_base.new_empty(shape, dtype=cdt), c.k_base.new_empty(shape, dtype=cdt)


def _attention_fake(q, k_inflight, v_inflight, q_positions, inflight_positions, depth, *rest):
    *cache, scale = rest
    B, H, S, D, G, R, NB, CAPT = _check_cache(tuple(cache))
    _check_depth(depth, R)
    c = PackedTensors(*cache)
    cdt, dev = c.k_tail.dtype, c.k_base.device
    torch._check(q.dim() == 4, lambda: f"q must be [B, Hq, T, D], got {tuple(q.shape)}")
    torch._check(q.dtype == cdt and q.shape[3] == D, lambda: f"q must be {cdt} with head_dim {D}, got {q.dtype} {tuple(q.shape)}")
    torch._check(q.shape[1] % H == 0, lambda: f"query heads {q.shape[1]} must be a multiple of kv heads {H}")
    _check_tokens("k_inflight", k_inflight, B, H, D, cdt, dev)
    _check_tokens("v_inflight", v_inflight, B, H, D, cdt, dev)
    torch._check(k_inflight.shape == v_inflight.shape, lambda: "k_inflight and v_inflight shapes differ")
    torch._check(k_inflight.shape[0] == q.shape[0], lambda: "q and k_inflight batch differ")
    _check_positions("q_positions", q_positions, q.shape[0], q.shape[2])
    _check_positions("inflight_positions", inflight_positions, q.shape[0], k_inflight.shape[2])
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# ------------------------------------------------------------------------------------------------
# ATen bodies (the oracle): plain PyTorch, one batch row at a time, host syncs allowed
# ------------------------------------------------------------------------------------------------


def _pack(codes: Tensor) -> Tensor:
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def _unpack(packed: Tensor) -> Tensor:
    return torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)


class _Cache:
    """Named view of the 20 cache tensors plus geometry."""

    def __init__(self, tensors) -> None:
        for name, t in zip(CACHE_NAMES, tensors):
            setattr(self, name, t)
        self.B, self.H, self.S, half = self.k_base.shape
        self.D = 2 * half
        self.R = self.k_tail.shape[1]
        self.RING = self.k_tail.shape[3]
        self.G = self.RING // 2
        self.NG = self.D // self.G
        self.offset = self.res_layout[0].tolist()
        self.capacity = self.res_layout[1].tolist()


def _reconstruct(c: _Cache, b: int, pos: Tensor, depth: int) -> tuple[Tensor, Tensor, Tensor]:
    """FP32 logical K, V [H, n, D] at ``depth`` of positions pos [n] (in range) of slot b, and
    which of them hold a written token (others read 0). The resolution rule of DESIGN.md."""
    H, n, D, G, NG = c.H, pos.numel(), c.D, c.G, c.NG
    pos = pos.long()
    dc = c.depth_count[b, pos].long()
    valid = dc > 0
    e = torch.clamp(torch.minimum(dc - 1, torch.full_like(dc, depth)), min=0)
    packed = valid & (pos < c.flushed[b, e].long())
    blk = pos // G
    k = dequantize(_unpack(c.k_base[b, :, pos]), c.k_base_min[b, :, blk], c.k_base_scale[b, :, blk])
    v = dequantize(
        _unpack(c.v_base[b, :, pos]).view(H, n, NG, G), c.v_base_min[b, :, pos][..., None], c.v_base_scale[b, :, pos][..., None]
    ).view(H, n, D)
    for j in range(1, depth + 1):
        r = c.rows[j - 1, b, pos].long()
        has = packed & (r >= 0) & (j <= e)
        g = torch.where(has, c.offset[j] + r, torch.zeros_like(r))
        rk = dequantize(_unpack(c.k_res[b, :, g]), c.k_res_min[j - 1, b, :, blk], c.k_res_scale[j - 1, b, :, blk])
        rv = dequantize(
            _unpack(c.v_res[b, :, g]).view(H, n, NG, G), c.v_res_min[b, :, g][..., None], c.v_res_scale[b, :, g][..., None]
        ).view(H, n, D)
        k = torch.where(has[None, :, None], k + rk, k)
        v = torch.where(has[None, :, None], v + rv, v)
    ring = valid & ~packed
    slot = pos % c.RING
    kt = c.k_tail[b, e, :, slot].transpose(0, 1).float()  # [H, n, D]
    vt = c.v_tail[b, e, :, slot].transpose(0, 1).float()
    k = torch.where(ring[None, :, None], kt, k)
    v = torch.where(ring[None, :, None], vt, v)
    k = torch.where(valid[None, :, None], k, torch.zeros_like(k))
    v = torch.where(valid[None, :, None], v, torch.zeros_like(v))
    return k, v, valid


def packed_kv_write_aten(*args) -> None:
    """ATen body of ``flashloop::packed_kv_write`` (same arguments)."""
    *cache, k, v, positions, depth = args
    c = _Cache(cache)
    G, H, D, NG, S, RING = c.G, c.H, c.D, c.NG, c.S, c.RING
    off, cap = c.offset[depth], c.capacity[depth]
    for b in range(k.shape[0]):
        valid = positions[b] >= 0
        pos = positions[b][valid]
        kb, vb = k[b][:, valid], v[b][:, valid]  # [H, n, D]
        F = int(c.flushed[b, depth])
        if depth == 0:
            length = int(pos.max()) + 1 if pos.numel() else 0
            target = (length - G) // G * G if length >= G else 0
        else:
            target = int(c.flushed[b, depth - 1])
        T = min(max(F, target), S)
        c.depth_count[b, pos] = depth + 1
        index = {p: i for i, p in enumerate(pos.tolist())}
        row = int(c.row_count[b, depth])
        for s in range(F, T, G):
            block = torch.arange(s, s + G, device=k.device)
            idx = torch.tensor([index.get(p, -1) for p in range(s, s + G)], device=k.device)
            in_call = idx >= 0
            ring_k = c.k_tail[b, depth, :, block % RING]
            ring_v = c.v_tail[b, depth, :, block % RING]
            xk = torch.where(in_call[None, :, None], kb[:, idx.clamp_min(0)], ring_k).float()  # [H, G, D]
            xv = torch.where(in_call[None, :, None], vb[:, idx.clamp_min(0)], ring_v).float()
            if depth == 0:
                codes, mn, sc = quantize(xk, dim=1)  # K: one group per channel over the block
                c.k_base[b, :, s : s + G] = _pack(codes)
                c.k_base_min[b, :, s // G], c.k_base_scale[b, :, s // G] = mn[:, 0], sc[:, 0]
                codes, mn, sc = quantize(xv.view(H, G, NG, G), dim=-1)  # V: per token per G channels
                c.v_base[b, :, s : s + G] = _pack(codes.view(H, G, D))
                c.v_base_min[b, :, s : s + G], c.v_base_scale[b, :, s : s + G] = mn[..., 0], sc[..., 0]
                row += G
                continue
            active = c.depth_count[b, s : s + G].long() > depth
            n = int(active.sum())
            if n == 0:
                continue
            apos = block[active]
            rk, rv, _ = _reconstruct(c, b, apos, depth - 1)  # X_hat[depth - 1], FP32
            dk, dv = xk[:, active] - rk, xv[:, active] - rv  # residual against the reconstruction
            local = row + torch.arange(n, device=k.device)
            fits = local < cap
            if not bool(fits.all()):
                c.overflow.fill_(1)
            g = off + local[fits]
            codes, mn, sc = quantize(dk, dim=1)  # block-local K groups over the active rows
            c.k_res[b, :, g] = _pack(codes[:, fits])
            c.k_res_min[depth - 1, b, :, s // G], c.k_res_scale[depth - 1, b, :, s // G] = mn[:, 0], sc[:, 0]
            codes, mn, sc = quantize(dv.reshape(H, n, NG, G), dim=-1)
            c.v_res[b, :, g] = _pack(codes.view(H, n, D)[:, fits])
            c.v_res_min[b, :, g], c.v_res_scale[b, :, g] = mn[..., 0][:, fits], sc[..., 0][:, fits]
            c.rows[depth - 1, b, apos[fits]] = local[fits].to(torch.int32)
            row += n
        c.flushed[b, depth] = T
        c.row_count[b, depth] = row
        keep = pos >= T
        c.k_tail[b, depth, :, pos[keep] % RING] = kb[:, keep]
        c.v_tail[b, depth, :, pos[keep] % RING] = vb[:, keep]


def packed_read_aten(*args) -> tuple[Tensor, Tensor]:
    """ATen body of ``flashloop::packed_read`` (same arguments)."""
    *cache, positions, depth, inflight_positions, k_inflight, v_inflight = args
    c = _Cache(cache)
    cdt = c.k_tail.dtype
    Bc, P = positions.shape[0], positions.shape[-1]
    out_k = torch.zeros(Bc, c.H, P, c.D, dtype=cdt, device=positions.device)
    out_v = torch.zeros_like(out_k)
    heads = range(c.H) if positions.dim() == 3 else [slice(None)]
    for b in range(Bc):
        for h in heads:  # per-head positions: each head reads its own (all heads are reconstructed)
            pos = positions[b, h] if positions.dim() == 3 else positions[b]
            ok = (pos >= 0) & (pos < c.S)
            k, v, _ = _reconstruct(c, b, pos.clamp(0, c.S - 1), depth)
            out_k[b, h] = torch.where(ok[None, :, None], k, 0.0).to(cdt)[h]
            out_v[b, h] = torch.where(ok[None, :, None], v, 0.0).to(cdt)[h]
    return (overlay_inflight(out_k, positions, inflight_positions, k_inflight),
            overlay_inflight(out_v, positions, inflight_positions, v_inflight))


def overlay_inflight(stored: Tensor, positions: Tensor, inflight_positions: Tensor, rows: Tensor) -> Tensor:
    """stored [B, H, P, D] read at positions [B, P] or [B, H, P], with every entry at one of this
    step's positions (inflight_positions [B, T], -1 = padding) replaced by that token's row of
    rows [B, H, T, D]: what ``packed_read`` returns for a step's own tokens."""
    if inflight_positions.shape[1] == 0:
        return stored
    sel = positions if positions.dim() == 3 else positions[:, None].expand(-1, stored.shape[1], -1)
    live = (inflight_positions >= 0)[:, None, None, :]
    match = (sel[..., None] == inflight_positions[:, None, None, :]) & live  # [B, H, P, T]
    src = match.to(torch.int32).argmax(-1, keepdim=True)
    inflight = torch.gather(rows, 2, src.expand(-1, -1, -1, rows.shape[-1]))
    return torch.where(match.any(-1, keepdim=True), inflight.to(stored.dtype), stored)


def packed_attention_aten(q, k_inflight, v_inflight, q_positions, inflight_positions, depth, *rest) -> Tensor:
    """ATen body of ``flashloop::packed_attention``: explicit FP32 attention over the logical
    stored keys (read like ``packed_read``, in the compute dtype) and the in-flight keys."""
    *cache, scale = rest
    c = _Cache(cache)
    cdt = c.k_tail.dtype
    Bc, Hq, T, D = q.shape
    p0 = stored_end(q_positions, inflight_positions, c.S).tolist()
    out = torch.zeros(Bc, Hq, T, D, dtype=torch.float32, device=q.device)
    for b in range(Bc):
        spos = torch.arange(p0[b], device=q.device)
        ks, vs, svalid = _reconstruct(c, b, spos, depth)
        keys = torch.cat([ks.to(cdt).float(), k_inflight[b].float()], dim=1)  # [H, N, D]
        vals = torch.cat([vs.to(cdt).float(), v_inflight[b].float()], dim=1)
        kpos = torch.cat([spos, inflight_positions[b]])
        kvalid = torch.cat([svalid, inflight_positions[b] >= 0])
        qpos = q_positions[b]
        keys = keys.repeat_interleave(Hq // c.H, dim=0)
        vals = vals.repeat_interleave(Hq // c.H, dim=0)
        scores = (q[b].float() @ keys.transpose(-1, -2)) * scale  # [Hq, T, N]
        visible = kvalid[None, :] & (kpos[None, :] <= qpos[:, None]) & (qpos[:, None] >= 0)
        probs = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1).nan_to_num(0.0)
        out[b] = probs @ vals
    return out.to(q.dtype)


# ------------------------------------------------------------------------------------------------
# ops
# ------------------------------------------------------------------------------------------------

T_ = Tensor  # short alias for the long signatures below


# The Triton kernel modules are imported in the CUDA bodies, on first use (CPU installs need no Triton).


@torch.library.triton_op(f"{LIB}::packed_kv_write", mutates_args=WRITE_MUTATES)
def _packed_kv_write(
    k_base: T_, k_base_min: T_, k_base_scale: T_, v_base: T_, v_base_min: T_, v_base_scale: T_,
    k_res: T_, k_res_min: T_, k_res_scale: T_, v_res: T_, v_res_min: T_, v_res_scale: T_,
    k_tail: T_, v_tail: T_, flushed: T_, row_count: T_,
    rows: T_, depth_count: T_, res_layout: T_, overflow: T_,
    k: T_, v: T_, positions: T_, depth: int,
) -> None:
    cache = (k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, k_res_min, k_res_scale,
             v_res, v_res_min, v_res_scale, k_tail, v_tail, flushed, row_count, rows, depth_count, res_layout, overflow)
    if k.device.type != "cuda":
        torch.ops.flashloop.packed_kv_write_aten(*cache, k, v, positions, depth)
        return
    from flashloop_compile.lowering.kernels.packed_write import launch_packed_kv_write

    launch_packed_kv_write(cache, k, v, positions, depth, wrap=wrap_triton)


@torch.library.triton_op(f"{LIB}::packed_read", mutates_args=())
def _packed_read(
    k_base: T_, k_base_min: T_, k_base_scale: T_, v_base: T_, v_base_min: T_, v_base_scale: T_,
    k_res: T_, k_res_min: T_, k_res_scale: T_, v_res: T_, v_res_min: T_, v_res_scale: T_,
    k_tail: T_, v_tail: T_, flushed: T_, row_count: T_,
    rows: T_, depth_count: T_, res_layout: T_, overflow: T_,
    positions: T_, depth: int, inflight_positions: T_, k_inflight: T_, v_inflight: T_,
) -> tuple[Tensor, Tensor]:
    cache = (k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, k_res_min, k_res_scale,
             v_res, v_res_min, v_res_scale, k_tail, v_tail, flushed, row_count, rows, depth_count, res_layout, overflow)
    inflight = (inflight_positions, k_inflight, v_inflight)
    if positions.device.type != "cuda":
        return torch.ops.flashloop.packed_read_aten(*cache, positions, depth, *inflight)
    shape = (positions.shape[0], k_base.shape[1], positions.shape[-1], 2 * k_base.shape[3])
    out_k = torch.empty(shape, dtype=k_tail.dtype, device=positions.device)
    out_v = torch.empty(shape, dtype=k_tail.dtype, device=positions.device)
    from flashloop_compile.lowering.kernels.packed_read import launch_packed_read

    launch_packed_read(cache, positions, depth, out_k, out_v, inflight=inflight, wrap=wrap_triton)
    return out_k, out_v


@torch.library.triton_op(f"{LIB}::packed_attention", mutates_args=())
def _packed_attention(
    q: T_, k_inflight: T_, v_inflight: T_, q_positions: T_, inflight_positions: T_, depth: int,
    k_base: T_, k_base_min: T_, k_base_scale: T_, v_base: T_, v_base_min: T_, v_base_scale: T_,
    k_res: T_, k_res_min: T_, k_res_scale: T_, v_res: T_, v_res_min: T_, v_res_scale: T_,
    k_tail: T_, v_tail: T_, flushed: T_, row_count: T_,
    rows: T_, depth_count: T_, res_layout: T_, overflow: T_,
    scale: float,
) -> Tensor:
    cache = (k_base, k_base_min, k_base_scale, v_base, v_base_min, v_base_scale, k_res, k_res_min, k_res_scale,
             v_res, v_res_min, v_res_scale, k_tail, v_tail, flushed, row_count, rows, depth_count, res_layout, overflow)
    if q.device.type != "cuda":
        return torch.ops.flashloop.packed_attention_aten(q, k_inflight, v_inflight, q_positions, inflight_positions, depth, *cache, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    from flashloop_compile.lowering.kernels.packed_attention import launch_packed_attention

    launch_packed_attention(cache, q, k_inflight, v_inflight, q_positions, inflight_positions, depth, scale, out,
                            wrap=wrap_triton)
    return out


# Opaque twins with the ATen bodies: what a CPU trace (torch.compile on CPU) records.
def _twin_schema(op) -> str:
    schema = str(op._opoverload._schema)
    return schema[schema.index("(") :]


_packed_kv_write_aten_op = torch.library.custom_op(
    f"{LIB}::packed_kv_write_aten", packed_kv_write_aten, mutates_args=WRITE_MUTATES, schema=_twin_schema(_packed_kv_write)
)
_packed_read_aten_op = torch.library.custom_op(
    f"{LIB}::packed_read_aten", packed_read_aten, mutates_args=(), schema=_twin_schema(_packed_read)
)
_packed_attention_aten_op = torch.library.custom_op(
    f"{LIB}::packed_attention_aten", packed_attention_aten, mutates_args=(), schema=_twin_schema(_packed_attention)
)

for _op, _aten, _fake in (
    (_packed_kv_write, packed_kv_write_aten, _write_fake),
    (_packed_read, packed_read_aten, _read_fake),
    (_packed_attention, packed_attention_aten, _attention_fake),
):
    _op.register_kernel("cpu")(_aten)
    _op.register_fake(_fake)
for _op, _fake in ((_packed_kv_write_aten_op, _write_fake), (_packed_read_aten_op, _read_fake),
                   (_packed_attention_aten_op, _attention_fake)):
    _op.register_fake(_fake)


# ------------------------------------------------------------------------------------------------
# wrappers
# ------------------------------------------------------------------------------------------------


def packed_kv_write(cache: PackedCache, layer: int, k: Tensor, v: Tensor, positions: Tensor, depth: int) -> None:
    """Write depth ``depth`` of k/v [B, H, T, D] at positions [B, T] into ``cache``'s layer."""
    torch.ops.flashloop.packed_kv_write(*cache.op_tensors(layer), k, v, positions, int(depth))


def packed_read(
    cache: PackedCache, layer: int, positions: Tensor, depth: int,
    inflight: tuple[Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """Logical (k, v) [B, H, P, D] at ``depth`` of positions [B, P] (every head) or [B, H, P] (each
    kv head its own positions: the keys sparse decode selected). Positions outside 0..S-1 read 0.
    ``inflight``: (positions [B, Ti], k [B, H, Ti, D], v) of this step's tokens, read exactly."""
    if inflight is None:
        inflight = no_inflight(cache, positions.shape[0], positions.device)
    return torch.ops.flashloop.packed_read(*cache.op_tensors(layer), positions, int(depth), *inflight)


def no_inflight(cache: PackedCache, batch: int, device) -> tuple[Tensor, Tensor, Tensor]:
    """Empty in-flight arguments (Ti = 0) for a packed_read of stored tokens only."""
    rows = torch.empty(batch, cache.kv_heads, 0, cache.head_dim, dtype=cache.dtype, device=device)
    return torch.empty(batch, 0, dtype=torch.long, device=device), rows, rows.clone()


def packed_attention(
    cache: PackedCache, layer: int, q: Tensor, k_inflight: Tensor, v_inflight: Tensor,
    q_positions: Tensor, inflight_positions: Tensor, depth: int, scale: float | None = None,
) -> Tensor:
    """Causal attention at ``depth`` over the packed store and the in-flight keys."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return torch.ops.flashloop.packed_attention(
        q, k_inflight, v_inflight, q_positions, inflight_positions, int(depth), *cache.op_tensors(layer), scale
    )
