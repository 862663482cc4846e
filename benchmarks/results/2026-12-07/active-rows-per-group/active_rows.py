"""How token-sparse prefill's kept rows fall on the packed cache's 64-row groups: trained model against random weights.

The packed write flushes a residual depth (2 or 3) group by group, over each group's active rows
compacted into tiles of ACTIVE_ROWS_TILE rows (16 at depth 2, 8 at depth 3); a group holding more
rows than one tile takes a two-pass path (extrema, then codes). The study takes the nested top-k
of FlashLoopConfig's default retention [1, 1, 0.25, 0.10] (one window over the prompt) on the
dense trajectory of four held-out 4096-byte files, per group: how many groups hold an active row,
how many rows an occupied group holds, and how many groups need more than one tile.

    PYTHONPATH=. python3 benchmarks/results/2026-12-07/active-rows-per-group/active_rows.py
"""

from __future__ import annotations

import torch

from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.lowering.kernels.packed_write import ACTIVE_ROWS_TILE
from flashloop_compile.models.ouro import OuroForCausalLM
from flashloop_compile.quality.corpus import Corpus
from flashloop_compile.quality.redundancy import collect_trajectory
from flashloop_compile.reference.selection import change_scores, select_active

G = 64


def study(model, sequences, label):
    tsp = FlashLoopConfig.all_on().token_sparse_prefill
    counts = {2: [], 3: []}
    for tokens in sequences:
        tr = collect_trajectory(model, tokens)
        T = tokens.numel()
        pos = torch.arange(T)
        active = torch.ones(T, dtype=torch.bool)
        for loop in (3, 4):  # one-based; depth = loop - 1
            scores = change_scores(tr.states[loop - 2], tr.states[loop - 3])
            active = select_active(scores, active, pos, [(0, T)], tsp.retention[loop - 1], tsp, None)
            counts[loop - 1].append(active.view(-1, G).sum(-1).float())
    for depth in (2, 3):
        c = torch.cat(counts[depth])
        occ = c[c > 0]
        tile = ACTIVE_ROWS_TILE[depth]
        q = torch.quantile(occ, torch.tensor([0.1, 0.5, 0.9])).tolist()
        print(f"{label}, depth {depth}: groups with an active row {100 * (c > 0).float().mean():.1f}%; "
              f"rows per occupied group p10/median/p90 {q[0]:.0f}/{q[1]:.0f}/{q[2]:.0f} (mean {occ.mean():.1f}); "
              f"groups over one {tile}-row tile {100 * (c > tile).float().mean():.1f}% of all, "
              f"holding {100 * c[c > tile].sum() / c.sum():.1f}% of the active rows")


def main():
    torch.manual_seed(0)
    seqs = Corpus(packages=("torch", "triton", "sympy")).sequences("heldout", 4, 4096)
    trained = OuroForCausalLM.from_pretrained("checkpoints/ouro-python-6x256", dtype=torch.float32).eval()
    rand = OuroForCausalLM(trained.config).float().eval()
    study(trained, seqs, "trained 6x256")
    study(rand, seqs, "random 6x256")


if __name__ == "__main__":
    main()
