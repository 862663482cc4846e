"""Multi-query decode steps (speculative verification) and their rollback: what a step of k new
tokens per row changes in the packed KV cache, and how to undo a suffix of it exactly.

A step writes tokens L..L+k-1 of a row (L = the row's length before the step). Every one of them
lands in the tail ring (slot p % 2G): before the write the ring holds at most 2G-1 tokens, and at
least G once a block can flush, so the one G-token block a write may flush (k <= 8 < G) holds
tokens older than the step. Accepting n < k of
them must leave the cache as if only tokens L..L+n-1 had been written:

- the ring slots of tokens L+n..L+k-1 get back the values they held before the step (the slots
  of older tail tokens that a flush had freed, or stale values of flushed positions);
- ``depth_count`` of those positions gets back its value before the step (0: never written);
- when the step flushed a block that writing n tokens would not have (the flushed boundary is a
  function of the row's length, the write op's rule :func:`flushed_after`), every layer's
  ``flushed`` and ``row_count`` of the row and the ``rows`` maps of that block get back their
  values before the step. The codes the undone flush wrote stay in the block's storage, which no
  reader looks at below the boundary and the next flush of the block rewrites.

So :meth:`StepUndo.capture` keeps, before the step, only those parts: k ring slots per (layer,
depth, head), the row counters, k ``depth_count`` entries and, for a row whose step flushes, the
G ``rows`` entries of the block. A dense cache needs nothing: a position past a row's length is
never read (attention is causal by position) before a forward writes it again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flashloop_compile.runtime.packed_kv import PackedKVCache

__all__ = ["MIN_VERIFY_TOKENS", "MAX_VERIFY_TOKENS", "flushed_after", "StepUndo"]

MIN_VERIFY_TOKENS, MAX_VERIFY_TOKENS = 2, 8


def flushed_after(length: int, group: int) -> int:
    """The flushed boundary of a row holding ``length`` tokens: whole G-token blocks leave the tail
    while it would hold 2G tokens or more (the packed write's rule, lowering/packed_ops.py)."""
    return (length - group) // group * group if length >= group else 0


@dataclass
class StepUndo:
    """The state a multi-query step of ``k`` tokens at ``starts`` (each row's length before the
    step) may change, kept before the step for :meth:`roll_back`."""

    starts: list[int]
    k: int
    slots: Tensor  # [b, k] ring slots of the step's positions
    k_tail: list[Tensor]  # per layer [b, R, H, k, D]: the slots' values before the step
    v_tail: list[Tensor]
    flushed: list[Tensor]  # per layer [b, R]
    row_count: list[Tensor]
    depth_count: Tensor  # [b, k]
    rows: dict[int, Tensor]  # row -> [R-1, G] rows map of the block its step flushes

    @classmethod
    def capture(cls, cache: PackedKVCache, starts: list[int], k: int) -> "StepUndo":
        b, ring, g = len(starts), 2 * cache.tail, cache.group_size
        dev = cache.device
        pos = torch.tensor(starts, device=dev)[:, None] + torch.arange(k, device=dev)  # [b, k]
        slots = pos % ring
        k_tail, v_tail, flushed, row_count = [], [], [], []
        for lay in cache.layers:
            _, r, h, _, d = lay.k_tail.shape
            idx = slots[:, None, None, :, None].expand(b, r, h, k, d)
            k_tail.append(torch.gather(lay.k_tail[:b], 3, idx))
            v_tail.append(torch.gather(lay.v_tail[:b], 3, idx))
            flushed.append(lay.flushed[:b].clone())
            row_count.append(lay.row_count[:b].clone())
        depth_count = torch.gather(cache.depth_count[:b], 1, pos)
        rows = {}
        for row, start in enumerate(starts):
            lo = flushed_after(start, g)
            if flushed_after(start + k, g) > lo:
                rows[row] = cache.rows[:, row, lo : lo + g].clone()
        return cls(list(starts), k, slots, k_tail, v_tail, flushed, row_count, depth_count, rows)

    def roll_back(self, cache: PackedKVCache, row: int, n: int) -> None:
        """Row ``row`` keeps the first ``n`` of the step's k tokens: the cache becomes what writing
        only those would have left (see the module docstring). Device ops only, no host sync."""
        k, start, g = self.k, self.starts[row], cache.group_size
        if n == k:
            return
        slots = self.slots[row, n:]
        for i, lay in enumerate(cache.layers):
            lay.k_tail[row, :, :, slots] = self.k_tail[i][row, :, :, n:]
            lay.v_tail[row, :, :, slots] = self.v_tail[i][row, :, :, n:]
        cache.depth_count[row, start + n : start + k] = self.depth_count[row, n:]
        lo = flushed_after(start, g)
        if row in self.rows and flushed_after(start + n, g) == lo:  # the step flushed; n tokens would not have
            for i, lay in enumerate(cache.layers):
                lay.flushed[row] = self.flushed[i][row]
                lay.row_count[row] = self.row_count[i][row]
            cache.rows[:, row, lo : lo + g] = self.rows[row]
