"""The packed KV cache's layout: its tensors' names in the order the ``flashloop.packed_*`` ops
take them, their shapes and dtypes for a geometry, and the interface the op wrappers need from a
cache. The runtime (runtime/packed_kv.py) allocates a cache from :func:`tensor_specs`; the ops
check their arguments against it; the kernels read the tensors by these names. No Triton, no
runtime.

G = ``group_size``, D = ``head_dim``, H = ``kv_heads``, S = ``max_seq``, NB = S / G,
R = ``num_loops``, CAP_d = the compact residual rows of depth d (1..R-1), CAPT = sum of CAP_d.

Per layer (``LAYER_TENSOR_NAMES``)::

    k_base       [B, H, S, D/2]          uint8  loop-1 K codes, two per byte (even channel low nibble)
    k_base_min   [B, H, NB, D]           fp16   one group per channel per G-token block
    k_base_scale [B, H, NB, D]           fp16
    v_base       [B, H, S, D/2]          uint8  loop-1 V codes
    v_base_min   [B, H, S, D/G]          fp16   one group per token per G channels
    v_base_scale [B, H, S, D/G]          fp16
    k_res        [B, H, CAPT, D/2]       uint8  residual codes of every depth: depth d owns the
                                                compact rows [off_d, off_d + CAP_d)
    k_res_min    [R-1, B, H, NB, D]      fp16   block-local K residual groups, depth d at index d-1
    k_res_scale  [R-1, B, H, NB, D]      fp16
    v_res        [B, H, CAPT, D/2]       uint8
    v_res_min    [B, H, CAPT, D/G]       fp16   per compact row
    v_res_scale  [B, H, CAPT, D/G]       fp16
    k_tail       [B, R, H, 2*tail, D]    dtype  ring of recent tokens, slot = position % (2*tail)
    v_tail       [B, R, H, 2*tail, D]    dtype
    flushed      [B, R]                  int32  positions quantized per depth (tail = [flushed, length))
    row_count    [B, R]                  int32  compact rows used per depth (demand: may exceed CAP_d)

Per model (``MODEL_TENSOR_NAMES``)::

    rows         [R-1, B, S]             int32  depth d at index d-1: position -> compact row of
                                                depth d (local to depth d), -1 = no residual
    depth_count  [B, S]                  uint8  depths at which the token was computed
    res_layout   [2, R]                  int32  row offset off_d and capacity CAP_d per depth
    overflow     [1]                     int32  set to 1 by a write whose compact rows overflowed
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from flashloop_compile.reference.codec import PARAM_DTYPE

__all__ = [
    "PackedTensors", "LAYER_TENSOR_NAMES", "MODEL_TENSOR_NAMES", "CACHE_NAMES", "PackedGeometry", "TensorSpec",
    "tensor_specs", "res_layout", "PackedCache", "PACKED_LAYOUT_VERSION",
]

# The version of this layout (names, order, shapes, dtypes, fills and the meaning of each tensor):
# an exported package records it and the loader refuses another. Bump it with any change of those.
PACKED_LAYOUT_VERSION = 1


class PackedTensors(NamedTuple):
    """Named view of the packed cache's tensors in the ops' order: ``PackedTensors(*cache)``, then
    ``c.k_tail``. One layer's tensors, then the model's (shapes in the module docstring)."""

    k_base: Tensor
    k_base_min: Tensor
    k_base_scale: Tensor
    v_base: Tensor
    v_base_min: Tensor
    v_base_scale: Tensor
    k_res: Tensor
    k_res_min: Tensor
    k_res_scale: Tensor
    v_res: Tensor
    v_res_min: Tensor
    v_res_scale: Tensor
    k_tail: Tensor
    v_tail: Tensor
    flushed: Tensor
    row_count: Tensor
    rows: Tensor
    depth_count: Tensor
    res_layout: Tensor
    overflow: Tensor


CACHE_NAMES = PackedTensors._fields
LAYER_TENSOR_NAMES = CACHE_NAMES[:16]
MODEL_TENSOR_NAMES = CACHE_NAMES[16:]


@dataclass(frozen=True)
class PackedGeometry:
    """What a model's graph fixes about its packed cache: layers, loops, batch slots, context,
    heads and head_dim (from its cache buffers) and the quantization's group size and tail. The
    compact residual rows per depth and the compute dtype are the allocator's choice."""

    num_layers: int
    num_loops: int
    max_batch: int
    max_seq: int
    kv_heads: int
    head_dim: int
    group_size: int
    tail: int


