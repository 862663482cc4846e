import os

import pytest


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """GPU tests check the compiled kernels: refuse to run them through the interpreter."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.fail(
            "TRITON_INTERPRET=1 is set (tests/conftest.py sets it only without CUDA), so these tests "
            "would not run the compiled kernels: run `TRITON_INTERPRET=0 pytest -m gpu tests/gpu`"
        )
