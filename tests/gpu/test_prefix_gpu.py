"""Prefix reuse under CUDA graphs (issue 35): the scenario of tests/runtime/test_prefix.py on the
tiny preset (one layer, three loops) in BF16 with decode replayed from graphs. The copies land in
the addresses the captured decode graph replays on, after its capture: the decode after reuse
replays that graph (no recapture) and continues as the in-place run does.

Run on the GPU machine: ``TRITON_INTERPRET=0 pytest -m gpu tests/gpu/test_prefix_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.backend import make_backend
from flashloop_compile.runtime.engine import Engine
from passes.conftest import small
from runtime.test_prefix import A, B, C, D, MAX_SEQ, STEPS, _config
from runtime.test_snapshot import _greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ATOL = RTOL = 2e-2  # BF16: the bytes move exactly; a different batch around the row rounds differently


@pytest.mark.parametrize("switches", [(False, False, False), (True, True, True)], ids=["dense", "all_on"])
def test_a_reused_prefix_under_cuda_graphs_continues_as_the_in_place_run(switches):
    torch._dynamo.reset()
    config = _config(switches)
    model = small().to(device="cuda", dtype=torch.bfloat16)
    engine = Engine(model, config, max_batch=3, max_seq=MAX_SEQ, cuda_graphs=True,
                    backend=make_backend(config, inner="eager"))
    n = 32 if switches[0] else 40  # whole windows of the 40 shared tokens where token-sparse prefill selects
    engine.prefill([B[:n], C, A])  # row 2 holds A: the cached request
    logits = engine.prefill([B, C], cached=[n, 0])
    in_place, in_place_logits = _greedy(engine, logits, torch.tensor([len(B), len(C)]), STEPS)  # captures bucket 2
    graphs = engine.num_graphs

    assert engine.reuse_prefix(2, 0, 40) == n
    assert engine.reuse_prefix(2, 1, 40) == n
    logits = engine.prefill([B, D], cached=[n, n])
    tokens, out = _greedy(engine, logits, torch.tensor([len(B), len(D)]), STEPS)
    assert engine.num_graphs == graphs  # replayed on the copied bytes, not recaptured
    assert tokens[:, 0].tolist() == in_place[:, 0].tolist()
    torch.testing.assert_close(out[:, 0].float(), in_place_logits[:, 0].float(), atol=ATOL, rtol=RTOL)
