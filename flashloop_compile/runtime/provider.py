"""The runtime side of the pass layer's :class:`~flashloop_compile.passes.base.RuntimeProvider`:
each model's step plan and packed KV cache, kept in its :class:`~flashloop_compile.runtime.state.ModelState`."""

from __future__ import annotations

import torch
from torch import Tensor

from flashloop_compile.lowering.packed_layout import PackedGeometry
from flashloop_compile.runtime.packed_kv import PackedKVCache
from flashloop_compile.runtime.state import StepPlan, state_for_tensor

__all__ = ["ModelStateProvider"]


class ModelStateProvider:
    """Finds a model's state by its anchor tensor (runtime/state.py). The engine allocates the
    packed cache before compiling (sized for its requests); a graph compiled without an engine
    gets one of the default capacity. An anchor of None gets fresh private state."""

    def step_plan(self, anchor: Tensor | None, max_batch: int) -> StepPlan:
        if anchor is None:
            return StepPlan.allocate(max_batch, "cpu")
        return state_for_tensor(anchor, max_batch).plan

    def packed_cache(self, anchor: Tensor | None, geometry: PackedGeometry, dtype: torch.dtype,
                     device: torch.device) -> PackedKVCache:
        if anchor is None:
            return PackedKVCache.for_geometry(geometry, dtype=dtype, device=device)
        state = state_for_tensor(anchor, anchor.shape[0])
        if state.packed is None or state.packed.geometry != geometry:
            state.packed = PackedKVCache.for_geometry(geometry, dtype=dtype, device=device)
        return state.packed
