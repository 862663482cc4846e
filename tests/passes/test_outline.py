"""Compile each distinct layer once: segment counts, artifact counts, numerics."""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.backend import last_report, make_backend
from flashloop_compile.passes import recognize
from flashloop_compile.passes.outline import layer_cuts

from .conftest import SMALL, capture, ragged_batch, small, tiny


def _run(model, backend, lengths=(7, 7)):
    ids, pos = ragged_batch(list(lengths))
    model.setup_caches(len(lengths), 64)
    torch._dynamo.reset()
    fn = torch.compile(model, backend=backend) if backend else model
    with torch.no_grad():
        prefill = fn(ids, pos)
        decode = fn(prefill[:, -1].argmax(-1, keepdim=True), torch.full((len(lengths), 1), max(lengths)))
    torch._dynamo.reset()
    return prefill, decode


@pytest.mark.parametrize("loops, layers", [(4, 2), (3, 3), (2, 1)])
def test_cuts_give_one_segment_per_layer_and_loop_tail(loops, layers):
    model = tiny(total_ut_steps=loops, num_hidden_layers=layers)
    model.setup_caches(2, 32)
    ids, pos = ragged_batch([5, 5])
    s = recognize(capture(model, ids, pos))
    cuts = layer_cuts(s)
    # end of prologue + per loop: N layer ends and H[r]
    assert len(cuts) == 1 + loops * (layers + 1)
    assert [c for c in cuts if c in s.states] == s.states[1:]


@pytest.mark.parametrize(
    "options, artifacts",
    [
        # prologue, one layer kind, the loop tail (end-of-loop norm), the coda
        ({}, 4),
        # ... plus loop 2's reference layers and the correction layers of loops 3..4
        ({"sparse_decode_attention.enabled": True}, 6),
    ],
)
def test_each_distinct_segment_compiled_once(options, artifacts):
    model = tiny()
    _run(model, make_backend({"compilation.outline_layers": True, **options}, inner="eager"))
    report = last_report()
    assert report.phase == "decode"
    assert len(report.segments) == artifacts
    assert sum(report.segments.values()) == 1 + 4 * 3 + 1


def test_outlined_inductor_matches_eager_rewrite():
    # one layer of 3 loops: the same segment kinds as the tiny preset (prologue, a loop-1 layer,
    # loop 2's reference layer, loop 3's correction layer, the loop tail, the coda), each compiled once
    model = small()
    options = {"sparse_decode_attention.enabled": True}
    expected = _run(model, make_backend(options, inner="eager"))
    got = _run(model, make_backend({"compilation.outline_layers": True, **options}))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_outlined_token_sparse_prefill_matches_eager_rewrite():
    options = {"token_sparse_prefill.enabled": True, "token_sparse_prefill.window": 4}

    def run(opts):
        model = tiny()
        ids, pos = ragged_batch([11, 11])
        model.setup_caches(2, 64)
        torch._dynamo.reset()
        torch._dynamo.mark_dynamic(ids, 1)
        torch._dynamo.mark_dynamic(pos, 1)
        with torch.no_grad():
            out = torch.compile(model, backend=make_backend(opts, inner="eager"))(ids, pos)
        torch._dynamo.reset()
        return out, last_report()

    expected, _ = run(options)
    got, report = run({**options, "compilation.outline_layers": True})
    assert report.matched == {"TokenSparsePrefillPass": 2, "PositionAttentionPass": 8}
    assert sum(report.segments.values()) == 1 + 4 * 3 + 1
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options", [{}, {"token_sparse_prefill.enabled": True, **SMALL}], ids=["dense", "token_sparse"])
def test_outlined_inductor_serves_every_prompt_length(monkeypatch, options):
    """The engine marks the prefill token dimension dynamic: each distinct segment is compiled once,
    symbolic in the token count, and serves a later call with another prompt length (an artifact
    compiled for its first call's shapes failed with 'expected size 23==14'). On small(): one layer
    of 3 loops has every segment kind the tiny preset has."""
    import flashloop_compile.backend as backend
    from flashloop_compile.config import FlashLoopConfig
    from flashloop_compile.runtime.engine import Engine

    compiles = []
    inductor = backend._inductor
    monkeypatch.setattr(backend, "_inductor", lambda gm, inputs: compiles.append(gm) or inductor(gm, inputs))
    g = torch.Generator().manual_seed(0)
    # two calls, two prompt lengths (ragged rows); past 10 tokens: a token-sparse graph traced at
    # fewer guards 5 <= T <= 10 (the model's own specialization, a recompile also without outlining)
    calls = [[torch.randint(0, 256, (n,), generator=g) for n in lengths] for lengths in ((14, 11), (23, 19))]

    def prefill(opts, inner):
        config = FlashLoopConfig.from_dict(opts)
        engine = Engine(small(), config, max_batch=2, max_seq=64, backend=make_backend(config, inner=inner))
        torch._dynamo.reset()
        out, counts = [], []
        for prompts in calls:
            out.append(engine.prefill(prompts))
            counts.append(len(compiles))
        torch._dynamo.reset()
        return out, counts

    expected, _ = prefill(options, "eager")  # the rewrite, whole graph, no Inductor
    got, counts = prefill({**options, "compilation.outline_layers": True}, "inductor")
    assert counts[0] == len(last_report().segments) and counts[1] == counts[0]  # no recompile
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_segment_without_recorded_values_compiles_per_input_shape():
    """The fallback when a segment's placeholders carry no example values: compiled at the call,
    for the call's shapes, so another shape compiles again instead of reusing the artifact."""
    from flashloop_compile.passes.outline import SharedSegment

    gm = torch.fx.symbolic_trace(lambda x: x.sin() + 1)  # no "val"/"example_value" meta
    compiled = []

    def compiler(g, inputs):
        compiled.append([tuple(x.shape) for x in inputs])
        return g.forward

    segment = SharedSegment(gm, "key", {}, compiler)
    for n in (3, 5, 3):
        x = torch.randn(2, n)
        torch.testing.assert_close(segment(x), x.sin() + 1)
    assert compiled == [[(2, 3)], [(2, 5)]]
