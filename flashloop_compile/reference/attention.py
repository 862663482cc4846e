"""Explicit attention for the reference: dense causal attention, and the sparse-decode pair
``reference_attention`` (loop 2) / ``correction_attention`` (loops 3..R) of SPEC.md section 2,
with ``reuse_correction_attention`` for ``sparse_decode_attention.reuse_selected_probabilities``.

The reuse option (the FlashLoop paper's engine option): loop r >= 3 reuses loop 2's
probabilities over the selected keys S instead of its own scores, and reads only V::

    p_S   = P_ref[S] / m                (loop 2's probabilities, renormalized over S)
    C_new = m * (p_S @ V[r, S])          (= P_ref[S] @ V[r, S])
    O[r]  = O_ref - C_ref + C_new

SPEC.md's worked example (P_ref [0.1, 0.3, 0.6], S the last two keys, m = 0.9, O_ref 25,
C_ref 24) with later selected values [20, 40]: p_S = [1/3, 2/3], C_new = 0.9 * 100/3 = 30,
O = 25 - 24 + 30 = 31. With every key retained it is loop 2's attention pattern over loop r's V.

Everything is FP32 with materialized probabilities: this is the oracle, not the fast path.
Shapes: queries [Tq, Hq, D] at absolute positions q_pos [Tq]; keys/values [Tk, Hkv, D] at k_pos
[Tk]. A key is visible to a query iff k_pos <= q_pos. Grouped-query attention maps query head h
to kv head h // (Hq // Hkv).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from flashloop_compile.config import ceil_fraction

__all__ = [
    "attention_probs", "causal_attention", "ReferenceState", "reference_attention", "correction_attention",
    "reuse_correction_attention",
]


def _expand_kv(x: Tensor, n_heads: int) -> Tensor:
    return x.float().repeat_interleave(n_heads // x.shape[1], dim=1)


def _softmax_scale(head_dim: int) -> float:
    """1/sqrt(head_dim) as a factor, as SDPA and every flashloop op apply it: dividing by sqrt(head_dim)
    rounds differently where it is not a power of two (32, 128), and INT4 codes amplify that ulp."""
    return 1.0 / math.sqrt(head_dim)


def attention_probs(q: Tensor, q_pos: Tensor, k: Tensor, k_pos: Tensor) -> Tensor:
    """Causal softmax probabilities [Tq, Hq, Tk] in FP32."""
    kf = _expand_kv(k, q.shape[1])
    scores = torch.einsum("qhd,khd->qhk", q.float(), kf) * _softmax_scale(q.shape[-1])
    visible = k_pos[None, None, :] <= q_pos[:, None, None]
    return torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)


def causal_attention(q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor, k_pos: Tensor) -> Tensor:
    """Dense causal attention output [Tq, Hq, D] in FP32."""
    return torch.einsum("qhk,khd->qhd", attention_probs(q, q_pos, k, k_pos), _expand_kv(v, q.shape[1]))


@dataclass
class ReferenceState:
    """What loop 2 records for one sparse loop, per (query, head).

    keys: selected key *indices* into the key sequence, [Tq, Hq, kmax], padded with -1;
    count: valid entries per query [Tq] (k = ceil(fraction * causal_length));
    mass: m = sum of reference probabilities over S, [Tq, Hq];
    o_ref: full reference output [Tq, Hq, D]; c_ref: reference contribution over S [Tq, Hq, D];
    probs: the reference probabilities of the keys in ``keys`` [Tq, Hq, kmax], 0 in the padding
    (their sum is ``mass``).
    """

    keys: Tensor
    count: Tensor
    mass: Tensor
    o_ref: Tensor
    c_ref: Tensor
    probs: Tensor


def reference_attention(
    q: Tensor, q_pos: Tensor, k: Tensor, v: Tensor, k_pos: Tensor, fractions: list[float]
) -> tuple[Tensor, list[ReferenceState]]:
    """Full causal attention plus, for each sparse loop's key fraction, the top-k statistics.

    S holds the k most probable visible keys (the current token too, when it ranks); equal
    probabilities go to the lower key index. Future keys never enter S.
    """
    probs = attention_probs(q, q_pos, k, k_pos)  # [Tq, Hq, Tk]
    vf = _expand_kv(v, q.shape[1])  # [Tk, Hq, D]
    o_ref = torch.einsum("qhk,khd->qhd", probs, vf)
    causal_len = (k_pos[None, :] <= q_pos[:, None]).sum(-1)  # [Tq]
    # Most probable first. Masked (future) keys rank after every visible key: a visible key whose
    # probability underflows to 0 would otherwise tie with them and lose to a lower key index.
    visible = k_pos[None, None, :] <= q_pos[:, None, None]
    order = torch.sort(-torch.where(visible, probs, -1.0), dim=-1, stable=True).indices
    states = []
    for fraction in fractions:
        count = torch.tensor([ceil_fraction(fraction, int(n)) for n in causal_len], dtype=torch.long)
        kmax = int(count.max())
        keys = order[..., :kmax].clone()
        keys.masked_fill_(torch.arange(kmax)[None, None, :] >= count[:, None, None], -1)
        selected = torch.zeros_like(probs, dtype=torch.bool)
        for qi in range(q.shape[0]):
            for h in range(q.shape[1]):
                selected[qi, h, keys[qi, h, : count[qi]]] = True
        p_sel = probs * selected
        p_keys = torch.where(keys >= 0, probs.gather(-1, keys.clamp_min(0)), 0.0)
        states.append(
            ReferenceState(keys, count, p_sel.sum(-1), o_ref, torch.einsum("qhk,khd->qhd", p_sel, vf), p_keys)
        )
    return o_ref, states


def correction_attention(q: Tensor, k: Tensor, v: Tensor, state: ReferenceState) -> Tensor:
    """O = O_ref - C_ref + m * softmax(q K_S^T / sqrt(d)) V_S, FP32, with K/V of the later loop."""
    kf, vf = _expand_kv(k, q.shape[1]), _expand_kv(v, q.shape[1])
    out = torch.empty_like(state.o_ref)
    for qi in range(q.shape[0]):
        for h in range(q.shape[1]):
            s = state.keys[qi, h, : state.count[qi]]
            p_local = torch.softmax(kf[s, h] @ q[qi, h].float() * _softmax_scale(q.shape[-1]), dim=-1)
            c_new = state.mass[qi, h] * (p_local @ vf[s, h])
            out[qi, h] = state.o_ref[qi, h] - state.c_ref[qi, h] + c_new
    return out


def reuse_correction_attention(v: Tensor, state: ReferenceState) -> Tensor:
    """O = O_ref - C_ref + m * (p_S @ V_S) with p_S = P_ref[S] / m, FP32, V of the later loop (no K)."""
    vf = _expand_kv(v, state.o_ref.shape[1])
    out = torch.empty_like(state.o_ref)
    for qi in range(state.o_ref.shape[0]):
        for h in range(state.o_ref.shape[1]):
            s = state.keys[qi, h, : state.count[qi]]
            m = state.mass[qi, h]  # > 0: S holds the most probable key
            p_s = state.probs[qi, h, : state.count[qi]] / m
            out[qi, h] = state.o_ref[qi, h] - state.c_ref[qi, h] + m * (p_s @ vf[s, h])
    return out
