"""Prefill attention masked by position becomes the fastest exact attention for the graph.

A model that keeps its KV cache in place and masks by position (Ouro here, gpt-fast and HF
static caches alike) calls SDPA in prefill with a boolean mask ``[B, 1, T, S]`` over the whole
cache: PyTorch then runs its masked kernel, which reads every one of the S keys for every query
tile (30.7 ms a site for a 32K prompt on the H200; ``benchmarks/RESULTS.md``). This pass replaces
each such site of a prefill graph by one of two exact forms:

- **a fresh prompt** (the graph builds positions 0..T-1 itself: the model called without
  ``input_pos``, as the engine calls a prompt's first chunk; recognize.fresh_prompt): every key a
  query sees is this step's own, so the site becomes causal SDPA over the step's K/V
  (``prefill_ops.prompt_attention``: FlashAttention or cuDNN on the GPU, 6.7 ms there);
- **a chunk at given positions** (there may be a stored prefix): ``flashloop.position_attention``
  (Triton), keys ``j <= q_pos`` only, key tiles past a query tile's last position never loaded
  (11.4 ms there).

Token-sparse loops (non-consecutive queries) are already ``position_attention`` and stay so. It
changes how attention is computed, not what, so it is a compilation option
(``compilation.position_attention``): None (the default) applies it wherever the graph has the
pattern and leaves other graphs alone, True requires it, False turns it off. It runs after
token-sparse prefill and before KV quantization, which keeps a fresh prompt's causal SDPA (the
reference attends a step's own tokens exactly) and replaces ``position_attention`` by
``packed_attention``. Prefill graphs only: a decode row's masked SDPA reads a [B, 1, 1, S] mask
and is bandwidth-bound on the cache either way.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from flashloop_compile.lowering.prefill_ops import SUPPORTED_HEAD_DIMS, prompt_attention
from flashloop_compile.passes.graph import op_name, shape_of
from flashloop_compile.passes.base import FlashLoopPass
from flashloop_compile.passes.recognize import LoopStructure, RecognitionError, describe, fresh_prompt
from flashloop_compile.passes.sparse_decode import site_scale

__all__ = ["PositionAttentionPass"]


class PositionAttentionPass(FlashLoopPass):
    group = "compilation"
    phases = ("prefill",)

    @property
    def enabled(self) -> bool:
        return self.config.compilation.position_attention is not False

    @property
    def required(self) -> bool:
        return self.config.compilation.position_attention is True

    def check(self, structure: LoopStructure) -> None:
        fresh = fresh_prompt(structure)
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
            if not fresh and d not in SUPPORTED_HEAD_DIMS:
                raise RecognitionError(
                    f"compilation.position_attention supports head_dim in {SUPPORTED_HEAD_DIMS} at given positions; "
                    f"{where} has {d}"
                )

    def plan(self, structure: LoopStructure) -> list[str]:
        if fresh_prompt(structure):
            return [f"{len(structure.sites)} prefill attention sites of a fresh prompt -> causal SDPA over the "
                    f"prompt's own K/V (exact; token-sparse loops keep flashloop.position_attention)"]
        return [f"{len(structure.sites)} prefill attention sites masked by position -> flashloop.position_attention "
                f"(exact; the sites token-sparse prefill re-emitted already are)"]

    def apply(self, gm: fx.GraphModule, structure: LoopStructure) -> int:
        graph = gm.graph
        ctx = self.context
        fresh = fresh_prompt(structure)
        done = 0
        for site in structure.sites:
            node = ctx.follow(site.node)
            if op_name(node) == "flashloop.position_attention":  # a token-sparse loop
                done += 1
                continue
            if fresh:
                q, k, v = (ctx.follow(n) for n in (site.q, site.cache.k_new, site.cache.v_new))
                target, args = prompt_attention, (q, k, v, site_scale(site))
            else:
                q, k, v, pos = (ctx.follow(n) for n in (site.q, site.k, site.v, site.cache.positions))
                target, args = torch.ops.flashloop.position_attention.default, (q, k, v, pos, site_scale(site))
            with graph.inserting_before(node):
                new = graph.call_function(target, args)
            node.replace_all_uses_with(new)
            graph.erase_node(node)
            ctx.replaced[site.node] = new
            done += 1
        return done
