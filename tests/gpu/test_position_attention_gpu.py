"""flashloop::position_attention on CUDA (Triton kernel) against the ATen body on the same CUDA
tensors, at token-sparse prefill sizes; plus torch.compile(fullgraph=True) and CUDA graphs.

Run on the GPU machine: ``pytest -m gpu tests/gpu/test_position_attention_gpu.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashloop_compile.lowering import prefill_ops
from flashloop_compile.lowering.prefill_ops import position_attention, position_attention_aten

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOL = {
    torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
    torch.float16: dict(rtol=5e-3, atol=5e-3),
    torch.float32: dict(rtol=1e-4, atol=1e-4),
}


def _sparse_inputs(b=1, hq=16, hkv=16, s=8192, tq=2048, d=128, dtype=torch.bfloat16, seed=0, order="sorted"):
    """Active queries at a sorted random subset of the S positions (per batch row), K/V the full
    cache of the loop."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, tq, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, hkv, s, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, hkv, s, d, device="cuda", generator=g).to(dtype)
    rows = []
    for _ in range(b):
        p = torch.randperm(s, device="cuda", generator=g)[:tq]
        if order == "sorted":
            p = p.sort().values
        rows.append(p)
    return q, k, v, torch.stack(rows).to(torch.int64)


def _bool_mask(q_pos, s):
    return torch.arange(s, device=q_pos.device)[None, None, None, :] <= q_pos[:, None, :, None]  # [B, 1, Tq, S]


def _check(out, q, k, v, q_pos, scale):
    ref = position_attention_aten(q, k, v, q_pos, scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype and out.is_contiguous()
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, **TOL[q.dtype])
    pad = (q_pos < 0)[:, None, :].expand(-1, q.shape[1], -1)
    assert (out[pad] == 0).all()


@pytest.mark.gpu
@needs_cuda
def test_sparse_prefill_matches_aten_bf16():
    """B=1, H=16, D=128, S=8192, 2048 active queries (sorted random subset), bf16."""
    q, k, v, q_pos = _sparse_inputs()
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = position_attention(q, k, v, q_pos)
    torch.cuda.synchronize()
    _check(out, q, k, v, q_pos, scale)
    # and the masked SDPA the graph used before
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=_bool_mask(q_pos, k.shape[2]), scale=scale)
    torch.testing.assert_close(out, sdpa, **TOL[torch.bfloat16])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "dtype, d, hq, hkv, b, order",
    [
        (torch.bfloat16, 128, 16, 4, 2, "sorted"),  # GQA, batch 2
        (torch.bfloat16, 64, 8, 8, 1, "unsorted"),
        (torch.float16, 32, 4, 2, 1, "sorted"),
        (torch.float16, 16, 4, 4, 2, "unsorted"),
        (torch.float32, 128, 4, 1, 1, "sorted"),
        (torch.float32, 64, 4, 2, 2, "unsorted"),
    ],
)
def test_variants_match_aten(dtype, d, hq, hkv, b, order):
    q, k, v, q_pos = _sparse_inputs(b=b, hq=hq, hkv=hkv, s=1500, tq=377, d=d, dtype=dtype, seed=d + hq, order=order)
    q_pos[:, 5] = q_pos[:, 4]  # a repeated position
    q_pos[-1, -7:] = -1  # padding
    q_pos[0, 0] = 0
    out = position_attention(q, k, v, q_pos, scale=0.1)
    _check(out, q, k, v, q_pos, 0.1)


@pytest.mark.gpu
@needs_cuda
def test_strided_inputs():
    """The model's [B, T, H, D] layouts, transposed views (no copies)."""
    b, hq, hkv, s, tq, d = 2, 8, 2, 1024, 200, 128
    g = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(b, tq, hq, d, device="cuda", generator=g).bfloat16().transpose(1, 2)
    k = torch.randn(b, s, hkv, d, device="cuda", generator=g).bfloat16().transpose(1, 2)
    v = torch.randn(b, s, hkv, d, device="cuda", generator=g).bfloat16().transpose(1, 2)
    q_pos = torch.stack([torch.randperm(s, device="cuda", generator=g)[:tq].sort().values for _ in range(b)])
    out = position_attention(q, k, v, q_pos)
    _check(out, q, k, v, q_pos, 1.0 / math.sqrt(d))


