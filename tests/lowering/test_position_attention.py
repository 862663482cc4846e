"""flashloop::position_attention (lowering/prefill_ops.py): the CPU op (ATen body) against an
explicit float64 reference, the op's contract (opcheck, fake checks), and the Triton kernel
(lowering/kernels/prefill_attention.py) run on CPU tensors through the Triton interpreter
(tests/conftest.py sets TRITON_INTERPRET=1 before triton is imported) against the ATen body."""

from __future__ import annotations

import math

import pytest
import torch

from flashloop_compile.lowering import prefill_ops
from flashloop_compile.lowering.prefill_ops import position_attention, position_attention_aten

triton = pytest.importorskip("triton")

from flashloop_compile.lowering.kernels import prefill_attention as pa  # noqa: E402



SMALL = pa.PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)  # several blocks both ways


# ------------------------------------------------------------------------------------------
# inputs and the explicit reference
# ------------------------------------------------------------------------------------------


def _positions(kind: str, b: int, tq: int, s: int, g: torch.Generator) -> torch.Tensor:
    """[B, Tq] int64 positions of one of the scenario kinds."""
    rows = []
    for r in range(b):
        if kind == "sorted":  # token-sparse prefill: sorted random subset, ragged per row
            n_valid = tq - (3 * r) % max(tq // 2, 1)
            p = torch.randperm(s, generator=g)[:n_valid].sort().values
            p = torch.cat([p, torch.full((tq - n_valid,), -1)])  # trailing padding
        elif kind == "dense":  # every position (loop 1/2 style): ordinary causal attention
            p = torch.arange(s - tq, s)
        elif kind == "unsorted":  # any order, repeats, padding in the middle, past the cache
            p = torch.randint(0, s, (tq,), generator=g)
            p[1] = p[0]
            p[tq // 2] = -1
            p[-1] = s + 5
            p[2] = 0
        elif kind == "duplicated":  # sorted with repeated rows
            p = torch.randperm(s, generator=g)[: (tq + 1) // 2].sort().values.repeat_interleave(2)[:tq]
        else:
            raise ValueError(kind)
        rows.append(p)
    return torch.stack(rows).to(torch.int64)


def _inputs(b=2, hq=4, hkv=2, tq=12, s=70, d=16, dtype=torch.float32, kind="sorted", seed=0, strided=False):
    g = torch.Generator().manual_seed(seed)
    if strided:  # the model's [B, T, H, D] layouts, transposed views
        q = torch.randn(b, tq, hq, d, generator=g).transpose(1, 2)
        k = torch.randn(b, s, hkv, d, generator=g).transpose(1, 2)
        v = torch.randn(b, s, hkv, 2 * d, generator=g)[..., ::2].transpose(1, 2)
    else:
        q = torch.randn(b, hq, tq, d, generator=g)
        k = torch.randn(b, hkv, s, d, generator=g)
        v = torch.randn(b, hkv, s, d, generator=g)
    pos = _positions(kind, b, tq, s, g)
    return q.to(dtype), k.to(dtype), v.to(dtype), pos


def _explicit_reference(q, k, v, pos, scale):
    """float64, one query row at a time over the keys j <= pos (an explicit mask), zeros for
    padding rows."""
    b, hq, tq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    out = torch.zeros(b, hq, tq, d, dtype=torch.float64)
    for bi in range(b):
        for i in range(tq):
            p = int(pos[bi, i])
            if p < 0:
                continue
            visible = torch.arange(s) <= p
            for h in range(hq):
                kv = h // (hq // hkv)
                scores = (k[bi, kv].double() @ q[bi, h, i].double()) * scale
                scores = scores.masked_fill(~visible, float("-inf"))
                out[bi, h, i] = torch.softmax(scores, 0) @ v[bi, kv].double()
    return out


# ------------------------------------------------------------------------------------------
# the CPU op (ATen body)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sorted", "dense", "unsorted", "duplicated"])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 3), (6, 1)])
def test_cpu_op_matches_explicit_reference(kind, hq, hkv):
    q, k, v, pos = _inputs(hq=hq, hkv=hkv, kind=kind, seed=hq * 10 + hkv)
    scale = 0.3
    out = torch.ops.flashloop.position_attention(q, k, v, pos, scale)
    assert out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous()
    ref = _explicit_reference(q, k, v, pos, scale)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()
    assert (out[(pos < 0)[:, None, :].expand(-1, hq, -1)] == 0).all(), "padding rows must be zeros"


def test_cpu_op_semantics_by_hand():
    """Position 0 sees only key 0 (output = v[0]); duplicated rows give equal outputs; a
    position past the cache sees all of it; -1 gives zeros even with NaN queries."""
    q, k, v, _ = _inputs(b=1, hq=2, hkv=1, tq=5, s=20, d=16)
    q[0, :, 4] = float("nan")
    q[0, :, 2] = q[0, :, 1]  # a duplicated row: same token, same position
    pos = torch.tensor([[0, 7, 7, 100, -1]])
    out = position_attention(q, k, v, pos)  # default scale 1/sqrt(16)
    torch.testing.assert_close(out[0, :, 0], v[0, 0, 0].expand(2, -1))
    assert torch.equal(out[0, :, 1], out[0, :, 2])
    full = torch.softmax(q[0, :, 3] @ k[0, 0].T / 4.0, -1) @ v[0, 0]
    torch.testing.assert_close(out[0, :, 3], full)
    assert torch.equal(out[0, :, 4], torch.zeros(2, 16))


def test_cpu_op_bf16_and_strided():
    q, k, v, pos = _inputs(dtype=torch.bfloat16, strided=True, kind="unsorted", seed=3)
    out = position_attention(q, k, v, pos, scale=0.2)
    assert out.dtype == torch.bfloat16 and out.is_contiguous()
    ref = _explicit_reference(q, k, v, pos, 0.2)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def test_opcheck():
    q, k, v, pos = _inputs(kind="unsorted", seed=5)
    torch.library.opcheck(torch.ops.flashloop.position_attention.default, (q, k, v, pos, 0.25))
    q, k, v, pos = _inputs(hq=4, hkv=1, dtype=torch.bfloat16, strided=True, seed=6)
    torch.library.opcheck(torch.ops.flashloop.position_attention.default, (q, k, v, pos, 0.125))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, p: (q, k, v, p.to(torch.int32)), "q_pos must be int64"),
        (lambda q, k, v, p: (q, k, v, p[:, :-1]), "q_pos must be"),
        (lambda q, k, v, p: (q[:, :3], k, v, p), "multiple of kv heads"),
        (lambda q, k, v, p: (q, k, v[:, :, :-1], p), "k and v shapes differ"),
        (lambda q, k, v, p: (q, k.half(), v.half(), p), "dtypes differ"),
        (lambda q, k, v, p: (q[..., :8], k[..., :8], v[..., :8], p), "head_dim must be one of"),
        (lambda q, k, v, p: (q[0], k, v, p), r"q must be \[B, Hq, Tq, D\]"),
    ],
)
def test_contract_checks(change, message):
    args = change(*_inputs())
    with pytest.raises(RuntimeError, match=message):  # eager CPU
        torch.ops.flashloop.position_attention(*args, 0.25)
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match=message):  # the fake impl
        torch.ops.flashloop.position_attention(*(mode.from_tensor(a) for a in args), 0.25)


