"""Graph capture helpers for pass tests: Dynamo graphs of prefill and decode steps."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashloop_compile.models.ouro import PRESETS, OuroForCausalLM


def capture(model, *args, **kwargs) -> torch.fx.GraphModule:
    """The single Dynamo graph of ``model(*args, **kwargs)`` (features untouched, not compiled)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True, dynamic=False)(*args, **kwargs)
    torch._dynamo.reset()
    assert len(graphs) == 1
    return graphs[0]


def capture_dynamic(model, ids, pos=None) -> torch.fx.GraphModule:
    """The Dynamo graph of a prefill ``model(ids, pos)`` with a dynamic token dimension (as the
    engine traces it; token-sparse prefill needs it); ``pos`` None: ``model(ids)``, a fresh
    prompt whose positions the graph builds (as the engine calls a prompt's first chunk)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(ids, 1)
    if pos is not None:
        torch._dynamo.mark_dynamic(pos, 1)
    with torch.no_grad():
        torch.compile(model, backend=backend)(*((ids,) if pos is None else (ids, pos)))
    torch._dynamo.reset()
    return graphs[0]


def tiny(**overrides) -> OuroForCausalLM:
    config = dataclasses.replace(PRESETS["tiny"], **overrides)
    torch.manual_seed(0)
    return OuroForCausalLM(config).init_random_().eval()


# token-sparse prefill's retention for small(): one ratio per loop
SMALL = {"token_sparse_prefill.retention": (1.0, 1.0, 0.25)}


def small() -> OuroForCausalLM:
    """The tiny preset cut to one layer of 3 loops (about a third of the compile time of the whole
    preset): loop 3 still selects (token-sparse prefill, sparse decode) and stores residuals. Its
    configs take SMALL."""
    return tiny(num_hidden_layers=1, total_ut_steps=3)


def ragged_batch(lengths, vocab=256, seed=0):
    """Right-padded ids [B, T] with per-row positions 0..T-1, and the per-row lengths."""
    g = torch.Generator().manual_seed(seed)
    t = max(lengths)
    ids = torch.randint(0, vocab, (len(lengths), t), generator=g)
    pos = torch.arange(t)[None].expand(len(lengths), -1)
    return ids, pos


@pytest.fixture
def hf_models():
    from models.hf_style_ouro import OuroForCausalLM as HFStyle

    return HFStyle
