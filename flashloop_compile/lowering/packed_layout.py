"""The packed KV cache's tensor names, in the order the ``flashloop.packed_*`` ops take them, and
the interface the op wrappers need from a cache. The runtime (runtime/packed_kv.py) allocates a
cache with these tensors; the ops and kernels read them by these names. No Triton, no runtime."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import Tensor

__all__ = ["PackedTensors", "LAYER_TENSOR_NAMES", "MODEL_TENSOR_NAMES", "CACHE_NAMES", "PackedCache"]

class PackedTensors(NamedTuple):
    """Named view of the packed cache's tensors in the ops' order: ``PackedTensors(*cache)``, then
    ``c.k_tail``. One layer's tensors (shapes in runtime/packed_kv.py), then the model's."""

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


class PackedCache(Protocol):
    """What the op wrappers read from a packed cache (runtime.PackedKVCache)."""

    kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def op_tensors(self, layer: int) -> tuple[Tensor, ...]: ...
