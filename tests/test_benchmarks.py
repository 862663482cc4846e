"""The benchmark harness (benchmarks/common.py) on CPU: what it hands the backend and how it calls
the result. Two harness bugs made GPU numbers wrong without failing: SymInt example inputs passed
to the compiled function (a negative size at the first dynamic-shape call), and compiling with grad
enabled (training graphs: saved activations and a copy of every mutated cache)."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from common import capture_graph, compile_variant  # noqa: E402

from flashloop_compile.models.ouro import OuroForCausalLM  # noqa: E402


def _prefill_graph(t: int, dynamic: bool):
    model = OuroForCausalLM.from_preset("tiny", dtype=torch.float32, seed=0).eval()
    model.setup_caches(1, t + 16)
    ids = torch.randint(0, model.config.vocab_size, (1, t), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(t)[None].contiguous()
    with torch.no_grad():
        want = model(ids, pos)
    gm, inputs = capture_graph(model, ids, pos, dynamic_tokens=dynamic)
    return want, gm, inputs


def test_dynamic_capture_hands_concrete_sizes_and_the_compiled_graph_runs():
    want, gm, inputs = _prefill_graph(24, dynamic=True)
    assert any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in gm.graph.nodes if n.op == "placeholder")
    assert not any(isinstance(x, torch.SymInt) for x in inputs)
    assert 24 in [x for x in inputs if isinstance(x, int)]
    fn, _, _ = compile_variant(gm, inputs, {"compilation.outline_layers": True})
    with torch.no_grad():
        got = fn(*inputs)
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compile_variant_builds_inference_graphs_even_with_grad_enabled():
    _, gm, inputs = _prefill_graph(8, dynamic=False)
    assert torch.is_grad_enabled()
    fn, _, _ = compile_variant(gm, inputs, {"compilation.outline_layers": True})
    out = fn(*inputs)  # grad enabled, as a benchmark's first call may be
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert not out.requires_grad, "a segment was compiled as a training graph"
