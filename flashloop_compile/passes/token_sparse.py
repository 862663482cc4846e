"""Token-sparse prefill pass: loops 3..R run on the selected rows only.

In a prefill graph, before each loop r >= 3 whose retention is below 1:
1. ``flashloop.select_active`` scores the tokens from the two preceding loop states and keeps a
   nested top-k per window (static size from the token count, no host sync);
2. the loop state and every per-token input of the body (positions, given or built in the graph,
   and what the graph computes from them: RoPE cos/sin) are gathered at the selected rows;
3. each layer's cache slot of loop r first inherits loop r-1's K/V at the forward's positions,
   then the re-emitted body writes K/V for the active rows only;
4. loop r's body is re-emitted on the gathered rows (norms, QKV, MLP, the end-of-loop norm);
   its attention becomes ``flashloop.position_attention``: the active queries at their original,
   non-consecutive positions over the loop's full logical KV cache; every value the body hands
   on (H[r], exit-gate logits, per-loop logits) is scattered back into loop r-1's value, which
   is what inactive rows keep.

The body is re-emitted with its token count replaced by the selection size, so the graph must
have a dynamic token dimension (the generator marks it; otherwise an error says how).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from flashloop_compile.lowering.selection_ops import ratio_fraction, selected_count
from flashloop_compile.passes.graph import runtime_buffer, shape_of, val
from flashloop_compile.passes.base import FlashLoopPass
from flashloop_compile.passes.recognize import LoopStructure, RecognitionError, describe, require_inplace_cache
from flashloop_compile.passes.sparse_decode import site_scale

__all__ = ["TokenSparsePrefillPass", "gather_rows", "scatter_rows"]


def gather_rows(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[b, index[b, k], ...] -> [B, K, ...]."""
    idx = index.reshape(*index.shape, *([1] * (x.dim() - 2))).expand(*index.shape, *x.shape[2:])
    return torch.gather(x, 1, idx)


