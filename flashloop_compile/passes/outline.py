"""Compile each distinct layer once: outline the unrolled loop body into shared segments.

Dynamo unrolls R loops of N layers into one graph, and Inductor then compiles R*N copies of the
same layer (about two minutes for Ouro-1.4B, per shape). A looped model's layers are isomorphic,
so this pass cuts the graph at layer boundaries, groups the segments whose graphs are identical
(same operations, shapes and dtypes; weights and caches are inputs), and compiles one Inductor
artifact per group, reused by every member. Loop 1's layers, loop 2's reference layers and the
correction layers of loops 3..R each form one group, so compile time no longer grows with R*N.

Layer boundaries are found on the graph *before* the feature passes: in each loop body the
residual stream is the only value live across the point right after a layer's last residual
add. Cutting there and at the loop boundaries H[r] gives segments layer by layer. Feature passes
add values that cross segments (loop 2's reference statistics); they become segment outputs and
inputs.

The price: no fusion across a layer boundary (one extra read and write of the hidden state per
layer) and one Python call per segment when not replayed from a CUDA graph.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from flashloop_compile.passes.graph import canonical_graph, shape_of
from flashloop_compile.passes.recognize import LoopStructure

__all__ = ["layer_cuts", "outline_segments", "SharedSegment"]

log = logging.getLogger("flashloop_compile.passes")


def layer_cuts(structure: LoopStructure) -> list[fx.Node]:
    """Boundary nodes (a segment ends after each) in program order: the end of the prologue, then
    per loop the end of each layer (its last residual add) and H[r]."""
    cuts: list[fx.Node] = []
    first = structure.loops[0][0]
    if first.prev.op != "root":
        cuts.append(first.prev)
    delta = None
    for r, body in enumerate(structure.loops):
        pos = {n: i for i, n in enumerate(body)}
        single = _single_live_points(body, shape_of(structure.states[r + 1]))
        site_pos = [pos[s.node] for s in structure.sites if s.loop == r and s.node in pos]
        state_pos = pos[structure.states[r + 1]]
        for j, nxt in enumerate(site_pos[1:]):
            # the last point before the next layer's attention where only the residual stream is live
            between = sorted(i for i in single if site_pos[j] < i < nxt)
            if not between:
                raise RuntimeError(f"no layer boundary between layers {j} and {j + 1} of loop {r + 1}")
            cuts.append(body[between[-1]])
            delta = between[-1] - site_pos[j]
        # layers are isomorphic: the last layer ends at the same offset from its attention; with
        # one layer per loop, at the last residual add (an add of two hidden states) before H[r]
        if delta is not None:
            end = site_pos[-1] + delta
        else:
            adds = [i for i in sorted(single) if site_pos[-1] < i < state_pos and _is_residual_add(body[i])]
            end = adds[-1] if adds else None
        if end is not None and end in single and end < state_pos:
            cuts.append(body[end])
        cuts.append(body[-1])
    return cuts


def _is_residual_add(n: fx.Node) -> bool:
    from flashloop_compile.passes.graph import is_op

    args = [a for a in n.args if isinstance(a, fx.Node)]
    return is_op(n, "add") and len(args) == 2 and shape_of(args[0]) == shape_of(args[1]) == shape_of(n)


def _single_live_points(body: list[fx.Node], hidden: tuple | None) -> set[int]:
    """Indices i where the only body value defined up to i and used after i is body[i] itself."""
    pos = {n: i for i, n in enumerate(body)}
    last_use = {n: max((pos.get(u, len(body)) for u in n.users), default=-1) for n in body}
    alive: set[fx.Node] = set()
    out = set()
    for i, n in enumerate(body):
        alive = {a for a in alive if last_use[a] > i}
        if last_use[n] > i:
            alive.add(n)
        if alive == {n} and shape_of(n) == hidden:
            out.add(i)
    return out


class SharedSegment(torch.nn.Module):
    """A segment whose compiled artifact is shared with every isomorphic segment (same key).

    The artifact is normally compiled by :func:`outline_segments` from the placeholders' recorded
    example values (symbolic where Dynamo made a dimension dynamic), so it serves every size those
    symbols take. A segment without recorded values is compiled at its first call per concrete
    input shapes instead (an artifact compiled for real inputs is specialized to their shapes).
    """

    def __init__(self, gm: fx.GraphModule, key: str, cache: dict[Any, Callable], compiler: Callable) -> None:
        super().__init__()
        self.gm, self.key, self._cache, self._compiler = gm, key, cache, compiler

    def forward(self, *args: Any) -> Any:
        fn = self._cache.get(self.key)
        if fn is None:
            key = (self.key, tuple(_concrete(a) for a in args))
            fn = self._cache.get(key)
            if fn is None:
                fn = self._cache[key] = self._compiler(self.gm, list(args))
        return fn(*args)


def _concrete(a: Any) -> Any:
    if isinstance(a, torch.Tensor):
        return (tuple(a.shape), a.stride(), a.dtype, a.device)
    return a if isinstance(a, (int, float, bool, type(None))) else type(a)


def _symbolic_inputs(gm: fx.GraphModule) -> list[Any] | None:
    """The example values recorded for ``gm``'s placeholders (fake tensors and SymInts of the
    Dynamo graph's ShapeEnv; split_module copies the meta), or None if one is missing."""
    from torch._subclasses.fake_tensor import FakeTensor

    from flashloop_compile.passes.graph import val

    values = [val(n) for n in gm.graph.nodes if n.op == "placeholder"]
    if any(v is None or (isinstance(v, torch.Tensor) and not isinstance(v, FakeTensor)) for v in values):
        return None
    return [_plain_symbol(v) for v in values]


