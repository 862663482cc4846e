"""Host-side helpers shared by the kernel launchers."""

from __future__ import annotations

import torch

__all__ = ["next_pow2", "sm_count", "no_wrap"]

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


def no_wrap(kernel):
    """Launch a kernel directly (``kernel[grid]``); ops pass ``torch.library.wrap_triton`` instead."""
    return kernel
