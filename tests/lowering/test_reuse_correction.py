"""reuse_selected_probabilities' ops: flashloop.reference_attention_probs (loop 2 keeps the selected
keys' probabilities) and flashloop.reuse_correction_attention (loops 3..R: V only), the ATen bodies
against the explicit reference, the Triton kernels (the selection's compaction with KEEP_P,
correction._reuse_correction_kernel) under the interpreter against the ATen bodies.

Tolerances: FP32 throughout, 1e-5; the kernels sum P_ref[S] * V where the reference renormalizes
(m * ((P_ref[S] / m) @ V)), equal up to FP32 rounding."""

from __future__ import annotations

import os

import pytest
import torch

from flashloop_compile.lowering import ops
from flashloop_compile.reference import attention as ref

TOL = dict(rtol=1e-5, atol=1e-5)


def _inputs(b=2, hq=4, hkv=2, t=1, s=40, d=16, lengths=(23, 40), seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=g)
    k = torch.randn(b, hkv, s, d, generator=g)
    v = torch.randn(b, hkv, s, d, generator=g)
    qpos = torch.stack([torch.arange(n - t, n) for n in lengths])  # [B, T], ragged
    mask = torch.arange(s)[None, None, None, :] <= qpos[:, None, :, None]  # [B, 1, T, S]
    v_later = v + 0.3 * torch.randn(v.shape, generator=g)
    return q, k, v, mask, qpos, v_later


def _dense_probs(keys, probs, s):
    """Selected probabilities scattered to [.., S] (0 elsewhere): independent of the keys' order."""
    out = torch.zeros(*keys.shape[:-1], s + 1)
    return out.scatter(-1, torch.where(keys >= 0, keys, s).long(), probs)[..., :s]


def test_opcheck():
    q, k, v, mask, _, v2 = _inputs()
    args = (q, k, v, mask, 0.25, [0.1, 0.5], [4, 20])
    torch.library.opcheck(torch.ops.flashloop.reference_attention_probs.default, args)
    _, keys, count, mass, o_ref, c_ref, probs = torch.ops.flashloop.reference_attention_probs(*args)
    torch.library.opcheck(torch.ops.flashloop.reuse_correction_attention.default, (v2, keys[1], count[1], probs[1], o_ref, c_ref[1]))


def test_spec_scalar_example_through_the_ops():
    probs = torch.tensor([0.1, 0.3, 0.6])
    q = torch.ones(1, 1, 1, 1)
    k = torch.log(probs).view(1, 1, 3, 1)
    v = torch.tensor([10.0, 20.0, 30.0]).view(1, 1, 3, 1)
    mask = torch.ones(1, 1, 1, 3, dtype=torch.bool)
    out, keys, count, mass, o_ref, c_ref, p_sel = ops.reference_attention_probs(q, k, v, mask, scale=1.0, fractions=[2 / 3])
    torch.testing.assert_close(p_sel.sum(), torch.tensor(0.9))
    # later loop's values [99, 20, 40]: 25 - 24 + 0.3 * 20 + 0.6 * 40 = 31 (key 0 is not selected)
    v2 = torch.tensor([99.0, 20.0, 40.0]).view(1, 1, 3, 1)
    o = ops.reuse_correction_attention(v2, keys[0], count[0], p_sel[0], o_ref, c_ref[0])
    torch.testing.assert_close(o.flatten(), torch.tensor([31.0]))


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (6, 1)])
def test_ops_match_reference_ragged_gqa_several_rows(t, hq, hkv):
    fractions = [0.1, 0.4]
    q, k, v, mask, qpos, v_later = _inputs(hq=hq, hkv=hkv, t=t, lengths=(9, 40))
    plain = ops.reference_attention(q, k, v, mask, fractions=fractions)
    out, keys, count, mass, o_ref, c_ref, probs = ops.reference_attention_probs(q, k, v, mask, fractions=fractions)
    for a, b_ in zip(plain, (out, keys, count, mass, o_ref, c_ref)):  # the same six outputs
        assert torch.equal(a, b_)
    torch.testing.assert_close(probs.sum(-1), mass, **TOL)
    for b in range(q.shape[0]):
        n = int(qpos[b].max()) + 1
        kb, vb = k[b, :, :n].transpose(0, 1), v[b, :, :n].transpose(0, 1)
        _, states = ref.reference_attention(q[b].transpose(0, 1), qpos[b], kb, vb, torch.arange(n), fractions)
        for f, st in enumerate(states):
            kmax = st.keys.shape[-1]
            torch.testing.assert_close(_dense_probs(keys[f, b, :, :, :kmax].transpose(0, 1), probs[f, b, :, :, :kmax].transpose(0, 1), n),
                                       _dense_probs(st.keys, st.probs, n), **TOL)
            expected = ref.reuse_correction_attention(v_later[b, :, :n].transpose(0, 1), st)
            got = ops.reuse_correction_attention(v_later, keys[f], count[f], probs[f], o_ref, c_ref[f])
            torch.testing.assert_close(got[b].transpose(0, 1), expected, **TOL)


