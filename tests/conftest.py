import os

import pytest
import torch

# Triton kernels run on CPU tensors through the interpreter in CI.
os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model():
    from flashloop_compile.models.ouro import OuroForCausalLM

    return OuroForCausalLM.from_preset("tiny", dtype=torch.float32, seed=0).eval()
