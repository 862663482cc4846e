"""Prefill attention masked by position becomes ``flashloop.position_attention`` (exact).

A model that keeps its KV cache in place and masks by position (Ouro here, gpt-fast and HF
static caches alike) calls SDPA in prefill with a boolean mask ``[B, 1, T, S]`` over the whole
cache: PyTorch then runs its masked kernel, which reads every one of the S keys for every query
tile (30.7 ms a site for a 32K prompt on the H200, where causal flash attention takes 6.7 ms;
``benchmarks/RESULTS.md``). ``position_attention`` (Triton) computes the same thing
from the positions: keys ``j <= q_pos`` only, key tiles past a query tile's last position never
loaded (11.4 ms there).

This is a compilation option, not a FlashLoop feature (``compilation.position_attention``, off
by default: it needs an in-place cache and a position mask; the benchmarks turn it on in every
config: a 1x32K dense prefill 3343 -> 1593 ms, ``benchmarks/RESULTS.md``): it changes how attention is computed,
not what. It runs after token-sparse prefill (which already attends its sparse loops
this way) and before KV quantization (which replaces either form by ``packed_attention``).
Prefill graphs only: a decode row's masked SDPA reads a [B, 1, 1, S] mask and is
bandwidth-bound on the cache either way.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from flashloop_compile.lowering.prefill_ops import SUPPORTED_HEAD_DIMS
from flashloop_compile.passes.graph import op_name, shape_of
from flashloop_compile.passes.base import FlashLoopPass
from flashloop_compile.passes.recognize import LoopStructure, RecognitionError, describe
from flashloop_compile.passes.sparse_decode import site_scale

__all__ = ["PositionAttentionPass"]


class PositionAttentionPass(FlashLoopPass):
    group = "compilation"
    phases = ("prefill",)

    @property
    def enabled(self) -> bool:
        return self.config.compilation.position_attention

    def check(self, structure: LoopStructure) -> None:
        for s in structure.sites:
            where = f"the attention at {describe(s.node)} (loop {s.loop + 1}, layer {s.layer})"
            if s.cache is None or s.cache.kind != "inplace" or s.cache.positions is None:
                kind = "no cache" if s.cache is None else s.cache.kind
                raise RecognitionError(
                    f"compilation.position_attention needs a KV cache written in place at per-row positions; "
                    f"{where} reads a '{kind}' cache: turn the option off for this model"
                )
            if s.mask_kind != "causal-position":
                raise RecognitionError(
                    f"compilation.position_attention rewrites attention masked by position (key position <= query "
                    f"position); {where} has mask kind '{s.mask_kind}': turn the option off for this model"
                )
            d = shape_of(s.q)[-1]
            if d not in SUPPORTED_HEAD_DIMS:
                raise RecognitionError(
                    f"compilation.position_attention supports head_dim in {SUPPORTED_HEAD_DIMS}; {where} has {d}"
                )

    def plan(self, structure: LoopStructure) -> list[str]:
        return [f"{len(structure.sites)} prefill attention sites masked by position -> flashloop.position_attention "
                f"(exact; the sites token-sparse prefill re-emitted already are)"]

    def apply(self, gm: fx.GraphModule, structure: LoopStructure) -> int:
        graph = gm.graph
        ctx = self.context
        done = 0
        for site in structure.sites:
            node = ctx.follow(site.node)
            if op_name(node) == "flashloop.position_attention":  # a token-sparse loop
                done += 1
                continue
            q, k, v, pos = (ctx.follow(n) for n in (site.q, site.k, site.v, site.cache.positions))
            with graph.inserting_before(node):
                new = graph.call_function(
                    torch.ops.flashloop.position_attention.default, (q, k, v, pos, site_scale(site)),
                )
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            ctx.replaced[site.node] = new
            done += 1
        return done
