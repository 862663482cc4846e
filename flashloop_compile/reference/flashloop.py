"""The explicit FlashLoop reference: every feature combination over an Ouro model, eagerly.

This is the oracle every optimized path is tested against, so it is written to be read: one
request at a time (a batch is a list, which makes batch-invariance true by construction),
Python loops over loops and layers, materialized probabilities, FP32 attention. It reuses the
model's weights (norms, projections, MLP) and nothing of its forward.

    ref = ReferenceFlashLoop(model, FlashLoopConfig.all_on())
    req = ref.request()
    step = req.prefill(prompt)          # StepRecord: logits, states, active sets, K/V, ...
    step = req.decode(next_tokens)      # one or more query rows at the following positions

Loop numbers are one-based in the docs; ``depth`` below is zero-based (depth 0 = loop 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.models.ouro import LAST, OuroForCausalLM, Readout, apply_rope, combine_readout, rope_cos_sin
from flashloop_compile.reference.attention import (
    ReferenceState,
    causal_attention,
    correction_attention,
    reference_attention,
    reuse_correction_attention,
)
from flashloop_compile.reference.kvstore import DenseKVStore, QuantizedKVStore
from flashloop_compile.reference.selection import change_scores, select_active, window_bounds

__all__ = ["ReferenceFlashLoop", "ReferenceRequest", "StepRecord"]


@dataclass
class StepRecord:
    """What one forward of one request computed.

    logits [T, V] under the readout; states[d] the normalized state after depth d [T, hidden];
    active[d] bool [T] (rows recomputed at depth d); k[layer][d] / v[layer][d] the logical K/V
    [T, Hkv, D] of this forward's tokens at every depth (inherited where inactive);
    reference[layer] the loop-2 statistics per sparse loop (sparse decode only).
    """

    logits: Tensor
    states: list[Tensor]
    active: list[Tensor]
    k: list[list[Tensor]]
    v: list[list[Tensor]]
    gate_logits: list[Tensor]
    reference: list[list[ReferenceState]] = field(default_factory=list)


class ReferenceFlashLoop:
    def __init__(self, model: OuroForCausalLM, config: FlashLoopConfig | None = None, readout: Readout = LAST) -> None:
        self.model = model
        self.config = (config or FlashLoopConfig()).resolve(model.config.num_loops, head_dim=model.config.head_dim)
        self.readout = readout

    def request(self) -> "ReferenceRequest":
        return ReferenceRequest(self)

    @torch.no_grad()
    def greedy(self, prompt: Tensor, max_new_tokens: int) -> Tensor:
        """Greedy continuation of one prompt [T]: the new tokens [max_new_tokens]."""
        req = self.request()
        tok = req.prefill(prompt).logits[-1].argmax()
        out = [tok]
        for _ in range(max_new_tokens - 1):
            tok = req.decode(tok[None]).logits[-1].argmax()
            out.append(tok)
        return torch.stack(out)


class ReferenceRequest:
    """One request's persistent state (its KV store) and its forwards."""

    def __init__(self, engine: ReferenceFlashLoop) -> None:
        self.engine = engine
        cfg, model_cfg = engine.config, engine.model.config
        q = cfg.kv_residual_quantization
        n_layers, n_depths = model_cfg.num_hidden_layers, model_cfg.num_loops
        self.store = (
            QuantizedKVStore(n_layers, n_depths, q.group_size, q.tail) if q.enabled else DenseKVStore(n_layers, n_depths)
        )
        self.length = 0
        self.prompt_done = False

    @torch.no_grad()
    def prefill(self, tokens: Tensor, *, final: bool = True) -> StepRecord:
        """Prompt tokens [T] at the next positions; ``final=False`` for a non-last chunk."""
        if self.prompt_done:
            raise RuntimeError("this request's prompt is complete: use decode()")
        rec = self._forward(tokens, phase="prefill", final=final)
        self.prompt_done = final
        return rec

    @torch.no_grad()
    def decode(self, tokens: Tensor) -> StepRecord:
        """Generated tokens [k] (k >= 1 query rows, e.g. speculative verification)."""
        if not self.prompt_done:
            raise RuntimeError("decode() before the prompt's final prefill chunk")
        return self._forward(tokens, phase="decode", final=True)

    def _forward(self, tokens: Tensor, phase: str, final: bool) -> StepRecord:
        engine = self.engine
        model, cfg = engine.model, engine.config
        mcfg = model.config
        tsp, sda = cfg.token_sparse_prefill, cfg.sparse_decode_attention
        n_loops = engine.readout.loops_to_run(mcfg.num_loops)
        start, n = self.length, tokens.shape[0]
        pos = torch.arange(start, start + n)
        key_pos = torch.arange(start + n)
        embed = model.model.embed_tokens(tokens)
        cos, sin = rope_cos_sin(pos[None], mcfg.head_dim, mcfg.rope_theta, embed.dtype)

        sparse_decode = phase == "decode" and sda.enabled and n_loops > sda.reference_loop
        fractions = [sda.fraction_at(loop) for loop in range(sda.reference_loop + 1, n_loops + 1)]
        select = phase == "prefill" and tsp.selects
        windows = window_bounds(start, n, tsp.window, final) if select else []

        states, gates, actives = [embed], [], []
        active = torch.ones(n, dtype=torch.bool)
        depth_count = torch.zeros(n, dtype=torch.long)
        ks = [[] for _ in model.model.layers]
        vs = [[] for _ in model.model.layers]
        reference: list[list[ReferenceState]] = [[] for _ in model.model.layers]
        for depth in range(n_loops):
            if select and depth >= 2:
                scores = change_scores(states[-1], states[-2])
                last = start + n - 1 if (tsp.keep_last_token and final) else None
                active = select_active(scores, active, pos, windows, tsp.retention[depth], tsp, last)
            rows = torch.nonzero(active).flatten()
            x = states[-1][rows]
            for i, layer in enumerate(model.model.layers):
                attn = layer.self_attn
                xn = layer.input_layernorm(x)
                q = attn.q_proj(xn).view(-1, attn.n_heads, attn.head_dim)
                k = attn.k_proj(xn).view(-1, attn.n_kv, attn.head_dim)
                v = attn.v_proj(xn).view(-1, attn.n_kv, attn.head_dim)
                c, s = cos[:, rows], sin[:, rows]
                q = apply_rope(q.transpose(0, 1)[None], c, s)[0].transpose(0, 1)
                k = apply_rope(k.transpose(0, 1)[None], c, s)[0].transpose(0, 1)
                # This depth's logical K/V: inactive rows inherit the previous depth's.
                k_all = ks[i][-1].clone() if depth else torch.empty_like(k)
                v_all = vs[i][-1].clone() if depth else torch.empty_like(v)
                k_all[rows], v_all[rows] = k, v
                ks[i].append(k_all)
                vs[i].append(v_all)
                prefix_k, prefix_v = self.store.read(i, depth, start) if start else (k_all[:0], v_all[:0])
                keys, values = torch.cat([prefix_k, k_all]), torch.cat([prefix_v, v_all])
                if sparse_decode and depth == sda.reference_loop - 1:
                    out, reference[i] = reference_attention(q, pos[rows], keys, values, key_pos, fractions)
                elif sparse_decode and depth >= sda.reference_loop and sda.reuse_selected_probabilities:
                    out = reuse_correction_attention(values, reference[i][depth - sda.reference_loop])
                elif sparse_decode and depth >= sda.reference_loop:
                    out = correction_attention(q, keys, values, reference[i][depth - sda.reference_loop])
                else:
                    out = causal_attention(q, pos[rows], keys, values, key_pos)
                out = attn.o_proj(out.to(x.dtype).reshape(x.shape[0], -1))
                x = x + layer.input_layernorm_2(out)
                x = x + layer.post_attention_layernorm_2(layer.mlp(layer.post_attention_layernorm(x)))
            h = states[-1].clone()
            h[rows] = model.model.norm(x)
            states.append(h)
            gates.append(model.model.early_exit_gate(h))
            actives.append(active.clone())
            depth_count[rows] = depth + 1

        for i in range(len(model.model.layers)):
            # Depths this forward did not run inherit the last one it did.
            k_full = ks[i] + [ks[i][-1]] * (mcfg.num_loops - n_loops)
            v_full = vs[i] + [vs[i][-1]] * (mcfg.num_loops - n_loops)
            self.store.append(i, k_full, v_full, depth_count)
        self.length += n
        logits = combine_readout([model.lm_head(s) for s in states[1:]], gates, engine.readout)
        return StepRecord(logits, states[1:], actives, ks, vs, gates, reference if sparse_decode else [])