@pytest.mark.gpu
@needs_cuda
def test_all_positions_equal_causal_sdpa():
    q, k, v, _ = _sparse_inputs(s=4096, tq=4096)
    q_pos = torch.arange(4096, device="cuda")[None]
    out = position_attention(q, k, v, q_pos)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, ref, **TOL[torch.bfloat16])


@pytest.mark.gpu
@needs_cuda
def test_inside_torch_compile_fullgraph():
    q, k, v, q_pos = _sparse_inputs(s=8192, tq=2048)
    w = torch.randn(128, 128, device="cuda").bfloat16() * 0.05

    def f(q, k, v, q_pos):
        out = position_attention(q * 1.5, k, v, q_pos)
        return out @ w + 1.0

    compiled = torch.compile(f, backend="flashloop", fullgraph=True)  # the caches keyed on the launch tables
    got = compiled(q, k, v, q_pos)
    torch.cuda.synchronize()
    ref = (position_attention_aten(q * 1.5, k, v, q_pos, 1.0 / math.sqrt(128)) @ w) + 1.0
    torch.testing.assert_close(got, ref, rtol=3e-2, atol=3e-2)
    # new positions, same shapes: no recompilation needed for correctness
    q_pos2 = torch.randperm(8192, device="cuda")[:2048].sort().values[None]
    torch.testing.assert_close(compiled(q, k, v, q_pos2), f(q, k, v, q_pos2), rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_capture():
    """The launcher never syncs with the host: capture once, replay with new positions."""
    q, k, v, q_pos = _sparse_inputs(s=2048, tq=512)
    position_attention(q, k, v, q_pos)  # compile the kernel outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = position_attention(q, k, v, q_pos)
    q_pos.copy_(torch.randperm(2048, device="cuda")[:512].sort().values[None])
    graph.replay()
    torch.cuda.synchronize()
    _check(out, q, k, v, q_pos, 1.0 / math.sqrt(128))


@pytest.mark.gpu
@needs_cuda
def test_module_registers_cuda_body():
    assert prefill_ops.position_attention is position_attention
    q, k, v, q_pos = _sparse_inputs(s=256, tq=64, hq=2, hkv=2)
    q_pos[0, :10] = -1
    out = torch.ops.flashloop.position_attention(q, k, v, q_pos, 0.1)
    _check(out, q, k, v, q_pos, 0.1)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("hq, hkv", [(16, 16), (8, 2)])
def test_prompt_attention_matches_position_attention_from_zero(hq, hkv):
    # a fresh prompt's causal SDPA over its own K/V equals the kernel at positions 0..T-1 over a
    # cache whose first T positions hold them (the rest never visible)
    g = torch.Generator(device="cuda").manual_seed(0)
    b, t, s, d = 2, 3000, 4096, 128
    q = torch.randn(b, hq, t, d, device="cuda", generator=g).to(torch.bfloat16)
    cache_k = torch.randn(b, hkv, s, d, device="cuda", generator=g).to(torch.bfloat16)
    cache_v = torch.randn(b, hkv, s, d, device="cuda", generator=g).to(torch.bfloat16)
    scale = 1 / math.sqrt(d)
    pos = torch.arange(t, device="cuda").expand(b, -1).contiguous()
    got = prefill_ops.prompt_attention(q, cache_k[:, :, :t], cache_v[:, :, :t], scale)
    want = position_attention(q, cache_k, cache_v, pos, scale)
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])
    compiled = torch.compile(prefill_ops.prompt_attention, fullgraph=True)
    torch.testing.assert_close(compiled(q, cache_k[:, :, :t], cache_v[:, :, :t], scale), want, **TOL[torch.bfloat16])
