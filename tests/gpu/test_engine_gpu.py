"""The engine's decode under CUDA graphs (issue 7): for dense and each feature configuration, on
the tiny preset in BF16, every batch bucket's graph replay equals the same engine's direct
execution on the same cache state, a bucket is captured once and replayed afterwards, and the
number of graphs is the number of buckets used.

One engine per configuration (max_batch 4: buckets 1, 2, 4) prefills three ragged prompts into
slots 0..2, then decodes rounds of STEPS steps at batches 1, 2, 3 and 1 again (buckets 1, 2, 4,
1). Every step runs twice from one snapshot of the caches (dense and packed): through the graph
(``Engine.decode``) and directly (``Engine.decode(graph=False)``); the logits and the written
cache state of the live slots must agree, and generation continues from the graph's state. The
prompts are placed so that packed-cache tail flushes happen inside replayed steps.

Run on the GPU machine: ``TRITON_INTERPRET=0 pytest -m gpu tests/gpu/test_engine_gpu.py`` (about
30-60 s; one test per configuration, so ``-n 4`` spreads them). The engines compile with
``inner="eager"`` (the rewritten graph without Inductor: what is under test is the engine's
graph mechanism -- static inputs, the step plan, packed-cache addresses, buckets -- and Inductor
would add about a minute of compiles per configuration). ``FLASHLOOP_GPU_ENGINE_INNER=inductor``
runs the same checks through Inductor (whole graph, outline_layers off).
"""

from __future__ import annotations

import os

import pytest
import torch

from flashloop_compile.backend import make_backend
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.runtime.engine import BATCH_BUCKETS, Engine

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

INNER = os.environ.get("FLASHLOOP_GPU_ENGINE_INNER", "eager")
_FEATURES = ("token_sparse_prefill", "sparse_decode_attention", "kv_residual_quantization")
CONFIGS = {
    "dense": {},
    "token_sparse": {"token_sparse_prefill.enabled": True},
    "sparse_decode": {"sparse_decode_attention.enabled": True},
    "quant": {"kv_residual_quantization.enabled": True},
    "all_on": {f"{g}.enabled": True for g in _FEATURES},
    "all_on_reuse": {**{f"{g}.enabled": True for g in _FEATURES}, "sparse_decode_attention.reuse_selected_probabilities": True},
}
MAX_BATCH, MAX_SEQ = 4, 256
# slot 0 crosses position 192 in its second step (a packed-tail flush in a bucket-1 replay), slot 1
# crosses 128 in the last step of its first round (a flush in a bucket-2 replay); 16 + 12 + 8
# decode steps stay below MAX_SEQ
PROMPT_LENS = (190, 124, 62)
BATCHES = (1, 2, 3, 1)
STEPS = 4
LIVE = len(PROMPT_LENS)  # slots holding requests; slot 3 only ever holds a padded row
# BF16: the direct run at batch 3 may pick other GEMM kernels than the bucket-4 graph
ATOL = RTOL = 2e-2


@pytest.fixture(scope="module")
def model():
    from flashloop_compile.models.ouro import OuroForCausalLM

    return OuroForCausalLM.from_preset("tiny", dtype=torch.bfloat16, device="cuda", seed=0).eval()


# -- cache state: snapshot, restore, compare (live slots only) ------------------------------------
_SLOT_DIM = {"k_res_min": 1, "k_res_scale": 1, "rows": 1, "res_layout": None, "overflow": None}  # default: dim 0


def _snapshot(engine: Engine) -> dict[str, torch.Tensor]:
    return {n: t.clone() for n, t in engine.state_tensors().items()}


def _restore(engine: Engine, snap: dict[str, torch.Tensor]) -> None:
    for n, t in engine.state_tensors().items():  # in place: the graphs hold these addresses
        t.copy_(snap[n])


def _live(name: str, t: torch.Tensor) -> torch.Tensor:
    """The live slots' part; in the dense caches without position max_seq - 1, where capture
    forwards write (Engine._capture_inputs)."""
    dim = _SLOT_DIM.get(name.split(".")[-1], 0)
    if name.startswith("dense"):
        t = t[:, :, : MAX_SEQ - 1]
    return t if dim is None else t.narrow(dim, 0, LIVE)


