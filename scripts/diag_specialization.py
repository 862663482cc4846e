"""Where does a dynamic dimension get specialized? Prints the Python stack of every ShapeEnv
replacement of a symbol by a constant, then runs the given pytest arguments.

    python scripts/diag_specialization.py tests/gpu/test_engine_gpu.py -k quant -x
"""

import sys
import traceback

import pytest
import sympy
from torch.fx.experimental import symbolic_shapes

_orig = symbolic_shapes.ShapeEnv._set_replacement


def _set_replacement(self, a, tgt, msg):
    if isinstance(tgt, sympy.Integer) and int(tgt) > 2:
        stack = [f for f in traceback.extract_stack()[:-1] if "flashloop" in f.filename or "tests/" in f.filename]
        print(f"\n=== {a} -> {tgt} ({msg})", file=sys.stderr)
        print("".join(traceback.format_list(stack[-12:])), file=sys.stderr)
        print("".join(traceback.format_list(traceback.extract_stack()[-14:-1])), file=sys.stderr)
    return _orig(self, a, tgt, msg)


symbolic_shapes.ShapeEnv._set_replacement = _set_replacement
sys.exit(pytest.main(sys.argv[1:]))
