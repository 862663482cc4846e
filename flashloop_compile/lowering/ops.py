"""The ``flashloop`` op library: the custom ops the feature passes rewrite graphs into.

Every op is a ``torch.library`` op with
- a fake (meta) implementation whose ``torch._check`` calls state the shape/dtype contract,
- an ATen reference body for CPU (plain PyTorch, FP32 accumulation), and
- on CUDA a ``triton_op`` body launching the kernels in :mod:`.kernels` through ``wrap_triton``,
  so Inductor sees the Triton kernels and keeps them inside its graph (and CUDA graphs).

Use the wrappers at the bottom (``ops.reference_attention(...)``) or ``torch.ops.flashloop.*``.

Sparse decode attention (SPEC.md section 2):
- ``reference_attention(q, k, v, mask, scale, fractions, capacities)`` -> ``(out, keys, count,
  mass, o_ref, c_ref)``: full attention plus, for each key fraction f, the top-k visible keys
  per (batch, head, query) with k = max(1, ceil(f * visible)), their probability mass and their
  weighted value contribution. ``keys`` [F, B, Hq, T, Kmax] int32 (padded with -1), ``count``
  [F, B, Hq, T] int32, ``mass`` [F, B, Hq, T] fp32, ``o_ref`` [B, Hq, T, D] fp32,
  ``c_ref`` [F, B, Hq, T, D] fp32.
- ``correction_attention(q, k, v, keys, count, mass, o_ref, c_ref, scale)`` -> out:
  O = O_ref - C_ref + m * softmax(q K_S^T * scale) V_S for one fraction's state.

Under ``sparse_decode_attention.reuse_selected_probabilities``:
- ``reference_attention_probs(...)``: ``reference_attention``'s arguments and outputs plus
  ``probs`` [F, B, Hq, T, Kmax] fp32, the reference probability of each key in ``keys`` (0 in
  the padding; they sum to ``mass``), written by the selection's compaction.
- ``reuse_correction_attention(v, keys, count, probs, o_ref, c_ref)`` -> out [B, Hq, T, D] in
  v's dtype: O = O_ref - C_ref + m * (p_S @ V_S) with p_S = probs / m, computed as
  sum_j probs[j] * V[keys[j]] (FP32): no K, no scores.

Shapes: q [B, Hq, T, D]; k, v [B, Hkv, S, D] with Hq a multiple of Hkv (query head h reads kv
head h // (Hq // Hkv)); mask bool, broadcastable to [B, Hq, T, S] (True = visible).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from flashloop_compile.config import ceil_fraction
from flashloop_compile.lowering.kernels.common import key_counts

__all__ = ["reference_attention", "correction_attention", "reference_attention_probs", "reuse_correction_attention",
           "key_counts"]

LIB = "flashloop"


def _check_attention_inputs(q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> None:
    torch._check(q.dim() == 4, lambda: f"q must be [B, Hq, T, D], got {tuple(q.shape)}")
    torch._check(k.dim() == 4 and v.dim() == 4, lambda: f"k, v must be [B, Hkv, S, D], got {tuple(k.shape)}, {tuple(v.shape)}")
    torch._check(k.shape == v.shape, lambda: f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    torch._check(k.shape[0] == q.shape[0] and k.shape[3] == q.shape[3], lambda: "k/v batch and head_dim must match q")
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: f"query heads {q.shape[1]} must be a multiple of kv heads {k.shape[1]}")
    torch._check(mask.dtype == torch.bool, lambda: f"mask must be bool (True = visible), got {mask.dtype}")
    torch._check(mask.dim() == 4, lambda: f"mask must be 4-D, broadcastable to [B, Hq, T, S], got {tuple(mask.shape)}")
    torch._check(mask.shape[-1] == k.shape[2] and mask.shape[-2] == q.shape[2], lambda: "mask must be [.., .., T, S]")


def _expand_heads(x: Tensor, n_heads: int) -> Tensor:
    return x.repeat_interleave(n_heads // x.shape[1], dim=1)


def _reference_attention_aten(q, k, v, mask, scale, fractions, capacities, keep_probs: bool = False):
    b, hq, t, d = q.shape
    s = k.shape[2]
    kf, vf = _expand_heads(k.float(), hq), _expand_heads(v.float(), hq)
    visible = mask.expand(b, hq, t, s)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    o_ref = probs @ vf
    # Most probable first; invisible keys after every visible one; ties to the lower index.
    order = torch.sort(-torch.where(visible, probs, -1.0), dim=-1, stable=True).indices
    n_visible = visible.sum(-1)
    kmax = max(capacities)
    keys, counts, masses, c_refs, p_keys = [], [], [], [], []
    for fraction, cap in zip(fractions, capacities):
        count = key_counts(fraction, n_visible)
        rank = torch.arange(kmax, device=q.device)
        top = order[..., :kmax].to(torch.int32)
        top = torch.where(rank < count[..., None], top, torch.full_like(top, -1))
        selected = torch.zeros_like(probs, dtype=torch.bool)
        selected.scatter_(-1, order[..., :cap], (rank[:cap] < count[..., None]))
        p_sel = probs * selected
        keys.append(top)
        counts.append(count)
        masses.append(p_sel.sum(-1))
        c_refs.append(p_sel @ vf)
        p_keys.append(torch.where(top >= 0, probs.gather(-1, top.clamp_min(0).long()), 0.0))
    out = (o_ref.to(q.dtype, copy=True), torch.stack(keys), torch.stack(counts), torch.stack(masses), o_ref, torch.stack(c_refs))
    return out + (torch.stack(p_keys),) if keep_probs else out


def _correction_attention_aten(q, k, v, keys, count, mass, o_ref, c_ref, scale):
    hq = q.shape[1]
    kf, vf = _expand_heads(k.float(), hq), _expand_heads(v.float(), hq)
    idx = keys.clamp_min(0).long()  # [B, Hq, T, K]
    valid = torch.arange(keys.shape[-1], device=q.device) < count[..., None]
    # Gather per (b, h, t) the selected rows of that head's K/V.
    b, _, t, kk = idx.shape
    k_sel = torch.gather(kf[:, :, None].expand(-1, -1, t, -1, -1), 3, idx[..., None].expand(-1, -1, -1, -1, kf.shape[-1]))
    v_sel = torch.gather(vf[:, :, None].expand(-1, -1, t, -1, -1), 3, idx[..., None].expand(-1, -1, -1, -1, vf.shape[-1]))
    scores = (k_sel @ q.float()[..., None]).squeeze(-1) * scale  # [B, Hq, T, K]
    p_local = torch.softmax(scores.masked_fill(~valid, float("-inf")), dim=-1).nan_to_num(0.0)
    c_new = mass[..., None] * (p_local[..., None, :] @ v_sel).squeeze(-2)
    return (o_ref - c_ref + c_new).to(q.dtype)


def _reuse_correction_attention_aten(v, keys, count, probs, o_ref, c_ref):
    vf = _expand_heads(v.float(), o_ref.shape[1])
    idx = keys.clamp_min(0).long()  # [B, Hq, T, K]
    valid = torch.arange(keys.shape[-1], device=v.device) < count[..., None]
    t = idx.shape[2]
    v_sel = torch.gather(vf[:, :, None].expand(-1, -1, t, -1, -1), 3, idx[..., None].expand(-1, -1, -1, -1, vf.shape[-1]))
    c_new = (torch.where(valid, probs, 0.0)[..., None, :] @ v_sel).squeeze(-2)  # m * (p_S @ V_S), p_S = probs / m
    return (o_ref - c_ref + c_new).to(v.dtype)


@torch.library.triton_op(f"{LIB}::reference_attention", mutates_args=())
def _reference_attention_op(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, fractions: list[float], capacities: list[int]
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    if q.device.type != "cuda":  # traced (decomposed) on another device: the ATen body
        return _reference_attention_aten(q, k, v, mask, scale, fractions, capacities)
    from flashloop_compile.lowering.kernels.reference_attention import reference_attention_triton

    return reference_attention_triton(q, k, v, mask, scale, fractions, capacities, wrap=True)


@_reference_attention_op.register_kernel("cpu")
def _(q, k, v, mask, scale, fractions, capacities):
    return _reference_attention_aten(q, k, v, mask, scale, fractions, capacities)


@_reference_attention_op.register_fake
def reference_fake(q, k, v, mask, scale, fractions, capacities):
    """Shape contract of ``reference_attention`` (also the packed reference's)."""
    _check_attention_inputs(q, k, v, mask)
    torch._check(len(fractions) == len(capacities) and len(fractions) >= 1, lambda: "one capacity per key fraction")
    for cap in capacities:
        torch._check(1 <= cap <= k.shape[2], lambda: f"key capacity {cap} must lie in 1..S={k.shape[2]}")
    b, hq, t, d = q.shape
    f, kmax = len(fractions), max(capacities)
    fp32 = dict(dtype=torch.float32, device=q.device)
    return (
        q.new_empty(b, hq, t, d),
        q.new_empty(f, b, hq, t, kmax, dtype=torch.int32),
        q.new_empty(f, b, hq, t, dtype=torch.int32),
        torch.empty(f, b, hq, t, **fp32),
        torch.empty(b, hq, t, d, **fp32),
        torch.empty(f, b, hq, t, d, **fp32),
    )


@torch.library.triton_op(f"{LIB}::correction_attention", mutates_args=())
def _correction_attention_op(
    q: Tensor, k: Tensor, v: Tensor, keys: Tensor, count: Tensor, mass: Tensor, o_ref: Tensor, c_ref: Tensor, scale: float
) -> Tensor:
    if q.device.type != "cuda":  # traced (decomposed) on another device: the ATen body
        return _correction_attention_aten(q, k, v, keys, count, mass, o_ref, c_ref, scale)
    from flashloop_compile.lowering.kernels.correction import correction_attention_triton

    return correction_attention_triton(q, k, v, keys, count, mass, o_ref, c_ref, scale, wrap=True)


@_correction_attention_op.register_kernel("cpu")
def _(q, k, v, keys, count, mass, o_ref, c_ref, scale):
    return _correction_attention_aten(q, k, v, keys, count, mass, o_ref, c_ref, scale)


@_correction_attention_op.register_fake
def _(q, k, v, keys, count, mass, o_ref, c_ref, scale):
    torch._check(q.dim() == 4 and k.dim() == 4 and k.shape == v.shape, lambda: "q [B, Hq, T, D]; k, v [B, Hkv, S, D]")
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: "query heads must be a multiple of kv heads")
    torch._check(keys.dtype == torch.int32 and keys.shape[:4] == q.shape[:3] + (keys.shape[3],), lambda: "keys [B, Hq, T, K] int32")
    torch._check(count.shape == q.shape[:3] and mass.shape == q.shape[:3], lambda: "count and mass are [B, Hq, T]")
    torch._check(o_ref.shape == q.shape and c_ref.shape == q.shape, lambda: "o_ref and c_ref are [B, Hq, T, D]")
    torch._check(o_ref.dtype == torch.float32 and c_ref.dtype == torch.float32 and mass.dtype == torch.float32, lambda: "reference state is FP32")
    return torch.empty_like(q)


