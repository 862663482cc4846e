"""FX graph helpers shared by the passes: op classification and the canonical graph printer.

Dynamo graphs spell one operation several ways (``torch.matmul``, ``operator.matmul``,
``x.matmul(...)``; ``F.softmax``, ``x.softmax(...)``; ATen overloads in exported graphs). The
``is_*`` predicates accept every spelling so recognition reasons about operations, not spellings.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx as fx

__all__ = [
    "GraphSnapshot",
    "runtime_buffer",
    "lift_runtime_buffers",
    "canonical_names",
    "val",
    "shape_of",
    "dtype_of",
    "op_name",
    "is_op",
    "input_nodes",
    "VIEW_OPS",
    "canonical_graph",
    "fmt_val",
]

aten = torch.ops.aten


def val(n: Any) -> Any:
    """The example value (a FakeTensor, SymInt, ...) FX recorded for a node, or None."""
    if not isinstance(n, fx.Node):
        return n
    return n.meta.get("example_value", n.meta.get("val"))


def shape_of(n: Any) -> tuple | None:
    v = val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype_of(n: Any) -> torch.dtype | None:
    v = val(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _target_name(target: Any) -> str:
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1] + ("" if target._overloadname == "default" else f".{target._overloadname}")
    if isinstance(target, torch._ops.OpOverloadPacket):
        return target._qualified_op_name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def op_name(n: fx.Node) -> str:
    """A canonical operation name: 'linear', 'setitem', '.view', 'flashloop.reference_attention', ..."""
    if n.op == "call_method":
        return "." + n.target
    if n.op == "call_function":
        t = n.target
        if isinstance(t, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            ns = (t.namespace if isinstance(t, torch._ops.OpOverload) else t._qualified_op_name.split("::")[0])
            return (f"{ns}." if ns not in ("aten",) else "") + _target_name(t)
        return _target_name(t)
    return n.op


# Every spelling of an operation, by kind. Names are op_name() results, with the leading '.' of
# methods stripped for the comparison.
_SPELLINGS: dict[str, set[str]] = {
    "linear": {"linear"},
    "sdpa": {"scaled_dot_product_attention"},
    "softmax": {"softmax", "_softmax", "softmax.int"},
    "matmul": {"matmul", "bmm", "mm"},
    "transpose": {"transpose", "transpose.int", "t", "permute", "swapaxes", "mT"},
    "cat": {"cat"},
    "setitem": {"setitem"},
    "inplace_write": {"index_copy_", "index_put_", "copy_", "scatter_", "index_copy", "index_put"},
    "compare": {"le", "lt", "ge", "gt", "eq", "ne", "le.Tensor", "lt.Tensor", "ge.Tensor", "gt.Tensor"},
    "triangle": {"triu", "tril"},
    "select_where": {"where", "masked_fill", "masked_fill_", "where.self", "masked_fill.Scalar"},
    "embedding": {"embedding"},
    "repeat_interleave": {"repeat_interleave"},
    "expand": {"expand", "expand_as"},
    "reshape": {"reshape", "view", "flatten", "unflatten", "_unsafe_view"},
    "getitem": {"getitem"},
    "dtype_cast": {"to", "float", "type", "type_as", "half", "bfloat16", "_to_copy", "contiguous", "clone"},
    "dropout": {"dropout"},
    "add": {"add", "iadd", "add.Tensor"},
    "scale": {"mul", "truediv", "div", "mul.Tensor", "div.Tensor", "imul", "itruediv"},
}

VIEW_OPS = _SPELLINGS["reshape"] | _SPELLINGS["transpose"] | _SPELLINGS["expand"] | {"getitem", "unsqueeze", "squeeze", "contiguous"}


def is_op(n: Any, kind: str) -> bool:
    """Whether node ``n`` performs operation ``kind`` (a key of the spelling table)."""
    if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
        return False
    name = op_name(n).lstrip(".")
    if kind == "compare" and n.op == "call_function" and n.target in (operator.le, operator.lt, operator.ge, operator.gt):
        return True
    return name in _SPELLINGS[kind]


def input_nodes(n: fx.Node) -> list[fx.Node]:
    """Direct node inputs in argument order (kwargs included), without duplicates."""
    return list(dict.fromkeys(n.all_input_nodes))


def arg(n: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Positional-or-keyword argument of a call node."""
    if len(n.args) > index:
        return n.args[index]
    return n.kwargs.get(name, default)


