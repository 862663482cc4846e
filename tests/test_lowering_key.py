"""The compile caches see what the flashloop ops' bodies decide while traced
(flashloop_compile/lowering/lowering_key.py).

torch.compile's on-disk caches (AOTAutograd, Inductor's FX graph cache) key a compile on the graph
Dynamo captured, where a flashloop op is one node. Its body, traced later, picks kernels and launch
parameters from the launch tables; the backend adds their values and the package's source to the
key, so a changed table (a ``FLASHLOOP_*`` override, a test's patch, a tuning run) or a changed
checkout compiles again instead of reusing an earlier artifact."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass

import flashloop_compile  # noqa: F401  (registers backend="flashloop")
from flashloop_compile.lowering.kernels import packed_kv as K
from flashloop_compile.lowering.kernels import sparse_decode as sd
from flashloop_compile.lowering.lowering_key import LoweringKey, lowering_key


@torch.library.triton_op("flashloop_test::by_table", mutates_args=())
def _by_table(x: torch.Tensor) -> torch.Tensor:
    # like the flashloop ops: a body that decides from a launch table while it is traced
    return x + 1 if K.PACKED_READ["num_warps"] == 4 else x * 2


@pytest.fixture
def fresh_caches(tmp_path, monkeypatch):
    """The on-disk compile caches in an empty directory, on (as by default), and counted."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", True)
    monkeypatch.setattr(inductor_config, "fx_graph_cache", True)
    monkeypatch.setattr(inductor_config, "force_disable_caches", False)
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _compiled(x: torch.Tensor) -> torch.Tensor:
    torch._dynamo.reset()  # a new compile, as a new process would make (the disk caches stay)
    return torch.compile(lambda t: torch.ops.flashloop_test.by_table(t), backend="flashloop", fullgraph=True)(x)


def test_a_changed_launch_table_is_compiled_again_not_taken_from_the_cache(fresh_caches, monkeypatch):
    x = torch.full((4,), 3.0)
    monkeypatch.setitem(K.PACKED_READ, "num_warps", 4)
    assert _compiled(x).tolist() == [4.0] * 4
    assert _compiled(x).tolist() == [4.0] * 4
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1  # the same tables: the cached artifact
    monkeypatch.setitem(K.PACKED_READ, "num_warps", 8)
    # without the key, the cache hands back the first artifact: 4.0, the body traced at 4 warps
    assert _compiled(x).tolist() == [6.0] * 4
    assert counters["aot_autograd"]["autograd_cache_hit"] == 1


@pytest.mark.parametrize("table, entry, value", [
    ("FAST_DECODE", "waves", 5), ("PACKED_READ", "fused", False), ("PACKED_REFERENCE", "linear", False),
    ("PACKED_PREFILL", "block_m", 32), ("PACKED_WRITE", "chunks", 3), ("PACKED_CORRECTION", "linear", True),
])
def test_the_key_follows_every_launch_table(monkeypatch, table, entry, value):
    from flashloop_compile.lowering import tables

    home = tables if table == "PACKED_CORRECTION" else K  # (the pass's table lives without Triton)
    assert len(K.LAUNCH_TABLES) == 6 and any(t is getattr(home, table) for t in K.LAUNCH_TABLES.values())
    before = lowering_key()
    assert lowering_key() == before
    monkeypatch.setitem(getattr(home, table), entry, value)
    assert lowering_key() != before


def test_the_key_follows_the_sparse_decode_config(monkeypatch):
    before = lowering_key()
    monkeypatch.setattr(sd, "DEFAULT_CONFIG", dataclasses.replace(sd.DEFAULT_CONFIG, num_stages_corr=1))
    assert lowering_key() != before


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
