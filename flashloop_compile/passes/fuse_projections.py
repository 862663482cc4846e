"""Linears that share an input become one GEMM over weights concatenated once, at compile time.

Ouro's ``q_proj``/``k_proj``/``v_proj`` read the same normed hidden state, as do the MLP's
``gate_proj``/``up_proj``: seven linears per layer and loop become four GEMMs (QKV, O, gate-up,
down). Each group's weights (and biases) are concatenated along the output dimension into one
tensor when the graph is compiled; the group becomes ``linear(x, W_fused)`` and every former output
a ``narrow`` of it. Exact: each output element is the same dot product over the same input row
(only the GEMM's internal reduction order may differ). The backend runs this after the feature
passes, in every configuration including features off (``compilation.fuse_projections``).

How the fused weight is held: a non-persistent buffer of the graph module, read by ``get_attr``
(:func:`~flashloop_compile.passes.graph.runtime_buffer`), so the backend passes it as a trailing
graph input (the same tensor every call, a static address) or, when outlining, as a segment
input. It is a copy: the model's weights take up to twice their memory for the fused
projections. Under Dynamo the weights are graph inputs, and a graph compiled for one model
instance serves every instance of the same class; the callable the backend returns therefore
checks, before each call, that the weights it receives are the tensors the copy was taken from,
unmodified (identity and version counter), and re-concatenates into the same buffer when they are
not. Rules for the user:

- inference only: a graph whose weights may need gradients (grad mode on, weights requiring
  grad) is left unfused, since the copy carries no gradient;
- an in-place change to a weight after compiling is seen at the next call of the compiled model,
  but not by a CUDA graph captured before it (the engine's decode replays): rebuild the engine;
- inference tensors carry no version counter: an in-place change to one made under
  ``torch.inference_mode`` is not seen; swap in a new tensor or recompile.

Linears qualify when their weights are graph inputs or attributes with real tensors behind them
(the backend's example inputs) and no output feeds a custom operator, the graph's output, or a
``view`` that the narrowed (strided) output cannot satisfy.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx

from flashloop_compile.passes.graph import arg, is_op, op_name, runtime_buffer, shape_of, val

__all__ = ["FusedProjections", "fuse_projections", "fusable_groups"]

log = logging.getLogger("flashloop_compile.passes")


def _version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors track no version
        return -1


@dataclass
class _Group:
    """One fused weight (and bias) and the tensors it was concatenated from."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    # per source tensor: its placeholder index (None: a graph-module attribute), a reference, its version
    sources: list[tuple[int | None, weakref.ref, int]]
    num_weights: int

    def current(self, args: tuple) -> list[torch.Tensor] | None:
        """The source tensors of this call, or None when they are the ones the copy was taken from."""
        stale = False
        tensors = []
        for index, ref, version in self.sources:
            t = ref() if index is None else args[index]
            tensors.append(t)
            if t is None or (index is not None and t is not ref()) or _version(t) != version:
                stale = True
        return tensors if stale else None

    def refresh(self, tensors: list[torch.Tensor]) -> None:
        if any(t is None for t in tensors):
            raise RuntimeError("a fused projection's weight was freed; recompile the model (torch._dynamo.reset())")
        ws, bs = tensors[: self.num_weights], tensors[self.num_weights:]
        with torch.inference_mode():
            torch.cat(ws, dim=0, out=self.weight)
            if self.bias is not None:
                torch.cat(bs, dim=0, out=self.bias)
        self.sources = [(i, weakref.ref(t), _version(t)) for (i, _, _), t in zip(self.sources, tensors)]


