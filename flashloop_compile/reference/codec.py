"""The affine INT4 group codec of SPEC.md section 3, in plain PyTorch: the codec every kernel matches.

A group of values x (FP32) is stored as FP16 ``minimum`` and ``scale`` plus one 4-bit code per
value::

    minimum = fp16(min(x))
    scale   = fp16((max(x) - min(x)) / 15)
    code    = clamp(round_half_even((x - minimum) / scale), 0, 15)   computed in FP32
    decode  = minimum + scale * code                                   computed in FP32

Codes are computed against the *stored* (FP16-rounded) parameters, so decode error is at most
scale/2 per element plus the FP16 rounding of the parameters. A constant group (or one whose
scale rounds to 0 in FP16) has scale 0, all codes 0, and decodes to its minimum.

Grouping (group size G, 64 by default):
- K (post-RoPE) ``[tokens, kv_heads, head_dim]``: one group per channel across up to G token
  rows (``token_groups``); a final group may be partial.
- V ``[tokens, kv_heads, head_dim]``: one group per token across G consecutive channels of the
  flattened ``kv_heads * head_dim`` row (``channel_groups``).

Storage packs two codes per byte along the channel axis: the even channel in the low nibble.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "QMAX",
    "PARAM_DTYPE",
    "quantize",
    "dequantize",
    "QuantizedTokenGroups",
    "QuantizedChannelGroups",
    "quantize_token_groups",
    "quantize_channel_groups",
    "pack_nibbles",
    "unpack_nibbles",
]

QMAX = 15
PARAM_DTYPE = torch.float16


def quantize(x: Tensor, dim: int) -> tuple[Tensor, Tensor, Tensor]:
    """Quantize groups that run along ``dim`` (the whole extent of ``dim`` is one group).

    Returns (codes uint8 like x, minimum fp16, scale fp16), the parameters with ``dim`` kept
    as size 1.
    """
    xf = x.float()
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    minimum = lo.to(PARAM_DTYPE)
    # tensor / tensor: a correctly rounded division on every device (on CUDA, ATen divides by a
    # Python scalar through its reciprocal, which rounds differently from the kernels)
    scale = ((hi - lo) / torch.full_like(hi, float(QMAX))).to(PARAM_DTYPE)
    m32, s32 = minimum.float(), scale.float()
    safe = torch.where(s32 > 0, s32, torch.ones_like(s32))
    codes = torch.where(s32 > 0, torch.round((xf - m32) / safe).clamp(0, QMAX), torch.zeros_like(xf))
    return codes.to(torch.uint8), minimum, scale


def dequantize(codes: Tensor, minimum: Tensor, scale: Tensor) -> Tensor:
    """FP32 decode: minimum + scale * code (parameters broadcast over their group's axis)."""
    return minimum.float() + scale.float() * codes.float()


@dataclass
class QuantizedTokenGroups:
    """K layout: codes [n, H, D]; one (minimum, scale) per channel for the whole n <= G rows."""

    codes: Tensor  # uint8 [n, H, D]
    minimum: Tensor  # fp16 [H, D]
    scale: Tensor  # fp16 [H, D]

    def decode(self) -> Tensor:
        return dequantize(self.codes, self.minimum[None], self.scale[None])


@dataclass
class QuantizedChannelGroups:
    """V layout: codes [n, H, D]; one (minimum, scale) per token per G channels of the H*D row."""

    codes: Tensor  # uint8 [n, H, D]
    minimum: Tensor  # fp16 [n, H*D // G]
    scale: Tensor  # fp16 [n, H*D // G]
    group_size: int

    def decode(self) -> Tensor:
        n, h, d = self.codes.shape
        grouped = self.codes.reshape(n, -1, self.group_size)
        return dequantize(grouped, self.minimum[..., None], self.scale[..., None]).reshape(n, h, d)


def quantize_token_groups(x: Tensor) -> QuantizedTokenGroups:
    """One K group per channel across all rows of x [n, H, D] (n <= group size, caller's job)."""
    codes, minimum, scale = quantize(x, dim=0)
    return QuantizedTokenGroups(codes, minimum[0], scale[0])


def quantize_channel_groups(x: Tensor, group_size: int) -> QuantizedChannelGroups:
    """V groups of ``group_size`` consecutive channels of each token's flattened H*D row."""
    n, h, d = x.shape
    if (h * d) % group_size:
        raise ValueError(f"kv_heads*head_dim={h * d} is not a multiple of group_size={group_size}")
    codes, minimum, scale = quantize(x.reshape(n, -1, group_size), dim=-1)
    return QuantizedChannelGroups(codes.reshape(n, h, d), minimum[..., 0], scale[..., 0], group_size)


def pack_nibbles(codes: Tensor) -> Tensor:
    """uint8 codes [..., D] (0..15, D even) -> bytes [..., D/2]; even channel in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"the packed axis must have even length, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: Tensor) -> Tensor:
    """Inverse of :func:`pack_nibbles`."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)
