"""The bulk decode kernel (_decode_bulk_kernel: split-K, scores and the PV product taken in the
code domain on codes converted to 1 + code/16 or 1 + code/256, no reconstructed K/V) against the ATen body, run
by the interpreter.

Without the compute-dtype rounding of the reconstruction, the code-domain form equals the
reference up to FP32 rounding on fp32 caches (tolerance 1e-5); 16-bit caches at the bf16
tolerance (1e-2)."""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.lowering import packed_ops as P
from flashloop_compile.lowering.kernels import packed_attention as PA
from flashloop_compile.runtime import PackedKVCache
from tests.lowering.packed_scenario import nested_residual_cache

B, H, D, R = 2, 2, 128, 4
LENGTHS = (160, 131)  # neither a multiple of the group: the bulk ends before the stored end


def _cache(dtype: torch.dtype, group: int) -> PackedKVCache:
    """Both rows written at depths 0..3: residuals on nested random subsets of each row's tokens
    (absent rows inherit the previous depth), so a tile mixes present and absent residuals."""
    return nested_residual_cache(dtype, group, 192, LENGTHS, H, D, R, 11, lambda k, d: k + 0.3 * d, lambda v, d: v - 0.2 * d)[0]


@pytest.mark.parametrize("dtype, group, block_n", [
    (torch.float32, 64, 16), (torch.float32, 64, 32), (torch.float32, 32, 32), (torch.bfloat16, 32, 16),
    (torch.float32, 64, 64),
], ids=["fp32_g64_bn16", "fp32_g64_bn32", "fp32_g32_bn32", "bf16_g32_bn16", "fp32_g64_bn64"])
def test_linear_decode_matches_aten(dtype, group, block_n):
    # head_dim 128: two V groups per row at group 64, four at group 32 (the per-group V
    # parameters); four, two and one key tiles per K block; depths 0..3 (no residual up to
    # three); two kv heads and two batch rows of different lengths (the residual K parameters
    # are per depth, row and head); a 64-key tile (the default). The interpreter's cost is per
    # operation: five cases.
    cache = _cache(dtype, group)
    flushed = cache.op_tensors(0)[P.CACHE_NAMES.index("flushed")]
    assert flushed.min().item() >= 64  # every row has a flushed bulk at every depth
    _check_decode(cache, dtype, {"block_n": block_n, "block_n_residual": block_n}, 1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("splits", [1, 3, 5])
def test_linear_decode_on_bf16_caches_over_several_splits(splits):
    # the default launch (64-key tiles, one K block each) on a 16-bit cache: each row's bulk is
    # one tile, so at 3 and 5 splits most programs take none (their partials m -inf, l 0);
    # depths 0..3, ragged rows, residuals present and absent in a tile. Dropping a residual (its
    # codes or its minimum's bias) fails it.
    _check_decode(_cache(torch.bfloat16, 64), torch.bfloat16, {}, 1e-2, splits)


def _check_decode(cache, dtype, tuning, tol, splits=2):
    """One decode token per row at depths 0..R-1 through the bulk kernel of ``tuning`` vs the ATen body."""
    g = torch.Generator().manual_seed(12)
    q = torch.randn(B, H, 1, D, generator=g).to(dtype)
    ki = torch.randn(B, H, 1, D, generator=g).to(dtype)
    vi = torch.randn(B, H, 1, D, generator=g).to(dtype)
    ipos = torch.tensor(LENGTHS)[:, None]
    for depth in range(R):
        ref = P.packed_attention_aten(q, ki, vi, ipos, ipos, depth, *cache.op_tensors(0), 0.1)
        out = torch.empty_like(q)
        PA.launch_packed_attention(cache.op_tensors(0), q, ki, vi, ipos, ipos, depth, 0.1, out, num_splits=splits, tuning=tuning)
        torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol, msg=lambda m: f"depth {depth}: {m}")


def test_the_tail_over_several_programs_matches_aten():
    # FAST_DECODE["tail_programs"]: what the bulk kernel leaves (the unflushed tail, the ring) in
    # _attn_kernel's programs NSTORED.. of a row, each taking every n-th tile of min(group, 32)
    # keys (the rows here leave 1 and 2 such tiles: with 2 programs, the second of row 0 takes
    # none); the first also the in-flight key. The interpreter runs one program unless asked
    # (every other decode test here: one program takes several tiles); the default, 4, runs in
    # tests/gpu. A program that ignored its stride (tested: `tile += 1` fails), or partials laid
    # out for one tail program, fail it.
    cache = _cache(torch.float32, 32)
    tensors = cache.op_tensors(0)
    flushed = tensors[P.CACHE_NAMES.index("flushed")]
    tail_tiles = [-(-n // 32) - int(flushed[b].min()) // 16 * 16 // 32 for b, n in enumerate(LENGTHS)]
    assert tail_tiles == [1, 2], tail_tiles
    _check_decode(cache, torch.float32, {"block_n": 16, "block_n_residual": 16, "tail_programs": 2}, 1e-5)