def flatten_args(a: Any) -> Iterator[Any]:
    if isinstance(a, (list, tuple)):
        for x in a:
            yield from flatten_args(x)
    elif isinstance(a, dict):
        for x in a.values():
            yield from flatten_args(x)
    elif isinstance(a, slice):
        yield from flatten_args((a.start, a.stop, a.step))
    else:
        yield a


# --- canonical printing ----------------------------------------------------------------------------

_DTYPE_ABBR = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "b8",
}


def fmt_val(v: Any) -> str:
    """'f32[2, 5, 64]' for tensors; symbolic sizes print as their expression."""
    if isinstance(v, torch.Tensor):
        return f"{_DTYPE_ABBR.get(v.dtype, str(v.dtype))}[{', '.join(str(s) for s in v.shape)}]"
    if isinstance(v, (list, tuple)):
        return "(" + ", ".join(fmt_val(x) for x in v) + ")"
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return f"sym({v})"
    return type(v).__name__ if v is not None else "none"


def _fmt_arg(a: Any, names: dict[fx.Node, str]) -> str:
    if isinstance(a, fx.Node):
        return names.get(a, "?")
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_fmt_arg(x, names) for x in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k}={_fmt_arg(v, names)}" for k, v in a.items()) + "}"
    if isinstance(a, slice):
        return f"{_fmt_arg(a.start, names) if a.start is not None else ''}:{_fmt_arg(a.stop, names) if a.stop is not None else ''}" + (
            f":{_fmt_arg(a.step, names)}" if a.step is not None else ""
        )
    if isinstance(a, torch.dtype):
        return _DTYPE_ABBR.get(a, str(a))
    if isinstance(a, torch.device):
        return "device"
    if a is Ellipsis:
        return "..."
    if isinstance(a, float):
        return repr(a)
    return repr(a)


def canonical_names(graph: fx.Graph, known: dict[fx.Node, str] | None = None) -> dict[fx.Node, str]:
    """Stable node names: placeholders ``%inN``, other nodes ``%N`` in program order. Nodes
    already in ``known`` keep their name; nodes not in it are named ``%newN``."""
    names: dict[fx.Node, str] = {}
    n_in = n_op = n_new = 0
    for n in graph.nodes:
        if n.op == "output":
            continue
        if known is not None:
            if n in known:
                names[n] = known[n]
            else:
                names[n] = f"%new{n_new}"
                n_new += 1
        elif n.op == "placeholder":
            names[n] = f"%in{n_in}"
            n_in += 1
        else:
            names[n] = f"%{n_op}"
            n_op += 1
    return names


def canonical_graph(
    gm: fx.GraphModule | fx.Graph,
    *,
    label: Callable[[fx.Node], str | None] | None = None,
    nodes: Iterable[fx.Node] | None = None,
    names: dict[fx.Node, str] | None = None,
) -> str:
    """A stable text form of a graph: op, renumbered operands, dtype/shape; no torch node names.

    Placeholders print as ``%inN``; other nodes as ``%N`` (see :func:`canonical_names`).
    ``label(node)`` may add a note.
    """
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    names = names if names is not None else canonical_names(graph)
    lines = []
    chosen = set(nodes) if nodes is not None else None
    for n in graph.nodes:
        if chosen is not None and n not in chosen:
            continue
        note = label(n) if label else None
        suffix = f"  # {note}" if note else ""
        if n.op == "placeholder":
            lines.append(f"{names[n]} = input : {fmt_val(val(n))}{suffix}")
        elif n.op == "output":
            lines.append(f"return {_fmt_arg(n.args[0], names)}")
        elif n.op == "get_attr":
            lines.append(f"{names[n]} = get_attr : {fmt_val(val(n))}{suffix}")
        else:
            args = [_fmt_arg(a, names) for a in n.args] + [f"{k}={_fmt_arg(v, names)}" for k, v in n.kwargs.items() if k != "device"]
            lines.append(f"{names[n]} = {op_name(n)}({', '.join(args)}) : {fmt_val(val(n))}{suffix}")
    return "\n".join(lines) + "\n"


