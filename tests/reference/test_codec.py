"""The affine INT4 group codec (SPEC.md section 3): error bound, code range, constant groups,
nibble packing, K/V grouping, partial groups and the rounding rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashloop_compile.reference.codec import (
    PARAM_DTYPE,
    QMAX,
    dequantize,
    pack_nibbles,
    quantize,
    quantize_channel_groups,
    quantize_token_groups,
    unpack_nibbles,
)

U16 = 2.0**-11  # unit roundoff of FP16 (10 stored mantissa bits): |fp16(a) - a| <= U16 * |a| for normal a
H16 = 2.0**-25  # half the smallest FP16 subnormal: the absolute rounding error below the normal range
U32 = 2.0**-24  # unit roundoff of FP32


def error_bound(x: torch.Tensor, scale: torch.Tensor, dim) -> torch.Tensor:
    """A sound per-element bound on |decode(quantize(x)) - x| for groups running along ``dim``.

    Notation per group: lo, hi the FP32 min/max, R = hi - lo, s_t = R / 15 (FP32), and the stored
    FP16 parameters m = fp16(lo), s = fp16(s_t). Codes are computed against m and s:
    t = (x - m) / s, code = clamp(round(t), 0, 15), decode = m + s * code.

    * 0 <= t <= 15: decode - x = s * (round(t) - t), so the error is at most s / 2.
    * t < 0 (possible only because m may round above lo): code 0, decode m, and
      x >= lo gives error m - x <= |m - lo|.
    * t > 15 (possible because m and s are rounded): code 15, error
      x - m - 15 s <= (hi - lo) + (lo - m) - 15 s <= |R - 15 s| + |m - lo|.

    Hence error <= s/2 + |m - lo| + |R - 15 s|, with
      |m - lo|     <= U16 |lo| + H16                       (FP16 rounding of the minimum)
      |R - 15 s|   <= 15 |s_t - s| + 15 |R/15 - s_t|
                   <= 15 (U16 s_t + H16) + 2 U32 R         (FP16 rounding of the scale; FP32
                                                           subtraction/division forming s_t)
                   <= U16 R (1 + U32) + 15 H16 + 2 U32 R.
    A scale that underflows to 0 in FP16 (s_t < 2^-25) is the case s = 0, covered by the same
    terms (error <= R + |m - lo|, and R < 15 H16). Finally the FP32 evaluation of (x - m) / s
    and of m + s * code adds a few FP32 ulps of max(|lo|, |hi|) + R; we allow 8 U32 of that.
    """
    xf = x.double()
    lo = xf.amin(dim=dim, keepdim=True)
    hi = xf.amax(dim=dim, keepdim=True)
    r = hi - lo
    s = scale.double()
    return s / 2 + U16 * lo.abs() + U16 * r * 1.01 + 16 * H16 + 2 * U32 * r + 8 * U32 * (lo.abs() + hi.abs() + r)


# Values bounded well inside FP16's range (the scale and minimum must not overflow).
finite32 = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def groups(draw, max_size=64):
    """A list of FP32 values from one of several regimes: wide, narrow around an offset, few distinct."""
    n = draw(st.integers(1, max_size))
    kind = draw(st.sampled_from(["wide", "narrow", "few", "seeded"]))
    if kind == "wide":
        vals = draw(st.lists(finite32, min_size=n, max_size=n))
    elif kind == "narrow":
        base = draw(finite32)
        spread = draw(st.sampled_from([1e-9, 1e-7, 1e-5, 1e-3, 1.0]))
        vals = draw(st.lists(st.floats(-1, 1, width=32), min_size=n, max_size=n))
        vals = [base + spread * v for v in vals]
    elif kind == "few":
        choices = draw(st.lists(finite32, min_size=1, max_size=3))
        vals = draw(st.lists(st.sampled_from(choices), min_size=n, max_size=n))
    else:
        seed = draw(st.integers(0, 2**31 - 1))
        mag = draw(st.sampled_from([1e-3, 1.0, 30.0, 1e3]))
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(n, generator=g) * mag).tolist()
    return vals


@settings(max_examples=100, deadline=None, derandomize=True)
@given(vals=groups())
def test_decode_error_bound_and_code_range(vals):
    x = torch.tensor(vals, dtype=torch.float32)
    codes, minimum, scale = quantize(x, dim=0)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert minimum.dtype == PARAM_DTYPE and scale.dtype == PARAM_DTYPE
    assert minimum.shape == (1,) and scale.shape == (1,)
    assert int(codes.min()) >= 0 and int(codes.max()) <= QMAX
    # The stored parameters are the FP16 roundings of min and (max - min) / 15.
    assert minimum.item() == x.min().to(torch.float16).item()
    assert scale.item() == ((x.max() - x.min()) / QMAX).to(torch.float16).item()
    assert scale.item() >= 0
    dec = dequantize(codes, minimum, scale)
    assert dec.dtype == torch.float32
    err = (dec.double() - x.double()).abs()
    bound = error_bound(x, scale, dim=0)
    assert bool((err <= bound).all()), (err.max().item(), bound.max().item())
    if scale.item() > 0:
        # Codes are the rounding of (x - m) / s against the *stored* parameters (up to FP32 ties).
        t = (x.double() - minimum.double()) / scale.double()
        ideal = t.clamp(0, QMAX)
        assert bool(((codes.double() - ideal).abs() <= 0.5 + 1e-5).all())


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 64), heads=st.integers(1, 3), dim=st.sampled_from([2, 8, 32]),
       mag=st.sampled_from([1e-2, 1.0, 100.0]))
def test_token_groups_error_bound(seed, n, heads, dim, mag):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, dim, generator=g) * mag + torch.randn(1, heads, dim, generator=g) * mag
    q = quantize_token_groups(x)
    err = (q.decode().double() - x.double()).abs()
    assert bool((err <= error_bound(x, q.scale[None], dim=0)).all())
    assert int(q.codes.max()) <= QMAX


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 20), shape=st.sampled_from([(1, 64, 64), (2, 32, 64), (4, 16, 16), (2, 64, 32), (8, 16, 128)]),
       mag=st.sampled_from([1e-2, 1.0, 100.0]))
def test_channel_groups_error_bound(seed, n, shape, mag):
    heads, dim, gs = shape
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads, dim, generator=g) * mag
    q = quantize_channel_groups(x, gs)
    grouped = x.reshape(n, -1, gs)
    err = (q.decode().double().reshape(n, -1, gs) - grouped.double()).abs()
    assert bool((err <= error_bound(grouped, q.scale[..., None], dim=-1)).all())
    assert int(q.codes.max()) <= QMAX


# --------------------------------------------------------------------------------------------
# Constant groups
# --------------------------------------------------------------------------------------------

fp16_values = st.floats(-6e4, 6e4, allow_nan=False, allow_infinity=False, width=16)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(v=fp16_values, n=st.integers(1, 64))
def test_constant_group_decodes_exactly(v, n):
    x = torch.full((n,), v, dtype=torch.float32)
    codes, minimum, scale = quantize(x, dim=0)
    assert scale.item() == 0.0
    assert bool((codes == 0).all())
    assert minimum.item() == v
    assert torch.equal(dequantize(codes, minimum, scale), x)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(v=fp16_values, n=st.integers(1, 64), heads=st.integers(1, 2), dim=st.sampled_from([2, 32]))
def test_constant_token_groups(v, n, heads, dim):
    # K: each channel constant across the rows (different constants per channel).
    offsets = torch.arange(heads * dim, dtype=torch.float16).reshape(heads, dim)
    per_channel = (torch.tensor(v, dtype=torch.float16) * 0.5 + offsets).float()  # fp16-representable
    per_channel = per_channel.to(torch.float16).float()
    x = per_channel[None].expand(n, heads, dim).contiguous()
    q = quantize_token_groups(x)
    assert bool((q.scale == 0).all()) and bool((q.codes == 0).all())
    assert torch.equal(q.minimum.float(), per_channel)
    assert torch.equal(q.decode(), x)


@settings(max_examples=50, deadline=None, derandomize=True)
@given(vals=st.lists(fp16_values, min_size=1, max_size=8))
def test_constant_channel_groups(vals):
    # V: each token's 64-channel group constant (one constant per token).
    n = len(vals)
    x = torch.tensor(vals, dtype=torch.float32)[:, None, None].expand(n, 2, 32).contiguous()
    q = quantize_channel_groups(x, 64)
    assert q.minimum.shape == (n, 1)
    assert bool((q.scale == 0).all()) and bool((q.codes == 0).all())
    assert torch.equal(q.decode(), x)


def test_constant_group_not_fp16_representable_decodes_to_stored_minimum():
    v = 0.1  # not representable in FP16
    x = torch.full((64,), v, dtype=torch.float32)
    codes, minimum, scale = quantize(x, dim=0)
    assert scale.item() == 0.0 and bool((codes == 0).all())
    dec = dequantize(codes, minimum, scale)
    assert bool((dec == torch.tensor(v, dtype=torch.float16).float()).all())
    assert abs(dec[0].item() - v) <= U16 * v


def test_scale_underflow_behaves_like_constant():
    # A range so small that (max - min) / 15 rounds to 0 in FP16: explicitly a constant group.
    x = torch.tensor([1.0, 1.0 + 2**-23, 1.0 + 2**-22], dtype=torch.float32)
    codes, minimum, scale = quantize(x, dim=0)
    assert scale.item() == 0.0
    assert bool((codes == 0).all())
    assert bool((dequantize(codes, minimum, scale) == 1.0).all())


# --------------------------------------------------------------------------------------------
# Rounding rule
# --------------------------------------------------------------------------------------------


def test_round_half_even_exact_ties():
    # min 0, max 15 -> scale exactly 1, so (x - min) / scale hits exact .5 ties.
    x = torch.tensor([0.0, 0.5, 1.5, 2.5, 3.5, 4.5, 13.5, 14.5, 15.0, 7.25, 7.75])
    codes, minimum, scale = quantize(x, dim=0)
    assert minimum.item() == 0.0 and scale.item() == 1.0
    assert codes.tolist() == [0, 0, 2, 2, 4, 4, 14, 14, 15, 7, 8]
    assert dequantize(codes, minimum, scale).tolist() == [0.0, 0.0, 2.0, 2.0, 4.0, 4.0, 14.0, 14.0, 15.0, 7.0, 8.0]


def test_round_half_even_with_offset_and_fractional_scale():
    # min 8, max 15.5 -> scale exactly 0.5; ties at 0.5, 1.5, 2.5, 5.5 steps.
    x = torch.tensor([8.0, 8.25, 8.75, 9.25, 10.75, 15.5])
    codes, minimum, scale = quantize(x, dim=0)
    assert minimum.item() == 8.0 and scale.item() == 0.5
    assert codes.tolist() == [0, 0, 2, 2, 6, 15]


# --------------------------------------------------------------------------------------------
# Nibble packing
# --------------------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), lead=st.lists(st.integers(1, 4), max_size=2), half=st.integers(1, 40))
def test_pack_unpack_round_trip(seed, lead, half):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (*lead, 2 * half), generator=g, dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*lead, half)
    assert torch.equal(unpack_nibbles(packed), codes)
    # Every byte value unpacks and repacks to itself.
    all_bytes = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(pack_nibbles(unpack_nibbles(all_bytes)), all_bytes)


def test_pack_layout_even_channel_low_nibble():
    codes = torch.tensor([[1, 2, 15, 0, 0, 15, 10, 11]], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F, 0xF0, 0xBA]]


def test_pack_odd_length_rejected():
    with pytest.raises(ValueError):
        pack_nibbles(torch.zeros(3, 5, dtype=torch.uint8))


# --------------------------------------------------------------------------------------------
# K / V grouping
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 7, 63, 64])
def test_token_groups_are_per_channel_across_rows(n):
    g = torch.Generator().manual_seed(n)
    heads, dim = 2, 8
    x = torch.randn(n, heads, dim, generator=g) * torch.linspace(0.1, 10, heads * dim).reshape(heads, dim)
    q = quantize_token_groups(x)
    assert q.codes.shape == (n, heads, dim)
    assert q.minimum.shape == (heads, dim) and q.scale.shape == (heads, dim)
    assert q.minimum.dtype == PARAM_DTYPE and q.scale.dtype == PARAM_DTYPE
    assert torch.equal(q.minimum, x.amin(0).to(torch.float16))
    assert torch.equal(q.scale, ((x.amax(0) - x.amin(0)) / 15).to(torch.float16))
    # Each channel is an independent group: quantizing that channel's column alone agrees.
    for h in range(heads):
        for d in range(dim):
            codes, m, s = quantize(x[:, h, d], dim=0)
            assert torch.equal(q.codes[:, h, d], codes)
            assert m.item() == q.minimum[h, d].item() and s.item() == q.scale[h, d].item()
    if n == 1:
        # A single row is a constant group per channel: it decodes to fp16(x).
        assert torch.equal(q.decode(), x.to(torch.float16).float())
    else:
        # Each channel's extreme rows are codes 0 and 15.
        assert bool((q.codes.amax(0) == 15).all())
        assert bool((q.codes.amin(0) == 0).all())


def test_token_groups_do_not_mix_channels():
    # One outlier channel must not widen the other channels' scales.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 1, 4, generator=g)
    wide = x.clone()
    wide[:, 0, 0] *= 1000
    q, qw = quantize_token_groups(x), quantize_token_groups(wide)
    assert torch.equal(q.scale[0, 1:], qw.scale[0, 1:])
    assert torch.equal(q.codes[:, 0, 1:], qw.codes[:, 0, 1:])
    assert qw.scale[0, 0] > 100 * q.scale[0, 0]


@pytest.mark.parametrize("heads,dim,gs", [(1, 64, 64), (4, 16, 64), (2, 64, 32), (2, 8, 16), (1, 128, 64)])
def test_channel_groups_per_token_per_group_size_channels(heads, dim, gs):
    n = 5
    g = torch.Generator().manual_seed(heads * 1000 + dim + gs)
    x = torch.randn(n, heads, dim, generator=g) * torch.linspace(0.1, 10, heads * dim).reshape(heads, dim)
    q = quantize_channel_groups(x, gs)
    n_groups = heads * dim // gs
    assert q.codes.shape == (n, heads, dim)
    assert q.minimum.shape == (n, n_groups) and q.scale.shape == (n, n_groups)
    assert q.minimum.dtype == PARAM_DTYPE and q.scale.dtype == PARAM_DTYPE
    flat = x.reshape(n, heads * dim)
    flat_codes = q.codes.reshape(n, heads * dim)
    for t in range(n):
        for j in range(n_groups):
            seg = flat[t, j * gs : (j + 1) * gs]  # consecutive channels of the flattened H*D row
            codes, m, s = quantize(seg, dim=0)
            assert torch.equal(flat_codes[t, j * gs : (j + 1) * gs], codes)
            assert m.item() == q.minimum[t, j].item() and s.item() == q.scale[t, j].item()
            assert m.item() == seg.min().to(torch.float16).item()


def test_channel_groups_do_not_mix_tokens():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 1, 64, generator=g)
    wide = x.clone()
    wide[2] *= 1000
    q, qw = quantize_channel_groups(x, 64), quantize_channel_groups(wide, 64)
    keep = [0, 1, 3]
    assert torch.equal(q.codes[keep], qw.codes[keep])
    assert torch.equal(q.scale[keep], qw.scale[keep])


def test_channel_groups_size_mismatch_rejected():
    with pytest.raises(ValueError, match="group_size"):
        quantize_channel_groups(torch.zeros(2, 3, 20), 64)


def test_partial_token_group_bound_uses_only_present_rows():
    # A partial K group (fewer than 64 rows) takes min/max over its rows only.
    x = torch.tensor(np.linspace(-3.0, 5.0, 17), dtype=torch.float32)[:, None, None]
    q = quantize_token_groups(x)
    assert q.codes.shape == (17, 1, 1)
    assert q.minimum.item() == -3.0
    assert q.scale.item() == torch.tensor(8.0 / 15).to(torch.float16).item()
    assert q.codes[0].item() == 0 and q.codes[-1].item() == 15