class TensorSpec(NamedTuple):
    """A cache tensor's shape, dtype and initial value, and where one request's part of it lies:
    its batch-slot axis (``row_axis``, None for a tensor every row shares) and the axis the row fills
    as it grows (``extent_axis``), counted in ``extent`` units: "token" (positions), "block"
    (G-token blocks), "ring" (tail slots, min(length, 2 * tail) in use) or "compact" (every depth's
    compact residual rows, ``res_layout``); None: the whole row."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    fill: int = 0  # the value of a fresh (or fully reset) cache
    row_axis: int | None = 0
    extent_axis: int | None = None
    extent: str | None = None


def tensor_specs(g: PackedGeometry, res_rows: int, dtype: torch.dtype) -> dict[str, TensorSpec]:
    """Shape, dtype and initial value of every cache tensor, in ``CACHE_NAMES`` order (the same
    for every layer). ``res_rows``: CAPT, the compact residual rows of all depths together;
    ``dtype``: the compute dtype of the tails."""
    B, H, S, D, G, R = g.max_batch, g.kv_heads, g.max_seq, g.head_dim, g.group_size, g.num_loops
    NB, NG, CAPT = S // G, D // G, res_rows
    u8, f16, i32 = torch.uint8, PARAM_DTYPE, torch.int32
    return PackedTensors(
        k_base=TensorSpec((B, H, S, D // 2), u8, extent_axis=2, extent="token"),
        k_base_min=TensorSpec((B, H, NB, D), f16, extent_axis=2, extent="block"),
        k_base_scale=TensorSpec((B, H, NB, D), f16, extent_axis=2, extent="block"),
        v_base=TensorSpec((B, H, S, D // 2), u8, extent_axis=2, extent="token"),
        v_base_min=TensorSpec((B, H, S, NG), f16, extent_axis=2, extent="token"),
        v_base_scale=TensorSpec((B, H, S, NG), f16, extent_axis=2, extent="token"),
        k_res=TensorSpec((B, H, CAPT, D // 2), u8, extent_axis=2, extent="compact"),
        k_res_min=TensorSpec((R - 1, B, H, NB, D), f16, row_axis=1, extent_axis=3, extent="block"),
        k_res_scale=TensorSpec((R - 1, B, H, NB, D), f16, row_axis=1, extent_axis=3, extent="block"),
        v_res=TensorSpec((B, H, CAPT, D // 2), u8, extent_axis=2, extent="compact"),
        v_res_min=TensorSpec((B, H, CAPT, NG), f16, extent_axis=2, extent="compact"),
        v_res_scale=TensorSpec((B, H, CAPT, NG), f16, extent_axis=2, extent="compact"),
        k_tail=TensorSpec((B, R, H, 2 * g.tail, D), dtype, extent_axis=3, extent="ring"),
        v_tail=TensorSpec((B, R, H, 2 * g.tail, D), dtype, extent_axis=3, extent="ring"),
        flushed=TensorSpec((B, R), i32),
        row_count=TensorSpec((B, R), i32),
        rows=TensorSpec((R - 1, B, S), i32, fill=-1, row_axis=1, extent_axis=2, extent="token"),
        depth_count=TensorSpec((B, S), u8, extent_axis=1, extent="token"),
        res_layout=TensorSpec((2, R), i32, row_axis=None),
        overflow=TensorSpec((1,), i32, row_axis=None),
    )._asdict()


def res_layout(max_seq: int, residual_capacity: Sequence[int]) -> list[list[int]]:
    """The ``res_layout`` values: [row offset off_d, capacity CAP_d] of depths 0..R-1 (depth 0,
    which has no residual, as offset 0 and capacity max_seq)."""
    offsets = [sum(residual_capacity[:i]) for i in range(len(residual_capacity))]
    return [[0, *offsets], [max_seq, *residual_capacity]]


class PackedCache(Protocol):
    """What the op wrappers and the passes read from a packed cache (runtime.PackedKVCache)."""

    geometry: PackedGeometry
    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def layer_tensors(self, layer: int) -> tuple[Tensor, ...]:
        """The layer's ``LAYER_TENSOR_NAMES`` tensors."""
        ...

    def model_tensors(self) -> tuple[Tensor, ...]:
        """The ``MODEL_TENSOR_NAMES`` tensors, shared by every layer."""
        ...

    def op_tensors(self, layer: int) -> tuple[Tensor, ...]:
        """layer_tensors(layer) + model_tensors(): the cache arguments of every packed op."""
        ...
