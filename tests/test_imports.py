"""The package's import graph, read from the source with ``ast`` (every import statement, also the
ones inside functions): no cycle among flashloop_compile's modules, and the lowering and pass
layers import nothing from the runtime."""

from __future__ import annotations

import ast
from pathlib import Path


PACKAGE = Path(__file__).resolve().parents[1] / "flashloop_compile"


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the flashloop_compile modules it imports (``from a import b`` counts a.b when that
    is a module, else a), every import statement of the file."""
    modules = {_module(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in modules:  # a name inside a module: the module
                    t = t.rpartition(".")[0]
                if t and t != name:
                    deps.add(t)
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle_among_the_package_modules():
    # ``from flashloop_compile.passes.graph import x`` is an edge to passes.graph (Python imports
    # the package's __init__ first, which is only a cycle when that __init__ imports back)
    assert _cycles(import_graph()) == []


def _runtime_imports(layer: str) -> dict[str, list[str]]:
    bad = {m: sorted(d for d in deps if d.startswith("flashloop_compile.runtime"))
           for m, deps in import_graph().items() if m.startswith(layer)}
    return {m: d for m, d in bad.items() if d}


def test_lowering_imports_nothing_from_the_runtime():
    assert _runtime_imports("flashloop_compile.lowering") == {}


def test_passes_import_nothing_from_the_runtime():
    assert _runtime_imports("flashloop_compile.passes") == {}


def test_the_import_graph_sees_function_local_imports():
    graph = import_graph()
    assert "flashloop_compile.lowering.lowering_key" in graph["flashloop_compile.backend"]  # imported in a function
