"""Host-side helpers shared by the kernel launchers and the ops (plain torch: importable without
Triton, which CPU-only installs do not have)."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["next_pow2", "sm_count", "cpu_semantics", "no_wrap", "wrap_triton", "stored_end", "key_counts", "SUPPORTED_HEAD_DIMS"]

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)  # position_attention's constexpr head dims

_SM_COUNT: dict[int, int] = {}


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): Triton block sizes."""
    return 1 << max(int(n) - 1, 0).bit_length()


def sm_count(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (cached); 4 elsewhere (interpreter runs)."""
    if device.type != "cuda":
        return 4
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def cpu_semantics(device: torch.device) -> bool:
    """Whether launchers pick the interpreter's launch choices (FP32 dots, its own tiles): on CPU
    tensors. scripts/kernel_report.py replaces it to compile the GPU's launches on CPU tensors."""
    return device.type != "cuda"


# launch options Triton takes besides the kernel's parameters
_LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion"})


class _Complete:
    """``target[grid](*args, **kwargs)`` after checking that the call names every parameter of
    ``kernel``. ``torch.library.wrap_triton`` analyses a launch (which tensors it mutates) by
    compiling the kernel with exactly the arguments given: a parameter left to its default makes
    that analysis fail, torch then assumes every input is mutated, and functionalizing a mutated
    bool input fails later with an unrelated-looking error. Checked for direct launches too, so
    the CPU tests (interpreter, no wrap) catch a call site that would break under torch.compile."""

    def __init__(self, kernel, target):
        self.kernel, self.target = kernel, target
        names = getattr(kernel, "arg_names", None)
        if names is None:  # an Autotuner around the JIT function
            names = kernel.fn.arg_names
        self.names = tuple(names)

    def __getitem__(self, grid):
        target = self.target[grid]

        def launch(*args, **kwargs):
            given = set(self.names[: len(args)]) | (kwargs.keys() - _LAUNCH_OPTIONS)
            missing = [n for n in self.names if n not in given]
            if missing:
                name = getattr(getattr(self.kernel, "fn", self.kernel), "__name__", "kernel")
                raise TypeError(f"{name} launched without {missing}: pass every kernel parameter explicitly "
                                "(torch.library.wrap_triton analyses the launch with exactly the arguments given)")
            return target(*args, **kwargs)

        return launch


def no_wrap(kernel):
    """Launch a kernel directly (``kernel[grid]``), every parameter passed (see :class:`_Complete`);
    ops pass :func:`wrap_triton` instead."""
    return _Complete(kernel, kernel)


def wrap_triton(kernel):
    """``torch.library.wrap_triton(kernel)`` (for launches inside ``triton_op`` bodies), every
    parameter passed (see :class:`_Complete`)."""
    return _Complete(kernel, torch.library.wrap_triton(kernel))


def first_inflight(inflight_positions: torch.Tensor, max_seq: int) -> torch.Tensor:
    """[B] the first valid in-flight position of each row (padding -1 ignored), max_seq for a row
    without one: below it a read needs no in-flight overlay. On device, no host sync."""
    ip = inflight_positions
    if not ip.shape[1]:
        return ip.new_full(ip.shape[:1], max_seq)
    return torch.where(ip >= 0, ip, max_seq).amin(1)


def stored_end(q_positions: torch.Tensor, inflight_positions: torch.Tensor, max_seq: int) -> torch.Tensor:
    """P0 [B] int32: positions < P0 are read from the store. The first valid in-flight position
    (padding -1 ignored); a row without valid in-flight keys reads the store up to its last valid
    query position. On device, no host sync."""
    big = torch.iinfo(torch.int64).max
    if inflight_positions.shape[1]:
        first = torch.where(inflight_positions >= 0, inflight_positions, big).amin(dim=1)
    else:
        first = torch.full(inflight_positions.shape[:1], big, dtype=torch.int64, device=inflight_positions.device)
    if q_positions.shape[1]:
        qend = q_positions.amax(dim=1).clamp_min(-1) + 1
    else:
        qend = torch.zeros(q_positions.shape[:1], dtype=torch.int64, device=q_positions.device)
    return torch.where(first == big, qend, first).clamp(0, max_seq).to(torch.int32)


def key_counts(fraction: float, visible: Tensor) -> Tensor:
    """max(1, ceil(fraction * visible)) elementwise, int32, with the decimal rounding of
    :func:`flashloop_compile.config.ceil_fraction` (computed in float64)."""
    n = visible.to(torch.float64)
    k = torch.ceil(torch.round(n * fraction, decimals=9)).clamp_min(1.0)
    return torch.where(visible > 0, k, torch.zeros_like(k)).to(torch.int32)
