"""What a compiled graph of the flashloop ops depends on beyond the graph itself, for torch's caches.

torch.compile keeps compiled graphs on disk, across processes: AOTAutograd's cache and Inductor's
FX graph cache. AOTAutograd keys its entry on the graph Dynamo captured, where a flashloop op is
one node. What the op's body decides while Inductor traces it is not in that graph: the kernels,
their launch parameters (module constants next to each kernel) and the Python launchers (split
counts, which kernel a shape takes). Without more, a process running a changed checkout is handed
an earlier process's artifact: its kernels and launch parameters, silently
(tests/test_lowering_key.py shows it).

:class:`LoweringKey` is a post-grad pass that changes nothing and whose ``uuid()`` hashes the
package's source; Inductor puts a custom pass's uuid in both cache keys
(``torch._inductor.custom_graph_pass``). The backend installs it around every compile
(:func:`flashloop_compile.backend._inductor`); a compile of the ops through another backend
(``torch.compile(fn)`` with Inductor) does not get it: use ``backend="flashloop"``, which hands a
graph without recognized loops to Inductor unchanged. Importing this module does not import
Triton.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path
from typing import Any

from torch._inductor.custom_graph_pass import CustomGraphPass

__all__ = ["LoweringKey", "lowering_key", "source_digest"]


def source_digest(root: Path) -> str:
    """SHA-256 (32 hex digits) of every Python file under ``root`` (paths and contents)."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:32]


@functools.lru_cache(maxsize=1)
def lowering_key() -> str:
    """:func:`source_digest` of the package, once per process: the kernels' launch parameters are
    constants in that source."""
    return source_digest(Path(__file__).resolve().parents[1])


class LoweringKey(CustomGraphPass):
    """A post-grad pass that leaves the graph as it is and keys the compile caches on
    :func:`lowering_key`. ``inner``: a post-grad pass already configured, run first and hashed
    too; one that Inductor cannot hash (a plain callable, or a uuid of None) keeps the caches off,
    as it would without this wrapper."""

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
        import flashloop_compile.lowering.lowering_key as this  # (looked up at call time: tests replace it)

        return hashlib.sha256(f"{this.lowering_key()}:{inner}".encode()).hexdigest()[:32]
