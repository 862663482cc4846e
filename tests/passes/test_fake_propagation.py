"""propagate_fake_values (the metadata pass run after each feature pass): a fake kernel that
specializes a dynamic size is named in a warning, since Dynamo later reports only the input."""

import logging

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from flashloop_compile.passes.manager import propagate_fake_values


def _reads_size_as_int(t):
    return t.new_zeros(int(t.shape[0]))


def _graph(fn, value) -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["example_value"] = value
    g.output(g.call_function(fn, (x,)))
    return fx.GraphModule({}, g)


def _dynamic_input():
    mode = FakeTensorMode(shape_env=ShapeEnv())
    return mode.from_tensor(torch.randn(5, 3), static_shapes=False)


def test_a_node_that_specializes_a_dynamic_size_is_named(caplog):
    x = _dynamic_input()
    with caplog.at_level(logging.WARNING, logger="flashloop_compile.passes"):
        propagate_fake_values(_graph(_reads_size_as_int, x))
    assert any("_reads_size_as_int" in r.getMessage() and "to 5" in r.getMessage() for r in caplog.records), caplog.text


def test_symbolic_nodes_stay_quiet(caplog):
    x = _dynamic_input()
    gm = _graph(torch.sin, x)
    with caplog.at_level(logging.WARNING, logger="flashloop_compile.passes"):
        propagate_fake_values(gm)
    # the project's own records only: torch logs at DEBUG under its own names (torch.__trace)
    ours = [r for r in caplog.records if r.name == "flashloop_compile" or r.name.startswith("flashloop_compile.")]
    assert not ours, caplog.text
    out = [n for n in gm.graph.nodes if n.op == "call_function"][0]
    assert isinstance(out.meta["val"].shape[0], torch.SymInt)


def _dispatcher_state(t):
    _dispatcher_state.seen = torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PythonDispatcher)
    return t.clone()


def test_propagation_runs_under_the_python_dispatcher_like_dynamo():
    # Without it, C++ composite kernels (CUDA `linear` on a 3-D input) read sizes as ints and
    # specialize the prompt length of the engine's dynamic prefill graph.
    propagate_fake_values(_graph(_dispatcher_state, _dynamic_input()))
    assert _dispatcher_state.seen is True
