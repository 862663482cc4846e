"""Snapshot and restore under CUDA graphs (issue 35): the scenario of tests/runtime/test_snapshot.py
on the tiny preset in BF16 with decode replayed from graphs. The snapshot is taken right after a
replay with no host sync of the caller's (snapshot synchronizes the device itself), and the restore
writes into the addresses the target's captured graphs replay on.

Run on the GPU machine: ``TRITON_INTERPRET=0 pytest -m gpu tests/gpu/test_snapshot_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from flashloop_compile.backend import make_backend
from flashloop_compile.models.ouro import OuroForCausalLM
from flashloop_compile.runtime.engine import Engine
from runtime.test_snapshot import AFTER, BEFORE, MAX_SEQ, PROMPTS_A, PROMPTS_B, _config, _greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

# BF16: the bytes move exactly; the batch around the moved row differs
ATOL = RTOL = 2e-2


def _engine(config) -> Engine:
    model = OuroForCausalLM.from_preset("tiny", dtype=torch.bfloat16, device="cuda", seed=0).eval()
    return Engine(model, config, max_batch=2, max_seq=MAX_SEQ, cuda_graphs=True, backend=make_backend(config, inner="eager"))


@pytest.mark.parametrize("switches", [(False, False, False), (True, True, True)], ids=["dense", "all_on"])
def test_a_request_moved_between_engines_under_cuda_graphs_continues_as_if_never_moved(switches):
    torch._dynamo.reset()
    config = _config(switches)
    a = _engine(config)
    logits = a.prefill(PROMPTS_A)
    pos = torch.tensor([len(p) for p in PROMPTS_A])
    _, before = _greedy(a, logits, pos, BEFORE)
    logits, pos = before[-1], pos + BEFORE
    data = a.snapshot(1, int(pos[1]), logits=logits[1])
    want_tokens, want_logits = _greedy(a, logits, pos, AFTER)

    torch._dynamo.reset()
    b = _engine(config)
    _, warm = _greedy(b, b.prefill(PROMPTS_B), torch.tensor([len(p) for p in PROMPTS_B]), 1)  # captures bucket 2
    assert b.num_graphs == 1
    request = b.restore(data, 0)  # replaces row 0's request, after the capture
    assert request.logits.device.type == "cuda"
    tokens, after = _greedy(b, torch.stack([request.logits, warm[-1, 1].float()]),
                            torch.tensor([request.position, len(PROMPTS_B[1]) + 1]), AFTER)
    assert b.num_graphs == 1  # replayed on the restored bytes, not recaptured
    assert tokens[:, 0].tolist() == want_tokens[:, 1].tolist()
    torch.testing.assert_close(after[:, 0].float(), want_logits[:, 1].float(), atol=ATOL, rtol=RTOL)
