"""reuse_selected_probabilities' V-only correction over the packed cache (packed_ops.reuse_read_values:
packed_read._read_values_kernel, then correction's reuse combine), run by the interpreter on CPU
tensors, against the ATen body of ``flashloop::packed_reuse_correction_attention`` (packed_read of
the selected keys, then reuse_correction_attention over that copy), and the op itself.

The kernel weights the values packed_read would have written, rounded to the compute dtype: equal
to the two-op form up to FP32 summation order (1e-5 on fp32 caches, 1e-2 in bf16). Tiles of 16 keys
cover the three kinds of program (flushed bulk: V planes only; ring / in-flight keys: per-token
resolution; past the row's count: an empty partial)."""

from __future__ import annotations

import pytest
import torch


from flashloop_compile.lowering import packed_sparse_ops as PS
from flashloop_compile.lowering.kernels import packed_read as PR
from tests.lowering.test_correction_read_attend import TILE, _case, _tile_kinds

pytest.importorskip("triton")


def _reuse_case(dtype, depth, padded_row=False, seed=31):
    """_case's cache, keys and in-flight token, with a probability per selected key (random, 0 in the padding)."""
    tensors, (q, keys, count, mass, o_ref, c_ref), (ip, _kd, vd) = _case(dtype, depth, padded_row, seed)
    g = torch.Generator().manual_seed(seed + 1)
    valid = torch.arange(keys.shape[-1]) < count[..., None]
    probs = torch.where(valid, torch.rand(keys.shape, generator=g), 0.0)
    return tensors, (keys, count, probs, o_ref, c_ref), (ip, vd)


@pytest.mark.parametrize("dtype, depth", [(torch.float32, 2), (torch.float32, 3), (torch.bfloat16, 3)],
                         ids=["fp32_d2", "fp32_d3", "bf16_d3"])
def test_read_values_matches_read_then_reuse(dtype, depth):
    tensors, args, inflight = _reuse_case(dtype, depth)
    keys, count = args[:2]
    assert _tile_kinds(tensors, keys, count, inflight[0], depth) == {"bulk", "resolved", "empty"}
    want = PS.packed_reuse_correction_attention_aten(*args, *inflight, depth, *tensors)
    assert want.dtype == dtype and want.shape == args[3].shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for block_p in (TILE, None):  # None: the interpreter's one tile per row
        got = PS.reuse_read_values(*args, inflight, depth, tensors, block_p=block_p)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol, msg=lambda m: f"block_p {block_p}: {m}")


def test_read_values_padded_row_is_o_ref_minus_c_ref():
    tensors, args, inflight = _reuse_case(torch.float32, 3, padded_row=True, seed=5)
    keys, count, probs, o_ref, c_ref = args
    assert int(count[1].max()) == 0
    got = PS.reuse_read_values(*args, inflight, 3, tensors, block_p=TILE)
    torch.testing.assert_close(got, PS.packed_reuse_correction_attention_aten(*args, *inflight, 3, *tensors), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], (o_ref - c_ref)[1], atol=1e-6, rtol=0)


def test_the_op_on_cpu_is_the_aten_body_and_checks_its_contract():
    tensors, args, inflight = _reuse_case(torch.float32, 2)
    got = torch.ops.flashloop.packed_reuse_correction_attention(*args, *inflight, 2, *tensors)
    torch.testing.assert_close(got, PS.packed_reuse_correction_attention_aten(*args, *inflight, 2, *tensors))
    torch.library.opcheck(torch.ops.flashloop.packed_reuse_correction_attention.default, (*args, *inflight, 2, *tensors))
    keys, count, probs, o_ref, c_ref = args
    meta = [t.to("meta") for t in (keys, count, probs[..., :3], o_ref, c_ref, *inflight)]
    with pytest.raises(Exception, match="probs are fp32, shaped as keys"):
        torch.ops.flashloop.packed_reuse_correction_attention(*meta, 2, *[t.to("meta") for t in tensors])


def test_read_values_refuses_several_query_heads_per_kv_head():
    tensors, (keys, count, probs, *_rest), inflight = _reuse_case(torch.float32, 2)
    with pytest.raises(ValueError, match="one query row per kv head"):
        PR.launch_packed_read_values(tensors, keys.repeat_interleave(2, dim=1), count.repeat_interleave(2, dim=1),
                                     probs.repeat_interleave(2, dim=1), 2, inflight=inflight)
