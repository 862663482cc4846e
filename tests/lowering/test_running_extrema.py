"""running_extrema (the packed write's search keys, prefill's in-flight bounds) against torch's
cummax / cummin under the Triton interpreter: any integer rows, several tiles per row, strided
rows, and the dtype's extreme values (no sentinel is assumed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashloop_compile.lowering.kernels.running_extrema import running_extrema


def _expected(x):
    return x.cummax(1).values, x.flip(1).cummin(1).values.flip(1)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 3), st.integers(1, 70), st.sampled_from([16, 32, None]), st.integers(0, 2**31 - 1),
       st.booleans())
def test_equals_cummax_and_the_reversed_cummin(B, T, block, seed, sorted_rows):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 60, (B, T), generator=g)
    if sorted_rows:  # a prompt: ascending positions, right padding
        x = x.sort(1).values
        x[:, T - T // 4:] = -1
    premax, sufmin = running_extrema(x, premax=True, sufmin=True, block=block)
    want_max, want_min = _expected(x)
    assert torch.equal(premax, want_max)
    assert torch.equal(sufmin, want_min)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_strided_rows_extreme_values_and_one_output(dtype):
    info = torch.iinfo(dtype)
    x = torch.randint(-5, 5, (2, 2 * 50), dtype=dtype, generator=torch.Generator().manual_seed(1))
    x[0, 10] = info.max
    x[1, 0] = info.min
    x[1, 98] = info.min
    xs = x[:, ::2]  # row stride 100, position stride 2
    premax, none = running_extrema(xs, block=16)
    assert none is None and premax.is_contiguous()
    assert torch.equal(premax, _expected(xs)[0])
    none, sufmin = running_extrema(xs, premax=False, sufmin=True, block=16)
    assert none is None and torch.equal(sufmin, _expected(xs)[1])


def test_empty_rows_and_bad_input():
    a, b = running_extrema(torch.empty(2, 0, dtype=torch.int64), sufmin=True)
    assert a.shape == b.shape == (2, 0)
    with pytest.raises(ValueError, match="integer"):
        running_extrema(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="power of two"):
        running_extrema(torch.zeros(2, 3, dtype=torch.int64), block=24)