@dataclass
class FusedProjections:
    """What :func:`fuse_projections` did to one graph: the fused weights and the node map."""

    linears: int = 0  # linears replaced
    gemms: int = 0  # fused GEMMs that replaced them
    groups: list[_Group] = field(default_factory=list)
    replaced: dict[fx.Node, fx.Node] = field(default_factory=dict)  # erased linear -> its narrow

    def refresh(self, args: tuple) -> None:
        """Re-concatenate every fused weight whose sources are not the tensors of this call."""
        for g in self.groups:
            tensors = g.current(args)
            if tensors is not None:
                g.refresh(tensors)

    def wrap(self, fn: Callable) -> Callable:
        """``fn`` preceded by :meth:`refresh` (``fn`` itself when nothing was fused)."""
        if not self.groups:
            return fn

        def with_fused_weights(*args: Any) -> Any:
            self.refresh(args)
            return fn(*args)

        return with_fused_weights


def _linear_parts(n: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    if not is_op(n, "linear") or n.op != "call_function":
        return None
    if set(n.kwargs) - {"input", "weight", "bias"} or len(n.args) > 3:
        return None
    x, w, b = arg(n, 0, "input"), arg(n, 1, "weight"), arg(n, 2, "bias")
    if not isinstance(x, fx.Node) or not isinstance(w, fx.Node) or not (b is None or isinstance(b, fx.Node)):
        return None
    return x, w, b


def _real_tensors(gm: fx.GraphModule, example_inputs: list | None) -> dict[fx.Node, tuple[int | None, torch.Tensor]]:
    """Placeholders (with their index) and tensor attributes that have a real tensor behind them."""
    from torch._subclasses.fake_tensor import FakeTensor

    out: dict[fx.Node, tuple[int | None, torch.Tensor]] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if example_inputs is not None and len(example_inputs) == len(placeholders):
        for i, (n, t) in enumerate(zip(placeholders, example_inputs)):
            out[n] = (i, t)
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            obj: Any = gm
            for part in str(n.target).split("."):
                obj = getattr(obj, part, None)
            out[n] = (None, obj)
    return {n: (i, t) for n, (i, t) in out.items() if isinstance(t, torch.Tensor) and not isinstance(t, FakeTensor)}


def _users_accept_narrow(n: fx.Node, total: int) -> bool:
    """Whether every user of ``n`` computes the same on a narrow of a wider output (strided rows)."""
    for u in n.users:
        if u.op == "output":
            return False
        t = u.target
        if isinstance(t, torch._ops.HigherOrderOperator):
            return False
        if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)) and t.namespace not in ("aten", "prims"):
            return False  # custom kernels may assume contiguous rows
        if op_name(u).lstrip(".") == "view":
            shape = shape_of(u)
            if shape is None or any(isinstance(a, torch.dtype) for a in u.args[1:]):
                return False
            v = val(n)
            mode = getattr(v, "fake_mode", None)
            if mode is None:
                return False
            with mode:
                wide = v.new_empty(*v.shape[:-1], total)
                try:
                    wide.narrow(-1, 0, v.shape[-1]).view(shape)
                except (RuntimeError, ValueError):  # ValueError: the reference view under fake tensors
                    return False
    return True