def _assert_state_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], where: str) -> None:
    for name in want:
        a, b = _live(name, got[name]), _live(name, want[name])
        if a.is_floating_point():
            torch.testing.assert_close(a.float(), b.float(), atol=ATOL, rtol=RTOL, msg=lambda m: f"{where}: {name}: {m}")
        elif a.dtype == torch.uint8 and name.split(".")[-1] != "depth_count":
            # packed INT4 codes: at most one level apart (a value on a rounding boundary)
            a, b = a.int(), b.int()
            off = torch.maximum((a & 15) - (b & 15), (b & 15) - (a & 15)).max()
            off = torch.maximum(off, ((a >> 4) - (b >> 4)).abs().max())
            assert int(off) <= 1, f"{where}: {name}: INT4 codes differ by {int(off)} levels"
        else:
            assert torch.equal(a, b), f"{where}: {name} differs (counters and maps must match exactly)"


# -- the test -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_graph_replay_equals_direct_execution_and_each_bucket_is_captured_once(name, model, monkeypatch):
    torch._dynamo.reset()
    config = FlashLoopConfig.from_dict(CONFIGS[name])
    engine = Engine(model, config, max_batch=MAX_BATCH, max_seq=MAX_SEQ, cuda_graphs=True,
                    backend=make_backend(config, inner=INNER))
    assert engine.buckets == (1, 2, 4)

    captures: dict[int, int] = {}
    capture = engine._capture

    def counting_capture(bucket):
        captures[bucket] = captures.get(bucket, 0) + 1
        return capture(bucket)

    engine._capture = counting_capture
    forwards = [0]
    compiled = engine.compiled

    def counting_compiled(*args):
        forwards[0] += 1
        return compiled(*args)

    engine.compiled = counting_compiled
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
    buckets_used = set()
    for b in BATCHES:
        bucket = next(x for x in BATCH_BUCKETS if x >= b)
        first_use = bucket not in buckets_used
        buckets_used.add(bucket)
        for step in range(STEPS):
            where = f"{name}: batch {b} (bucket {bucket}) step {step} at positions {pos[:b].tolist()}"
            before = _snapshot(engine)
            f0, r0 = forwards[0], replays[0]
            graph_logits = engine.decode(tok[:b], pos[:b]).float().clone()  # a view of the graph's output: copy it
            assert replays[0] == r0 + 1, f"{where}: the step did not replay a graph"
            if not (first_use and step == 0):
                assert forwards[0] == f0, f"{where}: a replayed step ran the compiled model (recapture or fallback)"
            assert captures == {x: 1 for x in buckets_used}, f"{where}: captures per bucket {captures}"
            after_graph = _snapshot(engine)

            _restore(engine, before)
            f1 = forwards[0]
            direct_logits = engine.decode(tok[:b], pos[:b], graph=False).float()
            assert forwards[0] == f1 + 1 and replays[0] == r0 + 1, f"{where}: graph=False did not run directly"

            # not vacuous: real logits that differ between rows of different prompts
            assert torch.isfinite(graph_logits).all(), where
            assert graph_logits.std(-1).min() > 0.05, f"{where}: degenerate logits"
            if b > 1:
                assert not torch.equal(graph_logits[0], graph_logits[1]), f"{where}: rows are identical"
            torch.testing.assert_close(graph_logits, direct_logits, atol=ATOL, rtol=RTOL, msg=lambda m: f"{where}: {m}")
            top2 = direct_logits.topk(2, -1).values
            clear = top2[:, 0] - top2[:, 1] > 4 * ATOL
            assert torch.equal(graph_logits.argmax(-1)[clear], direct_logits.argmax(-1)[clear]), f"{where}: tokens differ"
            _assert_state_close(after_graph, _snapshot(engine), where)

            _restore(engine, after_graph)  # continue from the graph's state and tokens
            tok[:b] = graph_logits.argmax(-1)
            pos[:b] += 1
    assert engine.packed is None or int(engine.packed.overflow.item()) == 0
    # bounded by the bucket ladder: one graph per bucket used, never more than the ladder allows
    assert captures == {1: 1, 2: 1, 4: 1}
    assert engine.num_graphs == len(buckets_used) == 3 <= len(engine.buckets)
