"""The paper's three redundancy findings, measured on any Ouro model over some sequences.

Everything is measured on the *dense* trajectory (every loop, every token), in FP32, on the
model's device. H[r] is loop r's output after the end-of-loop norm (one-based loops).

1. **Hidden states converge across loops** (what token-sparse prefill exploits).
   ``state_change[r]``: the per-token relative change ||H[r] - H[r-1]|| / ||H[r]||, r = 2..R,
   as quantiles over all tokens. ``change_energy_covered[r][rho]``: the share of loop r's total
   squared change sum_i ||H[r,i] - H[r-1,i]||^2 that falls on the top-rho tokens by FlashLoop's
   score for loop r (computed from loops r-1 and r-2): what a retention of rho would recompute.
2. **Active sets are nested.** The unconstrained top-k of the score for loop r+1 against that of
   loop r (score[r][i] = ||H[r-1,i] - H[r-2,i]|| / ||H[r-1,i]||; "loop R+1" is the change after the
   last loop): ``containment`` = |top_b(score[r+1]) & top_a(score[r])| / |top_b(score[r+1])| for
   (a, b) = (0.25, 0.10) and the equal-size overlaps at 0.25 and 0.10 (a random set would give a),
   and the Spearman rank correlation of the two scores.
3. **Attention concentrates on the same keys across loops** (what sparse decode exploits). Per
   layer, for queries in the second half of each sequence: take the top-k keys of loop r-1's
   attention (and of loop 2's, the reference loop) per (query, head), k = ceil(f * causal
   length), and sum loop r's probabilities over them (``captured``). ``oracle`` is loop r's own
   top-k mass, the most any k keys could hold.
4. **Cross-loop K/V residuals quantize better than full states** (what residual INT4 exploits).
   Per loop and layer, relative Frobenius error of INT4 K (post-RoPE, per channel over 64-token
   groups) and V (per token over 64-channel groups): quantizing the full state
   ``||deq(q(X[r])) - X[r]|| / ||X[r]||`` against the residual chain of SPEC section 3
   ``X_hat[r] = X_hat[r-1] + deq(q(X[r] - X_hat[r-1]))``; errors pooled over layers per loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import Tensor

from flashloop_compile.config import ceil_fraction
from flashloop_compile.models.ouro import apply_rope, rope_cos_sin
from flashloop_compile.reference.attention import attention_probs
from flashloop_compile.reference.codec import quantize_channel_groups, quantize_token_groups

__all__ = ["Trajectory", "collect_trajectory", "redundancy_report", "report_markdown", "QUANTILES", "key_ranks", "key_counts", "topk_mask_per_query"]

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9, 0.99)


@dataclass
class Trajectory:
    """Dense per-loop data of one sequence: states[r] [T, hidden]; q/k/v[r][layer] [T, H, D]
    (q, k after RoPE), all FP32; r zero-based."""

    states: list[Tensor]
    q: list[list[Tensor]]
    k: list[list[Tensor]]
    v: list[list[Tensor]]


@torch.no_grad()
def collect_trajectory(model, tokens: Tensor) -> Trajectory:
    """Run the dense forward once, capturing every loop's states and every (loop, layer)'s Q/K/V."""
    inner, cfg = model.model, model.config
    dev = next(model.parameters()).device
    tokens = tokens.to(dev)
    seen: dict[str, list[list[Tensor]]] = {"q": [[] for _ in inner.layers], "k": [[] for _ in inner.layers], "v": [[] for _ in inner.layers]}
    hooks = []
    for i, layer in enumerate(inner.layers):
        for name in ("q", "k", "v"):
            mod = getattr(layer.self_attn, f"{name}_proj")
            hooks.append(mod.register_forward_hook(lambda m, args, out, i=i, name=name: seen[name][i].append(out[0].float())))
    try:
        states, _ = model.forward_loops(tokens[None])
    finally:
        for h in hooks:
            h.remove()
    T = tokens.numel()
    pos = torch.arange(T, device=dev)[None]
    cos, sin = rope_cos_sin(pos, cfg.head_dim, cfg.rope_theta, torch.float32)
    n_loops = len(states)

    def heads(x: Tensor, n: int, rope: bool) -> Tensor:
        x = x.view(T, n, cfg.head_dim)
        if rope:
            x = apply_rope(x.transpose(0, 1)[None], cos, sin)[0].transpose(0, 1)
        return x.contiguous()

    q = [[heads(seen["q"][i][r], cfg.num_attention_heads, True) for i in range(len(inner.layers))] for r in range(n_loops)]
    k = [[heads(seen["k"][i][r], cfg.num_key_value_heads, True) for i in range(len(inner.layers))] for r in range(n_loops)]
    v = [[heads(seen["v"][i][r], cfg.num_key_value_heads, False) for i in range(len(inner.layers))] for r in range(n_loops)]
    return Trajectory([s[0].float() for s in states], q, k, v)


def _rel_change(a: Tensor, b: Tensor) -> Tensor:
    """||a - b|| / ||a|| per row (FlashLoop's score, SCORE_EPS floor)."""
    return torch.linalg.vector_norm(a - b, dim=-1) / torch.linalg.vector_norm(a, dim=-1).clamp_min(1e-6)


def _topk_set(scores: Tensor, ratio: float) -> Tensor:
    """Bool mask of the ceil(ratio * T) highest scores (ties to the lower position)."""
    k = ceil_fraction(ratio, scores.numel())
    order = torch.sort(-scores.double(), stable=True).indices
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask[order[:k]] = True
    return mask


def _quantiles(x: Tensor) -> dict[str, float]:
    x = x.double().flatten().cpu()
    q = torch.quantile(x, torch.tensor(QUANTILES, dtype=torch.float64)) if x.numel() else torch.full((len(QUANTILES),), float("nan"))
    out = {f"p{int(round(p * 100))}": float(v) for p, v in zip(QUANTILES, q)}
    out["mean"] = float(x.mean()) if x.numel() else float("nan")
    return out


def _spearman(a: Tensor, b: Tensor) -> float:
    ra = torch.argsort(torch.argsort(a.double())).double()
    rb = torch.argsort(torch.argsort(b.double())).double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp_min(1e-12))