def fusable_groups(gm: fx.GraphModule, real: dict[fx.Node, Any] | None = None) -> list[list[fx.Node]]:
    """Groups (program order) of two or more linears over the same input whose weights can be
    concatenated. ``real``: the nodes with real tensors behind them (None: graph analysis only,
    without the tensors, e.g. ``flashloop-compile inspect``)."""
    by_input: dict[tuple, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        parts = _linear_parts(n)
        if parts is None:
            continue
        x, w, b = parts
        if real is not None and (w not in real or (b is not None and b not in real)):
            continue
        if real is None and (w.op not in ("placeholder", "get_attr") or (b is not None and b.op not in ("placeholder", "get_attr"))):
            continue
        wv, bv = (real[w][1], real[b][1] if b is not None else None) if real is not None else (val(w), val(b))
        if not isinstance(wv, torch.Tensor) or wv.dim() != 2 or (b is not None and (not isinstance(bv, torch.Tensor) or bv.dim() != 1)):
            continue
        if b is not None and bv.dtype != wv.dtype:
            continue
        key = (x, wv.dtype, wv.device, b is None, wv.shape[1])
        by_input.setdefault(key, []).append(n)
    groups = []
    for members in by_input.values():
        while len(members) >= 2:
            total = sum(shape_of(m)[-1] if shape_of(m) else 0 for m in members)
            keep = [m for m in members if shape_of(m) is not None and _users_accept_narrow(m, total)]
            if len(keep) == len(members):
                groups.append(members)
                break
            members = keep
    return groups


def fuse_projections(gm: fx.GraphModule, example_inputs: list | None) -> FusedProjections:
    """Rewrite ``gm`` in place: each group of :func:`fusable_groups` becomes one linear over a
    weight concatenated here, from the real tensors behind the graph's inputs."""
    from torch._dispatch.python import enable_python_dispatcher
    from torch._subclasses.fake_tensor import FakeTensor

    result = FusedProjections()
    grad = torch.is_grad_enabled()
    real = _real_tensors(gm, example_inputs)
    groups = fusable_groups(gm, real)
    if not groups:
        return result
    graph = gm.graph
    mode = next((v.fake_mode for v in (val(n) for n in graph.nodes if n.op == "placeholder") if isinstance(v, FakeTensor)), None)
    fused_nodes: dict[tuple[fx.Node, ...], tuple[fx.Node, fx.Node | None]] = {}
    for members in groups:
        parts = [_linear_parts(m) for m in members]
        x = parts[0][0]
        w_nodes = tuple(p[1] for p in parts)
        b_nodes = tuple(p[2] for p in parts) if parts[0][2] is not None else ()
        sources = [real[n] for n in w_nodes + b_nodes]
        if grad and any(t.requires_grad for _, t in sources):
            continue  # the fused copy carries no gradient to the weights
        key = w_nodes + b_nodes
        if key not in fused_nodes:
            with torch.no_grad():
                weight = torch.cat([t for _, t in sources[: len(w_nodes)]], dim=0)
                bias = torch.cat([t for _, t in sources[len(w_nodes):]], dim=0) if b_nodes else None
            k = len(result.groups)
            w_get = runtime_buffer(gm, f"flashloop_fused_weight_{k}", weight)
            b_get = runtime_buffer(gm, f"flashloop_fused_bias_{k}", bias) if bias is not None else None
            for node, t in ((w_get, weight), (b_get, bias)):
                if node is not None and mode is not None:
                    node.meta["val"] = node.meta["example_value"] = mode.from_tensor(t, static_shapes=True)
            result.groups.append(_Group(weight, bias, [(i, weakref.ref(t), _version(t)) for i, t in sources], len(w_nodes)))
            fused_nodes[key] = (w_get, b_get)
        w_get, b_get = fused_nodes[key]
        sizes = [shape_of(m)[-1] for m in members]
        with graph.inserting_before(members[0]):
            fused = graph.call_function(members[0].target, (x, w_get, b_get))
            fused.meta["stack_trace"] = members[0].meta.get("stack_trace")
            outs, offset = [], 0
            for m, size in zip(members, sizes):
                outs.append(graph.call_function(torch.narrow, (fused, -1, offset, size)))
                offset += size
        if mode is not None:
            with mode, enable_python_dispatcher():
                y = torch.nn.functional.linear(val(x), val(w_get), val(b_get))
                fused.meta["val"] = fused.meta["example_value"] = y
                for out, off, size in zip(outs, [sum(sizes[:i]) for i in range(len(sizes))], sizes):
                    out.meta["val"] = out.meta["example_value"] = y.narrow(-1, off, size)
        for m, out in zip(members, outs):
            m.replace_all_uses_with(out)
            graph.erase_node(m)
            result.replaced[m] = out
        result.linears += len(members)
        result.gemms += 1
    graph.lint()
    gm.recompile()
    if result.gemms:
        log.info("projection fusion: %d linears sharing an input -> %d GEMMs", result.linears, result.gemms)
    return result