class GraphSnapshot:
    """Canonical text of a graph before an in-place rewrite, for a readable diff after it.

    Nodes that survive the rewrite keep their names, so the diff shows only what the pass removed
    (``-`` lines) and added (``+`` lines, new nodes named ``%newN``).
    """

    def __init__(self, gm: fx.GraphModule) -> None:
        self.names = canonical_names(gm.graph)
        self.text = canonical_graph(gm, names=self.names)

    def diff(self, gm: fx.GraphModule) -> str:
        import difflib

        after = canonical_graph(gm, names=canonical_names(gm.graph, self.names))
        lines = difflib.unified_diff(self.text.splitlines(), after.splitlines(), lineterm="", n=0)
        return "\n".join(ln for ln in lines if not ln.startswith(("---", "+++", "@@"))) + "\n"


def runtime_buffer(gm: fx.GraphModule, name: str, tensor: torch.Tensor) -> fx.Node:
    """A get_attr node for a runtime-owned tensor (step plan, packed cache), registered once as a
    non-persistent buffer of the graph module and read at the top of the graph. The backend lifts
    these to graph inputs before compiling (:func:`lift_runtime_buffers`)."""
    if not hasattr(gm, name):
        gm.register_buffer(name, tensor, persistent=False)
        gm.__dict__.setdefault(_RUNTIME_NAMES, []).append(name)
    for n in gm.graph.nodes:
        if n.op == "get_attr" and n.target == name:
            return n
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        return gm.graph.get_attr(name)


_RUNTIME_NAMES = "_flashloop_runtime_buffers"


def lift_runtime_buffers(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[torch.Tensor]]:
    """A copy of ``gm`` taking the runtime buffers :func:`runtime_buffer` registered as trailing
    graph inputs, and those tensors in input order.

    AOTAutograd lifts a module's buffers to inputs and, for a graph Dynamo captured, looks each one
    up in Dynamo's own records (``param_name_to_source``), which do not know buffers a pass added;
    graph inputs need no such record. The caller passes the returned tensors, the same objects on
    every call (static addresses, as CUDA-graph replay needs). ``gm`` itself keeps its inputs:
    Dynamo reads its placeholders after the backend returns. The copy keeps ``gm``'s metadata
    (``meta``, Dynamo's attributes and per-input sources), so it is still compiled as a Dynamo graph.
    """
    import copy

    from torch._subclasses.fake_tensor import FakeTensor

    names = gm.__dict__.pop(_RUNTIME_NAMES, [])
    if not names:
        return gm, []
    graph = copy.deepcopy(gm.graph)
    for old, new in zip(gm.graph.nodes, graph.nodes):  # node for node, in order
        if hasattr(old, "_dynamo_source"):
            new._dynamo_source = old._dynamo_source
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    getters = {n.target: n for n in graph.nodes if n.op == "get_attr" and n.target in names}
    mode = next((v.fake_mode for v in map(val, placeholders) if isinstance(v, FakeTensor)), None)
    tensors: list[torch.Tensor] = []
    last = placeholders[-1] if placeholders else None
    for name in names:
        getter = getters.get(name)
        if getter is None:  # registered, then every read of it was removed
            continue
        tensor = getattr(gm, name)
        if last is None:
            with graph.inserting_before(next(iter(graph.nodes))):
                node = graph.placeholder(name)
        else:
            with graph.inserting_after(last):
                node = graph.placeholder(name)
        node.meta.update(getter.meta)
        if mode is not None:  # static shapes: the fake tensor AOTAutograd will make of it
            node.meta["val"] = node.meta["example_value"] = mode.from_tensor(tensor, static_shapes=True)
        node._dynamo_source = None  # as Dynamo's DDP optimizer marks inputs without a user source
        getter.replace_all_uses_with(node)
        graph.erase_node(getter)
        tensors.append(tensor)
        last = node
    graph.lint()
    lifted = fx.GraphModule(gm, graph)
    for key, value in gm.__dict__.items():
        lifted.__dict__.setdefault(key, value)
    lifted.meta = gm.meta
    return lifted, tensors


def sdpa_args(n: fx.Node) -> dict[str, Any]:
    return {
        "q": arg(n, 0, "query"),
        "k": arg(n, 1, "key"),
        "v": arg(n, 2, "value"),
        "mask": arg(n, 3, "attn_mask"),
        "dropout_p": arg(n, 4, "dropout_p", 0.0),
        "is_causal": arg(n, 5, "is_causal", False),
        "scale": arg(n, 6, "scale"),
        "enable_gqa": n.kwargs.get("enable_gqa", False),
    }

