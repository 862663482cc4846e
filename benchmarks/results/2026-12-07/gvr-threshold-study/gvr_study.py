"""Would a threshold carried from the previous decode step find loop 2's top-k (Guess-Verify-Refine)?

Loop 2's selection keeps, per (query, head), the k = ceil(0.1 * causal length) most probable keys.
Consecutive queries of one dense forward are consecutive decode steps. The study takes K*_{t-1}, the
k-th largest probability of the previous query (same layer and head), and a band
[K*_{t-1} / r, K*_{t-1} * r] ("previous K*"); or, since the selection's first pass knows this row's
largest probability before it histograms, the previous step's K* relative to its own row maximum,
scaled by this row's maximum ("previous K* / max"). The guess is verified when the band holds this step's K*_t: fewer
than k keys lie above the band, and at least k lie at or above its floor. The keys inside the band
are the candidates that an exact pass would sort. The script reports, per r, the share verified and
the candidates as a multiple of k (median, p90, p99).

    PYTHONPATH=. python3 benchmarks/results/2026-12-07/gvr-threshold-study/gvr_study.py
"""

from __future__ import annotations

import math
import sys

import torch

from flashloop_compile.models.ouro import OuroForCausalLM
from flashloop_compile.quality.corpus import Corpus
from flashloop_compile.quality.redundancy import collect_trajectory
from flashloop_compile.reference.attention import attention_probs

RATIOS = (1.05, 1.1, 1.25, 1.5, 2.0, 4.0)
RELATIVE = False
FRACTION = 0.1


def study(model, sequences, label):
    rows = {r: {"hit": [], "cand": []} for r in RATIOS}
    steps = []
    for tokens in sequences:
        tr = collect_trajectory(model, tokens)
        T = tokens.numel()
        pos = torch.arange(T)
        q_pos = pos[T // 2:]
        for layer in range(len(tr.q[1])):
            p = attention_probs(tr.q[1][layer][q_pos], q_pos, tr.k[1][layer], pos)  # loop 2: [n, H, T]
            k = torch.tensor([math.ceil(FRACTION * (int(i) + 1)) for i in q_pos])  # [n]
            srt = torch.sort(p, dim=-1, descending=True).values  # [n, H, T]
            kstar = srt.gather(-1, (k - 1)[:, None, None].expand(-1, p.shape[1], 1))[..., 0]  # [n, H]
            if RELATIVE:
                pmax = srt[..., 0]
                prev = kstar[:-1] / pmax[:-1] * pmax[1:]
            else:
                prev = kstar[:-1]
            cur, pc, kc = kstar[1:], p[1:], k[1:]
            steps.append((cur / prev).flatten())
            for r in RATIOS:
                lo, hi = prev / r, prev * r
                above = (pc > hi[..., None]).sum(-1)  # [n-1, H]
                at_least_lo = (pc >= lo[..., None]).sum(-1)
                hit = (above < kc[:, None]) & (at_least_lo >= kc[:, None])
                rows[r]["hit"].append(hit.flatten().float())
                rows[r]["cand"].append(((at_least_lo - above).float() / kc[:, None]).flatten())
    ratio = torch.cat(steps)
    q = torch.tensor([0.01, 0.1, 0.5, 0.9, 0.99])
    label = f"{label}, {'previous K* / max' if RELATIVE else 'previous K*'}"
    print(f"{label}: K*_t / guess quantiles (1, 10, 50, 90, 99%): "
          + ", ".join(f"{v:.3f}" for v in torch.quantile(ratio, q).tolist()))
    print(f"{label}: band ratio r | verified | candidates / k: median, p90, p99")
    for r in RATIOS:
        hit = torch.cat(rows[r]["hit"])
        cand = torch.cat(rows[r]["cand"])
        c = torch.quantile(cand, torch.tensor([0.5, 0.9, 0.99])).tolist()
        print(f"{label}:   {r:5.2f} | {100 * hit.mean():6.2f}% | {c[0]:.2f}, {c[1]:.2f}, {c[2]:.2f}")
    sys.stdout.flush()


def main():
    torch.manual_seed(0)
    seqs = Corpus(packages=("torch", "triton", "sympy")).sequences("heldout", 4, 4096)
    global RELATIVE
    trained = OuroForCausalLM.from_pretrained("checkpoints/ouro-python-6x256", dtype=torch.float32).eval()
    rand = OuroForCausalLM(trained.config).float().eval()  # the same shape, random weights (the benchmarks' case)
    for RELATIVE in (False, True):
        study(trained, seqs, "trained 6x256, 4 held-out files x 4096")
        study(rand, seqs, "random 6x256, the same files")


if __name__ == "__main__":
    main()