def _plain_symbol(v: Any) -> Any:
    """A SymInt input as a SymInt of the symbol it currently equals. Dynamo may hand the graph a
    size symbol that a guard replaced by another (s70 -> s2; tensors are sized by s2); Inductor
    binds a SymInt input by its original symbol, so a segment whose tensors are sized by
    expressions of s2 and that gets s2 only as that input would find s2 unbound."""
    import sympy

    if isinstance(v, torch.SymInt) and isinstance(v.node.expr, sympy.Symbol):
        return v.node.shape_env.create_symintnode(v.node.expr, hint=v.node.hint)
    return v


def _segment_key(gm: fx.GraphModule) -> str:
    text = canonical_graph(gm)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def outline_segments(gm: fx.GraphModule, cuts: list[fx.Node], compiler: Callable) -> tuple[fx.GraphModule, dict[str, int]]:
    """Split ``gm`` after each cut node, compile each distinct segment once with ``compiler``.

    Called from the backend: each distinct segment is compiled here from its placeholders'
    example values, so a dynamic token or batch dimension stays symbolic in the artifact.

    Returns the top-level module (plain Python calls between segments) and the number of
    segments per key.
    """
    # A pass that rewires a node (token-sparse loops' rows) leaves the example value Dynamo
    # recorded for it; the fake propagation after each pass stores the current one as "val".
    # split_module reads "example_value" (segment inputs, their symbols), as do the segment keys.
    for n in gm.graph.nodes:
        if "val" in n.meta:
            n.meta["example_value"] = n.meta["val"]
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    cut_pos = sorted(order[c] for c in cuts if c in order)
    bounds = iter(cut_pos)
    part_of: dict[fx.Node, int] = {}
    current, nxt = 0, next(bounds, None)
    for n in gm.graph.nodes:
        part_of[n] = current
        if nxt is not None and order[n] == nxt:
            current += 1
            nxt = next(bounds, None)
    top = split_module(gm, None, lambda n: part_of[n], keep_original_order=True)
    cache: dict[Any, Callable] = {}
    counts: dict[str, int] = {}
    for name, sub in list(top.named_children()):
        key = _segment_key(sub)
        counts[key] = counts.get(key, 0) + 1
        if key not in cache and (inputs := _symbolic_inputs(sub)) is not None:
            # now, inside the backend call: guards the compiler adds to the Dynamo graph's
            # ShapeEnv become guards of that graph
            cache[key] = compiler(sub, inputs)
        setattr(top, name, SharedSegment(sub, key, cache, compiler))
    log.info("outlined %d segments into %d distinct compiled artifacts", sum(counts.values()), len(counts))
    return top, counts