def test_fraction_one_is_loop_2_attention_over_the_later_values():
    q, k, v, mask, qpos, v2 = _inputs(t=2)
    _, keys, count, mass, o_ref, c_ref, probs = ops.reference_attention_probs(q, k, v, mask, fractions=[1.0])
    o = ops.reuse_correction_attention(v2, keys[0], count[0], probs[0], o_ref, c_ref[0])
    loop2 = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v2.repeat_interleave(2, 1), attn_mask=mask)
    torch.testing.assert_close(o, loop2, **TOL)


def test_contract_errors():
    q, k, v, mask, _, v2 = _inputs()
    _, keys, count, mass, o_ref, c_ref, probs = ops.reference_attention_probs(q, k, v, mask, fractions=[0.2])
    meta = lambda *xs: [x.to("meta") for x in xs]  # noqa: E731
    with pytest.raises(Exception, match="probs are fp32, shaped as keys"):
        torch.ops.flashloop.reuse_correction_attention(*meta(v2, keys[0], count[0], probs[0, ..., :1], o_ref, c_ref[0]))
    with pytest.raises(Exception, match="multiple of kv heads"):
        torch.ops.flashloop.reuse_correction_attention(*meta(v2[:, :1].repeat(1, 3, 1, 1), keys[0], count[0], probs[0], o_ref, c_ref[0]))


# -- the Triton kernels under the interpreter -------------------------------------------------------

triton = pytest.importorskip("triton")
import triton.runtime.interpreter as triton_interpreter  # noqa: E402

from flashloop_compile.lowering.kernels import correction as CO, reference_attention as RA, sparse_config as SC  # noqa: E402

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" or not isinstance(CO._reuse_correction_kernel, triton_interpreter.InterpretedFunction),
    reason="needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)",
)
SPLIT_CONFIG = SC.KernelConfig(
    block_n=16, block_n_pv=16, block_sel=16, block_compact=16, block_k=16, min_sel_chunk=16, split_kv=3, split_sel=3, split_corr=3
)


@interpreted
@pytest.mark.parametrize("config", [None, SPLIT_CONFIG], ids=["one_split", "splits"])
@pytest.mark.parametrize("t, hq, hkv", [(1, 4, 4), (1, 4, 2), (2, 6, 1)])
def test_kernels_match_aten(config, t, hq, hkv):
    fractions = [0.15, 0.5]
    q, k, v, mask, qpos, v_later = _inputs(hq=hq, hkv=hkv, t=t, s=70, lengths=(50, 70), seed=3)
    caps = [ops.ceil_fraction(f, k.shape[2]) for f in fractions]
    got = RA.reference_attention_triton(q, k, v, mask, 0.25, fractions, caps, config=config, keep_probs=True)
    want = ops._reference_attention_aten(q, k, v, mask, 0.25, fractions, caps, keep_probs=True)
    assert len(got) == 7 and got[6].shape == want[6].shape and got[6].dtype == torch.float32
    keys, count, probs = got[1], got[2], got[6]
    assert torch.equal(count, want[2])
    # the same probabilities at the same keys (the compaction writes them in ascending key order)
    torch.testing.assert_close(_dense_probs(keys, probs, 70), _dense_probs(want[1], want[6], 70), **TOL)
    assert (probs[keys < 0] == 0).all()
    o_ref, c_ref = got[4], got[5]
    for f in range(len(fractions)):
        out = CO.reuse_correction_triton(v_later, keys[f], count[f], probs[f], o_ref, c_ref[f], config=config)
        expected = ops._reuse_correction_attention_aten(v_later, keys[f], count[f], probs[f], o_ref, c_ref[f])
        assert out.dtype == v_later.dtype and out.shape == q.shape
        torch.testing.assert_close(out, expected, **TOL)
        # and the explicit reference, row by row
        for b in range(q.shape[0]):
            n = int(qpos[b].max()) + 1
            _, states = ref.reference_attention(q[b].transpose(0, 1), qpos[b], k[b, :, :n].transpose(0, 1),
                                                v[b, :, :n].transpose(0, 1), torch.arange(n), fractions)
            torch.testing.assert_close(out[b].transpose(0, 1),
                                       ref.reuse_correction_attention(v_later[b, :, :n].transpose(0, 1), states[f]), **TOL)


@interpreted
def test_reuse_kernel_in_bf16():
    q, k, v, mask, qpos, v_later = _inputs(seed=4)
    _, keys, count, mass, o_ref, c_ref, probs = ops.reference_attention_probs(q, k, v, mask, fractions=[0.3])
    vb = v_later.to(torch.bfloat16)
    out = CO.reuse_correction_triton(vb, keys[0], count[0], probs[0], o_ref, c_ref[0], config=SPLIT_CONFIG)
    expected = ops._reuse_correction_attention_aten(vb, keys[0], count[0], probs[0], o_ref, c_ref[0])
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected.float(), rtol=1e-2, atol=1e-2)
