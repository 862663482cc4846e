"""PositionAttentionPass (compilation.position_attention): prefill attention masked by position
becomes causal SDPA over the prompt's own K/V (a fresh prompt: the model called without
input_pos) or flashloop.position_attention (given positions: a chunk that may follow a stored
prefix). On by default wherever it applies. Exact: op counts, the compiled model against eager
and the reference, the composition with the features, and the errors where it is required but
cannot apply."""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.backend import make_backend, pass_manager
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.lowering.prefill_ops import prompt_attention
from flashloop_compile.passes import RecognitionError
from flashloop_compile.passes.graph import op_name
from flashloop_compile.reference.flashloop import ReferenceFlashLoop

from .conftest import capture, capture_dynamic, ragged_batch, tiny

ON = {"compilation.position_attention": True}


def _counts(gm) -> dict[str, int]:
    names = [op_name(n) for n in gm.graph.nodes]
    return {k: names.count(k) for k in ("scaled_dot_product_attention", "flashloop.position_attention",
                                        "flashloop.packed_attention", "prompt_attention")}


def _causal_sdpa_calls(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is prompt_attention)


def test_every_prefill_site_is_rewritten_and_decode_is_untouched():
    model = tiny(total_ut_steps=4, num_hidden_layers=2)
    model.setup_caches(2, 64)
    ids, pos = ragged_batch([9, 9])
    gm = capture(model, ids, pos)
    assert _counts(gm)["scaled_dot_product_attention"] == 8
    report = pass_manager(FlashLoopConfig.from_dict(ON)).run(gm)
    assert report.matched == {"PositionAttentionPass": 8}
    assert _counts(gm) == {"scaled_dot_product_attention": 0, "flashloop.position_attention": 8,
                           "flashloop.packed_attention": 0, "prompt_attention": 0}
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
                                                   "flashloop.packed_attention": 0, "prompt_attention": 0}),
                           ((True, False, True), {"scaled_dot_product_attention": 0, "flashloop.position_attention": 0,
                                                  "flashloop.packed_attention": 8, "prompt_attention": 0})):
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


def test_the_default_rewrites_a_plain_compile_and_leaves_what_it_cannot_alone():
    # features off, no option: the prefill at given positions attends through position_attention
    model = tiny(total_ut_steps=4, num_hidden_layers=2)
    model.setup_caches(2, 64)
    ids, pos = ragged_batch([9, 9])
    gm = capture(model, ids, pos)
    report = pass_manager(FlashLoopConfig()).run(gm)
    assert report.matched == {"PositionAttentionPass": 8}
    assert _counts(gm)["flashloop.position_attention"] == 8 and _counts(gm)["scaled_dot_product_attention"] == 0
    # no cache (the pattern is absent): the graph compiles unchanged, no error
    model.clear_caches()
    gm = capture(model, ids, pos)
    report = pass_manager(FlashLoopConfig()).run(gm)
    assert report.num_loops is not None and report.matched == {}
    assert _counts(gm)["scaled_dot_product_attention"] == 8
    # not a looped model: nothing recognized, nothing asked, nothing rewritten
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    gm = capture(mlp, torch.randn(2, 4))
    assert pass_manager(FlashLoopConfig()).run(gm).num_loops is None
    # off: the model's masked SDPA stays
    model.setup_caches(2, 64)
    gm = capture(model, ids, pos)
    assert pass_manager(FlashLoopConfig.from_dict({"compilation.position_attention": False})).run(gm).matched == {}
    assert _counts(gm)["scaled_dot_product_attention"] == 8


def test_required_but_not_applicable_is_an_error_naming_the_site():
    model = tiny(total_ut_steps=4, num_hidden_layers=2)
    ids, pos = ragged_batch([9])
    gm = capture(model, ids, pos)  # no cache
    with pytest.raises(RecognitionError, match=r"compilation.position_attention needs a KV cache written in place.*loop 1, layer 0"):
        pass_manager(FlashLoopConfig.from_dict(ON)).run(gm)
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    gm = capture(mlp, torch.randn(2, 4))
    with pytest.raises(RecognitionError, match="no recurrent block found"):
        pass_manager(FlashLoopConfig.from_dict(ON)).run(gm)


