"""Projection fusion: linears sharing an input become one GEMM over weights concatenated at compile
time. Op counts, numerics against eager, the unfused rewrite and the reference (features off and
all on), outlining, and the rule that keeps the fused copy equal to the model's weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from flashloop_compile.backend import last_report, make_backend
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.passes.graph import is_op
from flashloop_compile.reference import ReferenceFlashLoop
from flashloop_compile.runtime.engine import Engine

from .conftest import SMALL, ragged_batch, small, tiny

PROMPTS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (70, 37)]
ALL_ON = {"token_sparse_prefill.enabled": True, "sparse_decode_attention.enabled": True,
          "kv_residual_quantization.enabled": True, "token_sparse_prefill.window": 32}
UNFUSED = {"compilation.fuse_projections": False}
NO_ATTENTION_REWRITE = {"compilation.position_attention": False}
# A fused GEMM adds its products in another order than the linears it replaces: the tiny model's
# FP32 logits (|logit| up to 6.6 with the weights x1.25) differ by up to ~3e-5 depending on the
# CPU's GEMM blocking (3.3e-5 on the 2-core CI machine).
FUSED_ORDER = {"rtol": 1e-4, "atol": 1e-4}


def _recording(config):
    """An eager-inner flashloop backend that keeps each graph module it rewrote."""
    inner = make_backend(config, inner="eager")
    graphs = []

    def backend(gm, example_inputs):
        fn = inner(gm, example_inputs)
        graphs.append(gm)
        return fn

    return backend, graphs


def _linears(gm):
    """(linears over a fused weight, linears over a model weight) in ``gm``."""
    lin = [n for n in gm.graph.nodes if is_op(n, "linear")]
    fused = [n for n in lin if n.args[1].op == "get_attr" and str(n.args[1].target).startswith("flashloop_fused_weight")]
    return len(fused), len(lin) - len(fused)


def _run(model, backend, lengths=(6, 6)):
    ids, pos = ragged_batch(list(lengths))
    model.setup_caches(len(lengths), 48)
    torch._dynamo.reset()
    fn = torch.compile(model, backend=backend) if backend is not None else model
    with torch.no_grad():
        prefill = fn(ids, pos)
        decode = fn(prefill[:, -1].argmax(-1, keepdim=True), torch.full((len(lengths), 1), max(lengths)))
    torch._dynamo.reset()
    return prefill, decode


def _generate(model, options, tokens=8):
    config = FlashLoopConfig.from_dict(options)
    backend, graphs = _recording(config)
    torch._dynamo.reset()
    engine = Engine(model, config, max_batch=2, max_seq=128, backend=backend)
    logits = engine.prefill(PROMPTS)
    out = engine.generate(PROMPTS, tokens).tokens
    torch._dynamo.reset()
    return logits, out, graphs


@pytest.mark.parametrize("options", [{}, {**ALL_ON, **SMALL}], ids=["features_off", "all_on"])
def test_seven_linears_per_layer_become_four_gemms_and_tokens_equal_the_reference(options):
    # small(): R=3 loops x N=1 layer, no attention bias (several layers per loop: the tests below)
    model = small()
    logits, tokens, graphs = _generate(model, options)
    assert {len(graphs)} != {0}
    for gm in graphs:
        # per layer and loop: QKV and gate-up fused, o_proj and down_proj alone; plus lm_head
        assert _linears(gm) == (2 * 3 * 1, 2 * 3 * 1 + 1)
    assert last_report().fused_linears == 5 * 3 * 1 and last_report().fused_gemms == 2 * 3 * 1
    config = FlashLoopConfig.from_dict(options)
    assert tokens == [ReferenceFlashLoop(model, config).greedy(p, 8).tolist() for p in PROMPTS]
    unfused_logits, unfused_tokens, unfused_graphs = _generate(model, {**options, **UNFUSED})
    assert all(_linears(gm) == (0, 7 * 3 * 1 + 1) for gm in unfused_graphs)
    torch.testing.assert_close(logits, unfused_logits, **FUSED_ORDER)
    assert tokens == unfused_tokens


def test_features_off_matches_eager_and_changes_only_the_projections():
    tiny_model = tiny()  # its own model: the session one must keep its caches
    expected = _run(tiny_model, None)
    # the prefill attention rewrite off: only the fusion differs from the captured graph
    backend, graphs = _recording(FlashLoopConfig.from_dict(NO_ATTENTION_REWRITE))
    got = _run(tiny_model, backend)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **FUSED_ORDER)
    assert "40 linears sharing an input fused into 16 GEMMs" in str(last_report())
    # nothing but the fusion: the unfused graph's other operations are all still there
    unfused_backend, unfused_graphs = _recording(FlashLoopConfig.from_dict({**UNFUSED, **NO_ATTENTION_REWRITE}))
    _run(tiny_model, unfused_backend)
    assert "untouched" in str(last_report())
    for fused, plain in zip(graphs, unfused_graphs):
        ops = lambda gm: sorted(str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method") and not is_op(n, "linear"))  # noqa: E731
        extra = ops(fused)
        for op in ops(plain):
            extra.remove(op)
        assert set(extra) == {str(torch.narrow)} and len(extra) == 40


def test_outlined_layers_share_artifacts_with_fused_weights_as_segment_inputs():
    tiny_model = tiny()
    options = {"compilation.outline_layers": True, "sparse_decode_attention.enabled": True}
    expected = _run(tiny_model, make_backend({**options, **UNFUSED}, inner="eager"))
    got = _run(tiny_model, make_backend(options, inner="eager"))
    report = last_report()
    assert report.fused_gemms == 16 and len(report.segments) == 6  # as many artifacts as unfused
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **FUSED_ORDER)


def test_weights_changed_after_compiling_are_seen_and_each_instance_gets_its_own():
    model, other = tiny(), tiny()
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.25)
    ids, pos = ragged_batch([6, 6])
    for m in (model, other):
        m.setup_caches(2, 48)
    calls = []
    inner = make_backend(None, inner="eager")

    def counting(gm, example_inputs):
        calls.append(gm)
        return inner(gm, example_inputs)

    torch._dynamo.reset()
    with torch.no_grad():
        first = torch.compile(model, backend=counting)(ids, pos)
        torch.testing.assert_close(first, model(ids, pos), **FUSED_ORDER)
        # Dynamo serves another instance of the class from the same graph, with its own weights
        got = torch.compile(other, backend=counting)(ids, pos)
        assert len(calls) == 1
        torch.testing.assert_close(got, other(ids, pos), **FUSED_ORDER)
        # an in-place change after compiling is seen at the next call
        model.model.layers[0].self_attn.k_proj.weight.mul_(-1)
        model.model.layers[1].mlp.up_proj.weight.add_(0.5)
        got = torch.compile(model, backend=counting)(ids, pos)
        assert len(calls) == 1
        torch.testing.assert_close(got, model(ids, pos), **FUSED_ORDER)
        assert not torch.allclose(got, first)
    torch._dynamo.reset()


def test_graphs_that_may_need_gradients_stay_unfused():
    model = tiny()
    ids, pos = ragged_batch([6, 6])
    model.setup_caches(2, 48)
    backend, graphs = _recording(FlashLoopConfig())
    torch._dynamo.reset()
    torch.compile(model, backend=backend)(ids, pos)
    torch._dynamo.reset()
    assert last_report().fused_gemms == 0 and _linears(graphs[0]) == (0, 7 * 4 * 2 + 1)


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 6)
        self.b = nn.Linear(8, 4)
        self.c = nn.Linear(8, 4)
        self.d = nn.Linear(8, 4, bias=False)

    def forward(self, x):
        # a's flattening view needs contiguous rows; d has no bias: neither joins b and c
        return self.a(x).view(-1), self.b(x) * 2, self.c(x).view(2, 3, 2, 2).relu(), self.d(x)


def test_biases_are_fused_and_outputs_a_strided_row_cannot_serve_stay_alone():
    torch.manual_seed(0)
    toy = _Toy().eval()
    x = torch.randn(2, 3, 8)
    backend, graphs = _recording(FlashLoopConfig())
    torch._dynamo.reset()
    with torch.no_grad():
        expected = toy(x)
        got = torch.compile(toy, backend=backend, fullgraph=True)(x)
    torch._dynamo.reset()
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert (last_report().fused_linears, last_report().fused_gemms) == (2, 1)
    assert _linears(graphs[0]) == (1, 2)
    assert hasattr(graphs[0], "flashloop_fused_bias_0")
