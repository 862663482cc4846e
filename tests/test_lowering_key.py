"""The compile caches see what the flashloop ops' bodies decide while traced
(flashloop_compile/lowering/lowering_key.py).

torch.compile's on-disk caches (AOTAutograd, Inductor's FX graph cache) key a compile on the graph
Dynamo captured, where a flashloop op is one node. Its body, traced later, picks kernels and launch
parameters from constants in the package's source; the backend adds that source's digest to the
key, so a changed checkout compiles again instead of reusing an earlier artifact."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

import flashloop_compile  # noqa: F401  (registers backend="flashloop")
from flashloop_compile.lowering import lowering_key as LK
from flashloop_compile.lowering.lowering_key import LoweringKey, lowering_key, source_digest

ROOT = Path(__file__).resolve().parents[1]
_CHECKOUT = {"version": 1}


@torch.library.triton_op("flashloop_test::by_source", mutates_args=())
def _by_source(x: torch.Tensor) -> torch.Tensor:
    # like the flashloop ops: a body whose trace depends on the checkout it runs from
    return x + 1 if _CHECKOUT["version"] == 1 else x * 2


@pytest.fixture
def fresh_caches(tmp_path, monkeypatch):
    """The on-disk compile caches in an empty directory, on (as by default), and counted."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    # the config modules' own patch: monkeypatch's undo leaves torch 2.13's config entries
    # unreadable ("enable_autograd_cache does not exist"), which failed later tests on the worker
    with functorch_config.patch(enable_autograd_cache=True), \
            inductor_config.patch(fx_graph_cache=True, force_disable_caches=False):
        torch._dynamo.reset()
        counters.clear()
        yield
        torch._dynamo.reset()


def _compiled(x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.reset()  # a new compile, as a new process would make (the disk caches stay)
    return torch.compile(lambda t: torch.ops.flashloop_test.by_source(t), backend="flashloop", fullgraph=True)(x)


def test_a_changed_checkout_is_compiled_again_not_taken_from_the_cache(fresh_caches, monkeypatch):
    x = torch.full((4,), 3.0)
    assert _compiled(x).tolist() == [4.0] * 4
    assert _compiled(x).tolist() == [4.0] * 4
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1  # the same source: the cached artifact
    # another checkout: another body and another source digest
    monkeypatch.setitem(_CHECKOUT, "version", 2)
    monkeypatch.setattr(LK, "lowering_key", lambda: "another checkout")
    # without the key, the cache hands back the first artifact: 4.0
    assert _compiled(x).tolist() == [6.0] * 4
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1


def test_the_key_is_the_digest_of_the_package_source(tmp_path):
    copy = tmp_path / "flashloop_compile"
    shutil.copytree(ROOT / "flashloop_compile", copy, ignore=shutil.ignore_patterns("__pycache__"))
    assert source_digest(copy) == lowering_key()
    kernel = copy / "lowering" / "kernels" / "packed_write.py"
    text = kernel.read_text()
    assert "num_warps=2" in text  # a launch parameter the edit below changes
    kernel.write_text(text.replace("num_warps=2", "num_warps=1", 1))
    assert source_digest(copy) != lowering_key()


def test_compiling_with_the_features_off_needs_no_triton():
    # a base install without Triton compiles features-off graphs: nothing on that path imports it
    code = """
import sys
sys.modules["triton"] = None  # import triton now fails
import torch
import flashloop_compile
from flashloop_compile.lowering import lowering_key
assert len(lowering_key.lowering_key()) == 32
m = torch.nn.Linear(4, 4)
out = torch.compile(m, backend="flashloop")(torch.randn(2, 4))
print(tuple(out.shape), sorted(n for n in sys.modules if n.startswith("flashloop_compile.lowering")))
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "(2, 4)" in run.stdout
    loaded = run.stdout.split("(2, 4)")[1]
    kernel_modules = set(re.findall(r"flashloop_compile\.lowering\.kernels\.(\w+)", loaded))
    assert kernel_modules <= {"common"}, kernel_modules  # the Triton kernel modules stay unimported


class _Mine(CustomGraphPass):
    def __init__(self, tag: str) -> None:
        self.tag, self.graphs = tag, []

    def __call__(self, graph) -> None:
        self.graphs.append(graph)

    def uuid(self) -> str:
        return self.tag


def test_a_post_grad_pass_already_configured_is_run_and_hashed():
    mine = _Mine("1")
    LoweringKey(mine)("graph")
    assert mine.graphs == ["graph"]
    assert LoweringKey(_Mine("1")).uuid() == LoweringKey(_Mine("1")).uuid() != LoweringKey(_Mine("2")).uuid()
    assert LoweringKey().uuid() not in (None, LoweringKey(_Mine("1")).uuid())
    # a pass Inductor cannot hash keeps the caches off, as without the wrapper
    assert LoweringKey(lambda graph: None).uuid() is None
