"""The flashloop backend end to end through Inductor (CPU): features off (projections fused)
equals inductor and eager; each feature configuration compiles through Inductor (outline_layers off) and matches
the rewritten graph run eagerly."""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.backend import last_report
from flashloop_compile.config import FlashLoopConfig


def _prefill_and_decode(model, backend, options=None):
    model.setup_caches(2, 48)
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9)[None].expand(2, -1)
    torch._dynamo.reset()
    fn = torch.compile(model, backend=backend, options=options) if backend else model
    with torch.no_grad():
        prefill = fn(ids, pos)
        decode = fn(prefill[:, -1].argmax(-1, keepdim=True), torch.tensor([[9], [9]]))
    torch._dynamo.reset()
    return prefill, decode


def test_features_off_equals_inductor_and_eager(tiny_model):
    eager = _prefill_and_decode(tiny_model, None)
    inductor = _prefill_and_decode(tiny_model, "inductor")
    flash = _prefill_and_decode(tiny_model, "flashloop", FlashLoopConfig().to_dict())
    # features off: the only rewrite is the exact projection fusion (tests/passes/test_fuse_projections.py)
    assert str(last_report()) == "flashloop: all features off; 40 linears sharing an input fused into 16 GEMMs"
    for a, b, c in zip(eager, inductor, flash):
        torch.testing.assert_close(c, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)


def test_sparse_decode_through_inductor_matches_eager_rewrite(tiny_model):
    from flashloop_compile.backend import make_backend

    config = FlashLoopConfig.from_switches(False, True, False)
    rewritten = _prefill_and_decode(tiny_model, make_backend(config, inner="eager"))
    compiled = _prefill_and_decode(tiny_model, "flashloop", config)
    assert last_report().matched == {"SparseDecodeAttentionPass": 6}
    for a, b in zip(rewritten, compiled):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_backend_rejects_inductor_only_arguments():
    import pytest

    from flashloop_compile.backend import flashloop_backend

    with pytest.raises(TypeError, match="options="):
        flashloop_backend(None, [], mode="max-autotune")


def test_entry_point_registered():
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    assert "flashloop" in list_backends(exclude_tags=())
    assert lookup_backend("flashloop").__name__ == "flashloop_backend"



def test_decode_does_not_recompile_as_the_context_grows(tiny_model):
    """The static per-(loop, layer) cache and tensor positions make every decode step one graph."""
    from flashloop_compile.backend import make_backend

    calls = []
    inner = make_backend(FlashLoopConfig.from_switches(False, True, False), inner="eager")

    def counting(gm, example_inputs):
        calls.append(gm)
        return inner(gm, example_inputs)

    tiny_model.setup_caches(2, 64)
    torch._dynamo.reset()
    fn = torch.compile(tiny_model, backend=counting)
    with torch.no_grad():
        for p in range(10, 20):
            fn(torch.zeros(2, 1, dtype=torch.long), torch.full((2, 1), p))
    torch._dynamo.reset()
    assert len(calls) == 1


_FEATURES = ("token_sparse_prefill", "sparse_decode_attention", "kv_residual_quantization")
_FEATURE_CONFIGS = {
    "token_sparse": {"token_sparse_prefill.enabled": True},
    "sparse_decode": {"sparse_decode_attention.enabled": True},
    "quant": {"kv_residual_quantization.enabled": True},
    "all_on": {f"{g}.enabled": True for g in _FEATURES},
}


def _generate_logits(model, backend, dynamic: bool, steps: int = 2):
    """Prefill 9 tokens (token dimension dynamic for token-sparse prefill) and ``steps`` greedy
    decode steps; the logits of each call."""
    model.setup_caches(2, 64)  # fresh caches: a fresh step plan and packed cache
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9)[None].expand(2, -1).clone()
    if dynamic:
        torch._dynamo.mark_dynamic(ids, 1)
        torch._dynamo.mark_dynamic(pos, 1)
    torch._dynamo.reset()
    fn = torch.compile(model, backend=backend, fullgraph=True)
    out = []
    with torch.no_grad():
        out.append(fn(ids, pos))
        for step in range(steps):
            out.append(fn(out[-1][:, -1].argmax(-1, keepdim=True), torch.full((2, 1), 9 + step)))
    torch._dynamo.reset()
    return out


@pytest.mark.parametrize("name", list(_FEATURE_CONFIGS))
def test_feature_config_through_inductor_matches_eager_rewrite(name):
    """outline_layers off, Inductor as the inner compiler: the runtime tensors the passes read
    (step plan, packed cache) reach AOTAutograd as graph inputs. As buffers registered on the
    Dynamo graph they failed with 'flashloop_seq_lens not found in param_name_to_source'.

    The tiny preset with one layer per loop (R = 4 x N = 1): Inductor's compile time grows with the
    unrolled graph; lifting with several layers is covered by every ``inner="eager"`` test."""
    import dataclasses

    from flashloop_compile.backend import make_backend
    from flashloop_compile.models.ouro import PRESETS, OuroForCausalLM

    torch.manual_seed(0)
    model = OuroForCausalLM(dataclasses.replace(PRESETS["tiny"], num_hidden_layers=1)).init_random_().eval()
    options = _FEATURE_CONFIGS[name]
    dynamic = "token_sparse_prefill.enabled" in options
    expected = _generate_logits(model, make_backend(options, inner="eager"), dynamic)
    got = _generate_logits(model, make_backend(options, inner="inductor"), dynamic)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("form", ["linear", "read_attend"])
def test_the_one_op_correction_forms_equal_the_two_op_form(form, tiny_model, monkeypatch):
    """tables.PACKED_CORRECTION["read_attend"] (default) / ["linear"] (opt-in): each loop-3/4
    correction is one flashloop.packed_correction_attention over the packed history instead of a compact
    packed_read and a correction_attention. Its CPU body is that two-op form, so sparse decode +
    quantization generates the same logits either way: the new op gets the pass's in-flight
    tokens, depth and reference state in the right places (its CUDA bodies are checked against
    this form in tests/gpu/test_packed_gpu.py, the read-and-attend kernel also by the interpreter
    in tests/lowering/test_correction_read_attend.py)."""
    import collections

    from flashloop_compile.backend import make_backend
    from flashloop_compile.lowering import tables
    from flashloop_compile.passes.graph import op_name

    options = {"sparse_decode_attention.enabled": True, "kv_residual_quantization.enabled": True}
    runs, ops = {}, {}
    for linear in (False, True):  # False: the two-op (copy) form
        monkeypatch.setitem(tables.PACKED_CORRECTION, "read_attend", linear and form == "read_attend")
        monkeypatch.setitem(tables.PACKED_CORRECTION, "linear", linear and form == "linear")
        inner = make_backend(options, inner="eager")
        seen = ops[linear] = collections.Counter()

        def backend(gm, example_inputs, inner=inner, seen=seen):
            fn = inner(gm, example_inputs)  # rewrites gm in place
            seen.update(op_name(n) for n in gm.graph.nodes if n.op == "call_function")
            return fn

        runs[linear] = _generate_logits(tiny_model, backend, False, steps=3)
    sites = 2 * tiny_model.config.num_hidden_layers  # loops 3 and 4 of the decode graph
    assert ops[True]["flashloop.packed_correction_attention"] == sites, ops[True]
    assert ops[True]["flashloop.correction_attention"] == 0 and ops[True]["flashloop.packed_read"] == 0
    assert ops[False]["flashloop.correction_attention"] == sites and ops[False]["flashloop.packed_read"] == sites
    for a, b in zip(runs[True], runs[False]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
