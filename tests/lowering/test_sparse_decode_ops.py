"""flashloop.reference_attention / correction_attention against the explicit reference."""

from __future__ import annotations

import math

import pytest
import torch

from flashloop_compile.lowering import ops
from flashloop_compile.reference import attention as ref


def _decode_inputs(b=2, hq=4, hkv=2, t=1, s=24, d=16, lengths=(17, 24), seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, t, d, generator=g)
    k = torch.randn(b, hkv, s, d, generator=g)
    v = torch.randn(b, hkv, s, d, generator=g)
    # query row j of batch b sits at position lengths[b] - t + j: causal over the cache prefix
    qpos = torch.stack([torch.arange(n - t, n) for n in lengths])  # [B, T]
    mask = (torch.arange(s)[None, None, None, :] <= qpos[:, None, :, None])  # [B, 1, T, S]
    return q, k, v, mask, qpos


def _reference_per_row(q, k, v, qpos, fractions, k_later=None, v_later=None):
    """Explicit reference for each batch row: (O_ref, states) and the corrected outputs."""
    outs, corrected = [], []
    for b in range(q.shape[0]):
        n = int(qpos[b].max()) + 1
        kb, vb = k[b, :, :n].transpose(0, 1), v[b, :, :n].transpose(0, 1)
        o, states = ref.reference_attention(q[b].transpose(0, 1), qpos[b], kb, vb, torch.arange(n), fractions)
        outs.append(o)
        if k_later is not None:
            kl, vl = k_later[b, :, :n].transpose(0, 1), v_later[b, :, :n].transpose(0, 1)
            corrected.append([ref.correction_attention(q[b].transpose(0, 1), kl, vl, st) for st in states])
    return outs, corrected


def test_opcheck_both_ops():
    q, k, v, mask, _ = _decode_inputs()
    args = (q, k, v, mask, 0.25, [0.1, 0.5], [3, 12])
    torch.library.opcheck(torch.ops.flashloop.reference_attention.default, args)
    _, keys, count, mass, o_ref, c_ref = torch.ops.flashloop.reference_attention(*args)
    torch.library.opcheck(
        torch.ops.flashloop.correction_attention.default, (q, k, v, keys[1], count[1], mass[1], o_ref, c_ref[1], 0.25)
    )


def test_spec_scalar_example_through_the_ops():
    # probabilities [0.1, 0.3, 0.6] at the reference loop: scores log(p) with q = 1, d = 1
    probs = torch.tensor([0.1, 0.3, 0.6])
    q = torch.ones(1, 1, 1, 1)
    k = torch.log(probs).view(1, 1, 3, 1)
    v = torch.tensor([10.0, 20.0, 30.0]).view(1, 1, 3, 1)
    mask = torch.ones(1, 1, 1, 3, dtype=torch.bool)
    out, keys, count, mass, o_ref, c_ref = ops.reference_attention(q, k, v, mask, scale=1.0, fractions=[2 / 3])
    assert count.item() == 2 and sorted(keys.flatten().tolist()) == [1, 2]
    torch.testing.assert_close(mass.flatten(), torch.tensor([0.9]))
    torch.testing.assert_close(o_ref.flatten(), torch.tensor([25.0]))
    torch.testing.assert_close(c_ref.flatten(), torch.tensor([24.0]))
    # later loop: selected softmax [0.75, 0.25], selected values [20, 40]
    k2 = torch.tensor([0.0, math.log(0.75), math.log(0.25)]).view(1, 1, 3, 1)
    v2 = torch.tensor([99.0, 20.0, 40.0]).view(1, 1, 3, 1)
    o = ops.correction_attention(q, k2, v2, keys[0], count[0], mass[0], o_ref, c_ref[0], scale=1.0)
    torch.testing.assert_close(o.flatten(), torch.tensor([23.5]))


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("hq, hkv", [(4, 4), (4, 2), (6, 1)])
def test_ops_match_reference_ragged_gqa_several_rows(t, hq, hkv):
    fractions = [0.1, 0.4]
    q, k, v, mask, qpos = _decode_inputs(hq=hq, hkv=hkv, t=t, lengths=(9, 24))
    g = torch.Generator().manual_seed(5)
    k_later, v_later = k + 0.3 * torch.randn(k.shape, generator=g), v + 0.3 * torch.randn(v.shape, generator=g)
    out, keys, count, mass, o_ref, c_ref = ops.reference_attention(q, k, v, mask, fractions=fractions)
    expected_o, expected_corr = _reference_per_row(q, k, v, qpos, fractions, k_later, v_later)
    for b in range(q.shape[0]):
        torch.testing.assert_close(o_ref[b].transpose(0, 1), expected_o[b], rtol=1e-5, atol=1e-5)
        for f in range(len(fractions)):
            # counts are ceil(f * causal length) per query row, the same for every head
            causal = qpos[b] + 1
            expected_count = torch.clamp(torch.ceil(fractions[f] * causal.double() - 1e-9), min=1).to(torch.int32)
            assert torch.equal(count[f, b], expected_count[None].expand(hq, -1))
            corr = ops.correction_attention(q, k_later, v_later, keys[f], count[f], mass[f], o_ref, c_ref[f])
            torch.testing.assert_close(corr[b].transpose(0, 1), expected_corr[b][f], rtol=1e-5, atol=1e-5)


def test_fraction_one_is_dense_attention():
    q, k, v, mask, qpos = _decode_inputs(t=2)
    k2, v2 = k.flip(2), v * 2
    _, keys, count, mass, o_ref, c_ref = ops.reference_attention(q, k, v, mask, fractions=[1.0])
    torch.testing.assert_close(mass, torch.ones_like(mass))
    o = ops.correction_attention(q, k2, v2, keys[0], count[0], mass[0], o_ref, c_ref[0])
    dense = torch.nn.functional.scaled_dot_product_attention(q, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1), attn_mask=mask)
    torch.testing.assert_close(o, dense, rtol=1e-5, atol=1e-5)


def test_current_token_included_when_it_ranks_and_future_never():
    q, k, v, mask, qpos = _decode_inputs(b=1, hq=1, hkv=1, t=1, s=10, lengths=(6,))
    k[0, 0, 5] = q[0, 0, 0] * 10  # the current token (position 5) dominates
    k[0, 0, 8] = q[0, 0, 0] * 50  # a future key that would dominate if it were visible
    _, keys, count, *_ = ops.reference_attention(q, k, v, mask, fractions=[0.34])
    selected = keys[0, 0, 0, 0, : count[0, 0, 0, 0]].tolist()
    assert 5 in selected and all(j <= 5 for j in selected) and len(selected) == 3


def test_contract_errors():
    q, k, v, mask, _ = _decode_inputs()
    with pytest.raises(Exception, match="mask must be bool"):
        torch.ops.flashloop.reference_attention(q.to("meta"), k.to("meta"), v.to("meta"), mask.float().to("meta"), 0.25, [0.1], [3])
    with pytest.raises(Exception, match="multiple of kv heads"):
        torch.ops.flashloop.reference_attention(q[:, :3].to("meta"), k.to("meta"), v.to("meta"), mask.to("meta"), 0.25, [0.1], [3])
