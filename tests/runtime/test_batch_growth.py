"""A serving engine meets every batch size: a batch of 1, then a larger one (up to max_batch),
recompiles for the new batch size and still equals the reference, for all 8 feature
combinations; through the Engine and through ``torch.compile(model, backend="flashloop")``."""

from __future__ import annotations

import itertools

import pytest
import torch

from flashloop_compile.backend import make_backend
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.reference import ReferenceFlashLoop
from flashloop_compile.runtime.engine import Engine
from passes.conftest import SMALL, small

SWITCHES = list(itertools.product([False, True], repeat=3))
IDS = ["".join("TSQ"[i] if on else "-" for i, on in enumerate(s)) for s in SWITCHES]
PROMPTS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)) for n in (13, 21)]


def _config(switches) -> FlashLoopConfig:
    return FlashLoopConfig.from_switches(*switches, **{"token_sparse_prefill.window": 8,
                                                       **SMALL})


@pytest.mark.parametrize("switches", SWITCHES, ids=IDS)
def test_engine_serves_a_batch_of_one_then_a_full_batch(switches):
    # the recompile for batch 2 (= max_batch) sees the batch size read from the input's shape
    model = small()
    config = _config(switches)
    torch._dynamo.reset()
    eng = Engine(model, config, max_batch=2, max_seq=64, backend=make_backend(config, inner="eager"))
    reference = [ReferenceFlashLoop(model, config).greedy(p, 4).tolist() for p in PROMPTS]
    assert eng.generate(PROMPTS[:1], 4).tokens == reference[:1]
    assert eng.generate(PROMPTS, 4).tokens == reference
    assert eng.generate(PROMPTS[1:], 4).tokens == reference[1:]


def _direct_generate(fn, prompts, steps: int) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy generation by calling the compiled model directly (rows of equal length, no plan):
    the new tokens per row and the logits [B, 1 + steps, V] that chose them."""
    ids = torch.stack(prompts)
    b, t = ids.shape
    pos = torch.arange(t)[None].expand(b, -1).contiguous()
    torch._dynamo.mark_dynamic(ids, 1)
    torch._dynamo.mark_dynamic(pos, 1)
    with torch.no_grad():
        logits = [fn(ids, pos)[:, -1]]
        for step in range(steps):
            logits.append(fn(logits[-1].argmax(-1, keepdim=True), torch.full((b, 1), t + step))[:, -1])
    stacked = torch.stack(logits, 1)
    return stacked.argmax(-1).tolist(), stacked


def _reference(model, config, prompt, steps: int) -> tuple[list[int], torch.Tensor]:
    req = ReferenceFlashLoop(model, config).request()
    logits = [req.prefill(prompt).logits[-1]]
    for _ in range(steps):
        logits.append(req.decode(logits[-1].argmax()[None]).logits[-1])
    stacked = torch.stack(logits)
    return stacked.argmax(-1).tolist(), stacked


EQUAL_PROMPTS = [torch.randint(0, 256, (16,), generator=torch.Generator().manual_seed(n)) for n in (1, 2)]


@pytest.mark.parametrize("switches", SWITCHES, ids=IDS)
def test_compiled_model_serves_a_batch_of_one_then_a_full_batch(switches, monkeypatch):
    # torch.compile(model, backend="flashloop", options=...) on the model's own caches; the
    # rewritten graphs run without Inductor here (Inductor: the slow test below)
    from flashloop_compile import backend

    monkeypatch.setattr(backend, "_inductor", backend._eager)
    model = small()
    config = _config(switches)
    model.setup_caches(2, 64)
    torch._dynamo.reset()
    fn = torch.compile(model, backend="flashloop", options=config.to_dict(), fullgraph=True)
    expected = [_reference(model, config, p, 2) for p in EQUAL_PROMPTS]
    for batch in (EQUAL_PROMPTS[:1], EQUAL_PROMPTS):
        tokens, logits = _direct_generate(fn, batch, 2)
        assert tokens == [t for t, _ in expected[: len(batch)]]
        torch.testing.assert_close(logits, torch.stack([lg for _, lg in expected[: len(batch)]]), rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_model_through_inductor_serves_a_batch_of_one_then_a_full_batch():
    # every feature on, Inductor compiling each graph (minutes on the CPU: one layer per loop)
    model = small()
    config = _config((True, True, True))
    model.setup_caches(2, 64)
    torch._dynamo.reset()
    fn = torch.compile(model, backend="flashloop", options=config.to_dict(), fullgraph=True)
    expected = [_reference(model, config, p, 1) for p in EQUAL_PROMPTS]
    for batch in (EQUAL_PROMPTS[:1], EQUAL_PROMPTS):
        tokens, logits = _direct_generate(fn, batch, 1)
        assert tokens == [t for t, _ in expected[: len(batch)]]
        torch.testing.assert_close(logits, torch.stack([lg for _, lg in expected[: len(batch)]]), rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()
