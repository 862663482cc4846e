"""``flashloop`` ops for token-sparse prefill (SPEC.md section 1), registered on import in the
style of :mod:`.ops`: a ``torch.library.triton_op`` whose CUDA body launches the Triton kernel of
:mod:`.kernels.prefill_attention` through ``torch.library.wrap_triton`` (Inductor sees the
kernel and keeps it in its graph and in CUDA graphs: the launcher never syncs with the host),
``register_kernel("cpu")`` with a plain-PyTorch ATen body (FP32, written for clarity: the
oracle), and a fake implementation whose ``torch._check`` calls state the contract.

- ``position_attention(q, k, v, q_pos, scale)`` -> out: causal attention for queries at
  arbitrary absolute positions over a full KV cache.

  q [B, Hq, Tq, D]; k, v [B, Hkv, S, D] (key j sits at absolute position j: the cache layout);
  q_pos [B, Tq] int64; scale float. Hq must be a multiple of Hkv: query head h reads kv head
  h // (Hq // Hkv). out [B, Hq, Tq, D] (q.dtype, contiguous):

      out[b, h, i] = softmax_j(q[b, h, i] . k[b, h // G, j] * scale  over j <= q_pos[b, i]) @ V

  Queries may come in any order and positions may repeat (duplicated rows give equal outputs);
  positions >= S see the whole cache; a query with q_pos < 0 (padding) gives zeros, not NaN.
  q, k, v share one dtype (bf16, fp16 or fp32); D in {16, 32, 64, 128}. Softmax statistics
  and accumulation in FP32.

- ``prompt_attention(q, k, v, scale)`` -> out: causal attention of a fresh prompt (positions
  0..T-1) over its own K/V [B, Hkv, T, D], as SDPA with ``is_causal`` (a plain function, not an
  op: Inductor runs its flash / cuDNN / memory-efficient kernel on the GPU; on CPU the
  position_attention oracle, FP32).

Token-sparse prefill uses position_attention for loops 3..R: the active queries (sorted absolute positions,
padded with -1) attend to the loop's logical KV cache, inactive tokens' inherited K/V included,
without materializing the boolean mask ``[B, 1, Tq, S]`` that SDPA needs.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from flashloop_compile.lowering.kernels.common import SUPPORTED_HEAD_DIMS


__all__ = ["position_attention", "position_attention_aten", "prompt_attention"]

LIB = "flashloop"
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def position_attention_aten(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float) -> Tensor:
    """The oracle: materialized mask, FP32 softmax and products, cast to q.dtype."""
    b, hq, tq, d = q.shape
    s = k.shape[2]
    group = hq // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [B, Hq, S, D]
    vf = v.float().repeat_interleave(group, dim=1)
    visible = torch.arange(s, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [B, Tq, S]
    scores = (q.float() @ kf.transpose(-1, -2)) * scale  # [B, Hq, Tq, S]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(visible.any(-1)[:, None, :, None], probs, 0.0)  # no visible key: zeros, not NaN
    return (probs @ vf).to(q.dtype).contiguous()


def prompt_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention of queries at positions 0..T-1 over keys at 0..T-1 (this step's own K/V):
    what position_attention computes when q_pos = 0..T-1 and the cache holds only these tokens.
    On CPU the position_attention oracle's FP32 arithmetic (the reference's order of operations:
    SDPA's CPU kernels round otherwise, which can flip a stored INT4 code in the CPU tests)."""
    if q.device.type == "cpu":
        positions = torch.arange(q.shape[2], device=q.device).expand(q.shape[0], -1)
        return position_attention_aten(q, k, v, positions, scale)
    # a branch, not enable_gqa=(q.shape[1] != k.shape[1]): traced with dynamic head counts (a
    # recompile for a second head count) that is a SymBool, which SDPA refuses even through
    # bool(); the branch guards on it and passes a constant
    if q.shape[1] != k.shape[1]:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor) -> None:
    torch._check(q.dim() == 4, lambda: f"q must be [B, Hq, Tq, D], got {tuple(q.shape)}")
    torch._check(k.dim() == 4 and v.dim() == 4, lambda: f"k, v must be [B, Hkv, S, D], got {tuple(k.shape)}, {tuple(v.shape)}")
    torch._check(k.shape == v.shape, lambda: f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    torch._check(k.shape[0] == q.shape[0], lambda: f"k/v batch {k.shape[0]} must match q batch {q.shape[0]}")
    torch._check(k.shape[3] == q.shape[3], lambda: f"k/v head_dim {k.shape[3]} must match q head_dim {q.shape[3]}")
    torch._check(k.shape[1] >= 1, lambda: "k/v need at least one head")
    torch._check(q.shape[1] % k.shape[1] == 0, lambda: f"query heads {q.shape[1]} must be a multiple of kv heads {k.shape[1]}")
    torch._check(q.shape[3] in SUPPORTED_HEAD_DIMS, lambda: f"head_dim must be one of {SUPPORTED_HEAD_DIMS}, got {q.shape[3]}")
    torch._check(q.dtype in _DTYPES, lambda: f"q must be bf16, fp16 or fp32, got {q.dtype}")
    torch._check(k.dtype == q.dtype and v.dtype == q.dtype, lambda: f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    torch._check(q_pos.dtype == torch.int64, lambda: f"q_pos must be int64, got {q_pos.dtype}")
    torch._check(
        q_pos.dim() == 2 and q_pos.shape[0] == q.shape[0] and q_pos.shape[1] == q.shape[2],
        lambda: f"q_pos must be [B, Tq] = [{q.shape[0]}, {q.shape[2]}], got {tuple(q_pos.shape)}",
    )
    torch._check(
        k.device == q.device and v.device == q.device and q_pos.device == q.device,
        lambda: "q, k, v and q_pos must be on one device",
    )


@torch.library.triton_op(f"{LIB}::position_attention", mutates_args=())
def _position_attention_op(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float) -> Tensor:
    if q.device.type != "cuda":  # traced (decomposed) on another device: the ATen body
        return position_attention_aten(q, k, v, q_pos, scale)
    from flashloop_compile.lowering.kernels.common import wrap_triton
    from flashloop_compile.lowering.kernels.prefill_attention import position_attention_triton

    return position_attention_triton(q, k, v, q_pos, scale, wrap=wrap_triton)


@_position_attention_op.register_kernel("cpu")
def _(q, k, v, q_pos, scale):
    _check_inputs(q, k, v, q_pos)
    return position_attention_aten(q, k, v, q_pos, scale)


@_position_attention_op.register_fake
def _(q, k, v, q_pos, scale):
    _check_inputs(q, k, v, q_pos)
    return q.new_empty(q.shape)  # contiguous, like both bodies


def position_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float | None = None) -> Tensor:
    """Attention of queries at absolute positions ``q_pos`` over the whole cache (see module
    docstring). ``scale`` defaults to 1/sqrt(head_dim)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return torch.ops.flashloop.position_attention(q, k, v, q_pos, float(scale))
