"""Multi-query decode (speculative verification, runtime/verify.py, Engine.verify/accept): a step
of k tokens per row and the rollback of a suffix of it.

- The packed cache after a k-token write rolled back to n tokens equals a cache that was only
  written those n tokens (tails, row maps, counts, flushed blocks), with and without a flush inside
  the step, exactly.
- On the tiny preset, for dense, sparse decode, KV quantization and all on: row j of a verify step
  equals the reference's multi-row decode and a decode of token j after tokens 0..j-1; after a
  partial acceptance, further decoding equals a run that only ever saw the accepted tokens.
- Bad k, bad n, accept without a verify step: errors that say what to change.
"""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.backend import make_backend
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.lowering.packed_layout import LAYER_TENSOR_NAMES
from flashloop_compile.lowering.packed_ops import packed_kv_write, packed_read
from flashloop_compile.reference import ReferenceFlashLoop
from flashloop_compile.runtime.engine import Engine
from flashloop_compile.runtime.packed_kv import PackedKVCache
from flashloop_compile.runtime.verify import StepUndo, flushed_after
from passes.conftest import tiny

# -- the packed cache ------------------------------------------------------------------------------
NL, R, B, S, H, D, G = 2, 3, 2, 128, 2, 32, 16


def _tokens(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(NL, R, B, H, n, D, generator=g)
    return k, torch.randn(NL, R, B, H, n, D, generator=g)


def _write(cache: PackedKVCache, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
    """Tokens start..start+n-1 of both rows, every depth of every layer (a decode step's writes)."""
    n = k.shape[-2]
    pos = torch.arange(start, start + n)[None].expand(B, -1).contiguous()
    for layer in range(NL):
        for d in range(R):
            packed_kv_write(cache, layer, k[layer, d].float(), v[layer, d].float(), pos, d)


def _live_state(cache: PackedKVCache, length: int) -> dict[str, torch.Tensor]:
    """What a reader can see of rows holding ``length`` tokens: counters, maps, every ring slot,
    the codes of flushed blocks and of the compact rows in use, and every depth's logical K/V."""
    out = {"rows": cache.rows.clone(), "depth_count": cache.depth_count.clone()}
    flushed = flushed_after(length, G)
    for layer in range(NL):
        t = dict(zip(LAYER_TENSOR_NAMES, cache.layer_tensors(layer)))
        for name in ("k_tail", "v_tail", "flushed", "row_count"):
            out[f"{layer}.{name}"] = t[name].clone()
        for name in ("k_base", "v_base", "v_base_min", "v_base_scale"):
            out[f"{layer}.{name}"] = t[name][:, :, :flushed].clone()
        for name in ("k_base_min", "k_base_scale"):
            out[f"{layer}.{name}"] = t[name][:, :, : flushed // G].clone()
        used = int(t["row_count"][:, 1:].max())
        for name in ("k_res", "v_res", "v_res_min", "v_res_scale"):
            out[f"{layer}.{name}"] = t[name][:, :, :used].clone()
        grid = torch.arange(length)[None].expand(B, -1)
        for d in range(R):
            out[f"{layer}.read{d}"] = torch.cat(packed_read(cache, layer, grid, d))
    return out


@pytest.mark.parametrize(
    "prefix,k,n",
    [(20, 4, 2), (30, 4, 1), (30, 4, 2), (30, 8, 0), (47, 8, 5), (5, 3, 0)],
    ids=["no-flush", "flush-undone", "flush-kept", "flush-all-rejected", "flush-at-the-last-kept", "short-row"],
)
def test_a_rolled_back_write_equals_a_cache_that_saw_only_the_accepted_tokens(prefix, k, n):
    # G = 16: the ring holds 16..31 tokens; a prefix of 30 plus 4 tokens flushes block 0..15, a
    # prefix of 30 plus 1 does not (the undone flush); 30 + 2 flushes (kept)
    kp, vp = _tokens(prefix, 0)
    ks, vs = _tokens(k, 1)
    caches = [PackedKVCache(NL, R, B, S, H, D, group_size=G, tail=G, dtype=torch.float32) for _ in range(2)]
    for c in caches:
        _write(c, kp, vp, 0)
    rolled, clean = caches
    undo = StepUndo.capture(rolled, [prefix, prefix], k)
    _write(rolled, ks, vs, prefix)
    for row in range(B):
        undo.roll_back(rolled, row, n)
    if n:
        _write(clean, ks[..., :n, :], vs[..., :n, :], prefix)
    a, b = _live_state(rolled, prefix + n), _live_state(clean, prefix + n)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    # and both continue alike: the next tokens (a flush now or later) leave equal caches
    kn, vn = _tokens(20, 2)
    for c in caches:
        _write(c, kn, vn, prefix + n)
    a, b = _live_state(rolled, prefix + n + 20), _live_state(clean, prefix + n + 20)
    for name in a:
        assert torch.equal(a[name], b[name]), name
