"""Sparse decode attention pass: loop 2 becomes the reference, loops 3..R its corrections.

In a decode graph (one query token per row) the attention of every layer at the reference loop
becomes ``flashloop.reference_attention``; its statistics (selected keys S, mass m, O_ref, C_ref)
flow as graph tensors to the same layer's attention at each later loop, which becomes
``flashloop.correction_attention`` over that loop's K/V. Under
``reuse_selected_probabilities`` loop 2 becomes ``flashloop.reference_attention_probs`` (it also
keeps the selected keys' probabilities) and each later site ``flashloop.reuse_correction_attention``
over that loop's V alone (its q and k feed nothing). Loop 1 stays dense. Prefill graphs
are not touched (prompt rows never get decode selection), nor are forwards that run fewer loops
than the first sparse one (a graph recognized with R <= 2 loops has no sparse loop).
"""

from __future__ import annotations

import math
import operator

import torch
import torch.fx as fx

from flashloop_compile.config import ceil_fraction
from flashloop_compile.passes.graph import dtype_of, is_op, sdpa_args, shape_of
from flashloop_compile.passes.base import FlashLoopPass
from flashloop_compile.passes.recognize import AttentionSite, LoopStructure, UnsupportedAttentionError, describe

__all__ = ["SparseDecodeAttentionPass"]


def site_scale(site: AttentionSite) -> float:
    """The softmax scale of an attention site (SDPA's scale, or the eager chain's constant)."""
    head_dim = shape_of(site.q)[-1]
    if site.kind == "sdpa":
        scale = sdpa_args(site.node)["scale"]
        return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)
    # eager: matmul(q, k^T) -> mul/div by a constant -> ... -> softmax
    n = site.node.args[0]
    while isinstance(n, fx.Node) and not is_op(n, "matmul"):
        if is_op(n, "scale"):
            c = n.args[1] if not isinstance(n.args[1], fx.Node) else n.args[0]
            if isinstance(c, (int, float)):
                name = str(n.target) if n.op == "call_method" else getattr(n.target, "__name__", "")
                return float(c) if "mul" in name else 1.0 / float(c)
        n = n.args[0]
    return 1.0


def visible_mask(graph: fx.Graph, site: AttentionSite) -> fx.Node:
    """A bool [B|1, H|1, T, S] 'visible' tensor from the site's mask (bool, or additive float)."""
    mask = site.mask
    if mask is None:
        raise UnsupportedAttentionError(
            f"sparse_decode_attention needs an explicit causal mask at {describe(site.node)}; "
            f"got mask kind {site.mask_kind}"
        )
    if dtype_of(mask) != torch.bool:
        # Additive masks hold 0 for visible keys and a very negative number (or -inf) otherwise.
        mask = graph.call_function(torch.gt, (mask, -1e30))
    shape = shape_of(site.mask)
    while len(shape) < 4:
        mask = graph.call_method("unsqueeze", (mask, 0))
        shape = (1,) + shape
    return mask


