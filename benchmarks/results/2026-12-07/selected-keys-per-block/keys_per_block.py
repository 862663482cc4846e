"""How loop 2's selected keys fall on the packed cache's 64-token blocks: trained model against random weights.

The read-and-attend correction takes a row's selected keys (sorted by position) in tiles of 32
(depth 2) or 16 (depth 3) and loads each key's K parameters, 256 bytes of fp16 pairs per channel
set and level, from its 64-token block. Keys of one tile that share a block read the same
parameters again. The study reports, for the top-k at k = ceil(0.1 x causal length) of loop 2 at
queries 2048-4095 of four held-out files, the distinct blocks per tile of 32 and of 16 keys, and how
the selected keys spread over the blocks that hold any.

    PYTHONPATH=. python3 benchmarks/results/2026-12-07/selected-keys-per-block/keys_per_block.py
"""

from __future__ import annotations

import math

import torch

from flashloop_compile.models.ouro import OuroForCausalLM
from flashloop_compile.quality.corpus import Corpus
from flashloop_compile.quality.redundancy import collect_trajectory
from flashloop_compile.reference.attention import attention_probs

G = 64


def study(model, sequences, label, stride=8):
    distinct = {32: [], 16: []}
    per_block, occupied = [], []
    for tokens in sequences:
        tr = collect_trajectory(model, tokens)
        T = tokens.numel()
        pos = torch.arange(T)
        q_pos = pos[T // 2::stride]
        for layer in range(len(tr.q[1])):
            p = attention_probs(tr.q[1][layer][q_pos], q_pos, tr.k[1][layer], pos)  # [n, H, T]
            for qi, i in enumerate(q_pos.tolist()):
                k = math.ceil(0.1 * (i + 1))
                keys = torch.topk(p[qi], k, dim=-1).indices.sort(-1).values  # [H, k], by position
                blocks = keys // G
                for tile in (32, 16):
                    n = (k // tile) * tile
                    if n:
                        t = blocks[:, :n].reshape(blocks.shape[0], -1, tile)
                        distinct[tile].append((1 + (t[..., 1:] != t[..., :-1]).sum(-1)).flatten().float())
                for h in range(blocks.shape[0]):
                    counts = torch.bincount(blocks[h], minlength=i // G + 1).float()
                    per_block.append(counts[counts > 0])
                    occupied.append(torch.tensor([(counts > 0).float().mean()]))
    q = torch.tensor([0.1, 0.5, 0.9])
    for tile in (32, 16):
        d = torch.cat(distinct[tile])
        print(f"{label}: distinct blocks per {tile}-key tile (p10, median, p90): "
              + ", ".join(f"{v:.0f}" for v in torch.quantile(d, q).tolist()) + f"; mean {d.mean():.2f}")
    pb = torch.cat(per_block)
    print(f"{label}: selected keys per occupied block (p10, median, p90): "
          + ", ".join(f"{v:.0f}" for v in torch.quantile(pb, q).tolist()) + f"; mean {pb.mean():.2f}")
    print(f"{label}: share of the visible blocks holding a selected key: {100 * torch.cat(occupied).mean():.1f}%")


def main():
    torch.manual_seed(0)
    seqs = Corpus(packages=("torch", "triton", "sympy")).sequences("heldout", 4, 4096)
    trained = OuroForCausalLM.from_pretrained("checkpoints/ouro-python-6x256", dtype=torch.float32).eval()
    rand = OuroForCausalLM(trained.config).float().eval()
    study(trained, seqs, "trained 6x256")
    study(rand, seqs, "random 6x256")


if __name__ == "__main__":
    main()