def key_ranks(probs: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """[Tq, H, Tk] rank of each key per (query, head): most probable visible key first, ties to
    the lower key index, invisible (future) keys after every visible one — the reference's order."""
    visible = k_pos[None, None, :] <= q_pos[:, None, None]
    order = torch.sort(-torch.where(visible, probs, -1.0), dim=-1, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=probs.device).expand_as(order))
    return rank


def key_counts(q_pos: Tensor, k_pos: Tensor, fraction: float) -> Tensor:
    """[Tq] k = ceil(fraction * causal length) per query."""
    causal = (k_pos[None, :] <= q_pos[:, None]).sum(-1)
    return torch.tensor([ceil_fraction(fraction, int(n)) for n in causal.tolist()], device=q_pos.device)


def topk_mask_per_query(probs: Tensor, q_pos: Tensor, k_pos: Tensor, fraction: float, ranks: Tensor | None = None) -> Tensor:
    """[Tq, H, Tk] bool: per (query, head) the ceil(fraction * causal length) most probable
    visible keys (ties to the lower key index), as the reference's sparse decode selects them."""
    ranks = key_ranks(probs, q_pos, k_pos) if ranks is None else ranks
    return ranks < key_counts(q_pos, k_pos, fraction)[:, None, None]


def _int4_k(x: Tensor, group: int) -> Tensor:
    """Decode(quantize(K)) with one group per channel over ``group`` token rows."""
    return torch.cat([quantize_token_groups(x[i : i + group]).decode() for i in range(0, x.shape[0], group)])


def _int4_v(x: Tensor, group: int) -> Tensor:
    return quantize_channel_groups(x, group).decode()


