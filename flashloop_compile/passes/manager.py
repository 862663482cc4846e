"""The pass framework: one class per FlashLoop feature, run by a manager in a fixed order.

Each pass is switched by its config group, checks that it can apply (raising a
:class:`~flashloop_compile.passes.recognize.RecognitionError` that names the node otherwise),
rewrites the graph, and reports how many sites it matched. ``uuid()`` hashes the pass's source
and its config group, so compiled artifacts keyed on it change when either does. At DEBUG level
on the ``flashloop_compile.passes`` logger the graph is dumped (valid Python) before and after
each pass.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.passes.base import FlashLoopPass, PassContext, Phase, RuntimeProvider, graph_phase
from flashloop_compile.passes.graph import shape_of
from flashloop_compile.passes.kv_quant import KVResidualQuantizationPass
from flashloop_compile.passes.position_attention import PositionAttentionPass
from flashloop_compile.passes.recognize import LoopStructure, RecognitionError, recognize
from flashloop_compile.passes.sparse_decode import SparseDecodeAttentionPass
from flashloop_compile.passes.token_sparse import TokenSparsePrefillPass

__all__ = ["FlashLoopPass", "PassManager", "RewriteReport", "Phase", "graph_phase", "PASS_ORDER"]

log = logging.getLogger("flashloop_compile.passes")


@dataclass
class RewriteReport:
    """What one compile recognized and rewrote. It holds no graph nodes: the backend keeps recent
    reports, and a node keeps its graph module alive, with the runtime buffers registered on it
    (the packed KV cache: GiBs at long contexts, held past the engine that allocated it)."""

    num_loops: int | None  # None: nothing recognized (all features off, no outlining)
    num_layers: int | None
    phase: Phase | None
    matched: dict[str, int] = field(default_factory=dict)
    segments: dict[str, int] = field(default_factory=dict)  # outlined segments per compiled artifact
    fused_linears: int = 0  # projection fusion (passes/fuse_projections.py): linears replaced
    fused_gemms: int = 0  # and the GEMMs that replaced them

    def __str__(self) -> str:
        fusion = f"; {self.fused_linears} linears sharing an input fused into {self.fused_gemms} GEMMs" if self.fused_gemms else ""
        if self.num_loops is None:
            return "flashloop: all features off" + (fusion or "; graph handed to inductor untouched")
        counts = ", ".join(f"{k}={v}" for k, v in self.matched.items()) or "no feature applies"
        text = (
            f"flashloop: {self.phase} graph, R={self.num_loops} x N={self.num_layers}; "
            f"matched {counts}"
        )
        text += fusion
        if self.segments:
            text += f"; {sum(self.segments.values())} segments compiled as {len(self.segments)} artifacts"
        return text


# Token-sparse prefill re-emits loop bodies and sparse decode replaces attention; the exact
# position-attention rewrite (a compilation option) takes the prefill sites left as SDPA; KV
# quantization runs last because it rewrites every cache write and read the others leave behind.
PASS_ORDER: list[type[FlashLoopPass]] = [
    TokenSparsePrefillPass, SparseDecodeAttentionPass, PositionAttentionPass, KVResidualQuantizationPass,
]


class PassManager:
    """Runs the enabled passes in a fixed order, then the cleanup tail (DCE, lint, recompile).
    ``runtime`` gives the passes that read runtime state (the step plan, the packed KV cache) the
    model's; the backend passes runtime/provider.py's (:func:`flashloop_compile.backend.pass_manager`).
    ``phase``: the phase of every graph it rewrites ("decode": a multi-query decode step's graph of
    k query rows), or None to tell it from the query length (one row: decode)."""

    def __init__(self, config: FlashLoopConfig, passes: list[type[FlashLoopPass]] | None = None, *,
                 runtime: RuntimeProvider | None = None, phase: Phase | None = None) -> None:
        if phase not in (None, "decode", "prefill"):
            raise ValueError(f"phase must be None, 'decode' or 'prefill', got {phase!r}")
        self.config = config
        self.runtime = runtime
        self.phase = phase
        self.passes = [p(config) for p in (passes if passes is not None else PASS_ORDER)]
        self.cuts: list[fx.Node] = []  # the last run's layer boundaries, when outlining

    def uuid(self) -> str:
        h = hashlib.sha256(self.config.hash().encode())
        for p in self.passes:
            if p.enabled:
                h.update(p.uuid().encode())
        return h.hexdigest()[:16]

    def run(self, gm: fx.GraphModule, example_inputs: list | None = None) -> RewriteReport:
        """Rewrite ``gm`` in place and report what matched; with outlining, :attr:`cuts` are then
        its layer boundaries (nodes of ``gm``: kept here, not in the report)."""
        outline = self.config.compilation.outline_layers
        self.cuts = []
        if not any(p.enabled for p in self.passes) and not outline:
            return RewriteReport(None, None, None)
        required = self.config.any_enabled or self.config.compilation.enabled
        try:
            structure = recognize(gm)
        except RecognitionError:
            if required:
                raise
            return RewriteReport(None, None, None)  # only best-effort rewrites: a graph without the pattern is left alone
        q_shape = shape_of(structure.sites[0].q) if structure.sites else None
        head_dim = int(q_shape[-1]) if q_shape else None
        self.config.resolve(structure.num_loops, forward_loops=structure.num_loops, head_dim=head_dim)
        phase = graph_phase(structure, self.phase)
        active = [p for p in self.passes if p.enabled and p.applies_to(structure, phase) and _allows(p, structure)]
        report = RewriteReport(structure.num_loops, structure.num_layers, phase)
        context = PassContext(gm, example_inputs, self.runtime)
        for p in active:
            p.context = context
        if outline:
            from flashloop_compile.passes.outline import layer_cuts

            self.cuts = layer_cuts(structure)
        for p in active:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("graph before %s:\n%s", p.name, gm.code)
            report.matched[p.name] = p.apply(gm, structure)
            self.cuts = [context.follow(c) for c in self.cuts]
            gm.graph.eliminate_dead_code(is_impure_node=_impure)
            if self.cuts:
                self.cuts = _prologue_cut(gm, self.cuts, structure, context)
            gm.graph.lint()
            gm.recompile()
            propagate_fake_values(gm)
            if log.isEnabledFor(logging.DEBUG):
                log.debug("graph after %s:\n%s", p.name, gm.code)
        return report

    def plan(self, structure: LoopStructure) -> list[str]:
        phase = graph_phase(structure, self.phase)
        lines = []
        for p in self.passes:
            if not p.enabled:
                continue
            if not p.applies_to(structure, phase):
                lines.append(f"{p.name}: not applied to {phase} graphs")
                continue
            try:
                p.check(structure)
            except RecognitionError as e:
                if p.required:
                    raise
                lines.append(f"{p.name}: not applied ({e})")
                continue
            lines.extend(f"{p.name}: {line}" for line in p.plan(structure))
        return lines


def _allows(p: FlashLoopPass, structure: LoopStructure) -> bool:
    """Whether ``p`` can rewrite this graph; a required pass that cannot raises (naming the node)."""
    try:
        p.check(structure)
    except RecognitionError:
        if p.required:
            raise
        return False
    return True


def propagate_fake_values(gm: fx.GraphModule) -> None:
    """Give nodes a pass added the fake values (shapes, dtypes) the next pass reads.

    Runs the graph under the fake mode Dynamo traced it with, from the placeholders' recorded
    example values; nodes Dynamo already described keep their metadata.
    """
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from flashloop_compile.passes.graph import val

    # The mode of the recorded example values (Dynamo hands backends a context with another one).
    inputs = [val(n) for n in gm.graph.nodes if n.op == "placeholder"]
    mode = next((x.fake_mode for x in inputs if isinstance(x, FakeTensor)), None)
    if mode is None:
        return
    import sympy

    env = mode.shape_env
    known = set(env.replacements) if env is not None else set()

    class _Prop(FakeTensorProp):
        def fetch_attr(self, target: str):  # runtime tensors registered on the graph module
            attr = super().fetch_attr(target)
            return mode.from_tensor(attr, static_shapes=True) if isinstance(attr, torch.Tensor) else attr

        def run_node(self, n: fx.Node):
            # A fake kernel that reads a size as an int fixes a dynamic dimension for the whole
            # graph (Dynamo later reports only the input it was, or recompiles per shape): name
            # the node that did it.
            out = super().run_node(n)
            if env is not None and len(env.replacements) != len(known):
                for sym in env.replacements.keys() - known:
                    to = env.replacements[sym]
                    if isinstance(to, sympy.Integer):
                        log.warning(
                            "fake propagation of %s specialized the dynamic size %s to %s (from %s)",
                            n.format_node(), sym, to, (n.meta.get("stack_trace") or "?").strip().splitlines()[-1:],
                        )
                known.update(env.replacements)
            return out

    # Dynamo computes its example values under the Python dispatcher (SymInt-aware Python
    # decompositions of composite ops); without it, the C++ composite `linear` on a 3-D CUDA
    # input reads `sizes()` and specializes the prompt length (F.linear(FakeTensor(3, s2, 128), W)
    # fixed s2 to 190).
    from torch._dispatch.python import enable_python_dispatcher

    with mode, enable_python_dispatcher():
        _Prop(gm, mode).propagate_dont_convert_inputs(*inputs)
    for n in gm.graph.nodes:
        if "example_value" not in n.meta and "val" in n.meta:
            n.meta["example_value"] = n.meta["val"]


def _prologue_cut(gm: fx.GraphModule, cuts: list[fx.Node], structure: LoopStructure, context: PassContext) -> list[fx.Node]:
    """Keep a boundary between the prologue and loop 1 when a pass removed the node it was on
    (the causal mask, say): the node just before loop 1's first surviving node."""
    alive = set(gm.graph.nodes)
    if cuts[0] in alive:
        return cuts
    first = next((context.follow(n) for n in structure.loops[0] if context.follow(n) in alive), None)
    rest = [c for c in cuts[1:] if c in alive]
    if first is None or first.prev.op == "root":
        return rest
    return [first.prev] + rest


def _impure(n: fx.Node) -> bool:
    """Keep mutations (cache writes, custom ops that write state) through dead-code elimination."""
    import operator

    if n.op == "call_function" and n.target is operator.setitem:
        return True
    if n.op == "call_method" and str(n.target).endswith("_"):
        return True
    if n.op == "call_function" and getattr(n.target, "__name__", "") in ("_vmap_increment_nesting", "_vmap_decrement_nesting"):
        return True  # torch.vmap's levels (transformers' masks): _add_batch_dim needs them
    return n.is_impure()
