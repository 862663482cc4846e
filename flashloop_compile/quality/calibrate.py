"""Derive a retention schedule and a key fraction from calibration sequences (threshold tau).

Both searches run on the *dense* trajectory of each calibration sequence (one forward each, all
statistics in FP32), so calibrating is cheap; the chosen schedule is then checked end to end
through the reference.

**Retention** (token-sparse prefill). A schedule [1, 1, rho_3, ..., rho_R] selects, before each
loop r >= 3, the active set A_r exactly as FlashLoop does (score from the dense states of loops
r-1 and r-2, top ceil(rho_r * window length) of A_{r-1} per window, ties to the lower position,
the base config's window and keep_last_token). A token whose last active loop is L_i carries
H[L_i] where dense has H[r]. The inheritance error at loop r is

    E_r = sqrt( sum_seq sum_i ||H[r, i] - H[min(L_i, r), i]||^2 / sum_seq sum_i ||H[r, i]||^2 )

(H = normalized loop outputs; a selected token is assumed exact, so E_r is the error of the
state the active rows *inherit*, not the second-order effect of stale K/V on them). Search (greedy):
for rho_3 in ascending grid order, pick for each later loop the smallest rho_r <= rho_{r-1} with
E_r <= tau; the first rho_3 that admits a complete schedule wins (so rho_3, then rho_4, ... are
each as small as the threshold allows).

**Key fraction** (sparse decode attention). For each sparse loop r >= 3 and each layer, queries
in the last ``1 - min_query_frac`` of every sequence (a decode step sees a long prefix), the
FlashLoop output O~_r = O_ref - C_ref + m * softmax(q_r K_r[S]^T / sqrt(d)) V_r[S], with S the
top ceil(f * causal length) keys of loop 2's probabilities per (query, head), is compared with
exact attention O_r of loop r:

    e_r(f) = sqrt( sum ||O~_r - O_r||^2 / sum ||O_r||^2 )     (over layers, queries, heads)

and the key fraction is the smallest grid value with max_r e_r(f) <= tau (or one per sparse loop
with ``per_loop_key_fraction``).

With ``strict=True`` the retentions are raised one grid step at a time until the end-to-end
final-state error of the reference (token-sparse prefill alone vs dense, same formula as E_R
but with the reference's actual states) is <= tau as well. The result is a full FlashLoopConfig
(the base config with the calibrated values) validated with ``resolve``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor

from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.quality.redundancy import collect_trajectory, key_ranks, topk_mask_per_query
from flashloop_compile.reference.attention import attention_probs
from flashloop_compile.reference.selection import change_scores, select_active, window_bounds

__all__ = ["RETENTION_GRID", "KEY_FRACTION_GRID", "CalibrationResult", "calibrate", "retention_errors", "key_fraction_errors"]

RETENTION_GRID = (0.02, 0.05, 0.10, 0.15, 0.20, 0.25, 0.30, 0.40, 0.50, 0.60, 0.75, 0.90, 1.0)
KEY_FRACTION_GRID = (0.01, 0.02, 0.05, 0.10, 0.15, 0.20, 0.25, 0.30, 0.40, 0.50, 0.75, 1.0)


@dataclass
class CalibrationResult:
    config: FlashLoopConfig
    threshold: float
    retention: list[float]
    key_fraction: list[float]
    retention_errors: dict[str, float]  # loop -> E_r of the chosen schedule
    key_fraction_errors: dict[str, dict[str, float]]  # fraction -> loop -> e_r
    end_to_end: dict[str, float] = field(default_factory=dict)
    sequences: int = 0
    tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "config": self.config.to_dict(),
            "calibration": {
                "threshold": self.threshold,
                "retention": self.retention,
                "key_fraction": self.key_fraction,
                "retention_inheritance_error": self.retention_errors,
                "key_fraction_attention_error": self.key_fraction_errors,
                "end_to_end": self.end_to_end,
                "sequences": self.sequences,
                "tokens": self.tokens,
            },
        }

    def to_markdown(self) -> str:
        out = ["### Calibration", "",
               f"{self.sequences} calibration sequences, {self.tokens:,} tokens, threshold {self.threshold:.1%}.", "",
               f"- retention: {self.retention} (inheritance error per loop: "
               + ", ".join(f"loop {r}: {e:.4f}" for r, e in self.retention_errors.items()) + ")",
               f"- key fraction: {self.key_fraction}"]
        if self.end_to_end:
            out.append("- end to end (reference, token-sparse prefill alone vs dense, calibration sequences): "
                       + ", ".join(f"{k} {v:.4f}" for k, v in self.end_to_end.items()))
        out += ["", "Sparse-decode attention error e_r(f) per key fraction:", ""]
        loops = sorted({r for d in self.key_fraction_errors.values() for r in d})
        out += ["| key fraction | " + " | ".join(f"loop {r}" for r in loops) + " |", "|---|" + "---|" * len(loops)]
        for f, d in self.key_fraction_errors.items():
            out.append(f"| {f} | " + " | ".join(f"{d[r]:.4f}" for r in loops) + " |")
        out += ["", f"Config: `{self.config}`", "", "```json", _json(self.config.to_dict()), "```", ""]
        return "\n".join(out)


def _json(d: dict) -> str:
    import json

    return json.dumps(d, indent=2, sort_keys=True)


def _schedule_errors(states_list: list[list[Tensor]], rhos: Sequence[float], base: FlashLoopConfig) -> list[float]:
    """E_r for r = 3..R of schedule [1, 1, *rhos] on dense trajectories (see module doc)."""
    tsp = base.token_sparse_prefill
    R = len(states_list[0])
    num = [0.0] * (R + 1)
    den = [0.0] * (R + 1)
    for H in states_list:
        T = H[0].shape[0]
        pos = torch.arange(T, device=H[0].device)
        windows = window_bounds(0, T, tsp.window, True)
        active = torch.ones(T, dtype=torch.bool, device=H[0].device)
        last = torch.full((T,), 1, dtype=torch.long, device=H[0].device)  # zero-based loop index of the last active loop (loop 2)
        for r in range(3, R + 1):
            scores = change_scores(H[r - 2], H[r - 3])
            active = select_active(scores, active, pos, windows, rhos[r - 3], tsp, T - 1 if tsp.keep_last_token else None)
            last = torch.where(active, torch.full_like(last, r - 1), last)
            inherited = torch.stack(H)[last, pos]  # [T, hidden]
            num[r] += float((H[r - 1] - inherited).pow(2).sum())
            den[r] += float(H[r - 1].pow(2).sum())
    return [math.sqrt(num[r] / den[r]) if den[r] > 0 else 0.0 for r in range(3, R + 1)]


def retention_errors(model, sequences: Sequence[Tensor], rhos: Sequence[float], base: FlashLoopConfig | None = None) -> list[float]:
    """E_r (r = 3..R) of a retention schedule for loops 3..R."""
    states = [collect_trajectory(model, s).states for s in sequences]
    return _schedule_errors(states, rhos, base or FlashLoopConfig.all_on())


def _search_retention(states_list, base: FlashLoopConfig, tau: float, grid: Sequence[float], R: int) -> tuple[list[float], list[float]]:
    def complete(prefix: list[float]) -> tuple[list[float], list[float]] | None:
        # extend a feasible prefix loop by loop with the smallest feasible ratio <= the previous one
        while len(prefix) < R - 2:
            cap = prefix[-1]
            for rho in [g for g in grid if g <= cap]:
                errs = _schedule_errors(states_list, prefix + [rho] * (R - 2 - len(prefix)), base)
                if errs[len(prefix)] <= tau:
                    prefix = prefix + [rho]
                    break
            else:
                return None
        errs = _schedule_errors(states_list, prefix, base)
        return (prefix, errs) if all(e <= tau for e in errs) else None

    for rho3 in grid:
        errs = _schedule_errors(states_list, [rho3] * (R - 2), base)
        if errs[0] > tau:
            continue
        done = complete([rho3])
        if done is not None:
            return done
    full = [1.0] * (R - 2)
    return full, _schedule_errors(states_list, full, base)


def key_fraction_errors(model, trajectories, fractions: Sequence[float], min_query_frac: float = 0.5) -> dict[float, dict[int, float]]:
    """e_r(f) for each fraction and sparse loop r = 3..R (see module doc)."""
    cfg = model.config
    R, N = cfg.num_loops, cfg.num_hidden_layers
    num = {f: {r: 0.0 for r in range(3, R + 1)} for f in fractions}
    den = {r: 0.0 for r in range(3, R + 1)}
    scale = 1.0 / math.sqrt(cfg.head_dim)
    for tr in trajectories:
        T = tr.states[0].shape[0]
        pos = torch.arange(T, device=tr.states[0].device)
        q_pos = pos[int(T * min_query_frac):]
        visible = pos[None, None, :] <= q_pos[:, None, None]
        for i in range(N):
            rep = cfg.num_attention_heads // cfg.num_key_value_heads
            v2 = tr.v[1][i].repeat_interleave(rep, dim=1)
            p2 = attention_probs(tr.q[1][i][q_pos], q_pos, tr.k[1][i], pos)  # [Tq, H, Tk]
            o_ref = torch.einsum("qhk,khd->qhd", p2, v2)
            exact, logits_r, vr = {}, {}, {}
            for r in range(3, R + 1):
                kr = tr.k[r - 1][i].repeat_interleave(rep, dim=1)
                vr[r] = tr.v[r - 1][i].repeat_interleave(rep, dim=1)
                logits_r[r] = torch.einsum("qhd,khd->qhk", tr.q[r - 1][i][q_pos], kr) * scale
                pr = torch.softmax(logits_r[r].masked_fill(~visible, float("-inf")), -1)
                exact[r] = torch.einsum("qhk,khd->qhd", pr, vr[r])
                den[r] += float(exact[r].pow(2).sum())
            ranks = key_ranks(p2, q_pos, pos)
            for f in fractions:
                sel = topk_mask_per_query(p2, q_pos, pos, f, ranks)
                psel = p2 * sel
                mass = psel.sum(-1, keepdim=True)
                c_ref = torch.einsum("qhk,khd->qhd", psel, v2)
                for r in range(3, R + 1):
                    local = torch.softmax(logits_r[r].masked_fill(~sel, float("-inf")), -1)
                    approx = o_ref - c_ref + mass * torch.einsum("qhk,khd->qhd", local, vr[r])
                    num[f][r] += float((approx - exact[r]).pow(2).sum())
    return {f: {r: math.sqrt(num[f][r] / den[r]) if den[r] > 0 else 0.0 for r in num[f]} for f in fractions}


@torch.no_grad()
def _end_to_end(model, sequences: Sequence[Tensor], config: FlashLoopConfig) -> dict[str, float]:
    """Token-sparse prefill alone through the reference vs dense: final-state error, logits KL, top-1 agreement."""
    from flashloop_compile.quality.evaluate import device_context
    from flashloop_compile.reference import ReferenceFlashLoop

    tsp_only = FlashLoopConfig.from_dict({**FlashLoopConfig().to_dict(), **{
        k: v for k, v in config.to_dict().items() if k.startswith("token_sparse_prefill.")}})
    dense, sparse = ReferenceFlashLoop(model, FlashLoopConfig()), ReferenceFlashLoop(model, tsp_only)
    num = den = kl = agree = n = 0.0
    dev = next(model.parameters()).device
    with device_context(model):
        for s in sequences:
            s = s.to(dev)
            a, b = dense.request().prefill(s), sparse.request().prefill(s)
            ha, hb = a.states[-1].float(), b.states[-1].float()
            num += float((hb - ha).pow(2).sum())
            den += float(ha.pow(2).sum())
            la, lb = torch.log_softmax(a.logits.float(), -1), torch.log_softmax(b.logits.float(), -1)
            kl += float((la.exp() * (la - lb)).sum())
            agree += float((la.argmax(-1) == lb.argmax(-1)).sum())
            n += s.numel()
    return {"final_state_error": math.sqrt(num / den) if den else 0.0, "logits_kl_nats": kl / max(n, 1), "top1_agreement": agree / max(n, 1)}


@torch.no_grad()
def calibrate(
    model,
    sequences: Sequence[Tensor],
    threshold: float = 0.05,
    *,
    base: FlashLoopConfig | None = None,
    retention_grid: Sequence[float] = RETENTION_GRID,
    key_fraction_grid: Sequence[float] = KEY_FRACTION_GRID,
    per_loop_key_fraction: bool = False,
    min_query_frac: float = 0.5,
    strict: bool = False,
    end_to_end: bool = True,
) -> CalibrationResult:
    """Calibrate ``base`` (default: every feature on) on ``sequences`` (1-D token tensors)."""
    if not (0 < threshold < 1):
        raise ValueError(f"threshold must lie in (0, 1), got {threshold}")
    base = base or FlashLoopConfig.all_on()
    R = model.config.num_loops
    if R < 3:
        raise ValueError(f"calibration needs a model with at least 3 loops, got {R}")
    rgrid = sorted(set(float(g) for g in retention_grid) | {1.0})
    kgrid = sorted(set(float(g) for g in key_fraction_grid) | {1.0})
    trajectories = [collect_trajectory(model, s) for s in sequences]
    states = [tr.states for tr in trajectories]
    retention, r_errs = _search_retention(states, base, threshold, rgrid, R)

    k_errs = key_fraction_errors(model, trajectories, kgrid, min_query_frac)
    loops = list(range(3, R + 1))
    if per_loop_key_fraction:
        fractions = [next((f for f in kgrid if k_errs[f][r] <= threshold), 1.0) for r in loops]
    else:
        fractions = [next((f for f in kgrid if max(k_errs[f].values()) <= threshold), 1.0)]

    def make(ret: list[float]) -> FlashLoopConfig:
        flat = base.to_dict()
        flat["token_sparse_prefill.retention"] = [1.0, 1.0] + ret
        flat["sparse_decode_attention.key_fraction"] = fractions
        return FlashLoopConfig.from_dict(flat).resolve(R)

    config = make(retention)
    e2e = _end_to_end(model, sequences, config) if (end_to_end or strict) else {}
    while strict and e2e["final_state_error"] > threshold and any(r < 1.0 for r in retention):
        retention = [next((g for g in rgrid if g > r), 1.0) for r in retention]
        config = make(retention)
        e2e = _end_to_end(model, sequences, config)
    r_errs = _schedule_errors(states, retention, base)
    return CalibrationResult(
        config=config,
        threshold=threshold,
        retention=[1.0, 1.0] + retention,
        key_fraction=fractions,
        retention_errors={str(r): e for r, e in zip(loops, r_errs)},
        key_fraction_errors={str(f): {str(r): e for r, e in d.items()} for f, d in k_errs.items()},
        end_to_end=e2e,
        sequences=len(sequences),
        tokens=sum(int(s.numel()) for s in sequences),
    )