def test_traces_with_torch_compile_fullgraph():
    q, k, v, pos = _inputs(kind="unsorted", seed=7)

    def f(q, k, v, pos):
        return position_attention(q * 2.0, k, v, pos, 0.25) + 1.0

    got = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v, pos)
    torch.testing.assert_close(got, f(q, k, v, pos))


# ------------------------------------------------------------------------------------------
# the Triton kernel under the interpreter
# ------------------------------------------------------------------------------------------

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _check_kernel(q, k, v, pos, scale, config=SMALL):
    out = pa.position_attention_triton(q, k, v, pos, scale, config=config)
    ref = position_attention_aten(q, k, v, pos, scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL[q.dtype])
    padding = (pos < 0)[:, None, :].expand(-1, q.shape[1], -1)
    assert (out[padding] == 0).all(), "padding rows must be zeros"
    return out


@pytest.mark.parametrize(
    "kind, hq, hkv, dtype",
    [
        ("sorted", 4, 2, torch.float32),
        ("sorted", 4, 2, torch.bfloat16),
        ("dense", 2, 2, torch.float32),
        ("unsorted", 3, 1, torch.float32),
        ("unsorted", 4, 2, torch.bfloat16),
        ("duplicated", 2, 1, torch.float16),
    ],
)
def test_kernel_matches_aten(kind, hq, hkv, dtype):
    q, k, v, pos = _inputs(b=2, hq=hq, hkv=hkv, tq=40, s=70, d=16, dtype=dtype, kind=kind, seed=11)
    _check_kernel(q, k, v, pos, 0.3)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_kernel_head_dims_and_strides(d):
    q, k, v, pos = _inputs(b=1, hq=2, hkv=1, tq=20, s=45, d=d, kind="sorted", seed=d, strided=True)
    _check_kernel(q, k, v, pos, 1.0 / math.sqrt(d), config=pa.PrefillConfig(16, 32, 4, 1))
    _check_kernel(q.bfloat16(), k.bfloat16(), v.bfloat16(), pos, 1.0 / math.sqrt(d), config=pa.PrefillConfig(16, 32, 4, 1))


def test_kernel_default_config_and_edge_positions():
    """Default interpreter tiles; a block of padding only; positions 0 and past the cache."""
    q, k, v, pos = _inputs(b=2, hq=2, hkv=1, tq=70, s=90, d=16, kind="sorted", seed=2)
    pos[0, 32:] = -1  # whole second query block is padding
    pos[1, 0] = 0
    pos[1, -1] = 10_000
    pos[1] = pos[1].sort().values
    _check_kernel(q, k, v, pos, 0.25, config=None)


def test_kernel_skips_key_blocks_above_every_position():
    """Keys in blocks past the largest position of a query block are never read: NaNs there
    leave the output finite (the ATen body, which reads everything, would return NaN)."""
    q, k, v, _ = _inputs(b=1, hq=2, hkv=2, tq=16, s=64, d=16, seed=4)
    pos = torch.arange(16)[None] * 2  # max position 30: key blocks [32, 64) are skipped
    k[:, :, 32:] = float("nan")
    v[:, :, 32:] = float("nan")
    out = pa.position_attention_triton(q, k, v, pos, 0.25, config=SMALL)
    ref = position_attention_aten(q, k[:, :, :32], v[:, :, :32], pos, 0.25)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_kernel_empty_shapes():
    q, k, v, pos = _inputs(b=1, hq=2, hkv=1, tq=0, s=10, d=16)
    assert pa.position_attention_triton(q, k, v, pos, 0.25).shape == (1, 2, 0, 16)
    q, k, v, pos = _inputs(b=1, hq=2, hkv=1, tq=3, s=10, d=16)
    out = pa.position_attention_triton(q, k[:, :, :0], v[:, :, :0], pos, 0.25)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(position_attention_aten(q, k[:, :, :0], v[:, :, :0], pos, 0.25), out)


def test_module_registers_the_op():
    assert hasattr(torch.ops.flashloop, "position_attention")
    assert prefill_ops.__all__ == ["position_attention", "position_attention_aten", "prompt_attention"]
