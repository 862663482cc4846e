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


# The README tests each run a block or command in a fresh interpreter, the longest (the Python
# block that compiles the shipped checkpoint) for minutes. Collected last (tests/test_readme.py),
# one worker of `pytest -n 2` ran it at the end while the other had nothing left to take; run
# first, the other worker's share of the suite runs beside it.
FIRST = ("test_readme.py",)


def pytest_collection_modifyitems(session, config, items):
    first = [item for item in items if item.path.name in FIRST]
    if first:
        items[:] = first + [item for item in items if item.path.name not in FIRST]
