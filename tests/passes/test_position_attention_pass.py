"""PositionAttentionPass (compilation.position_attention): prefill attention masked by position
becomes flashloop.position_attention. Exact: op counts, the compiled model against eager, the
composition with the features, and the errors where it cannot apply."""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.backend import make_backend, pass_manager
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.passes import RecognitionError
from flashloop_compile.passes.graph import op_name

from .conftest import capture, capture_dynamic, ragged_batch, tiny

ON = {"compilation.position_attention": True}


def _counts(gm) -> dict[str, int]:
    names = [op_name(n) for n in gm.graph.nodes]
    return {k: names.count(k) for k in ("scaled_dot_product_attention", "flashloop.position_attention",
                                        "flashloop.packed_attention")}


def test_every_prefill_site_is_rewritten_and_decode_is_untouched():
    model = tiny(total_ut_steps=4, num_hidden_layers=2)
    model.setup_caches(2, 64)
    ids, pos = ragged_batch([9, 9])
    gm = capture(model, ids, pos)
    assert _counts(gm)["scaled_dot_product_attention"] == 8
    report = pass_manager(FlashLoopConfig.from_dict(ON)).run(gm)
    assert report.matched == {"PositionAttentionPass": 8}
    assert _counts(gm) == {"scaled_dot_product_attention": 0, "flashloop.position_attention": 8,
                           "flashloop.packed_attention": 0}
    decode = capture(model, ids[:, :1], torch.full((2, 1), 9))
    report = pass_manager(FlashLoopConfig.from_dict(ON)).run(decode)
    assert report.matched == {}
    assert _counts(decode)["scaled_dot_product_attention"] == 8


def test_with_token_sparse_prefill_and_quantization():
    # token-sparse loops 3-4 are position_attention already (counted, not rewritten twice); under
    # quantization every site ends as packed_attention
    model = tiny(total_ut_steps=4, num_hidden_layers=2)
    model.setup_caches(2, 64)
    ids, pos = ragged_batch([9, 9])
    for switches, want in (((True, False, False), {"scaled_dot_product_attention": 0, "flashloop.position_attention": 8,
                                                   "flashloop.packed_attention": 0}),
                           ((True, False, True), {"scaled_dot_product_attention": 0, "flashloop.position_attention": 0,
                                                  "flashloop.packed_attention": 8})):
        gm = capture_dynamic(model, ids, pos)
        report = pass_manager(FlashLoopConfig.from_switches(*switches, **ON)).run(gm)
        assert report.matched["PositionAttentionPass"] == 8, report.matched
        assert _counts(gm) == want, switches


def test_compiled_prefill_and_decode_match_eager():
    # a ragged batch (right padding: the pad tokens sit at positions past each row's prompt), then
    # one decode step through the cache the rewritten prefill wrote. FP32: the rewrite is exact
    # (the op's BF16 kernel numerics are tests/lowering/test_position_attention.py's)
    model = tiny(num_hidden_layers=2)
    ids, pos = ragged_batch([9, 6])

    def run(compiled: bool):
        model.setup_caches(2, 32)
        fwd = torch.compile(model, backend=make_backend(ON, inner="eager"), dynamic=False) if compiled else model
        torch._dynamo.reset()
        with torch.no_grad():
            first = fwd(ids, pos)
            second = fwd(ids[:, :1], torch.tensor([[9], [6]]))
        return first, second

    want, got = run(False), run(True)
    for w, g in zip(torch.utils._pytree.tree_leaves(want), torch.utils._pytree.tree_leaves(got)):
        if isinstance(w, torch.Tensor) and w.is_floating_point():
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_a_model_without_a_position_mask_is_a_clear_error():
    # no cache: attention over the step's own keys (mask kind causal-position, but no in-place cache)
    model = tiny(num_hidden_layers=2)
    ids, pos = ragged_batch([9])
    gm = capture(model, ids, pos)
    with pytest.raises(RecognitionError, match="compilation.position_attention needs a KV cache written in place"):
        pass_manager(FlashLoopConfig.from_dict(ON)).run(gm)
