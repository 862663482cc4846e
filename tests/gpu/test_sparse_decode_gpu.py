"""Sparse decode ops on CUDA (Triton kernels) against the ATen bodies on the same CUDA tensors,
at realistic decode sizes; plus torch.compile(fullgraph=True) and CUDA graph capture.

Run on the GPU machine: ``TRITON_INTERPRET=0 pytest -m gpu tests/gpu`` (tests/conftest.py defaults
TRITON_INTERPRET to 1 for the CPU suite; the kernels must be compiled here).
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from flashloop_compile.config import ceil_fraction
from flashloop_compile.lowering import ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    # tests/conftest.py defaults TRITON_INTERPRET to 1 (CPU CI); compiled kernels need it off
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run with TRITON_INTERPRET=0 pytest -m gpu"),
]


def _decode_inputs(b, s, hq=16, hkv=16, t=1, d=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, t, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, hkv, s, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, hkv, s, d, device="cuda", generator=g).to(dtype)
    lengths = [s, s - s // 4 + 17, s // 2 + 5, 1000][:b]  # ragged cache lengths
    qpos = torch.stack([torch.arange(n - t, n, device="cuda") for n in lengths])
    mask = torch.arange(s, device="cuda")[None, None, None, :] <= qpos[:, None, :, None]  # [B, 1, T, S]
    return q, k, v, mask


def _probs(q, k, mask, scale):
    kf = k.float().repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)


def _selected(keys, s):
    """[..., Kmax] int32 padded with -1 -> [..., S] bool."""
    sel = torch.zeros(*keys.shape[:-1], s + 1, dtype=torch.bool, device=keys.device)
    sel.scatter_(-1, torch.where(keys >= 0, keys, s).long(), True)
    return sel[..., :s]


def assert_reference_matches(got, ref, q, k, v, mask, scale, capacities, rel_tie=1e-4):
    """Counts exact; the selected sets equal up to near-ties (keys whose ATen probability lies
    within ``rel_tie`` of the row's k-th probability: scores summed in another order may swap
    them); mass/C_ref equal to the ATen probabilities summed over the kernel's own set."""
    out, keys, count, mass, o_ref, c_ref = got
    for a, r in zip(got, ref):
        assert a.shape == r.shape and a.dtype == r.dtype
    assert torch.equal(count, ref[2])
    s = k.shape[2]
    probs = _probs(q, k, mask, scale)  # [B, Hq, T, S]
    visible = mask.expand_as(probs)
    sel, sel_ref = _selected(keys, s), _selected(ref[1], s)
    caps = torch.tensor(capacities, device=q.device).view(-1, 1, 1, 1)
    assert torch.equal(sel.sum(-1), torch.minimum(count, caps).to(sel.sum(-1).dtype)), "selection sizes"
    assert not (sel & ~visible).any(), "an invisible key was selected"
    kth = torch.where(sel_ref, probs, float("inf")).amin(-1, keepdim=True)  # ATen's k-th probability
    differ = sel ^ sel_ref
    near = (probs - kth).abs() <= rel_tie * kth
    assert not (differ & ~near).any(), f"{int((differ & ~near).sum())} keys differ beyond near-ties"
    assert differ.sum() <= max(8, sel_ref.sum() // 1000), f"too many near-tie swaps: {int(differ.sum())}"
    vf = v.float().repeat_interleave(q.shape[1] // v.shape[1], 1)
    tol = dict(rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(o_ref, ref[4], **tol)
    torch.testing.assert_close(out, ref[0], rtol=1e-2, atol=1e-2)
    p_sel = probs * sel
    torch.testing.assert_close(mass, p_sel.sum(-1), **tol)
    torch.testing.assert_close(c_ref, p_sel @ vf, **tol)
    torch.testing.assert_close(mass, ref[3], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("s", [8192, 32768])
@pytest.mark.parametrize("b", [1, 4])
def test_ops_match_aten_on_cuda(b, s):
    q, k, v, mask = _decode_inputs(b, s)
    scale = 1.0 / math.sqrt(q.shape[-1])
    fractions = [0.1] if b == 1 else [0.25, 0.1]
    capacities = [ceil_fraction(f, s) for f in fractions]
    got = torch.ops.flashloop.reference_attention(q, k, v, mask, scale, fractions, capacities)
    ref = ops._reference_attention_aten(q, k, v, mask, scale, fractions, capacities)
    assert_reference_matches(got, ref, q, k, v, mask, scale, capacities)
    _, keys, count, mass, o_ref, c_ref = got
    g = torch.Generator(device="cuda").manual_seed(1)
    k2 = (k.float() + 0.3 * torch.randn(k.shape, device="cuda", generator=g)).to(k.dtype)
    v2 = (v.float() + 0.3 * torch.randn(v.shape, device="cuda", generator=g)).to(v.dtype)
    for f in range(len(fractions)):
        state = (keys[f], count[f], mass[f], o_ref, c_ref[f])
        out = torch.ops.flashloop.correction_attention(q, k2, v2, *state, scale)
        expected = ops._correction_attention_aten(q, k2, v2, *state, scale)
        assert out.dtype == q.dtype and out.shape == q.shape
        torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
        # FP32 view of the same comparison, before the bf16 rounding of the output
        torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gqa_several_rows_and_fp32(dtype):
    q, k, v, mask = _decode_inputs(2, 4096, hq=16, hkv=4, t=4, d=64, dtype=dtype, seed=3)
    scale = 0.125
    fractions, capacities = [0.1, 0.5], [ceil_fraction(0.1, 4096), ceil_fraction(0.5, 4096)]
    got = torch.ops.flashloop.reference_attention(q, k, v, mask, scale, fractions, capacities)
    ref = ops._reference_attention_aten(q, k, v, mask, scale, fractions, capacities)
    assert_reference_matches(got, ref, q, k, v, mask, scale, capacities)
    _, keys, count, mass, o_ref, c_ref = got
    out = torch.ops.flashloop.correction_attention(q, k, v, keys[0], count[0], mass[0], o_ref, c_ref[0], scale)
    expected = ops._correction_attention_aten(q, k, v, keys[0], count[0], mass[0], o_ref, c_ref[0], scale)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, expected, **tol)


def test_exact_ties_on_cuda():
    """Dyadic inputs: exact scores in both implementations, so the sets must match exactly."""
    g = torch.Generator(device="cuda").manual_seed(5)
    b, h, s, d = 2, 4, 2048, 64
    q = (torch.randint(-2, 3, (b, h, 1, d), device="cuda", generator=g).float() * 0.5).bfloat16()
    base = torch.randint(-2, 3, (4, d), device="cuda", generator=g).float()
    k = base[torch.randint(0, 4, (b, h, s), device="cuda", generator=g)].bfloat16()
    v = torch.randn(b, h, s, d, device="cuda", generator=g).bfloat16()
    mask = (torch.arange(s, device="cuda") < torch.tensor([s, 1500], device="cuda")[:, None]).view(b, 1, 1, s)
    fractions, capacities = [0.1, 0.3], [ceil_fraction(0.1, s), ceil_fraction(0.3, s)]
    got = torch.ops.flashloop.reference_attention(q, k, v, mask, 0.25, fractions, capacities)
    ref = ops._reference_attention_aten(q, k, v, mask, 0.25, fractions, capacities)
    assert torch.equal(_selected(got[1], s), _selected(ref[1], s))
    torch.testing.assert_close(got[3], ref[3], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got[5], ref[5], rtol=1e-4, atol=1e-5)


def _both_ops(q, k, v, mask, k2, v2, scale, fractions, capacities):
    out, keys, count, mass, o_ref, c_ref = torch.ops.flashloop.reference_attention(q, k, v, mask, scale, fractions, capacities)
    corr = torch.ops.flashloop.correction_attention(q, k2, v2, keys[0], count[0], mass[0], o_ref, c_ref[0], scale)
    return out, keys, count, mass, o_ref, c_ref, corr


def _assert_same_results(a, b, s):
    """Same kernels on the same inputs: deterministic (no atomics), so equal up to rounding."""
    out, keys, count, mass, o_ref, c_ref, corr = a
    assert torch.equal(count, b[2])
    assert torch.equal(_selected(keys, s), _selected(b[1], s))
    for x, y in zip((out, mass, o_ref, c_ref, corr), (b[0], b[3], b[4], b[5], b[6])):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_torch_compile_fullgraph():
    q, k, v, mask = _decode_inputs(2, 8192)
    k2, v2 = k.flip(2), v.flip(2)
    args = (q, k, v, mask, k2, v2, 0.088, [0.1], [ceil_fraction(0.1, 8192)])
    eager = _both_ops(*args)
    torch._dynamo.reset()
    compiled = torch.compile(_both_ops, backend="flashloop", fullgraph=True)(*args)  # the caches keyed on the launch tables
    _assert_same_results(compiled, eager, 8192)


def test_cuda_graph_capture_and_replay():
    q, k, v, mask = _decode_inputs(4, 8192)
    k2, v2 = k.flip(2), v.flip(2)
    fractions, capacities = [0.1], [ceil_fraction(0.1, 8192)]
    static = [x.clone() for x in (q, k, v, mask, k2, v2)]
    run = lambda: _both_ops(*static, 0.088, fractions, capacities)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile the kernels and warm the allocator outside the capture
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    # new inputs (another request, other lengths) copied into the static buffers, then replay
    q3, k3, v3, mask3 = _decode_inputs(4, 8192, seed=9)
    mask3 = mask3 & (torch.arange(8192, device="cuda") < 6000)
    for dst, src in zip(static, (q3, k3, v3, mask3, k3.flip(2), v3.flip(2))):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    eager = _both_ops(q3, k3, v3, mask3, k3.flip(2), v3.flip(2), 0.088, fractions, capacities)
    _assert_same_results(captured, eager, 8192)
