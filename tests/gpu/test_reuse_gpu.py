"""reuse_selected_probabilities' ops on CUDA (Triton kernels) against the ATen bodies on the same CUDA
tensors: loop 2's kept probabilities (reference_attention_probs, dense and packed), the V-only
corrections (reuse_correction_attention, packed_reuse_correction_attention), eager, compiled
(fullgraph) and under CUDA-graph replay.

Run on the GPU machine: ``TRITON_INTERPRET=0 pytest -m gpu tests/gpu/test_reuse_gpu.py``.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from flashloop_compile.config import ceil_fraction
from flashloop_compile.lowering import ops
from flashloop_compile.lowering import packed_ops as P
from flashloop_compile.lowering import packed_sparse_ops as PS

from .test_packed_gpu import DT, D, H, _reference_case
from .test_sparse_decode_gpu import _decode_inputs, _probs

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run with TRITON_INTERPRET=0 pytest -m gpu"),
]


def _at_keys(keys, values, s):
    """values [..., K] at keys [..., K] (-1 padded) scattered to [..., S]."""
    out = torch.zeros(*keys.shape[:-1], s + 1, device=keys.device)
    return out.scatter(-1, torch.where(keys >= 0, keys, s).long(), values.float())[..., :s]


@pytest.mark.parametrize("s", [8192, 32768])
@pytest.mark.parametrize("b", [1, 4])
def test_dense_ops_match_aten_on_cuda(b, s):
    q, k, v, mask = _decode_inputs(b, s)
    scale = 1.0 / math.sqrt(q.shape[-1])
    fractions = [0.1] if b == 1 else [0.25, 0.1]
    caps = [ceil_fraction(f, s) for f in fractions]
    got = torch.ops.flashloop.reference_attention_probs(q, k, v, mask, scale, fractions, caps)
    plain = torch.ops.flashloop.reference_attention(q, k, v, mask, scale, fractions, caps)
    for a, p in zip(got, plain):  # the same six outputs
        torch.testing.assert_close(a, p, rtol=0, atol=0)
    _, keys, count, mass, o_ref, c_ref, probs = got
    want = _probs(q, k, mask, scale)  # [B, Hq, T, S]
    for f in range(len(fractions)):
        sel = _at_keys(keys[f], torch.ones_like(probs[f]), s) > 0
        torch.testing.assert_close(_at_keys(keys[f], probs[f], s), want * sel, rtol=1e-3, atol=1e-6)
        torch.testing.assert_close(probs[f].sum(-1), mass[f], rtol=1e-4, atol=1e-6)
        g = torch.Generator(device="cuda").manual_seed(f)
        v2 = (v.float() + 0.3 * torch.randn(v.shape, device="cuda", generator=g)).to(v.dtype)
        state = (keys[f], count[f], probs[f], o_ref, c_ref[f])
        out = torch.ops.flashloop.reuse_correction_attention(v2, *state)
        expected = ops._reuse_correction_attention_aten(v2, *state)
        assert out.dtype == v2.dtype and out.shape == q.shape
        torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)


def _both_ops(q, k, v, mask, v2, scale, fractions, capacities):
    out, keys, count, mass, o_ref, c_ref, probs = torch.ops.flashloop.reference_attention_probs(
        q, k, v, mask, scale, fractions, capacities)
    corr = torch.ops.flashloop.reuse_correction_attention(v2, keys[0], count[0], probs[0], o_ref, c_ref[0])
    return out, mass, o_ref, c_ref, corr


def test_dense_ops_compiled_and_replayed_equal_eager():
    q, k, v, mask = _decode_inputs(4, 8192)
    args = (q, k, v, mask, v.flip(2), 0.088, [0.1], [ceil_fraction(0.1, 8192)])
    eager = _both_ops(*args)
    torch._dynamo.reset()
    compiled = torch.compile(_both_ops, backend="flashloop", fullgraph=True)(*args)
    for x, y in zip(compiled, eager):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    static = [x.clone() for x in (q, k, v, mask)]
    run = lambda: _both_ops(*static, static[2].flip(2), 0.088, [0.1], [ceil_fraction(0.1, 8192)])  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    q3, k3, v3, mask3 = _decode_inputs(4, 8192, seed=9)
    for dst, src in zip(static, (q3, k3, v3, mask3)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    for x, y in zip(captured, _both_ops(q3, k3, v3, mask3, v3.flip(2), 0.088, [0.1], [ceil_fraction(0.1, 8192)])):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("depth", [2, 3])
def test_packed_reuse_matches_aten_eager_and_compiled(depth):
    # 4 x 8K ragged with token-sparse residuals (test_packed_gpu's case): loop 2's packed reference
    # keeps the probabilities (the code-domain body), the V-only correction at depth 2/3 reads the
    # selected keys' V planes; against the ATen body and the CUDA two-op form
    torch._dynamo.reset()
    c, args = _reference_case(40 + depth)
    q, ip, fk, fv = args[:4]
    got = torch.ops.flashloop.packed_reference_attention_probs(*args)
    plain = torch.ops.flashloop.packed_reference_attention(*args)
    for a, p in zip(got, plain):
        torch.testing.assert_close(a, p, rtol=0, atol=0)
    keys, count, mass, o_ref, c_ref, probs = got[1][0], got[2][0], got[3][0], got[4], got[5][0], got[6][0]
    torch.testing.assert_close(probs.sum(-1), mass, rtol=1e-4, atol=1e-6)
    v_d = (fv.float() - 0.3).to(DT)  # this depth's in-flight token
    rargs = (keys, count, probs, o_ref, c_ref, ip, v_d, depth, *c.op_tensors(0))
    ref = PS.packed_reuse_correction_attention_aten(*rargs)
    _k, v_sel = torch.ops.flashloop.packed_read(*c.op_tensors(0), PS.selected_positions(keys, count, H), depth, ip, v_d, v_d)
    two_op = torch.ops.flashloop.reuse_correction_attention(v_sel, PS.local_keys(keys, H), count, probs, o_ref, c_ref)
    out = {"read values": torch.ops.flashloop.packed_reuse_correction_attention(*rargs)}
    torch._dynamo.reset()
    out["compiled"] = torch.compile(lambda *a: torch.ops.flashloop.packed_reuse_correction_attention(*a),
                                    backend="flashloop", fullgraph=True)(*rargs)
    for name, x in out.items():
        assert x.dtype == DT and x.shape == (q.shape[0], H, 1, D)
        for other in (ref, two_op):
            torch.testing.assert_close(x.float(), other.float(), atol=1e-2, rtol=1e-2, msg=lambda m: f"{name}: {m}")
