"""The pass framework's base: a pass per FlashLoop feature (:class:`FlashLoopPass`), the context
the manager hands every pass (:class:`PassContext`) and what the passes need from the runtime
(:class:`RuntimeProvider`, which the runtime implements: the pass layer imports nothing from it).
The pass modules import this; the manager (passes/manager.py) imports them."""

from __future__ import annotations

import hashlib
import inspect
import json
from typing import ClassVar, Protocol

import torch
import torch.fx as fx
from torch import Tensor

from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.lowering.packed_layout import PackedCache, PackedGeometry
from flashloop_compile.passes.graph import shape_of, val
from flashloop_compile.passes.recognize import LoopStructure

__all__ = ["FlashLoopPass", "PassContext", "Phase", "graph_phase", "RuntimeProvider", "StepPlanTensors"]

Phase = str  # "prefill" or "decode"


def graph_phase(structure: LoopStructure, declared: Phase | None = None) -> Phase:
    """Decode graphs take one query token per row; every other graph is a prefill (chunk), unless
    the compile ``declared`` its phase: a multi-query decode step (speculative verification: k
    generated tokens per row, causal among themselves) is a decode graph of k query rows."""
    if declared is not None:
        return declared
    return "decode" if structure.query_len == 1 else "prefill"


class StepPlanTensors(Protocol):
    """The host-planned per-row values a rewritten graph reads (runtime/state.py's StepPlan)."""

    seq_lens: Tensor
    last_pos: Tensor


class RuntimeProvider(Protocol):
    """The runtime state the rewritten graphs read, owned by the runtime and found by a model's
    anchor tensor (its first cache buffer, or its first weight when it has no cache). An anchor of
    None: a graph analysed without its real inputs (tests), which gets private state."""

    def step_plan(self, anchor: Tensor | None, max_batch: int) -> StepPlanTensors:
        """The model's step plan, of ``max_batch`` rows when it is created."""
        ...

    def packed_cache(self, anchor: Tensor | None, geometry: PackedGeometry, dtype: torch.dtype,
                     device: torch.device) -> PackedCache:
        """The model's packed KV cache of ``geometry``: the one it has, or a new one (compute
        ``dtype``, on ``device``) when it has none of that geometry."""
        ...


class PassContext:
    """What passes may know beyond the graph: the real tensors behind its inputs (when the backend
    runs them) and the runtime state they belong to (through ``runtime``)."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list | None, runtime: RuntimeProvider | None = None) -> None:
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.real = dict(zip(placeholders, example_inputs)) if example_inputs is not None else {}
        self.runtime = runtime
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

    def _provider(self, what: str) -> RuntimeProvider:
        if self.runtime is None:
            raise RuntimeError(
                f"this rewrite reads the runtime's {what}: build the PassManager with "
                "runtime=flashloop_compile.runtime.provider.ModelStateProvider() "
                "(flashloop_compile.backend.pass_manager does)"
            )
        return self.runtime

    def plan_for(self, structure: LoopStructure) -> StepPlanTensors:
        """The model's step plan (see runtime/state.py), anchored on its first cache buffer."""
        runtime = self._provider("step plan")
        site = structure.sites[0]
        anchor_node = site.cache.k_buffer if site.cache is not None and site.cache.k_buffer is not None else structure.shared_weights[0]
        anchor = self.real.get(anchor_node)
        if isinstance(anchor, torch.Tensor):
            max_batch = anchor.shape[0] if anchor_node is not structure.shared_weights[0] else 256
            return runtime.step_plan(anchor, max_batch)
        # graphs analysed without their real inputs (tests): a private all-valid plan
        return runtime.step_plan(None, int(shape_of(structure.states[0])[0]))

    def packed_for(self, structure: LoopStructure, qcfg) -> PackedCache:
        """The model's packed KV cache (runtime state), sized from its cache buffers."""
        runtime = self._provider("packed KV cache")
        k_buffer = structure.sites[0].cache.k_buffer
        anchor = self.real.get(k_buffer)
        if not isinstance(anchor, torch.Tensor):  # analysed without real inputs: a private cache
            anchor = None
        described = anchor if anchor is not None else val(k_buffer)
        b, h, s, d = (int(x) for x in described.shape)
        geometry = PackedGeometry(structure.num_layers, structure.num_loops, b, s, h, d, qcfg.group_size, qcfg.tail)
        device = described.device if described.device.type != "meta" else torch.device("cpu")
        return runtime.packed_cache(anchor, geometry, described.dtype, device)


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

    @property
    def required(self) -> bool:
        """Whether the config asked for this rewrite: a graph that does not allow it is then an error;
        otherwise (a best-effort default) the pass leaves such a graph alone."""
        return True

    def applies_to(self, structure: LoopStructure, phase: Phase | None = None) -> bool:
        return graph_phase(structure, phase) in self.phases

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