@pytest.mark.parametrize("switches, want", [
    # dense: every site of a fresh prompt is causal SDPA over its own K/V
    ((False, False, False), {"prompt_attention": 8, "flashloop.position_attention": 0, "flashloop.packed_attention": 0}),
    # token-sparse: loops 1-2 causal SDPA, the selected rows of loops 3-4 keep the kernel
    ((True, False, False), {"prompt_attention": 4, "flashloop.position_attention": 4, "flashloop.packed_attention": 0}),
    # quantized: loops 1-2 attend the step's own K/V exactly (the reference does), so they stay SDPA
    ((False, False, True), {"prompt_attention": 8, "flashloop.position_attention": 0, "flashloop.packed_attention": 0}),
    ((True, True, True), {"prompt_attention": 4, "flashloop.position_attention": 0, "flashloop.packed_attention": 4}),
], ids=["dense", "token_sparse", "quantized", "all_on"])
def test_a_fresh_prompt_attends_its_dense_loops_with_causal_sdpa(switches, want):
    model = tiny(total_ut_steps=4, num_hidden_layers=2)
    model.setup_caches(2, 64)
    ids, _ = ragged_batch([9, 9])
    gm = capture_dynamic(model, ids)
    report = pass_manager(FlashLoopConfig.from_switches(*switches)).run(gm)
    assert report.matched["PositionAttentionPass"] == 8
    counts = _counts(gm)
    assert counts["scaled_dot_product_attention"] == 0
    assert {k: counts[k] for k in want} == want
    if switches[2]:
        writes = sum(1 for n in gm.graph.nodes if op_name(n) == "flashloop.packed_kv_write")
        assert writes == 8


def test_a_prefill_at_given_positions_does_not_take_the_causal_path():
    # positions passed in (a chunk that may follow a stored prefix, even when they happen to be
    # 0..T-1): the graph cannot know there is no prefix, so the kernel over the whole cache stays
    model = tiny(total_ut_steps=4, num_hidden_layers=2)
    model.setup_caches(2, 64)
    ids, pos = ragged_batch([9, 9])
    for switches in ((False, False, False), (True, False, True)):
        gm = capture_dynamic(model, ids, pos)
        pass_manager(FlashLoopConfig.from_switches(*switches)).run(gm)
        assert _counts(gm)["prompt_attention"] == 0, switches
    # positions past a prefix: the kernel over the whole cache
    gm = capture(model, ids.clone(), pos + 3)
    pass_manager(FlashLoopConfig()).run(gm)
    assert _counts(gm)["prompt_attention"] == 0 and _counts(gm)["flashloop.position_attention"] == 8


@pytest.mark.parametrize("options", [
    {}, {"token_sparse_prefill.enabled": True, "token_sparse_prefill.window": 4},
    {"kv_residual_quantization.enabled": True, "kv_residual_quantization.group_size": 16},
    {"token_sparse_prefill.enabled": True, "token_sparse_prefill.window": 4, "sparse_decode_attention.enabled": True,
     "kv_residual_quantization.enabled": True, "kv_residual_quantization.group_size": 16},
], ids=["dense", "token_sparse", "quantized", "all_on"])
def test_a_fresh_prompt_then_a_decode_step_match_the_reference(options):
    # the engine prefills a ragged batch (row 1 right-padded) as a fresh prompt, then decodes one
    # step through the cache it wrote; FP32, against the reference per request
    from flashloop_compile.runtime.engine import Engine

    model = tiny(total_ut_steps=4, num_hidden_layers=2)
    config = FlashLoopConfig.from_dict(options)
    inner, graphs = make_backend(config, inner="eager"), []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    prompts = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (11, 7)]
    torch._dynamo.reset()
    engine = Engine(model, config, max_batch=2, max_seq=64, backend=backend)
    prefill = engine.prefill(prompts)
    assert _causal_sdpa_calls(graphs[0]) == (8 if not config.token_sparse_prefill.enabled else 4)
    nxt = prefill.argmax(-1)
    decode = engine.decode(nxt, torch.tensor([len(p) for p in prompts]))
    torch._dynamo.reset()
    ref = ReferenceFlashLoop(model, config)
    for row, p in enumerate(prompts):
        req = ref.request()
        torch.testing.assert_close(prefill[row], req.prefill(p).logits[-1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(decode[row], req.decode(nxt[row][None]).logits[-1], atol=1e-4, rtol=1e-4)
