"""Launch parameters and launch helpers shared by the sparse decode kernels (reference_attention.py,
selection.py, correction.py)."""

from __future__ import annotations

import dataclasses

import torch

from flashloop_compile.lowering.kernels import common
from flashloop_compile.lowering.kernels.common import no_wrap, wrap_triton

__all__ = ["KernelConfig", "DEFAULT_CONFIG", "INTERPRETER_CONFIG", "Launcher", "cdiv", "split_range", "check_runnable", "config_for"]


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and split targets. ``None`` splits are chosen from the SM count."""

    block_n: int = 64  # keys per tile in the scores / PV kernels
    block_sel: int = 2048  # keys per tile in the selection (histogram) kernels
    block_compact: int = 1024  # keys per tile in the compaction kernel (divides block_sel)
    block_k: int = 64  # selected keys per tile in the correction kernel
    min_sel_chunk: int = 2048  # fewest keys one selection program handles
    split_kv: int | None = None  # splits of S for the scores / PV kernels
    split_sel: int | None = None  # programs per row in the selection kernels
    split_corr: int | None = None  # splits of the selected set in the correction kernel
    num_warps_kv: int = 4
    num_stages_kv: int = 3
    block_n_pv: int | None = 32  # keys per tile in the PV kernel (None: block_n)
    num_warps_pv: int = 4
    num_stages_pv: int = 4
    num_warps_sel: int = 8
    num_warps_compact: int = 4
    num_warps_corr: int = 4
    # correction kernel: software-pipelined key tiles (1: a plain loop). 2: cp.async gathers, the
    # index load a stage ahead; per correction site 5-14% faster at B1/B4 x 32K x depth 1/3 than 1,
    # and than 3 or 32-key tiles (H200)
    num_stages_corr: int = 2
    block_n_linear: int = 64  # keys per tile of the code-domain (linear) scores kernel (divides the group)
    block_n_pv_linear: int = 32  # ... and of its PV kernel (divides block_n_linear)
    num_warps_linear: int = 4
    num_stages_linear: int = 3
    waves_linear: int = 4  # linear kernels: splits of S for about this many programs per SM (with split_kv None)


# The launch parameters on CUDA and in the interpreter (CPU tensors: small tiles, the one-split
# correction, its FINAL path; tests pass their own configs to split).
DEFAULT_CONFIG = KernelConfig()


INTERPRETER_CONFIG = KernelConfig(block_n=16, block_n_pv=16, block_sel=64, block_compact=32, block_k=16, min_sel_chunk=64,
                                  block_n_linear=16, block_n_pv_linear=16, split_corr=1)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_range(total: int, block: int, want: int) -> tuple[int, int]:
    """(chunk, splits): `total` items in `splits` chunks of `chunk` (a multiple of `block`)."""
    want = max(1, min(int(want), cdiv(total, block)))
    chunk = cdiv(cdiv(total, want), block) * block
    return chunk, cdiv(total, chunk)


def check_runnable(kernel, device: torch.device) -> None:
    interpreted = type(kernel).__name__ == "InterpretedFunction"
    if device.type == "cuda" and interpreted:
        raise RuntimeError("TRITON_INTERPRET=1 was set when triton was imported: these kernels are interpreted, not compiled for CUDA")
    if device.type != "cuda" and not interpreted:
        raise RuntimeError(f"Triton kernels on {device.type} tensors need TRITON_INTERPRET=1 set before triton is imported")


class Launcher:
    """``kernel[grid](...)`` or ``torch.library.wrap_triton(kernel)[grid](...)``, every kernel
    parameter passed (common.no_wrap / common.wrap_triton check it)."""

    def __init__(self, wrap: bool):
        self.wrap = wrap

    def __call__(self, kernel, grid):
        return (wrap_triton if self.wrap else no_wrap)(kernel)[grid]


def config_for(device: torch.device, config: KernelConfig | None) -> KernelConfig:
    if config is not None:
        return config
    return INTERPRETER_CONFIG if common.cpu_semantics(device) else DEFAULT_CONFIG
