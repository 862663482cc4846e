"""The packed write's INT4 codes (packed_codec._codes: a reciprocal's estimate, then an exact test
against the nearest half-integer) equal the reference codec's torch.round of a correctly rounded
division at exact ties, next to them, on quotients that only round onto a tie, outside the code
range and for constant groups: random data almost never lands on a tie, so the write tests alone
would not see a rounding rule that breaks them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from hypothesis import given, settings
from hypothesis import strategies as st

from flashloop_compile.lowering.kernels.packed_codec import _codes
from flashloop_compile.reference.codec import QMAX

N = 256


@triton.jit
def _codes_kernel(x, mn, sc, out, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out + i, _codes(tl.load(x + i), tl.load(mn + i), tl.load(sc + i)))


def _kernel_codes(x: torch.Tensor, mn: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    out = torch.empty(n, dtype=torch.int32)
    _codes_kernel[(1,)](x, mn, sc, out, N=n)
    return out


def _reference_codes(x: torch.Tensor, mn: torch.Tensor, sc: torch.Tensor) -> torch.Tensor:
    m32, s32 = mn.float(), sc.float()
    safe = torch.where(s32 > 0, s32, torch.ones_like(s32))
    q = torch.round((x - m32) / safe).clamp(0, QMAX)
    return torch.where(s32 > 0, q, torch.zeros_like(q)).to(torch.int32)


def _case(q: torch.Tensor, scale: float, minimum: float):
    """x whose quotient (x - min) / scale is q (exactly, for power-of-two scales)."""
    mn = torch.full((N,), minimum, dtype=torch.float16)
    sc = torch.full((N,), scale, dtype=torch.float16)
    x = (mn.float() + q * sc.float()).float()
    return x, mn, sc


def test_exact_ties_round_to_even():
    q = torch.arange(N, dtype=torch.float32) / 8 - 2.0  # every eighth from -2 to 30: ties at .5
    for scale, minimum in ((1.0, 0.0), (0.25, -3.0), (2.0**-10, 1.5), (8.0, -64.0)):
        x, mn, sc = _case(q, scale, minimum)
        assert torch.equal(_kernel_codes(x, mn, sc), _reference_codes(x, mn, sc)), (scale, minimum)


def test_next_to_ties_and_outside_the_range():
    half = torch.arange(N, dtype=torch.float32) % 17 + 0.5
    below, above = torch.nextafter(half, torch.zeros_like(half)), torch.nextafter(half, torch.full_like(half, 99.0))
    for q in (below, above, half * 1e6, -half * 1e6):
        x, mn, sc = _case(q, 0.5, 1.0)
        assert torch.equal(_kernel_codes(x, mn, sc), _reference_codes(x, mn, sc))


def test_zero_scale_gives_code_zero():
    x = torch.linspace(-3, 3, N)
    mn = torch.zeros(N, dtype=torch.float16)
    sc = torch.zeros(N, dtype=torch.float16)
    assert torch.equal(_kernel_codes(x, mn, sc), torch.zeros(N, dtype=torch.int32))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(2.0**-14, 100.0), st.floats(-100.0, 100.0))
def test_random_groups_match_the_reference(seed, scale, minimum):
    g = torch.Generator().manual_seed(seed)
    mn = torch.full((N,), minimum, dtype=torch.float16)
    sc = torch.full((N,), scale, dtype=torch.float16)
    # quotients spread over the codes' range and past it, a quarter of them on exact ties
    q = torch.rand(N, generator=g) * 18 - 1.5
    q[::4] = torch.floor(q[::4]) + 0.5
    x = mn.float() + q * sc.float()
    assert torch.equal(_kernel_codes(x, mn, sc), _reference_codes(x, mn, sc))


def test_quotients_next_to_ties_for_any_scale():
    """x - min within a few FP32 steps of (k + 0.5) * scale, for scales with full fp16 mantissas (and
    subnormal ones): the quotient's estimate through the reciprocal cannot tell these apart, the
    exact test against the half-integer must."""
    g = torch.Generator().manual_seed(0)
    n = 4096
    mant = torch.randint(1, 2048, (n,), generator=g).float()
    scale = (mant * 2.0 ** torch.randint(-24, -4, (n,), generator=g).float()).to(torch.float16)
    c = (torch.randint(-1, 17, (n,), generator=g) + 0.5).float()
    d = c * scale.float()  # exact: 6 + 11 significant bits
    step = torch.randint(-3, 4, (n,), generator=g)
    for k in range(3):  # move d by |step| FP32 steps up or down
        d = torch.where(step.abs() > k, torch.nextafter(d, d + step.sign() * torch.ones_like(d)), d)
    assert bool((step == 0).any()) and bool((step != 0).any())
    for minimum in (0.0, -2.0**-6):
        mn = torch.full((n,), minimum, dtype=torch.float16)
        x = mn.float() + d
        got, want = _kernel_codes(x, mn, scale), _reference_codes(x, mn, scale)
        assert torch.equal(got, want), int((got != want).sum())
