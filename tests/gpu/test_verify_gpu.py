"""Multi-query decode (``Engine.verify``) under CUDA graphs: for dense and each feature
configuration, on the tiny preset in BF16, the replay of a (batch bucket, k) graph equals the same
engine's direct execution on the same cache state (logits and the written cache), each (bucket, k)
is captured once and replayed afterwards, and ``accept`` after a replay leaves the state that
``accept`` after the direct step leaves.

One engine per configuration (max_batch 4: buckets 1, 2, 4) prefills three ragged prompts into
slots 0..2, then runs verify steps at (batch, k) = (3, 4), (1, 2), (3, 4), (2, 8): buckets 4, 1, 4
(a replay of a captured key) and 2, keeping 1, 1, 2 and 5 tokens per row. Slot 0 (190 prompt
tokens) crosses the packed flush at 192 inside the first step, which keeping 1 token undoes, and
inside the second, which keeping 1 token keeps; slot 1 crosses 128 inside the last step (kept).
Generation continues from the graph's state.

Run on the GPU machine: ``TRITON_INTERPRET=0 pytest -m gpu tests/gpu/test_verify_gpu.py`` (one test
per configuration; ``-n 4`` spreads them). The engines compile with ``inner="eager"`` as
test_engine_gpu.py's do, and for the same reason.
"""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.backend import make_backend
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.runtime.engine import Engine

from .test_engine_gpu import ATOL, CONFIGS, LIVE, MAX_BATCH, MAX_SEQ, PROMPT_LENS, RTOL, _assert_state_close, _restore, _snapshot

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

STEPS = ((3, 4, 1), (1, 2, 1), (3, 4, 2), (2, 8, 5))  # (batch, k, tokens kept)


@pytest.fixture(scope="module")
def model():
    from flashloop_compile.models.ouro import OuroForCausalLM

    return OuroForCausalLM.from_preset("tiny", dtype=torch.bfloat16, device="cuda", seed=0).eval()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_verify_replay_equals_direct_execution_per_bucket_and_k(name, model, monkeypatch):
    torch._dynamo.reset()
    config = FlashLoopConfig.from_dict(CONFIGS[name])
    engine = Engine(model, config, max_batch=MAX_BATCH, max_seq=MAX_SEQ, cuda_graphs=True,
                    backend=make_backend(config, inner="eager"))
    captures: dict[tuple[int, int | None], int] = {}
    capture = engine._capture

    def counting_capture(bucket, k=None):
        captures[(bucket, k)] = captures.get((bucket, k), 0) + 1
        return capture(bucket, k)

    engine._capture = counting_capture
    replays = [0]
    replay = torch.cuda.CUDAGraph.replay

    def counting_replay(self):
        replays[0] += 1
        return replay(self)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counting_replay)

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g) for n in PROMPT_LENS]
    if engine.packed is not None:
        engine.packed.reset()
    tok = engine.prefill(prompts).argmax(-1)
    pos = torch.tensor(PROMPT_LENS, device="cuda")
    assert LIVE == 3
    for step, (b, k, n) in enumerate(STEPS):
        where = f"{name}: step {step}, batch {b}, k={k}, positions {pos[:b].tolist()}"
        drafts = torch.randint(0, model.config.vocab_size, (b, k), generator=g).cuda()
        drafts[:, 0] = tok[:b]
        before = _snapshot(engine)
        r0 = replays[0]
        graph_logits = engine.verify(drafts, pos[:b]).float().clone()  # a view of the graph's output
        assert replays[0] == r0 + 1, f"{where}: the step did not replay a graph"
        assert graph_logits.shape == (b, k, model.config.vocab_size)
        after_graph = _snapshot(engine)
        for row in range(b):
            engine.accept(row, n)
        accepted_graph = _snapshot(engine)

        _restore(engine, before)
        direct_logits = engine.verify(drafts, pos[:b], graph=False).float()
        assert replays[0] == r0 + 1, f"{where}: graph=False replayed a graph"
        assert torch.isfinite(graph_logits).all() and graph_logits.std(-1).min() > 0.05, f"{where}: degenerate logits"
        assert not torch.equal(graph_logits[:, 0], graph_logits[:, 1]), f"{where}: the k rows are identical"
        torch.testing.assert_close(graph_logits, direct_logits, atol=ATOL, rtol=RTOL, msg=lambda m: f"{where}: {m}")
        _assert_state_close(after_graph, _snapshot(engine), where)
        for row in range(b):
            engine.accept(row, n)
        _assert_state_close(accepted_graph, _snapshot(engine), f"{where}, after accept")

        _restore(engine, accepted_graph)  # continue from the graph's state
        tok[:b] = graph_logits[:, n - 1].argmax(-1)
        pos[:b] += n
    assert engine.packed is None or int(engine.packed.overflow.item()) == 0
    assert captures == {(4, 4): 1, (1, 2): 1, (2, 8): 1}, captures
    assert engine.num_graphs == 3