@torch.library.triton_op(f"{LIB}::reference_attention_probs", mutates_args=())
def _reference_attention_probs_op(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float, fractions: list[float], capacities: list[int]
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    if q.device.type != "cuda":
        return _reference_attention_aten(q, k, v, mask, scale, fractions, capacities, keep_probs=True)
    from flashloop_compile.lowering.kernels.reference_attention import reference_attention_triton

    return reference_attention_triton(q, k, v, mask, scale, fractions, capacities, wrap=True, keep_probs=True)


@_reference_attention_probs_op.register_kernel("cpu")
def _(q, k, v, mask, scale, fractions, capacities):
    return _reference_attention_aten(q, k, v, mask, scale, fractions, capacities, keep_probs=True)


@_reference_attention_probs_op.register_fake
def reference_probs_fake(q, k, v, mask, scale, fractions, capacities):
    """Shape contract of ``reference_attention_probs``: ``reference_attention``'s and probs (shaped as keys, fp32)."""
    out = reference_fake(q, k, v, mask, scale, fractions, capacities)
    return out + (torch.empty(out[1].shape, dtype=torch.float32, device=q.device),)


@torch.library.triton_op(f"{LIB}::reuse_correction_attention", mutates_args=())
def _reuse_correction_attention_op(
    v: Tensor, keys: Tensor, count: Tensor, probs: Tensor, o_ref: Tensor, c_ref: Tensor
) -> Tensor:
    if v.device.type != "cuda":
        return _reuse_correction_attention_aten(v, keys, count, probs, o_ref, c_ref)
    from flashloop_compile.lowering.kernels.correction import reuse_correction_triton

    return reuse_correction_triton(v, keys, count, probs, o_ref, c_ref, wrap=True)


@_reuse_correction_attention_op.register_kernel("cpu")
def _(v, keys, count, probs, o_ref, c_ref):
    return _reuse_correction_attention_aten(v, keys, count, probs, o_ref, c_ref)


def check_reuse_state(keys, count, probs, o_ref, c_ref) -> None:
    """The reference state a reuse correction takes (keys, count, probs of one fraction; o_ref, c_ref)."""
    torch._check(o_ref.dim() == 4 and c_ref.shape == o_ref.shape, lambda: "o_ref and c_ref are [B, Hq, T, D]")
    torch._check(keys.dtype == torch.int32 and keys.dim() == 4 and keys.shape[:3] == o_ref.shape[:3],
                 lambda: f"keys must be [B, Hq, T, K] int32, got {keys.dtype} {tuple(keys.shape)}")
    torch._check(probs.shape == keys.shape and probs.dtype == torch.float32, lambda: "probs are fp32, shaped as keys")
    torch._check(count.shape == o_ref.shape[:3], lambda: "count is [B, Hq, T]")
    torch._check(o_ref.dtype == torch.float32 and c_ref.dtype == torch.float32, lambda: "the reference state is FP32")


@_reuse_correction_attention_op.register_fake
def _(v, keys, count, probs, o_ref, c_ref):
    check_reuse_state(keys, count, probs, o_ref, c_ref)
    torch._check(v.dim() == 4 and v.shape[0] == o_ref.shape[0] and v.shape[3] == o_ref.shape[3],
                 lambda: f"v must be [B, Hkv, S, D] matching o_ref {tuple(o_ref.shape)}, got {tuple(v.shape)}")
    torch._check(o_ref.shape[1] % v.shape[1] == 0, lambda: "query heads must be a multiple of kv heads")
    return torch.empty(o_ref.shape, dtype=v.dtype, device=v.device)


def reference_attention(q, k, v, mask, scale=None, fractions=(0.1,), capacities=None):
    """Loop-2 reference attention; see the module docstring. ``capacities`` default to ceil(f*S)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if capacities is None:
        capacities = [ceil_fraction(f, k.shape[2]) for f in fractions]
    return torch.ops.flashloop.reference_attention(q, k, v, mask, float(scale), list(map(float, fractions)), list(capacities))


def correction_attention(q, k, v, keys, count, mass, o_ref, c_ref, scale=None):
    """Loops 3..R: correct O_ref with the selected keys of this loop's K/V."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.flashloop.correction_attention(q, k, v, keys, count, mass, o_ref, c_ref, float(scale))


def reference_attention_probs(q, k, v, mask, scale=None, fractions=(0.1,), capacities=None):
    """``reference_attention`` plus the selected keys' reference probabilities (the reuse option's loop 2)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if capacities is None:
        capacities = [ceil_fraction(f, k.shape[2]) for f in fractions]
    return torch.ops.flashloop.reference_attention_probs(q, k, v, mask, float(scale), list(map(float, fractions)), list(capacities))


def reuse_correction_attention(v, keys, count, probs, o_ref, c_ref):
    """Loops 3..R under reuse_selected_probabilities: correct O_ref with loop 2's probabilities over S and this loop's V."""
    return torch.ops.flashloop.reuse_correction_attention(v, keys, count, probs, o_ref, c_ref)
