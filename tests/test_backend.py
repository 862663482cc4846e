"""The flashloop backend end to end through Inductor (CPU): features off (projections fused)
equals inductor and eager; each feature configuration compiles through Inductor (outline_layers off) and matches
the rewritten graph run eagerly.

The Inductor compiles run on passes.conftest.small() (the tiny preset cut to one layer of 3 loops:
loop 3 still selects and stores residuals): Inductor's compile time grows with the unrolled graph;
several layers per loop are covered by every ``inner="eager"`` test."""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.backend import last_report
from flashloop_compile.config import FlashLoopConfig
from passes.conftest import SMALL, small


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


def test_features_off_equals_inductor_and_eager():
    model = small()
    eager = _prefill_and_decode(model, None)
    inductor = _prefill_and_decode(model, "inductor")
    flash = _prefill_and_decode(model, "flashloop", FlashLoopConfig().to_dict())
    # features off: the rewrites are exact (the prefill's attention, tests/passes/test_position_attention_pass.py;
    # the projection fusion, tests/passes/test_fuse_projections.py); the last graph is the decode step's
    assert str(last_report()) == ("flashloop: decode graph, R=3 x N=1; matched no feature applies; "
                                  "15 linears sharing an input fused into 6 GEMMs")
    for a, b, c in zip(eager, inductor, flash):
        torch.testing.assert_close(c, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)


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


# each feature alone (every feature on through Inductor, a batch of one then a full batch:
# tests/runtime/test_batch_growth.py): its options and what the compiled prefill and decode graphs matched
_FEATURE_CONFIGS = {
    "token_sparse": ({"token_sparse_prefill.enabled": True, **SMALL},
                     [{"TokenSparsePrefillPass": 1, "PositionAttentionPass": 3}, {}]),
    "sparse_decode": ({"sparse_decode_attention.enabled": True},
                      [{"PositionAttentionPass": 3}, {"SparseDecodeAttentionPass": 2}]),
    "quant": ({"kv_residual_quantization.enabled": True},
              [{"PositionAttentionPass": 3, "KVResidualQuantizationPass": 3}, {"KVResidualQuantizationPass": 3}]),
}


def _generate_logits(model, backend, dynamic: bool, steps: int = 2, options=None):
    """Prefill 9 tokens (token dimension dynamic for token-sparse prefill) and ``steps`` greedy
    decode steps; the logits of each call."""
    model.setup_caches(2, 64)  # fresh caches: a fresh step plan and packed cache
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(9)[None].expand(2, -1).clone()
    if dynamic:
        torch._dynamo.mark_dynamic(ids, 1)
        torch._dynamo.mark_dynamic(pos, 1)
    torch._dynamo.reset()
    fn = torch.compile(model, backend=backend, options=options, fullgraph=True)
    out = []
    with torch.no_grad():
        out.append(fn(ids, pos))
        for step in range(steps):
            out.append(fn(out[-1][:, -1].argmax(-1, keepdim=True), torch.full((2, 1), 9 + step)))
    torch._dynamo.reset()
    return out


@pytest.mark.parametrize("name", list(_FEATURE_CONFIGS))
def test_feature_config_through_inductor_matches_eager_rewrite(name):
    """``torch.compile(model, backend="flashloop", options=...)``, outline_layers off, Inductor as
    the inner compiler: the runtime tensors the passes read (step plan, packed cache) reach
    AOTAutograd as graph inputs. As buffers registered on the Dynamo graph they failed with
    'flashloop_seq_lens not found in param_name_to_source'."""
    from flashloop_compile import backend
    from flashloop_compile.backend import make_backend

    model = small()
    options, matched = _FEATURE_CONFIGS[name]
    dynamic = "token_sparse_prefill.enabled" in options
    expected = _generate_logits(model, make_backend(options, inner="eager"), dynamic)
    got = _generate_logits(model, "flashloop", dynamic, options=FlashLoopConfig.from_dict(options).to_dict())
    # one prefill graph, one decode graph, each rewritten by the feature's passes
    assert [(r.phase, r.matched) for r in backend._reports[-2:]] == list(zip(["prefill", "decode"], matched))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