@torch.no_grad()
def redundancy_report(
    model,
    sequences: Sequence[Tensor],
    *,
    retention: Sequence[float] = (0.25, 0.10),
    key_fraction: float = 0.10,
    group_size: int = 64,
    min_query_frac: float = 0.5,
) -> dict[str, Any]:
    """Measure the four findings (see module doc) over ``sequences`` (1-D token tensors)."""
    cfg = model.config
    R, N = cfg.num_loops, cfg.num_hidden_layers
    rho_a, rho_b = max(retention), min(retention)
    change: dict[int, list[Tensor]] = {r: [] for r in range(2, R + 1)}
    covered: dict[int, dict[float, list[float]]] = {r: {rho: [] for rho in retention} for r in range(3, R + 1)}
    nest: dict[int, dict[str, list[float]]] = {r: {"containment": [], f"overlap@{rho_a}": [], f"overlap@{rho_b}": [], "spearman": []} for r in range(3, R + 1)}
    # attention[kind][r][layer] -> list of (captured, oracle) tensors over queries/heads
    att: dict[str, dict[int, dict[int, list[Tensor]]]] = {"previous": {}, "reference": {}, "oracle": {}}
    q_err = {name: {kind: {r: [0.0, 0.0] for r in range(1, R + 1)} for kind in ("full", "residual")} for name in ("k", "v")}
    q_err_layer = {name: {kind: {(r, i): [0.0, 0.0] for r in range(1, R + 1) for i in range(N)} for kind in ("full", "residual")} for name in ("k", "v")}
    tokens_total = 0
    for seq in sequences:
        tr = collect_trajectory(model, seq)
        H = tr.states  # zero-based: H[0] is loop 1
        T = H[0].shape[0]
        tokens_total += T
        for r in range(2, R + 1):
            change[r].append(_rel_change(H[r - 1], H[r - 2]).cpu())
        # score for loop r (one-based, r >= 3) uses loops r-1 and r-2; "loop R+1" uses R and R-1.
        scores = {r: _rel_change(H[r - 2], H[r - 3]) for r in range(3, R + 2)}
        for r in range(3, R + 1):
            actual = (H[r - 1] - H[r - 2]).pow(2).sum(-1)
            for rho in retention:
                sel = _topk_set(scores[r], rho)
                covered[r][rho].append(float(actual[sel].sum() / actual.sum().clamp_min(1e-30)))
            a, b = scores[r], scores[r + 1]
            top_b, top_a = _topk_set(b, rho_b), _topk_set(a, rho_a)
            nest[r]["containment"].append(float((top_b & top_a).sum() / top_b.sum()))
            for rho in (rho_a, rho_b):
                sa, sb = _topk_set(a, rho), _topk_set(b, rho)
                nest[r][f"overlap@{rho}"].append(float((sa & sb).sum() / sa.sum()))
            nest[r]["spearman"].append(_spearman(a, b))
        # attention
        pos = torch.arange(T, device=H[0].device)
        q_pos = pos[int(T * min_query_frac):]
        for i in range(N):
            probs = [attention_probs(tr.q[r][i][q_pos], q_pos, tr.k[r][i], pos) for r in range(R)]
            masks = [topk_mask_per_query(p, q_pos, pos, key_fraction) for p in probs]
            for r in range(2, R + 1):  # one-based loop r, zero-based index r-1
                p_r = probs[r - 1]
                att["previous"].setdefault(r, {}).setdefault(i, []).append((p_r * masks[r - 2]).sum(-1).flatten().cpu())
                att["oracle"].setdefault(r, {}).setdefault(i, []).append((p_r * masks[r - 1]).sum(-1).flatten().cpu())
                if r >= 3:
                    att["reference"].setdefault(r, {}).setdefault(i, []).append((p_r * masks[1]).sum(-1).flatten().cpu())
            # INT4: full state vs residual chain
            for name, xs, fn in (("k", [tr.k[r][i] for r in range(R)], _int4_k), ("v", [tr.v[r][i] for r in range(R)], _int4_v)):
                prev_hat = None
                for r in range(1, R + 1):
                    x = xs[r - 1]
                    full = fn(x, group_size)
                    hat = full if prev_hat is None else prev_hat + fn(x - prev_hat, group_size)
                    norm2 = float(x.pow(2).sum())
                    for kind, approx in (("full", full), ("residual", hat)):
                        e2 = float((approx - x).pow(2).sum())
                        q_err[name][kind][r][0] += e2
                        q_err[name][kind][r][1] += norm2
                        q_err_layer[name][kind][(r, i)][0] += e2
                        q_err_layer[name][kind][(r, i)][1] += norm2
                    prev_hat = hat

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else float("nan")

    def rel(e: list[float]) -> float:
        return math.sqrt(e[0] / e[1]) if e[1] > 0 else float("nan")

    report: dict[str, Any] = {
        "sequences": len(sequences),
        "tokens": tokens_total,
        "settings": {"retention": list(retention), "key_fraction": key_fraction, "group_size": group_size, "min_query_frac": min_query_frac},
        "state_change": {str(r): _quantiles(torch.cat(v)) for r, v in change.items()},
        "change_energy_covered": {str(r): {str(rho): mean(v) for rho, v in d.items()} for r, d in covered.items()},
        "nestedness": {
            f"{r}->{r + 1}" if r < R else f"{r}->after-{R}": {k: mean(v) for k, v in d.items()} | {"random_containment": rho_a}
            for r, d in nest.items()
        },
        "attention_mass": {
            kind: {
                str(r): {
                    "per_layer_mean": [float(torch.cat(att[kind][r][i]).mean()) for i in range(N)],
                    "mean": float(torch.cat([torch.cat(att[kind][r][i]) for i in range(N)]).mean()),
                    "p10": float(torch.quantile(torch.cat([torch.cat(att[kind][r][i]) for i in range(N)]).double()[:2_000_000], 0.1)),
                }
                for r in att[kind]
            }
            for kind in att
        },
        "int4_error": {
            name: {
                kind: {str(r): rel(e) for r, e in q_err[name][kind].items()} for kind in ("full", "residual")
            }
            | {"per_layer_" + kind: {str(r): [rel(q_err_layer[name][kind][(r, i)]) for i in range(N)] for r in range(1, R + 1)} for kind in ("full", "residual")}
            for name in ("k", "v")
        },
    }
    return report


