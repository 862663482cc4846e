import os

import pytest
import torch

# Triton kernels run on CPU tensors through the interpreter in CI; on a GPU machine they compile
# (`pytest -m gpu`). The variable must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(1)


def _fix_interpreter_scalar_index() -> None:
    """Triton 3.6's interpreter turns a scalar into a Python int with ``int(array)``; program ids
    are 1-element arrays there, which NumPy >= 2.4 refuses. Loop bounds derived from the program
    id (``range(start, end, BLOCK)``) need the conversion, so read the single element instead."""
    import numpy as np
    import triton.runtime.interpreter as interpreter

    original = interpreter._patch_lang_tensor
    if getattr(original, "_flashloop_index_fix", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._flashloop_index_fix = True
    interpreter._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _fix_interpreter_scalar_index()


@pytest.fixture(scope="session")
def tiny_model():
    from flashloop_compile.models.ouro import OuroForCausalLM

    return OuroForCausalLM.from_preset("tiny", dtype=torch.float32, seed=0).eval()
