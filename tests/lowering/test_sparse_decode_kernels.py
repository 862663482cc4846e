"""Triton kernels of the sparse decode ops (kernels/reference_attention.py, selection.py, correction.py) against the ATen bodies,
run on CPU tensors through the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1
before triton is imported)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")
import triton.runtime.interpreter as triton_interpreter  # noqa: E402

from flashloop_compile.lowering import ops  # noqa: E402
from flashloop_compile.lowering.kernels import correction as CO, reference_attention as RA, selection as SEL, sparse_config as SC  # noqa: E402


if os.environ.get("TRITON_INTERPRET") != "1" or not isinstance(RA._scores_kernel, triton_interpreter.InterpretedFunction):
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)", allow_module_level=True)


# several programs per row / per split everywhere, with tiles small enough for tiny shapes
SPLIT_CONFIG = SC.KernelConfig(
    block_n=16, block_n_pv=16, block_sel=16, block_compact=16, block_k=16, min_sel_chunk=16, split_kv=3, split_sel=3, split_corr=3
)


def _inputs(b=2, hq=4, hkv=2, t=1, s=70, d=16, lengths=(50, 70), dtype=torch.float32, seed=0, ties=False):
    g = torch.Generator().manual_seed(seed)
    if ties:  # dyadic values: exact scores, so many keys tie exactly in both implementations
        q = torch.randint(-2, 3, (b, hq, t, d), generator=g).float() * 0.5
        base = torch.randint(-2, 3, (3, d), generator=g).float()
        k = base[torch.randint(0, 3, (b, hkv, s), generator=g)]
    else:
        q = torch.randn(b, hq, t, d, generator=g)
        k = torch.randn(b, hkv, s, d, generator=g)
    v = torch.randn(b, hkv, s, d, generator=g)
    qpos = torch.stack([torch.arange(n - t, n) for n in lengths])  # [B, T], ragged
    mask = torch.arange(s)[None, None, None, :] <= qpos[:, None, :, None]  # [B, 1, T, S]
    later = (k + 0.3 * torch.randn(k.shape, generator=g), v + 0.3 * torch.randn(v.shape, generator=g))
    cast = lambda x: x.to(dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), mask, tuple(map(cast, later))


def _capacities(fractions, s):
    from flashloop_compile.config import ceil_fraction

    return [ceil_fraction(f, s) for f in fractions]


def _assert_same_keys(keys, ref_keys, count):
    assert keys.shape == ref_keys.shape and keys.dtype == torch.int32
    flat, ref_flat = keys.reshape(-1, keys.shape[-1]), ref_keys.reshape(-1, keys.shape[-1])
    for i, (row, ref_row) in enumerate(zip(flat.tolist(), ref_flat.tolist())):
        valid = [j for j in row if j >= 0]
        assert len(valid) == len(set(valid)), f"row {i}: duplicate keys {row}"
        assert set(row) == set(ref_row), f"row {i}: {sorted(valid)} != {sorted(j for j in ref_row if j >= 0)}"
        assert row[len(valid):] == [-1] * (len(row) - len(valid)), f"row {i}: padding not at the end"
    assert torch.equal((keys >= 0).sum(-1), count.clamp_max(keys.shape[-1]))


def _check_reference(q, k, v, mask, scale, fractions, capacities, config=None):
    got = RA.reference_attention_triton(q, k, v, mask, scale, fractions, capacities, config=config)
    ref = ops._reference_attention_aten(q, k, v, mask, scale, fractions, capacities)
    out, keys, count, mass, o_ref, c_ref = got
    for name, a, r in zip(("out", "keys", "count", "mass", "o_ref", "c_ref"), got, ref):
        assert a.shape == r.shape and a.dtype == r.dtype and a.device == r.device, name
    assert torch.equal(count, ref[2])
    _assert_same_keys(keys, ref[1], count)
    tol = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mass, ref[3], **tol)
    torch.testing.assert_close(o_ref, ref[4], **tol)
    torch.testing.assert_close(c_ref, ref[5], **tol)
    out_tol = tol if q.dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out, ref[0], **out_tol)
    return got, ref


def _check_correction(q, k, v, state, ref_state, scale, config=None):
    keys, count, mass, o_ref, c_ref = state
    got = CO.correction_attention_triton(q, k, v, keys, count, mass, o_ref, c_ref, scale, config=config)
    same_state = ops._correction_attention_aten(q, k, v, keys, count, mass, o_ref, c_ref, scale)
    aten_state = ops._correction_attention_aten(q, k, v, *ref_state, scale)
    assert got.shape == q.shape and got.dtype == q.dtype
    tol = dict(rtol=1e-5, atol=1e-5) if q.dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, same_state, **tol)
    torch.testing.assert_close(got, aten_state, **tol)


def _run(q, k, v, mask, later, fractions, scale=0.25, config=None):
    capacities = _capacities(fractions, k.shape[2])
    got, ref = _check_reference(q, k, v, mask, scale, fractions, capacities, config)
    _, keys, count, mass, o_ref, c_ref = got
    _, r_keys, r_count, r_mass, r_oref, r_cref = ref
    for f in range(len(fractions)):
        _check_correction(
            q, *later, (keys[f], count[f], mass[f], o_ref, c_ref[f]), (r_keys[f], r_count[f], r_mass[f], r_oref, r_cref[f]), scale, config
        )
    return got


def test_interpreter_is_really_used():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert isinstance(RA._scores_kernel, triton_interpreter.InterpretedFunction)


@pytest.mark.parametrize(
    "hq, hkv, t, s, d, lengths, fractions, dtype, config",
    [
        (4, 2, 3, 70, 16, (50, 70), [0.1, 0.4], torch.float32, None),
        (4, 4, 1, 200, 64, (133, 200), [0.25], torch.float32, SPLIT_CONFIG),
        (4, 2, 2, 40, 64, (23, 40), [0.3, 1.0], torch.bfloat16, SPLIT_CONFIG),
        (4, 1, 2, 57, 16, (57, 31), [0.5], torch.bfloat16, None),
    ],
    ids=["gqa-T3-fp32", "mha-T1-D64-splits", "gqa-T2-bf16-splits", "g4-bf16"],
)
def test_kernels_match_aten(hq, hkv, t, s, d, lengths, fractions, dtype, config):
    q, k, v, mask, later = _inputs(hq=hq, hkv=hkv, t=t, s=s, d=d, lengths=lengths, dtype=dtype)
    _run(q, k, v, mask, later, fractions, config=config)


@pytest.mark.parametrize("config", [None, SPLIT_CONFIG], ids=["one-chunk", "splits"])
def test_exact_ties_go_to_the_lower_index(config):
    q, k, v, mask, later = _inputs(hq=4, hkv=2, t=2, s=72, lengths=(72, 49), ties=True, seed=3)
    scale = 0.25
    _, keys, count, *_ = _run(q, k, v, mask, later, [0.1, 0.45], scale=scale, config=config)
    # the construction really produces ties at the selection boundary
    probs = torch.softmax(((q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf")), -1)
    boundary_ties = 0
    for idx in np.ndindex(*count.shape):
        f, rest = idx[0], idx[1:]
        sel = keys[idx][: count[idx]].long()
        p_min = probs[rest][sel].min()
        visible = mask.expand_as(probs)[rest]
        boundary_ties += int(((probs[rest] == p_min) & visible).sum() > (probs[rest][sel] == p_min).sum())
    assert boundary_ties > 0


def test_zero_probability_ties_and_invisible_keys():
    # scores differ by >= 100 / 0.5: every non-maximal probability underflows to exactly 0, so the
    # budget is filled with zero-probability keys by index, and never with invisible ones.
    q, k, v, mask, later = _inputs(hq=2, hkv=2, t=2, s=48, lengths=(48, 20), ties=True, seed=1)
    _, keys, count, mass, *_ = _run(q, k, v, mask, later, [0.5, 1.0], scale=200.0, config=SPLIT_CONFIG)
    for idx in np.ndindex(*count.shape):
        limit = (20 if idx[1] == 1 else 48) - 2 + idx[3]  # last visible position of that query row
        assert keys[idx].max() <= limit and count[idx] == (limit + 1 if idx[0] == 1 else -(-(limit + 1) // 2))


def test_strided_per_head_mask_and_empty_rows():
    q, k, v, _, later = _inputs(b=2, hq=4, hkv=2, t=2, s=50, lengths=(50, 50), seed=7)
    g = torch.Generator().manual_seed(11)
    mask = (torch.rand(50, 2, 4, 2, generator=g) > 0.3).permute(3, 2, 1, 0)  # [B, Hq, T, S], not contiguous
    mask[1, 2, 0] = False  # a query row that sees no key at all
    mask[0, 1, 1] = False
    assert not mask.is_contiguous()
    got = _run(q, k, v, mask, later, [0.2, 1.0], config=SPLIT_CONFIG)
    assert got[2][:, 1, 2, 0].eq(0).all() and got[1][:, 1, 2, 0].eq(-1).all()
    # broadcast over batch and rows as well: [1, Hq, 1, S]
    _run(q, k, v, mask[:1, :, :1], later, [0.3])


def test_spec_scalar_example():
    probs = torch.tensor([0.1, 0.3, 0.6])
    q = torch.ones(1, 1, 1, 16)
    k = torch.zeros(1, 1, 3, 16)
    k[..., 0] = torch.log(probs)
    v = torch.tensor([10.0, 20.0, 30.0]).view(1, 1, 3, 1).expand(1, 1, 3, 16).contiguous()
    mask = torch.ones(1, 1, 1, 3, dtype=torch.bool)
    out, keys, count, mass, o_ref, c_ref = RA.reference_attention_triton(q, k, v, mask, 1.0, [2 / 3], [2])
    assert count.item() == 2 and sorted(keys.flatten().tolist()) == [1, 2]
    torch.testing.assert_close(mass.flatten(), torch.tensor([0.9]))
    torch.testing.assert_close(o_ref[..., 0].flatten(), torch.tensor([25.0]))
    torch.testing.assert_close(c_ref[..., 0].flatten(), torch.tensor([24.0]))
    k2 = torch.zeros(1, 1, 3, 16)
    k2[..., 0] = torch.tensor([0.0, np.log(0.75), np.log(0.25)])
    v2 = torch.tensor([99.0, 20.0, 40.0]).view(1, 1, 3, 1).expand(1, 1, 3, 16).contiguous()
    o = CO.correction_attention_triton(q, k2, v2, keys[0], count[0], mass[0], o_ref, c_ref[0], 1.0)
    torch.testing.assert_close(o[..., 0].flatten(), torch.tensor([23.5]))


def test_launchers_trace_without_host_syncs(monkeypatch):
    """With wrap=True the launchers trace on fake tensors into triton_kernel_wrapper nodes: no
    .item(), no data-dependent Python, as triton_op and CUDA graphs need."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from triton.runtime.jit import JITFunction

    # wrap_triton passes interpreted kernels through untouched: trace JIT flavours of them
    # (nothing is compiled or run here), the packed-KV helpers the packed reference calls included
    from flashloop_compile.lowering.kernels import packed_code_domain, packed_codec

    for module in (RA, SEL, CO, packed_codec, packed_code_domain):
        for name in dir(module):
            kernel = getattr(module, name)
            if isinstance(kernel, triton_interpreter.InterpretedFunction):
                monkeypatch.setattr(module, name, JITFunction(kernel.fn))
    monkeypatch.setattr(SC, "check_runnable", lambda kernel, device: None)
    q, k, v, mask, _ = _inputs(t=2)
    fractions, capacities = [0.1, 0.5], _capacities([0.1, 0.5], k.shape[2])

    def both(q, k, v, mask):
        _, keys, count, mass, o_ref, c_ref = RA.reference_attention_triton(q, k, v, mask, 0.25, fractions, capacities, wrap=True)
        return CO.correction_attention_triton(q, k, v, keys[1], count[1], mass[1], o_ref, c_ref[1], 0.25, wrap=True, config=SPLIT_CONFIG)

    gm = make_fx(both, tracing_mode="fake")(q, k, v, mask)
    launched = [n for n in gm.graph.nodes if "triton_kernel_wrapper" in str(n.target)]
    # scores, one selection kernel per radix digit + compaction, PV, combine; correction, combine
    assert len(launched) == 1 + len(SEL.radix_digits()) + 1 + 2 + 2
    assert not any("item" in str(n.target) or "nonzero" in str(n.target) for n in gm.graph.nodes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split", [1, 3], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("stages", [1, 2], ids=["plain", "pipelined"])
def test_correction_variants_match_the_aten_body(dtype, split, stages):
    # num_stages_corr: the correction's key tiles software-pipelined (the interpreter runs the loop as written). Loop 2's state from the
    # ATen reference; one row with no selected keys (count 0: its output is O_ref - C_ref) and a
    # split beyond a short row's count (a split with no keys: its partial must weigh nothing)
    q, k, v, mask, later = _inputs(hq=4, hkv=2, t=2, s=90, d=32, lengths=(90, 40), dtype=dtype, seed=5)
    fractions = [0.3]
    _, keys, count, mass, o_ref, c_ref = ops._reference_attention_aten(q, k, v, mask, 0.25, fractions,
                                                                       _capacities(fractions, k.shape[2]))
    count = count.clone()
    count[0, 0, 1, 0] = 0  # fraction 0, row (b 0, head 1, query 0)
    config = SC.KernelConfig(block_k=8, split_corr=split, num_stages_corr=stages)
    state = (keys[0], count[0], mass[0], o_ref, c_ref[0])
    got = CO.correction_attention_triton(q, *later, *state, 0.25, config=config)
    want = ops._correction_attention_aten(q, *later, *state, 0.25)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(got[0, 1, 0], (o_ref - c_ref[0])[0, 1, 0].to(dtype), **tol)


@pytest.mark.parametrize("split", [1, 3, 5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_radix_select_is_the_stable_top_k(split, seed, monkeypatch):
    """radix_select alone on rows with many exact ties, invisible keys, k = 0 and k = every visible
    key, two fractions: the selected positions are the k largest probabilities, ties to the lower
    position, ascending and -1 padded; K* and the last tie taken reproduce the set; the kept
    probabilities sit at their keys' slots, 0 past them. Its buffers start as garbage (the
    compaction writes every slot, padding included: no fill launch)."""
    empty = torch.empty

    def poisoned(*shape, **kw):
        x = empty(*shape, **kw)
        return x.fill_(float("nan") if x.is_floating_point() else 12345)

    monkeypatch.setattr(SEL.torch, "empty", poisoned)
    g = torch.Generator().manual_seed(seed)
    rows, s, kmax = 4, 150, 150
    scores = torch.randint(-3, 2, (rows, s), generator=g).float() * 0.5  # few distinct values: ties
    scores[1, 100:] = float("-inf")  # invisible keys
    scores[3] = float("-inf")
    scores[3, :7] = 0.0
    m = scores.max(-1).values
    part_m = m[:, None].contiguous()
    part_l = torch.exp(scores - m[:, None]).sum(-1, keepdim=True)
    visible = (scores > float("-inf")).sum(-1).to(torch.int32)
    kk = torch.stack([torch.tensor([17, 40, 0, 7], dtype=torch.int32), visible.clone()])  # [F, rows]
    kk[1, 2] = 1
    probs = scores.clone()
    cfg = SC.KernelConfig(block_sel=16, block_compact=16, min_sel_chunk=16, split_sel=split)
    keys, thr, cut, psel = SEL.radix_select(probs, part_m, part_l, kk, SEL.radix_digits(), s, rows, 2, kmax, 1, 1, rows, 1,
                                            1, cfg, SC.Launcher(False), probs.device, keep_probs=True)
    keys, psel = keys.view(2, rows, kmax), psel.view(2, rows, kmax)
    bits = torch.where(probs >= 0, probs.view(torch.int32).clamp_max((1 << 30) - 2) + 1, 0)
    for f in range(2):
        for r in range(rows):
            k = int(kk[f, r])
            order = sorted(range(s), key=lambda n: (-int(bits[r, n]), n))  # largest key first, lower position first
            want = sorted(order[:k])
            got = keys[f, r].tolist()
            assert got[:k] == want and all(x == -1 for x in got[k:]), (f, r)
            assert torch.equal(psel[f, r, :k], probs[r, want]) and not psel[f, r, k:].any()
            if k:
                kstar = int(bits[r, order[k - 1]])
                assert int(thr[f, r]) == kstar
                sel = (bits[r] > kstar) | ((bits[r] == kstar) & (torch.arange(s) <= int(cut[f, r])))
                assert sorted(torch.nonzero(sel).flatten().tolist()) == want