def report_markdown(report: dict[str, Any], title: str = "Redundancy report") -> str:
    """The report as markdown tables."""
    s = report["settings"]
    out = [f"### {title}", "", f"{report['sequences']} sequences, {report['tokens']:,} tokens; dense trajectory, FP32 statistics.", ""]
    out += ["**1. Hidden-state change per loop**: ||H[r] - H[r-1]|| / ||H[r]|| over tokens, and the share of loop r's "
            "squared change on the tokens FlashLoop's score would keep.", ""]
    qs = [f"p{int(round(p * 100))}" for p in QUANTILES]
    head = ["loop r"] + qs + ["mean"] + [f"change covered @ {rho}" for rho in s["retention"]]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r, q in report["state_change"].items():
        cov = report["change_energy_covered"].get(r, {})
        out.append("| " + " | ".join([r] + [f"{q[k]:.4f}" for k in qs] + [f"{q['mean']:.4f}"]
                                     + [f"{cov[str(rho)]:.3f}" if str(rho) in cov else "-" for rho in s["retention"]]) + " |")
    rho_a, rho_b = max(s["retention"]), min(s["retention"])
    out += ["", f"**2. Nestedness of unconstrained top-k sets** (score of loop r vs loop r+1): containment = share of "
            f"top-{rho_b} at r+1 inside top-{rho_a} at r (random: {rho_a}); overlaps of equal-size sets (random: the fraction).", ""]
    head = ["loops", f"containment {rho_b} in {rho_a}", f"overlap @ {rho_a}", f"overlap @ {rho_b}", "Spearman"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for pair, d in report["nestedness"].items():
        out.append(f"| {pair} | {d['containment']:.3f} | {d[f'overlap@{rho_a}']:.3f} | {d[f'overlap@{rho_b}']:.3f} | {d['spearman']:.3f} |")
    am = report["attention_mass"]
    out += ["", f"**3. Attention mass of loop r on another loop's top-{s['key_fraction']} keys** (per query and head, "
            f"queries in the last {1 - s['min_query_frac']:.0%} of each sequence): mean over layers [per layer].", ""]
    head = ["loop r", "previous loop's keys", "p10", "loop 2's keys (reference)", "own top-k (oracle)", "per layer: previous"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in am["previous"]:
        prev, orc, ref = am["previous"][r], am["oracle"][r], am["reference"].get(r)
        out.append(f"| {r} | {prev['mean']:.3f} | {prev['p10']:.3f} | {ref['mean']:.3f} | {orc['mean']:.3f} | "
                   + ", ".join(f"{x:.3f}" for x in prev["per_layer_mean"]) + " |" if ref else
                   f"| {r} | {prev['mean']:.3f} | {prev['p10']:.3f} | - | {orc['mean']:.3f} | "
                   + ", ".join(f"{x:.3f}" for x in prev["per_layer_mean"]) + " |")
    qe = report["int4_error"]
    out += ["", f"**4. INT4 relative error of K/V per loop** (group {s['group_size']}): full state vs residual against the "
            "reconstructed previous loop.", ""]
    head = ["loop r", "K full", "K residual", "V full", "V residual"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in qe["k"]["full"]:
        out.append(f"| {r} | {qe['k']['full'][r]:.4f} | {qe['k']['residual'][r]:.4f} | {qe['v']['full'][r]:.4f} | {qe['v']['residual'][r]:.4f} |")
    out.append("")
    return "\n".join(out)
