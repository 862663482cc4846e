"""Per-model runtime state the rewritten graphs read: the step plan (and, with quantization, the
packed cache), found by the model's own tensors.

Compiled graphs cannot take new arguments, so values planned on the host for each step (which
rows of a padded batch are real, where each prompt ends) live in preallocated tensors with static
addresses, registered on the rewritten graph (the backend hands them to the compiled graph as extra
inputs, the same tensors on every call). The runtime writes them before each
forward (plan/run split: the captured region only reads them), which also keeps them valid under
CUDA-graph replay.

A model is identified by its first cache buffer (or its first weight if it has none), the same
tensor object Dynamo hands the backend as a graph input, so the prefill and decode graphs of one
model share one state.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from flashloop_compile.runtime.packed_kv import PackedKVCache

__all__ = ["StepPlan", "ModelState", "state_for_tensor", "state_for_model"]


@dataclass
class StepPlan:
    """Host-planned per-row values of the current forward, in device tensors of max_batch rows.

    seq_lens: valid tokens of each row after this forward (its absolute end position); rows
        past a row's length are padding and never selected or stored.
    last_pos: the prompt's last position when this forward contains it, else -1 (keep_last_token).
    """

    seq_lens: Tensor
    last_pos: Tensor

    @classmethod
    def allocate(cls, max_batch: int, device: Any) -> "StepPlan":
        return cls(
            seq_lens=torch.full((max_batch,), -1, dtype=torch.int32, device=device),
            last_pos=torch.full((max_batch,), -2, dtype=torch.int32, device=device),
        )

    def set(self, seq_lens: Tensor | list[int], last_pos: Tensor | list[int] | None = None) -> None:
        """Plan the next forward. -1 in seq_lens (the default) means 'every token of the row is
        real'; last_pos default: seq_lens - 1 (a single-chunk prompt)."""
        n = len(seq_lens)
        self.seq_lens.fill_(-1)
        self.last_pos.fill_(-2)
        self.seq_lens[:n] = torch.as_tensor(seq_lens, dtype=torch.int32)
        if last_pos is not None:
            self.last_pos[:n] = torch.as_tensor(last_pos, dtype=torch.int32)

    def clear(self) -> None:
        """Back to 'all rows fully valid, prompt ends in this forward'."""
        self.seq_lens.fill_(-1)
        self.last_pos.fill_(-2)


@dataclass
class ModelState:
    plan: StepPlan
    packed: PackedKVCache | None = None  # with KV quantization (its geometry: packed.geometry)


# id(anchor tensor) -> (weak reference to it, state); tensors compare elementwise, so a
# WeakKeyDictionary (which compares keys with ==) cannot hold them.
_STATES: dict[int, tuple["weakref.ref[Tensor]", ModelState]] = {}


def _lookup(anchor: Tensor) -> ModelState | None:
    entry = _STATES.get(id(anchor))
    if entry is not None and entry[0]() is anchor:
        return entry[1]
    return None


def state_for_tensor(anchor: Tensor, max_batch: int) -> ModelState:
    """The state keyed by ``anchor`` (a model's first cache buffer or weight), created on first use."""
    state = _lookup(anchor)
    if state is None:
        key = id(anchor)
        state = ModelState(StepPlan.allocate(max_batch, anchor.device))
        _STATES[key] = (weakref.ref(anchor, lambda _: _STATES.pop(key, None)), state)
    return state


def state_for_model(model: torch.nn.Module, *, create: bool = True) -> ModelState | None:
    """The state a model's compiled graphs use, anchored on its first KV-cache buffer (call after
    the caches are allocated; reallocating them starts a new state)."""
    tensors = [t for name, t in model.named_buffers() if name.endswith("k_cache")]
    tensors += list(model.buffers()) + list(model.parameters())
    for t in tensors:
        state = _lookup(t)
        if state is not None:
            return state
    if not create or not tensors:
        return None
    anchor = tensors[0]
    return state_for_tensor(anchor, anchor.shape[0] if anchor.dim() == 4 else 256)
