"""Where does a dynamic dimension get specialized? Prints the Python stack of every ShapeEnv
replacement of a symbol by a constant, then runs the given pytest arguments.

    python scripts/diag_specialization.py -m gpu tests/gpu/test_engine_gpu.py -k "quant and not sparse" -x -p no:cacheprovider
"""

import sys
import traceback

import pytest
import sympy
import torch
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

# Name the FX node being propagated when it happens (flashloop's fake propagation after a pass).
from torch.fx.passes.fake_tensor_prop import FakeTensorProp  # noqa: E402

_current: list = []
_orig_run_node = FakeTensorProp.run_node


def _run_node(self, n):
    _current.append(n)
    try:
        return _orig_run_node(self, n)
    finally:
        _current.pop()


FakeTensorProp.run_node = _run_node
_orig_set = _set_replacement


def _describe(x):
    # no repr of symbolic shapes: printing one resolves replacements and re-enters this hook
    return f"tensor(ndim={x.dim()}, {x.dtype}, {x.device})" if isinstance(x, torch.Tensor) else type(x).__name__


def _set_replacement_with_node(self, a, tgt, msg):
    if _current and isinstance(tgt, sympy.Integer) and int(tgt) > 2:
        n = _current[-1]
        args = [_describe(getattr(x, "meta", {}).get("val", x)) for x in n.args]
        print(f"=== while propagating {n.op} {n.name} target {n.target}\n    args {args}\n"
              f"    from {(n.meta.get('stack_trace') or '')[-600:]}", file=sys.stderr)
    return _orig_set(self, a, tgt, msg)


symbolic_shapes.ShapeEnv._set_replacement = _set_replacement_with_node
sys.exit(pytest.main(sys.argv[1:]))
