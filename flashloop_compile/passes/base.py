"""The pass framework's base: a pass per FlashLoop feature (:class:`FlashLoopPass`) and the
context the manager hands every pass (:class:`PassContext`). The pass modules import this; the
manager (passes/manager.py) imports them."""

from __future__ import annotations

import hashlib
import inspect
import json
from typing import ClassVar

import torch
import torch.fx as fx

from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.passes.recognize import LoopStructure

__all__ = ["FlashLoopPass", "PassContext", "Phase", "graph_phase"]

Phase = str  # "prefill" or "decode"


def graph_phase(structure: LoopStructure) -> Phase:
    """Decode graphs take one query token per row; every other graph is a prefill (chunk)."""
    return "decode" if structure.query_len == 1 else "prefill"


class PassContext:
    """What passes may know beyond the graph: the real tensors behind its inputs (when the backend
    runs them) and the runtime state they belong to."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list | None) -> None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.real = dict(zip(placeholders, example_inputs)) if example_inputs is not None else {}
        # Every pass sees the structure recognized before the first rewrite; nodes a pass replaced
        # are followed here (later passes, layer boundaries when outlining).
        self.replaced: dict[fx.Node, fx.Node] = {}
        # token-sparse loops' per-site values, for the KV quantization pass: (depth, layer) ->
        # {"index", "k", "v", "positions", "q"} on the selected rows
        self.sparse_sites: dict[tuple[int, int], dict[str, fx.Node]] = {}

    def follow(self, n: fx.Node) -> fx.Node:
        while n in self.replaced:
            n = self.replaced[n]
        return n

    def plan_for(self, structure: LoopStructure):
        """The model's step plan (see runtime/state.py), anchored on its first cache buffer."""
        from flashloop_compile.passes.graph import shape_of
        from flashloop_compile.runtime.state import StepPlan, state_for_tensor

        site = structure.sites[0]
        anchor_node = site.cache.k_buffer if site.cache is not None and site.cache.k_buffer is not None else structure.shared_weights[0]
        anchor = self.real.get(anchor_node)
        if isinstance(anchor, torch.Tensor):
            max_batch = anchor.shape[0] if anchor_node is not structure.shared_weights[0] else 256
            return state_for_tensor(anchor, max_batch).plan
        # graphs analysed without their real inputs (tests, inspect): a private all-valid plan
        return StepPlan.allocate(int(shape_of(structure.states[0])[0]), "cpu")


    def packed_for(self, structure: LoopStructure, qcfg):
        """The model's packed KV cache (runtime state), sized from its cache buffers."""
        from flashloop_compile.passes.graph import val
        from flashloop_compile.runtime.packed_kv import PackedKVCache
        from flashloop_compile.runtime.state import ModelState, StepPlan, state_for_tensor

        site = structure.sites[0]
        anchor = self.real.get(site.cache.k_buffer)
        if isinstance(anchor, torch.Tensor):
            state = state_for_tensor(anchor, anchor.shape[0])
        else:  # analysed without real inputs: a private cache on the CPU
            anchor = val(site.cache.k_buffer)
            state = self.__dict__.setdefault("_private", ModelState(StepPlan.allocate(anchor.shape[0], "cpu")))
        packed = state.extras.get("packed")
        b, h, s, d = (int(x) for x in anchor.shape)
        geometry = (structure.num_layers, structure.num_loops, b, s, h, d, qcfg.group_size, qcfg.tail)
        if packed is None or state.extras.get("packed_geometry") != geometry:
            device = anchor.device if anchor.device.type != "meta" else "cpu"
            packed = PackedKVCache(*geometry[:6], group_size=qcfg.group_size, tail=qcfg.tail, dtype=anchor.dtype, device=device)
            state.extras["packed"], state.extras["packed_geometry"] = packed, geometry
        return packed


class FlashLoopPass:
    """Base class: subclasses set ``group`` (their config group) and implement plan/apply."""

    group: ClassVar[str]
    phases: ClassVar[tuple[Phase, ...]] = ("prefill", "decode")

    def __init__(self, config: FlashLoopConfig) -> None:
        self.config = config
        self.context: PassContext | None = None

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def enabled(self) -> bool:
        return getattr(self.config, self.group).enabled

    def applies_to(self, structure: LoopStructure) -> bool:
        return graph_phase(structure) in self.phases

    def check(self, structure: LoopStructure) -> None:
        """Raise a RecognitionError naming the node if this graph does not allow the rewrite."""

    def plan(self, structure: LoopStructure) -> list[str]:
        """Human-readable rewrites this pass would make (``flashloop-compile inspect``)."""
        raise NotImplementedError

    def apply(self, gm: fx.GraphModule, structure: LoopStructure) -> int:
        """Rewrite ``gm`` in place; return the number of matched sites."""
        raise NotImplementedError

    def uuid(self) -> str:
        src = inspect.getsource(type(self))
        params = json.dumps({k: v for k, v in self.config.to_dict().items() if k.startswith(self.group + ".")}, sort_keys=True)
        return hashlib.sha256((src + params).encode()).hexdigest()[:16]