def scatter_rows(base: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """base with base[b, index[b, k], ...] = rows[b, k, ...] (a new tensor)."""
    idx = index.reshape(*index.shape, *([1] * (base.dim() - 2))).expand(*index.shape, *base.shape[2:])
    return torch.scatter(base, 1, idx, rows.to(base.dtype))


class TokenSparsePrefillPass(FlashLoopPass):
    group = "token_sparse_prefill"
    phases = ("prefill",)

    def _sparse_depths(self, structure: LoopStructure) -> list[int]:
        ret = self.config.token_sparse_prefill.retention
        return [d for d in range(2, structure.num_loops) if ret[d] < 1.0]

    def _token_sources(self, gm: fx.GraphModule, structure: LoopStructure) -> tuple[list[fx.Node], list[fx.Node], set[str]]:
        """(per-token tensor placeholders [B, T], placeholders holding the token count T, and the
        names of T's symbols: Dynamo may give the ids and the positions separate, equal symbols)."""
        t = shape_of(structure.states[0])[1]
        if not isinstance(t, torch.SymInt):
            raise RecognitionError(
                f"token_sparse_prefill re-runs loop bodies on the selected rows, which needs the token dimension "
                f"to be dynamic in the captured graph (it is the constant {t}): compile with dynamic=True or call "
                f"torch._dynamo.mark_dynamic(input_ids, 1) and mark_dynamic(input_pos, 1) before the first call"
            )
        names = {str(t)}
        positions = structure.sites[0].cache.positions if structure.sites and structure.sites[0].cache else None
        if positions is not None and shape_of(positions) is not None and len(shape_of(positions)) == 2:
            names.add(str(shape_of(positions)[1]))
        syms, tensors = [], []
        for n in gm.graph.nodes:
            if n.op != "placeholder":
                continue
            v = val(n)
            if isinstance(v, torch.SymInt) and str(v) in names:
                syms.append(n)
            elif isinstance(v, torch.Tensor) and v.dim() >= 1 and any(str(s) in names for s in v.shape):
                if n in structure.loop_inputs or any(u in set(structure.loops[0]) or u in structure.loop_inputs for u in n.users):
                    if v.dim() != 2 or str(v.shape[1]) not in names:
                        raise RecognitionError(
                            f"token_sparse_prefill gathers per-token inputs by row; {describe(n)} has shape "
                            f"{tuple(v.shape)} instead of [batch, tokens]"
                        )
                    tensors.append(n)
        return tensors, syms, names

    def check(self, structure: LoopStructure) -> None:
        if not self._sparse_depths(structure):
            return
        for s in structure.sites:
            require_inplace_cache("token_sparse_prefill", s, "inactive tokens keep their K/V there")
            if not s.mask_supported:
                raise RecognitionError(f"token_sparse_prefill cannot rewrite {describe(s.node)}: {s.mask_kind}")

    def plan(self, structure: LoopStructure) -> list[str]:
        depths = self._sparse_depths(structure)
        if not depths:
            return ["retention 1 at every loop: no selection"]
        tsp = self.config.token_sparse_prefill
        w = "the whole forward" if tsp.window is None else f"windows of {tsp.window}"
        return [
            f"loop {d + 1}: select {tsp.retention[d]:g} of each window ({w}), gather rows, re-run "
            f"{structure.num_layers} layers on them, inherit + write K/V of active rows, scatter H[{d + 1}] back"
            for d in depths
        ]

    def apply(self, gm: fx.GraphModule, structure: LoopStructure) -> int:
        depths = self._sparse_depths(structure)
        if not depths:
            return 0
        graph = gm.graph
        tsp = self.config.token_sparse_prefill
        tensor_sources, sym_sources, token_names = self._token_sources(gm, structure)
        positions = structure.sites[0].cache.positions
        plan = self.context.plan_for(structure)
        seq_lens = runtime_buffer(gm, "flashloop_seq_lens", plan.seq_lens)
        last_pos = runtime_buffer(gm, "flashloop_last_pos", plan.last_pos)
        dependent = _dependents(graph, set(tensor_sources) | set(sym_sources), structure)
        final: dict[fx.Node, fx.Node] = {}
        prev_active = None
        for d in depths:
            body, prev_body = structure.loops[d], structure.loops[d - 1]
            in_body = set(body)
            h_prev = final.get(structure.states[d], structure.states[d])
            h_prev2 = final.get(structure.states[d - 1], structure.states[d - 1])
            p, q = ratio_fraction(tsp.retention[d])
            with graph.inserting_before(body[-1].next):
                t_node = sym_sources[0]
                k_out = _emit_count(graph, t_node, tsp.window, p, q)
                sel = graph.call_function(
                    torch.ops.flashloop.select_active.default,
                    (h_prev, h_prev2, prev_active, positions, seq_lens, last_pos, tsp.window, p, q, tsp.keep_last_token, k_out),
                )
                index = graph.call_function(operator.getitem, (sel, 0))
                active = graph.call_function(operator.getitem, (sel, 1))
                env: dict[fx.Node, fx.Node] = {h_prev: graph.call_function(gather_rows, (h_prev, index))}
                # positions built in the graph (a fresh prompt's arange) are gathered as they are:
                # re-emitting their computation at the selection's size would renumber the rows
                for src in tensor_sources + ([positions] if positions not in tensor_sources else []):
                    env[src] = graph.call_function(gather_rows, (src, index))
                for src in sym_sources:
                    env[src] = k_out
                # inactive tokens keep the previous loop's K/V in this loop's slot
                for layer in range(structure.num_layers):
                    site, before = structure.site(d, layer), structure.site(d - 1, layer)
                    for w in site.cache.writes:
                        src_buf = before.cache.k_buffer if w.args[0] is site.cache.k_buffer else before.cache.v_buffer
                        inherited = graph.call_function(operator.getitem, (src_buf, w.args[1]))
                        graph.call_function(operator.setitem, (w.args[0], w.args[1], inherited))
                emitted = _Reemitter(graph, env, in_body, dependent)
                for n in body:
                    emitted(n)
                # the active queries sit at non-consecutive positions: attend with the kernel
                # that takes them directly instead of a gathered [B, 1, K, S] mask
                for layer in range(structure.num_layers):
                    site = structure.site(d, layer)
                    old = emitted(site.node)
                    with graph.inserting_before(old):
                        new = graph.call_function(
                            torch.ops.flashloop.position_attention.default,
                            (emitted(site.q), emitted(site.k), emitted(site.v), emitted(site.cache.positions), site_scale(site)),
                        )
                    old.replace_all_uses_with(new)
                    graph.erase_node(old)
                    emitted.env[site.node] = new
                    self.context.sparse_sites[(d, layer)] = {
                        "index": index, "q": emitted(site.q), "positions": emitted(site.cache.positions),
                        "k": emitted(site.cache.k_new), "v": emitted(site.cache.v_new),
                    }
                for i, n in enumerate(body):
                    outside = [u for u in n.users if u not in in_body]
                    if not outside:
                        continue
                    prev = final.get(prev_body[i], prev_body[i])
                    t = shape_of(n)
                    if t is None or len(t) < 2 or str(t[1]) not in token_names:
                        raise RecognitionError(
                            f"token_sparse_prefill cannot hand {describe(n)} from loop {d + 1} on: values leaving a loop "
                            f"must be [batch, tokens, ...] like the loop state"
                        )
                    merged = graph.call_function(scatter_rows, (prev, index, emitted(n)))
                    for u in outside:
                        u.replace_input_with(n, merged)
                    final[n] = merged
            for n in body:
                self.context.replaced[n] = final.get(n, emitted(n))
            for n in reversed(body):
                graph.erase_node(n)
            prev_active = active
        return len(depths)


class _Reemitter:
    """Copies loop-body nodes (and loop invariants computed from per-token inputs) onto new inputs."""

    def __init__(self, graph: fx.Graph, env: dict[fx.Node, fx.Node], body: set[fx.Node], dependent: set[fx.Node]) -> None:
        self.graph, self.env, self.body, self.dependent = graph, env, body, dependent

    def __call__(self, n: fx.Node) -> fx.Node:
        if n in self.env:
            return self.env[n]
        if n not in self.body and n not in self.dependent:
            return n
        for a in n.all_input_nodes:
            self(a)
        copy = self.graph.node_copy(n, lambda a: self(a))
        self.env[n] = copy
        return copy


def _dependents(graph: fx.Graph, sources: set[fx.Node], structure: LoopStructure) -> set[fx.Node]:
    """Loop-invariant nodes computed from the per-token sources (cos/sin, masks, slices of them)."""
    bodies = set().union(*map(set, structure.loops))
    out: set[fx.Node] = set()
    for n in graph.nodes:
        if n in bodies or n in sources:
            continue
        if any(a in sources or a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def _emit_count(graph: fx.Graph, t: fx.Node, window: int | None, p: int, q: int) -> fx.Node:
    """Graph nodes computing selected_count(T) from the token-count symbol."""

    def budget(n):
        return graph.call_function(operator.floordiv, (graph.call_function(operator.add, (graph.call_function(operator.mul, (n, p)), q - 1)), q))

    if window is None:
        return budget(t)
    full = graph.call_function(operator.mul, (graph.call_function(operator.floordiv, (t, window)), selected_count(window, None, p, q)))
    return graph.call_function(operator.add, (full, budget(graph.call_function(operator.mod, (t, window)))))
