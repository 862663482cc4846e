"""Running maxima from the left and running minima from the right of integer rows, one launch.

The packed write binary-searches a call's positions through their running maxima, and prefill's
packed attention bounds its in-flight key loop by both. ``torch.cummax`` / ``torch.cummin`` on a
32K row ran as ATen's scan (Inductor falls back to it there): one block per row, ~100 us a call,
14.5 ms of the all-on 1x32K prefill over 144 launches (H100, 2026-12-05, fdbc503,
``bench_prefill.py --profile 1``). Here each program takes one tile of a row: the extremum of
everything before (or after) its tile, a reduction over the other tiles one tile at a time (a
chain of dependent L2 reads: at most MAX_TILES - 1 of them), plus a scan of the tile. Rows are
prompts (at most the cache's length): tiles of 4096 positions keep that chain at 7 reads for a
32K prompt; the tile grows with the row past MIN_TILE * MAX_TILES positions up to MAX_TILE, and
longer rows take more tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashloop_compile.lowering.kernels.common import next_pow2, no_wrap

__all__ = ["running_extrema", "MIN_TILE", "MAX_TILES", "MAX_TILE"]

MIN_TILE = 4096  # positions per program (8 warps: 16 int64 values a thread)
MAX_TILES = 16  # programs per row up to MAX_TILES * MAX_TILE positions
MAX_TILE = 8192  # up to here (two int64 tiles of it are 128 registers a thread): longer rows take more tiles


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _min2(a, b):
    return tl.minimum(a, b)


@triton.jit
def _running_extrema_kernel(x, premax, sufmin, T, sx_b, sx_t,
                            BLOCK: tl.constexpr, PREMAX: tl.constexpr, SUFMIN: tl.constexpr):
    """Tile j of row b: premax[b, t] = max(x[b, :t + 1]), sufmin[b, t] = min(x[b, t:]) (either
    may be off). The carry into the tile starts from the row's first (last) element, so no
    sentinel of the dtype is needed."""
    b = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1)
    row = x + b * sx_b
    t = j * BLOCK + tl.arange(0, BLOCK)
    tm = t < T
    if PREMAX:
        first = tl.load(row)
        acc = tl.zeros([BLOCK], x.dtype.element_ty) + first
        k = 0
        while k < j:  # every tile before j lies wholly inside the row
            acc = tl.maximum(acc, tl.load(row + (k * BLOCK + tl.arange(0, BLOCK)) * sx_t))
            k += 1
        xs = tl.load(row + t * sx_t, mask=tm, other=first)
        run = tl.maximum(tl.associative_scan(xs, 0, _max2), tl.max(acc, 0))
        tl.store(premax + b * T + t, run, mask=tm)
    if SUFMIN:
        last = tl.load(row + (T - 1) * sx_t)
        acc = tl.zeros([BLOCK], x.dtype.element_ty) + last
        k = j + 1
        while k * BLOCK < T:
            tk = k * BLOCK + tl.arange(0, BLOCK)
            acc = tl.minimum(acc, tl.load(row + tk * sx_t, mask=tk < T, other=last))
            k += 1
        xs = tl.load(row + t * sx_t, mask=tm, other=last)
        run = tl.minimum(tl.associative_scan(xs, 0, _min2, reverse=True), tl.min(acc, 0))
        tl.store(sufmin + b * T + t, run, mask=tm)


def running_extrema(x: torch.Tensor, *, premax: bool = True, sufmin: bool = False, wrap=no_wrap,
                    max_len: int | None = None, block: int | None = None) -> tuple:
    """(running maxima from the left, running minima from the right) of an integer x [B, T],
    contiguous [B, T] tensors (None for the one not asked for): ``torch.cummax(x, 1).values`` and
    ``x.flip(1).cummin(1).values.flip(1)``. ``max_len``: a bound on T where T is symbolic (a
    dynamic prefill under Inductor), which sets the tile; ``block`` overrides the tile (tests)."""
    if x.dim() != 2 or x.dtype.is_floating_point or x.dtype == torch.bool:
        raise ValueError(f"running_extrema takes an integer [B, T] tensor, got {x.dtype} {tuple(x.shape)}")
    B, T = x.shape
    out_max = torch.empty(B, T, dtype=x.dtype, device=x.device) if premax else None
    out_min = torch.empty(B, T, dtype=x.dtype, device=x.device) if sufmin else None
    if isinstance(T, int) and T == 0 or isinstance(B, int) and B == 0:
        return out_max, out_min
    bound = T if isinstance(T, int) else max_len
    if bound is None:
        raise ValueError("running_extrema of a symbolic length needs max_len (the longest row it can take)")
    if block is None:
        block = min(max(MIN_TILE, next_pow2(-(-int(bound) // MAX_TILES))), MAX_TILE, max(16, next_pow2(int(bound))))
    elif block < 16 or block & (block - 1):
        raise ValueError(f"the running-extrema tile must be a power of two >= 16, got {block}")
    # the output not asked for is passed as the other one (its constexpr branch stores nothing)
    wrap(_running_extrema_kernel)[(B, triton.cdiv(T, block))](
        x, out_max if premax else out_min, out_min if sufmin else out_max, T, x.stride(0), x.stride(1),
        BLOCK=block, PREMAX=premax, SUFMIN=sufmin, num_warps=8,
    )
    return out_max, out_min