class SparseDecodeAttentionPass(FlashLoopPass):
    group = "sparse_decode_attention"
    phases = ("decode",)

    def _sparse_loops(self, structure: LoopStructure) -> range:
        return range(self.config.sparse_decode_attention.reference_loop, structure.num_loops)

    def check(self, structure: LoopStructure) -> None:
        ref = self.config.sparse_decode_attention.reference_loop - 1
        for s in structure.sites:
            if s.loop < ref:
                continue
            if not s.mask_supported:
                raise UnsupportedAttentionError(
                    f"sparse_decode_attention cannot rewrite the attention at {describe(s.node)} "
                    f"(loop {s.loop + 1}, layer {s.layer}): {s.mask_kind}"
                )
            if s.mask is None:
                raise UnsupportedAttentionError(
                    f"sparse_decode_attention needs an explicit causal mask at {describe(s.node)} "
                    f"(loop {s.loop + 1}, layer {s.layer}); this site uses {s.mask_kind}"
                )

    def _fractions(self, structure: LoopStructure) -> list[float]:
        sda = self.config.sparse_decode_attention
        return [sda.fraction_at(d + 1) for d in self._sparse_loops(structure)]

    def plan(self, structure: LoopStructure) -> list[str]:
        n, ref = structure.num_layers, self.config.sparse_decode_attention.reference_loop
        sparse = list(self._sparse_loops(structure))
        if not sparse:
            return [f"no sparse loop (the graph runs {structure.num_loops} loops): attention stays dense"]
        fr = sorted(set(self._fractions(structure)))
        if self.config.sparse_decode_attention.reuse_selected_probabilities:
            return [
                f"loop {ref}: {n} attention sites -> flashloop.reference_attention_probs (key fractions {fr})",
                f"loops {sparse[0] + 1}..{sparse[-1] + 1}: {n * len(sparse)} attention sites -> "
                "flashloop.reuse_correction_attention (loop 2's probabilities over the selected keys, V only)",
            ]
        return [
            f"loop {ref}: {n} attention sites -> flashloop.reference_attention (key fractions {fr})",
            f"loops {sparse[0] + 1}..{sparse[-1] + 1}: {n * len(sparse)} attention sites -> flashloop.correction_attention",
        ]

    def apply(self, gm: fx.GraphModule, structure: LoopStructure) -> int:
        sparse = list(self._sparse_loops(structure))
        if not sparse:
            return 0
        graph = gm.graph
        fractions = self._fractions(structure)
        distinct = sorted(set(fractions), key=fractions.index)
        ref_depth = self.config.sparse_decode_attention.reference_loop - 1
        reuse = self.config.sparse_decode_attention.reuse_selected_probabilities
        ref_op = torch.ops.flashloop.reference_attention_probs.default if reuse else torch.ops.flashloop.reference_attention.default
        matched = 0
        for layer in range(structure.num_layers):
            site = structure.site(ref_depth, layer)
            key_len = shape_of(site.k)[2]
            if not isinstance(key_len, int):
                raise UnsupportedAttentionError(
                    f"sparse_decode_attention needs a static key length at {describe(site.node)} "
                    f"(a static cache), got {key_len}"
                )
            capacities = [ceil_fraction(f, key_len) for f in distinct]
            scale = site_scale(site)
            with graph.inserting_before(site.node):
                mask = visible_mask(graph, site)
                ref = graph.call_function(ref_op, (site.q, site.k, site.v, mask, scale, distinct, capacities))
                outs = [graph.call_function(operator.getitem, (ref, i)) for i in range(7 if reuse else 6)]
            _replace(site.node, outs[0])
            self.context.replaced[site.node] = ref
            matched += 1
            keys, count, mass, o_ref, c_ref = outs[1:6]
            for depth, fraction in zip(sparse, fractions):
                later = structure.site(depth, layer)
                f = distinct.index(fraction)
                with graph.inserting_before(later.node):
                    if reuse:
                        k_f, n_f, p_f, c_f = [graph.call_function(operator.getitem, (t, f)) for t in (keys, count, outs[6], c_ref)]
                        out = graph.call_function(
                            torch.ops.flashloop.reuse_correction_attention.default, (later.v, k_f, n_f, p_f, o_ref, c_f)
                        )
                    else:
                        k_f, *state = [graph.call_function(operator.getitem, (t, f)) for t in (keys, count, mass, c_ref)]
                        out = graph.call_function(
                            torch.ops.flashloop.correction_attention.default,
                            (later.q, later.k, later.v, k_f, state[0], state[1], o_ref, state[2], site_scale(later)),
                        )
                _replace(later.node, out)
                self.context.replaced[later.node] = out
                matched += 1
        return matched


def _replace(old: fx.Node, new: fx.Node) -> None:
    old.replace_all_uses_with(new)
    new.meta.update({k: v for k, v in old.meta.items() if k in ("example_value", "val", "stack_trace")})

