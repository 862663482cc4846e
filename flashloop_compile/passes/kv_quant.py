"""KV residual quantization pass: every cache write and read becomes a packed-cache op.

At each attention site (loop d, layer i) with an in-place cache:
- the dense cache writes are removed; ``flashloop.packed_kv_write`` stores depth d of the
  step's tokens (an INT4 base at depth 0, INT4 residuals against the reconstructed predecessor
  at later depths, the BF16 tail ring) after the attention has read the cache;
- dense attention (SDPA, or token-sparse loops' ``position_attention``) becomes
  ``flashloop.packed_attention``: the stored prefix read straight from the packed tiles, the
  step's own tokens exactly (in flight); a fresh prompt's dense loops, which the
  position-attention pass made causal SDPA over the step's own K/V (no stored prefix: nothing
  to read from the packed tiles), stay so;
- loop 2's reference (which attends to every key) becomes ``flashloop.packed_reference_attention``
  over the whole history at its depth (the packed tiles, the step's tokens in flight); a
  correction at loops 3..R becomes ``flashloop.packed_correction_attention``, which reads only
  the keys its reference selected and attends them (one query row per kv head: in one pass, no
  BF16 copy of them). The step's own tokens are their exact in-flight K/V (in-flight arguments:
  no merge after a read). Under reuse_selected_probabilities the reference becomes
  ``flashloop.packed_reference_attention_probs`` and the corrections
  ``flashloop.packed_reuse_correction_attention`` (the selected keys' V only).

In token-sparse loops only the active rows are written (absent residual = inheritance), and the
in-flight K/V the active queries see is loop d-1's in-flight K/V with the active rows replaced —
the exact values, as in the reference. Padded rows (the step plan's lengths) are written as
position -1, which the ops ignore.

The packed cache belongs to the model's runtime state and is sized from the model's cache
buffers (batch slots, heads, context, head_dim); its tensors are registered on the graph module.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from flashloop_compile.lowering.packed_layout import LAYER_TENSOR_NAMES, MODEL_TENSOR_NAMES
from flashloop_compile.lowering.packed_sparse_ops import local_keys, selected_positions
from flashloop_compile.lowering.prefill_ops import prompt_attention
from flashloop_compile.passes.graph import op_name, runtime_buffer, shape_of
from flashloop_compile.passes.base import FlashLoopPass
from flashloop_compile.passes.recognize import LoopStructure, RecognitionError, describe, require_inplace_cache
from flashloop_compile.passes.sparse_decode import site_scale

__all__ = [
    "KVResidualQuantizationPass", "mask_positions", "scatter_tokens",
    "selected_positions", "local_keys",
]


def mask_positions(positions: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """positions [B, T] with padding (position >= the planned length of its row) set to -1."""
    lens = seq_lens[: positions.shape[0], None].to(positions.dtype)
    return torch.where((lens < 0) | (positions < lens), positions, torch.full_like(positions, -1))


def scatter_tokens(base: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """base [B, H, T, D] with tokens index[b, k] replaced by rows [B, H, K, D] (a new tensor)."""
    idx = index[:, None, :, None].expand(-1, base.shape[1], -1, base.shape[3])
    return torch.scatter(base, 2, idx, rows.to(base.dtype))


class KVResidualQuantizationPass(FlashLoopPass):
    group = "kv_residual_quantization"

    def check(self, structure: LoopStructure) -> None:
        for s in structure.sites:
            require_inplace_cache("kv_residual_quantization", s, "it replaces that cache")
            if not s.mask_supported:
                raise RecognitionError(f"kv_residual_quantization cannot rewrite {describe(s.node)}: {s.mask_kind}")
            shape = shape_of(s.cache.positions)
            if shape is None or len(shape) != 2:
                raise RecognitionError(
                    f"kv_residual_quantization needs per-row positions [batch, tokens] at {describe(s.cache.positions)}"
                )

    def plan(self, structure: LoopStructure) -> list[str]:
        n = len(structure.sites)
        q = self.config.kv_residual_quantization
        return [
            f"{n} cache writes -> flashloop.packed_kv_write (INT4 base at loop 1, INT4 residuals at loops "
            f"2..{structure.num_loops}, group {q.group_size}, BF16 tail {q.tail}..{q.tail + q.group_size - 1})",
            f"{n} attention sites read the packed cache directly (flashloop.packed_attention; under sparse decode "
            f"the loop-2 reference becomes flashloop.packed_reference_attention, its corrections "
            "flashloop.packed_correction_attention, the selected keys read and attended in one pass)",
        ]

    def apply(self, gm: fx.GraphModule, structure: LoopStructure) -> int:
        graph = gm.graph
        ctx = self.context
        packed = ctx.packed_for(structure, self.config.kv_residual_quantization)
        plan = ctx.plan_for(structure)
        seq_lens = runtime_buffer(gm, "flashloop_seq_lens", plan.seq_lens)
        model_nodes = [runtime_buffer(gm, f"flashloop_kv_{name}", t) for name, t in zip(MODEL_TENSOR_NAMES, packed.model_tensors())]
        layer_nodes = [
            [runtime_buffer(gm, f"flashloop_kv_l{i}_{name}", t) for name, t in zip(LAYER_TENSOR_NAMES, packed.layer_tensors(i))]
            for i in range(structure.num_layers)
        ]
        buffers = {s.cache.k_buffer for s in structure.sites} | {s.cache.v_buffer for s in structure.sites}
        inflight: dict[tuple[int, int], tuple[fx.Node, fx.Node]] = {}
        masked: dict[fx.Node, fx.Node] = {}  # one mask_positions per positions node
        for site in structure.sites:
            d, i = site.loop, site.layer
            cache_args = tuple(layer_nodes[i]) + tuple(model_nodes)
            consumer = ctx.follow(site.node)
            sparse = ctx.sparse_sites.get((d, i))
            if site.cache.positions not in masked:
                with graph.inserting_before(consumer):
                    masked[site.cache.positions] = graph.call_function(mask_positions, (site.cache.positions, seq_lens))
            all_pos = masked[site.cache.positions]
            with graph.inserting_before(consumer):
                if sparse is None:
                    q, q_pos = site.q, all_pos
                    k_write, v_write, pos_write = site.cache.k_new, site.cache.v_new, all_pos
                    k_in, v_in = site.cache.k_new, site.cache.v_new
                else:
                    q = sparse["q"]
                    q_pos = graph.call_function(mask_positions, (sparse["positions"], seq_lens))
                    k_write, v_write, pos_write = sparse["k"], sparse["v"], q_pos
                    k_prev, v_prev = inflight[(d - 1, i)]
                    k_in = graph.call_function(scatter_tokens, (k_prev, sparse["index"], sparse["k"]))
                    v_in = graph.call_function(scatter_tokens, (v_prev, sparse["index"], sparse["v"]))
            inflight[(d, i)] = (k_in, v_in)
            name = op_name(consumer)
            if consumer.target is prompt_attention:
                # a fresh prompt's dense loop: its keys are the step's own tokens, which the
                # reference attends exactly (not quantized): causal SDPA over them stays
                after = consumer
            elif name in ("scaled_dot_product_attention", "flashloop.position_attention"):
                with graph.inserting_before(consumer):
                    out = graph.call_function(
                        torch.ops.flashloop.packed_attention.default,
                        (q, k_in, v_in, q_pos, all_pos, d) + cache_args + (site_scale(site),),
                    )
                consumer.replace_all_uses_with(out)
                graph.erase_node(consumer)
                ctx.replaced[site.node] = out
                after = out
            elif name == "flashloop.correction_attention":
                # one op over the packed history: no BF16 copy of the selected keys
                q_c, _k, _v, keys, count, mass, o_ref, c_ref, scale = consumer.args
                with graph.inserting_before(consumer):
                    out = graph.call_function(
                        torch.ops.flashloop.packed_correction_attention.default,
                        (q_c, keys, count, mass, o_ref, c_ref, all_pos, k_in, v_in, d) + cache_args + (scale,),
                    )
                consumer.replace_all_uses_with(out)
                graph.erase_node(consumer)
                after = out
            elif name == "flashloop.reuse_correction_attention":
                _v, keys, count, probs, o_ref, c_ref = consumer.args
                with graph.inserting_before(consumer):
                    out = graph.call_function(
                        torch.ops.flashloop.packed_reuse_correction_attention.default,
                        (keys, count, probs, o_ref, c_ref, all_pos, v_in, d) + cache_args,
                    )
                consumer.replace_all_uses_with(out)
                graph.erase_node(consumer)
                after = out
            elif name in ("flashloop.reference_attention", "flashloop.reference_attention_probs"):
                q_ref, _k, _v, mask, scale, fractions, capacities = consumer.args
                packed_ref = (torch.ops.flashloop.packed_reference_attention.default if name == "flashloop.reference_attention"
                              else torch.ops.flashloop.packed_reference_attention_probs.default)
                with graph.inserting_before(consumer):
                    ref = graph.call_function(
                        packed_ref, (q_ref, all_pos, k_in, v_in, d) + cache_args + (mask, scale, fractions, capacities),
                    )
                consumer.replace_all_uses_with(ref)
                graph.erase_node(consumer)
                after = ref
            else:
                raise RecognitionError(f"kv_residual_quantization does not know the attention {describe(consumer)}")
            with graph.inserting_after(after):
                graph.call_function(torch.ops.flashloop.packed_kv_write.default, cache_args + (k_write, v_write, pos_write, d))
        for n in list(graph.nodes):
            if n.op == "call_function" and n.target is operator.setitem and n.args[0] in buffers:
                graph.erase_node(n)
        return len(structure.sites)
