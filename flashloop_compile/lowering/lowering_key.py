"""What a compiled graph of the flashloop ops depends on beyond the graph itself, for torch's caches.

torch.compile keeps compiled graphs on disk, across processes: AOTAutograd's cache and Inductor's
FX graph cache. AOTAutograd keys its entry on the graph Dynamo captured, where a flashloop op is
one node. What the op's body decides while Inductor traces it is not in that graph: the launch
tables (``packed_kv.FAST_DECODE``, ``PACKED_READ``, ``PACKED_REFERENCE``, ``PACKED_PREFILL``,
``PACKED_WRITE``, ``sparse_decode.DEFAULT_CONFIG``, with their ``FLASHLOOP_*`` overrides) and
the Python launchers themselves (split counts, which kernel a mode takes). Without more, a process
that changes a table, or runs a changed checkout, is handed an earlier process's artifact: its
kernels and launch parameters, silently (tests/test_lowering_key.py shows it).

:class:`LoweringKey` is a post-grad pass that changes nothing and whose ``uuid()`` hashes the
tables' current values and the package's source; Inductor puts a custom pass's uuid in both cache
keys (``torch._inductor.custom_graph_pass``). The backend installs it around every compile
(:func:`flashloop_compile.backend._inductor`); a compile of the ops through another backend
(``torch.compile(fn)`` with Inductor) does not get it: use ``backend="flashloop"``, which hands a
graph without recognized loops to Inductor unchanged.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = ["LoweringKey", "launch_tables", "lowering_key"]


@functools.lru_cache(maxsize=1)
def _source_digest() -> str:
    """SHA-256 of every Python file of the package (paths and contents), once per process."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def launch_tables() -> dict[str, Any]:
    """The launch tables as the ops' bodies would read them now (overrides and patches included):
    every table packed_kv registered, by its environment variable, and the sparse decode config."""
    from flashloop_compile.lowering.kernels import packed_kv as K
    from flashloop_compile.lowering.kernels import sparse_decode as sd

    tables: dict[str, Any] = {env: dict(table) for env, table in K.LAUNCH_TABLES.items()}
    tables["sparse_decode.DEFAULT_CONFIG"] = dataclasses.asdict(sd.DEFAULT_CONFIG)
    return tables


def lowering_key() -> str:
    """Hash of the package's source and the launch tables' current values."""
    tables = json.dumps(launch_tables(), sort_keys=True, default=repr)
    return hashlib.sha256((_source_digest() + tables).encode()).hexdigest()[:32]


class LoweringKey(CustomGraphPass):
    """A post-grad pass that leaves the graph as it is and keys the compile caches on
    :func:`lowering_key` (taken when Inductor asks, that is at each compile). ``inner``: a post-grad
    pass already configured, run first and hashed too; one that Inductor cannot hash (a plain
    callable, or a uuid of None) keeps the caches off, as it would without this wrapper."""

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner

    def __call__(self, graph: Any) -> None:
        if self.inner is not None:
            self.inner(graph)

    def uuid(self) -> str | None:
        inner = ""
        if self.inner is not None:
            inner = self.inner.uuid() if isinstance(self.inner, CustomGraphPass) else None
            if inner is None:
                return None
        return hashlib.sha256(f"{lowering_key()}:{inner}".encode()).hexdigest()[:32]
