"""The flashloop backend end to end through Inductor (CPU): features off equals inductor and
eager; sparse decode attention compiles through Inductor with the flashloop ops."""

from __future__ import annotations

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
    assert "untouched" in str(last_report())
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
