"""Recognize the recurrent block and its attention/KV-cache sites in a Dynamo FX graph.

Recognition works from structure and dataflow, never from module or parameter names:

1. **Shared weights and R.** A looped model applies the same weights once per loop, so its
   weights are graph inputs with R uses. For each candidate use count c, the j-th use of every
   such input is assigned loop j and loop indices are propagated along dataflow (mutations of
   a cache buffer order later reads of it). A candidate is consistent when no node depends on a
   later loop than its own weights say; the consistent c with the most shared inputs is R.
2. **Isomorphism.** The nodes of each loop, in program order, must match loop 1's one to one
   (same operation, operands from the same position of the same loop, the same shared weight, or
   structurally equal loop-invariant values). Operands that come from the previous loop are the
   loop-carried state H[r-1]; exactly one is allowed. Per-loop inputs that differ between loops
   (one cache buffer per loop and layer) are recorded. What follows the last loop is the coda.
3. **Attention sites.** Scaled-dot-product calls and eager matmul-softmax-matmul chains inside a
   loop, in program order, are that loop's layers. For each site: q, k, v; the key source (an
   in-place cache write, a concatenation with a past tensor, or the current keys); positions;
   the mask and whether it is causal by absolute position.

The result is a :class:`LoopStructure`. Failures raise :class:`RecognitionError` subclasses that
name the node and what was expected.
"""

from __future__ import annotations

import operator
import os
import re
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.fx as fx

from flashloop_compile.passes.graph import (
    VIEW_OPS,
    arg,
    dtype_of,
    flatten_args,
    fmt_val,
    input_nodes,
    is_op,
    op_name,
    sdpa_args,
    shape_of,
    val,
)

__all__ = [
    "RecognitionError",
    "NoRecurrentBlockError",
    "LoopMismatchError",
    "UnsupportedAttentionError",
    "UnrecognizedKVSourceError",
    "require_inplace_cache",
    "CacheSite",
    "AttentionSite",
    "LoopStructure",
    "recognize",
    "fresh_prompt",
]


class RecognitionError(RuntimeError):
    """The graph does not have the structure a FlashLoop feature needs."""


class NoRecurrentBlockError(RecognitionError):
    pass


class LoopMismatchError(RecognitionError):
    pass


class UnsupportedAttentionError(RecognitionError):
    pass


class UnrecognizedKVSourceError(RecognitionError):
    pass


def describe(n: Any) -> str:
    """A node as users see it: operation, value type and the source line Dynamo recorded."""
    if not isinstance(n, fx.Node):
        return repr(n)
    return f"node '{n.name}' ({op_name(n)} -> {fmt_val(val(n))}){_source_line(n)}"


def _source_line(n: fx.Node) -> str:
    """' (model.py:123: `code`)' from the stack trace Dynamo recorded, or ''."""
    stack = n.meta.get("stack_trace") or ""
    lines = [ln for ln in stack.splitlines() if ln.strip()]
    for i in range(len(lines) - 1, -1, -1):
        m = re.match(r'\s*File "([^"]+)", line (\d+), in (\S+)', lines[i])
        if m:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f" ({os.path.basename(m.group(1))}:{m.group(2)}: `{code}`)"
    return ""


@dataclass
class CacheSite:
    """Where an attention site's keys and values come from.

    kind: "inplace" — K/V written into a persistent buffer at ``positions`` and read back;
    "concat" — the current K/V appended to past tensors; "none" — the current K/V only.
    """

    kind: Literal["inplace", "concat", "none"]
    k_new: fx.Node
    v_new: fx.Node
    k_buffer: fx.Node | None = None
    v_buffer: fx.Node | None = None
    writes: tuple[fx.Node, ...] = ()
    positions: fx.Node | None = None


def require_inplace_cache(feature: str, site: "AttentionSite", why: str = "") -> None:
    """Raise unless ``site`` reads a KV cache written in place at per-row positions, saying what
    to change: a concat cache (a Hugging Face model's DynamicCache) needs the conversion to this
    project's model, a model without a cache needs ``setup_caches``."""
    cache = site.cache
    if cache is not None and cache.kind == "inplace" and cache.positions is not None:
        return
    where = f"the attention at {describe(site.node)} (loop {site.loop + 1}, layer {site.layer})"
    convert = (
        "convert a Hugging Face Ouro with flashloop_compile.models.ouro.OuroForCausalLM.from_hf(hf_model_or_path) "
        "(the same weights, logits equal) and call its setup_caches(max_batch, max_seq) before compiling"
    )
    if cache is not None and cache.kind == "concat":
        found = "a 'concat' cache (grown by torch.cat, as transformers' DynamicCache is)"
        todo = convert
    elif cache is not None and cache.kind == "none":
        found = "a 'none' cache (the current keys only: no cache buffer is written)"
        todo = f"call model.setup_caches(max_batch, max_seq) before compiling; {convert}"
    else:
        found = "no cache written at per-row positions"
        todo = convert
    raise RecognitionError(
        f"{feature} needs a KV cache written in place at per-row positions{f' ({why})' if why else ''}; "
        f"{where} reads {found}: {todo}"
    )


@dataclass
class AttentionSite:
    loop: int  # zero-based depth
    layer: int
    kind: Literal["sdpa", "eager"]
    node: fx.Node  # the attention output (SDPA call, or the probability @ V matmul)
    q: fx.Node
    k: fx.Node  # keys as attended (cache read / concat result / current keys), before repeat_kv
    v: fx.Node
    cache: CacheSite | None
    mask: fx.Node | None
    mask_kind: str  # "causal-position", "causal-index", "none", or "unsupported: <why>"
    query_len: Any
    gqa_repeat: bool = False

    @property
    def mask_supported(self) -> bool:
        return not self.mask_kind.startswith("unsupported")


@dataclass
class LoopStructure:
    num_loops: int
    num_layers: int
    loops: list[list[fx.Node]]  # each loop's body nodes in program order (the coda excluded)
    states: list[fx.Node]  # H[0] (loop-1 input) .. H[R] (output of the last loop)
    shared_weights: list[fx.Node]
    loop_inputs: list[fx.Node]  # loop-invariant values the body reads (positions, cos/sin, masks, ...)
    per_loop_inputs: list[list[fx.Node]]  # inputs that differ per loop (one entry per loop)
    sites: list[AttentionSite]
    exit_gates: list[fx.Node]
    coda: list[fx.Node]
    positions: list[fx.Node] = field(default_factory=list)

    def site(self, loop: int, layer: int) -> AttentionSite:
        return self.sites[loop * self.num_layers + layer]

    @property
    def query_len(self) -> Any:
        return self.sites[0].query_len if self.sites else None

    def summary(self) -> str:
        """Stable text for expect tests and ``flashloop-compile inspect``."""
        h0 = self.states[0]
        lines = [
            f"recurrent block: R={self.num_loops} loops x N={self.num_layers} layers, "
            f"{len(self.loops[0])} nodes per loop, {len(self.shared_weights)} shared weights",
            f"state: H[0] = {op_name(h0)} {fmt_val(val(h0))}; H[r] = {op_name(self.states[1])} {fmt_val(val(self.states[1]))}",
            "loop inputs: " + (", ".join(f"{op_name(n)} {fmt_val(val(n))}" for n in self.loop_inputs) or "none"),
            f"per-loop inputs: {len(self.per_loop_inputs[0]) if self.per_loop_inputs else 0} per loop",
            "positions: " + (", ".join(fmt_val(val(p)) for p in self.positions) or "none"),
            f"exit gate: {f'linear -> {fmt_val(val(self.exit_gates[0]))} per loop' if self.exit_gates else 'none'}",
            "coda: " + (", ".join(op_name(n) for n in self.coda if n.op in ("call_function", "call_method")) or "none"),
            "attention sites:",
        ]
        described: dict[str, list[str]] = {}
        for s in self.sites:
            described.setdefault(_site_text(s), []).append(f"(loop {s.loop + 1}, layer {s.layer})")
        for text, where in described.items():
            at = where[0] if len(where) == 1 else f"{len(where)} sites {where[0]}..{where[-1]}"
            lines.append(f"  {at}: {text}")
        return "\n".join(lines) + "\n"


def _site_text(s: AttentionSite) -> str:
    cache = s.cache
    src = "?" if cache is None else cache.kind
    if cache is not None and cache.kind == "inplace":
        src += f" buffer {fmt_val(val(cache.k_buffer))}"
    elif cache is not None and cache.kind == "concat":
        src += f" past {fmt_val(val(cache.k_buffer))}"
    return (
        f"{s.kind}: q {fmt_val(val(s.q))} k {fmt_val(val(s.k))}{' repeat_kv' if s.gqa_repeat else ''}; "
        f"kv {src}; mask {s.mask_kind}; query_len {s.query_len}"
    )


# --- step 1: shared weights and loop assignment ---------------------------------------------------


def _mutated_base(n: fx.Node) -> fx.Node | None:
    """The tensor an in-place node writes, traced to its root through views."""
    if n.op == "call_function" and n.target is operator.setitem:
        base = n.args[0]
    elif is_op(n, "inplace_write") and op_name(n).endswith("_"):
        base = n.args[0]
    else:
        return None
    while isinstance(base, fx.Node) and base.op in ("call_function", "call_method") and op_name(base).lstrip(".") in VIEW_OPS:
        base = base.args[0]
    return base if isinstance(base, fx.Node) else None


def _root(n: fx.Node) -> fx.Node:
    while n.op in ("call_function", "call_method") and op_name(n).lstrip(".") in VIEW_OPS and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


class _Dataflow:
    """Node order, dependencies (with mutation order), users."""

    def __init__(self, graph: fx.Graph) -> None:
        self.nodes = [n for n in graph.nodes if n.op not in ("output",)]
        self.pos = {n: i for i, n in enumerate(self.nodes)}
        self.deps: dict[fx.Node, list[fx.Node]] = {}
        last_write: dict[fx.Node, fx.Node] = {}
        self.writes: dict[fx.Node, list[fx.Node]] = defaultdict(list)
        for n in self.nodes:
            deps = input_nodes(n)
            extra = [last_write[_root(d)] for d in deps if _root(d) in last_write and last_write[_root(d)] is not n]
            self.deps[n] = list(dict.fromkeys(deps + extra))
            base = _mutated_base(n)
            if base is not None:
                last_write[base] = n
                self.writes[base].append(n)
        self.users: dict[fx.Node, list[fx.Node]] = defaultdict(list)
        for n in self.nodes:
            for d in self.deps[n]:
                self.users[d].append(n)


def _weight_like(n: fx.Node) -> bool:
    v = val(n)
    return n.op in ("placeholder", "get_attr") and isinstance(v, torch.Tensor) and v.is_floating_point()


def _assign_loops(df: _Dataflow, shared: set[fx.Node]) -> tuple[dict[fx.Node, int], dict[fx.Node, int]] | None:
    """(anchors, depth): anchors map each user of a shared weight to its loop (the use's ordinal);
    depth is the latest loop a node depends on (-1: loop-invariant). None if inconsistent."""
    anchors: dict[fx.Node, int] = {}
    for w in shared:
        for j, u in enumerate(sorted(set(df.users[w]), key=df.pos.get)):
            if anchors.get(u, j) != j:
                return None
            anchors[u] = j
    depth: dict[fx.Node, int] = {}
    for n in df.nodes:
        dep = max((depth[d] for d in df.deps[n] if d in depth), default=-1)
        if n in anchors:
            if dep > anchors[n]:
                return None
            dep = anchors[n]
        depth[n] = dep
    return anchors, depth


def _find_shared(df: _Dataflow) -> tuple[set[fx.Node], "_Loops"]:
    counts: dict[int, set[fx.Node]] = defaultdict(set)
    for n in df.nodes:
        # Weights are read-only: inputs written in place (cache buffers) are state, not weights.
        if _weight_like(n) and n not in df.writes:
            c = len(set(df.users[n]))
            if c >= 2:
                counts[c].add(n)
    best: tuple[set[fx.Node], _Loops] | None = None
    first_error: RecognitionError | None = None
    for c, ws in sorted(counts.items()):
        if len(ws) < 2 or (best is not None and len(ws) <= len(best[0])):
            continue
        assigned = _assign_loops(df, ws)
        if assigned is None:
            continue
        try:
            best = (ws, _match_loops(df, ws, c, *assigned))
        except LoopMismatchError as e:
            first_error = first_error or e
    if best is None:
        if first_error is not None:
            raise first_error
        raise NoRecurrentBlockError(
            "no recurrent block found: a looped model applies the same weights once per loop, but no set of "
            "weights in this graph is used the same number of times (>= 2) in a consistent loop order. "
            "FlashLoop features need a looped (recurrent-depth) model; compile with all features off for "
            "other models"
        )
    return best


# --- step 2: isomorphism -------------------------------------------------------------------------


def _struct_key(n: Any, memo: dict) -> Any:
    """A hashable structural identity of a loop-invariant value (same computation => same key)."""
    if not isinstance(n, fx.Node):
        if isinstance(n, (list, tuple)):
            return (type(n).__name__, tuple(_struct_key(x, memo) for x in n))
        if isinstance(n, dict):
            return ("dict", tuple((k, _struct_key(v, memo)) for k, v in n.items()))
        if isinstance(n, slice):
            return ("slice", _struct_key(n.start, memo), _struct_key(n.stop, memo), _struct_key(n.step, memo))
        return ("const", repr(n))
    if n in memo:
        return memo[n]
    if n.op in ("placeholder", "get_attr"):
        key: Any = ("input", n)
    else:
        key = (n.op, op_name(n), _struct_key(n.args, memo), _struct_key(dict(n.kwargs), memo))
    memo[n] = key
    return key


@dataclass
class _Loops:
    bodies: list[list[fx.Node]]  # per loop, program order
    carried: dict[fx.Node, list[fx.Node]]  # loop-1 operand -> its counterpart at loops 2..R
    per_loop: dict[fx.Node, list[fx.Node]]  # loop-1 per-loop input -> counterparts at loops 2..R
    depth: dict[fx.Node, int]


def _operands(n: fx.Node, df: _Dataflow) -> tuple[list[Any], list[fx.Node]]:
    """Flattened arguments (constants and nodes, in order) and the mutation-order dependencies."""
    flat = list(flatten_args((n.args, n.kwargs)))
    args = set(x for x in flat if isinstance(x, fx.Node))
    return flat, [d for d in df.deps[n] if d not in args]


@dataclass
class _MatchState:
    mapping: dict[fx.Node, fx.Node] = field(default_factory=dict)  # loop-1 node -> loop-r node
    reverse: dict[fx.Node, fx.Node] = field(default_factory=dict)
    carried: dict[fx.Node, fx.Node] = field(default_factory=dict)
    inputs: dict[fx.Node, fx.Node] = field(default_factory=dict)

    def copy(self) -> "_MatchState":
        return _MatchState(dict(self.mapping), dict(self.reverse), dict(self.carried), dict(self.inputs))


class _Matcher:
    """Matches loop r onto loop 1, node for node, growing backwards from the shared-weight uses.

    A pair of operands (x in loop 1, y in loop r) is: the same node (a loop-invariant input); two
    body nodes (matched in turn); two different loop-invariant values (equal computations, or
    per-loop inputs such as one cache buffer per loop); or a loop-invariant x where y depends on
    earlier loops. In that last case x may still be loop 1's own preparation of its input (the
    first norm applied to the embedding), so the pair is matched speculatively and becomes the
    loop-carried state only where the computations diverge.
    """

    def __init__(self, df: _Dataflow, shared: set[fx.Node], anchors: dict[fx.Node, int], depth: dict[fx.Node, int], r: int) -> None:
        self.df, self.shared, self.anchors, self.depth, self.r = df, shared, anchors, depth, r
        self.memo: dict = {}

    def fail(self, msg: str) -> LoopMismatchError:
        return LoopMismatchError(f"loop {self.r + 1} does not repeat loop 1: {msg}")

    def run(self, st: _MatchState, pairs: list[tuple[fx.Node, fx.Node]]) -> None:
        stack = list(pairs)
        while stack:
            a, b = stack.pop()
            if a in st.mapping:
                if st.mapping[a] is not b:
                    raise self.fail(f"{describe(b)} and {describe(st.mapping[a])} both stand for loop 1's {describe(a)}")
                continue
            if b in st.reverse:
                raise self.fail(f"{describe(b)} stands for two loop-1 nodes")
            if a.op != b.op or op_name(a) != op_name(b):
                raise self.fail(f"{describe(b)} stands where loop 1 has {describe(a)}")
            st.mapping[a], st.reverse[b] = b, a
            xa, ma = _operands(a, self.df)
            xb, mb = _operands(b, self.df)
            if len(xa) != len(xb) or len(ma) != len(mb):
                raise self.fail(f"{describe(b)} has other operands than loop 1's {describe(a)}")
            for x, y in zip(xa + ma, xb + mb):
                self._pair(st, stack, b, x, y)

    def _pair(self, st: _MatchState, stack: list, b: fx.Node, x: Any, y: Any) -> None:
        if not isinstance(x, fx.Node) or not isinstance(y, fx.Node):
            if isinstance(x, fx.Node) or isinstance(y, fx.Node) or repr(x) != repr(y):
                raise self.fail(f"{describe(b)} has operand {describe(y)} where loop 1 has {describe(x)}")
            return
        if x is y or x in self.shared or y in self.shared:
            if x is not y:
                raise self.fail(f"{describe(b)} uses {describe(y)} where loop 1 uses the shared weight {describe(x)}")
            return
        dx, dy = self.depth.get(x, -1), self.depth.get(y, -1)
        if dx >= 0 and dy >= 0:
            if self.anchors.get(x, 0) != 0 or self.anchors.get(y, self.r) != self.r:
                raise self.fail(f"{describe(b)} reads {describe(y)} from another loop where loop 1 reads {describe(x)}")
            stack.append((x, y))
        elif dx < 0 and dy >= 0:
            if x in st.carried:
                if st.carried[x] is not y:
                    raise self.fail(f"it reads two different states where loop 1 reads {describe(x)}")
                return
            trial = st.copy()
            try:
                self.run(trial, [(x, y)])
            except LoopMismatchError:
                st.carried[x] = y
            else:
                st.__dict__.update(trial.__dict__)
        elif dx < 0 and dy < 0:
            if _struct_key(x, self.memo) != _struct_key(y, self.memo) and st.inputs.setdefault(x, y) is not y:
                raise self.fail(f"{describe(b)} reads {describe(y)} where loop 1 reads {describe(x)}")
        else:
            raise self.fail(f"{describe(b)} has operand {describe(y)} where loop 1 has {describe(x)}")


def _match_loops(df: _Dataflow, shared: set[fx.Node], n_loops: int, anchors: dict[fx.Node, int], depth: dict[fx.Node, int]) -> _Loops:
    """Match every loop onto loop 1 (see :class:`_Matcher`); the bodies, carried state, per-loop inputs."""
    by_loop: list[list[fx.Node]] = [[] for _ in range(n_loops)]
    for u, j in anchors.items():
        by_loop[j].append(u)
    for j in range(n_loops):
        by_loop[j].sort(key=df.pos.get)
    if len({len(b) for b in by_loop}) != 1:
        raise LoopMismatchError(
            f"shared weights are used {[len(b) for b in by_loop]} times in the {n_loops} loops: every loop "
            f"must apply the same weights"
        )
    states = []
    for r in range(1, n_loops):
        st = _MatchState()
        _Matcher(df, shared, anchors, depth, r).run(st, list(zip(by_loop[0], by_loop[r])))
        states.append(st)
    order0 = sorted(states[0].mapping, key=df.pos.get)
    for r, st in enumerate(states, start=1):
        if set(st.mapping) != set(order0):
            extra = next(iter(set(st.mapping) ^ set(order0)))
            raise LoopMismatchError(f"loop {r + 1} and loop 2 match loop 1 differently around {describe(extra)}")
    loops = [order0] + [[st.mapping[a] for a in order0] for st in states]
    carried: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    per_loop: dict[fx.Node, list[fx.Node]] = defaultdict(list)
    for st in states:
        for x, y in st.carried.items():
            carried[x].append(y)
        for x, y in st.inputs.items():
            per_loop[x].append(y)
    return _Loops(loops, dict(carried), {x: ys for x, ys in per_loop.items() if len(ys) == n_loops - 1}, depth)


# --- step 3: attention sites ----------------------------------------------------------------------


def _strip(n: Any, kinds: tuple[str, ...]) -> Any:
    while isinstance(n, fx.Node) and any(is_op(n, k) for k in kinds):
        n = n.args[0]
    return n


def _strip_repeat_kv(n: fx.Node) -> tuple[fx.Node, bool]:
    """Undo HF's repeat_kv (x[:, :, None].expand(...).reshape(...)) or repeat_interleave."""
    cur, repeated = n, False
    if is_op(cur, "repeat_interleave"):
        return cur.args[0], True
    if is_op(cur, "reshape") and isinstance(cur.args[0], fx.Node) and is_op(cur.args[0], "expand"):
        inner = cur.args[0].args[0]
        if isinstance(inner, fx.Node) and is_op(inner, "getitem"):
            return inner.args[0], True
        return inner, True
    return cur, repeated


def _cache_source(k: fx.Node, v: fx.Node, df: _Dataflow, loop_nodes: set[fx.Node]) -> CacheSite:
    """Classify where attended keys come from; raise if none of the known patterns."""

    def resolve(x: fx.Node) -> tuple[str, fx.Node, fx.Node | None, tuple[fx.Node, ...], fx.Node | None]:
        root = _root(x)
        writes = [w for w in df.writes.get(root, []) if w in loop_nodes and df.pos[w] < df.pos[x]]
        if writes:
            w = writes[-1]
            if w.op == "call_function" and w.target is operator.setitem:
                value, index = w.args[2], w.args[1]
            else:  # index_copy_(dim, index, source) / index_put_(indices, values) / copy_(src)
                name = op_name(w).lstrip(".")
                if name.startswith("index_copy"):
                    value, index = arg(w, 3, "source"), arg(w, 2, "index")
                elif name.startswith("index_put"):
                    value, index = arg(w, 2, "values"), arg(w, 1, "indices")
                else:
                    value, index = arg(w, 1, "src"), None
            positions = _positions_from_index(index)
            return "inplace", _heads_first(value, w), root, tuple(writes), positions
        if is_op(x, "cat"):
            parts = arg(x, 0, "tensors")
            if isinstance(parts, (list, tuple)) and len(parts) == 2 and all(isinstance(p, fx.Node) for p in parts):
                past, new = parts
                if past not in loop_nodes:
                    return "concat", new, past, (x,), None
        if x in loop_nodes:
            return "none", x, None, (), None
        raise UnrecognizedKVSourceError(
            f"attention keys come from {describe(x)}, which is not a recognizable KV source: expected the "
            f"current keys, an in-place write into a cache buffer followed by a read, or torch.cat of a past "
            f"tensor with the current keys"
        )

    kk, kn, kb, kw, kp = resolve(k)
    vk, vn, vb, vw, vp = resolve(v)
    if kk != vk:
        raise UnrecognizedKVSourceError(f"keys ({kk}) and values ({vk}) come from different kinds of cache at {describe(k)}")
    return CacheSite(kk, kn, vn, kb, vb, kw + vw, kp or vp)


def _heads_first(value: Any, write: fx.Node) -> Any:
    """The written K/V in [B, H, T, D] layout.

    ``cache[rows, :, positions] = x`` takes x as [B, T, H, D] (indexed dims first), which models
    produce by transposing their [B, H, T, D] keys: undo exactly that one transpose. Other write
    forms (index_copy_ along the sequence dim, copy_) take [B, H, T, D] already.
    """
    if write.op == "call_function" and write.target is operator.setitem:
        if isinstance(value, fx.Node) and is_op(value, "transpose") and sorted(value.args[1:3]) == [1, 2]:
            return value.args[0]
        raise UnrecognizedKVSourceError(
            f"the cache write {describe(write)} stores {describe(value)}; expected the keys/values transposed "
            f"from [batch, heads, tokens, head_dim] (x.transpose(1, 2))"
        )
    return value


def _positions_from_index(index: Any) -> fx.Node | None:
    """The per-token position tensor inside a cache-write index (the integer index with a token dim)."""
    cands = [a for a in flatten_args(index) if isinstance(a, fx.Node) and dtype_of(a) in (torch.int64, torch.int32)]
    if not cands:
        return None
    # rows-of-batch indices are [B, 1] aranges; positions are [B, T] or [T]: prefer the one from a placeholder.
    for c in cands:
        if _root(c).op == "placeholder":
            return c
    return cands[-1]


@dataclass(frozen=True)
class _MaskValue:
    """Abstract value of a node in a mask computation.

    kind: "pos" (integer positions or flags), "posf" (float positions), "const" (constants),
    "bool" (comparison results), "maskf" (an additive mask: constants selected by booleans),
    "bias" (float arithmetic on positions: a positional bias), "other".
    compares: the position comparisons that shape this value; offset: positions were shifted by
    a constant before a comparison (a window).
    """

    kind: str
    compares: frozenset = frozenset()
    offset: bool = False


_CONST_CTORS = {"full", "zeros", "ones", "empty", "full_like", "zeros_like", "ones_like", "new_full", "new_zeros", "new_ones", "scalar_tensor", "tensor"}
# torch.vmap under Dynamo (transformers' masking utilities vmap a mask function over batch, head,
# query and key indices): _add_batch_dim / _remove_batch_dim move a dimension in or out of the
# batched view and leave the values as they are; a padding mask function's lookup
# padding_mask[batch_idx, kv_idx] is recorded as aten.index.
_VMAP_DIMS = {"_add_batch_dim", "_remove_batch_dim"}
_PASS_THROUGH = VIEW_OPS | _VMAP_DIMS | {"index", "index.Tensor", "clone", "contiguous", "slice", "narrow", "repeat", "expand", "select", "index_select", "detach", "to", "float", "type", "type_as", "half", "bfloat16", "int", "long", "bool", "_to_copy"}
_LOGICAL = {"and_", "or_", "invert", "logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or", "bitwise_not", "__and__", "__or__", "__invert__", "iand", "ior"}
_ARITH = {"add", "sub", "rsub", "mul", "truediv", "div", "neg", "iadd", "isub", "imul"}
# Shape queries: a batch size read from an input (``key_pos.expand(ids.shape[0], -1)``, which
# Dynamo records once a dimension has been dynamic) is a constant of the mask, not tensor data.
_SHAPE_QUERIES = {"size", "sym_size", "sym_size.int", "dim", "numel", "sym_numel", "sym_stride"}


class _MaskAnalyzer:
    """Decides whether an attention mask is causal by absolute position (one comparison of key
    positions with query positions, optionally combined with padding flags) or something else:
    a window (positions shifted by a constant, or several comparisons) or a positional bias."""

    def __init__(self, df: _Dataflow) -> None:
        self.df = df
        self.memo: dict[fx.Node, _MaskValue] = {}

    def value(self, x: Any) -> _MaskValue:
        if not isinstance(x, fx.Node):
            return _MaskValue("const")
        if x not in self.memo:
            self.memo[x] = _MaskValue("other")  # cycles cannot occur; this guards re-entry
            self.memo[x] = self._eval(x)
        return self.memo[x]

    def _cast(self, x: fx.Node, v: _MaskValue) -> _MaskValue:
        dt = dtype_of(x)
        if dt is None:
            return v
        if v.kind == "pos" and dt.is_floating_point:
            return _MaskValue("posf", v.compares, v.offset)
        if v.kind == "posf" and not dt.is_floating_point and dt != torch.bool:
            return _MaskValue("pos", v.compares, v.offset)
        if v.kind == "bool" and dt.is_floating_point:
            return _MaskValue("maskf", v.compares, v.offset)
        return v

    def _eval(self, n: fx.Node) -> _MaskValue:
        name = op_name(n).lstrip(".")
        dt = dtype_of(n)
        if n.op in ("placeholder", "get_attr"):
            if dt is None:
                return _MaskValue("const")
            if dt == torch.bool:
                return _MaskValue("bool")
            # Float inputs (ALiBi slopes, a user's additive mask) carry no position structure.
            return _MaskValue("pos") if not dt.is_floating_point else _MaskValue("const")
        if name in _SHAPE_QUERIES:
            return _MaskValue("const")
        args = [a for a in flatten_args((n.args, n.kwargs)) if isinstance(a, fx.Node)]
        # A read of a buffer that was written in place sees the written values too.
        writes = [w for w in self.df.writes.get(_root(n), []) if self.df.pos[w] < self.df.pos[n]] if name in _PASS_THROUGH else []
        vals = [self.value(a) for a in args] + [self.value(w.args[2]) for w in writes if w.target is operator.setitem]
        compares = frozenset().union(*(v.compares for v in vals)) if vals else frozenset()
        offset = any(v.offset for v in vals)
        kinds = {v.kind for v in vals}
        if "other" in kinds:
            return _MaskValue("other")
        if "bias" in kinds:
            return _MaskValue("bias")
        if name == "arange":
            return _MaskValue("posf" if dt is not None and dt.is_floating_point else "pos")
        if name in _CONST_CTORS or not args:
            return _MaskValue("const")
        if is_op(n, "triangle"):
            base = vals[0]
            return _MaskValue("maskf" if dt is not None and dt.is_floating_point else "bool", base.compares | {n}, base.offset)
        if name in _PASS_THROUGH:
            merged = vals[0] if len(vals) == 1 else _MaskValue(_merge_kind(kinds), compares, offset)
            return self._cast(n, _MaskValue(merged.kind, compares, offset))
        if is_op(n, "compare"):
            operands = [a for a in n.args[:2]]
            sides = [self.value(a) for a in operands if isinstance(a, fx.Node)]
            positional = [v for v in sides if v.kind in ("pos", "posf")]
            if len(operands) == 2 and all(isinstance(a, fx.Node) for a in operands) and len(positional) == 2:
                return _MaskValue("bool", compares | {n}, offset)
            # A test against a constant (padding flags == 0, additive mask > -inf) keeps its input's shape.
            return _MaskValue("bool", compares, offset)
        if name in _LOGICAL or (is_op(n, "select_where") and dt == torch.bool):
            return _MaskValue("bool", compares, offset)
        if is_op(n, "select_where"):
            return _MaskValue("maskf", compares, offset)
        if name in _ARITH:
            consts = [a for a in flatten_args(n.args) if not isinstance(a, fx.Node)]
            if kinds <= {"pos", "const"} and "pos" in kinds:
                shifted = any(isinstance(c, (int, float)) and c != 0 for c in consts) and name not in ("mul", "imul")
                return _MaskValue("pos", compares, offset or shifted)
            if "posf" in kinds:
                if kinds <= {"posf", "const"} and len(args) == 1:
                    return _MaskValue("posf", compares, True)
                return _MaskValue("bias")
            if kinds <= {"const"}:
                return _MaskValue("const")
            if kinds <= {"const", "maskf", "bool", "pos"}:
                return _MaskValue("maskf", compares, offset)
        return _MaskValue("other")

    def classify(self, mask: Any, is_causal: bool, q_len: Any) -> str:
        if mask is None:
            if is_causal:
                return "causal-index"
            return "none" if q_len == 1 else "unsupported: no mask and not causal (bidirectional attention)"
        v = self.value(mask)
        if v.kind == "bias":
            return "unsupported: a positional bias is added to the scores (ALiBi-style), not a causal mask"
        if v.kind not in ("bool", "maskf"):
            return "unsupported: the mask is not built from position comparisons"
        if v.offset:
            return "unsupported: positions are shifted by a constant before the comparison (sliding-window or chunked attention)"
        if len(v.compares) > 1:
            return f"unsupported: {len(v.compares)} position comparisons (sliding-window or chunked attention)"
        if not v.compares:
            return "none" if q_len == 1 else "unsupported: the mask does not compare key and query positions"
        return "causal-position"


def _merge_kind(kinds: set[str]) -> str:
    for k in ("maskf", "bool", "posf", "pos"):
        if k in kinds:
            return k
    return "const"


def _attention_sites(body: list[fx.Node], loop: int, df: _Dataflow, masks: _MaskAnalyzer) -> list[AttentionSite]:
    nodes = set(body)
    sites = []
    for n in body:
        if is_op(n, "sdpa"):
            a = sdpa_args(n)
            q, k_att, v_att = a["q"], a["k"], a["v"]
            k, rep_k = _strip_repeat_kv(k_att)
            v, _ = _strip_repeat_kv(v_att)
            mask, causal = a["mask"], bool(a["is_causal"])
            kind = "sdpa"
        elif is_op(n, "softmax"):
            chain = _eager_chain(n)
            if chain is None:
                continue
            q, kt, v_att, mask, n = chain
            k_att = _strip(kt, ("transpose",))
            k, rep_k = _strip_repeat_kv(k_att)
            v, _ = _strip_repeat_kv(v_att)
            causal = False
            kind = "eager"
        else:
            continue
        qs = shape_of(q)
        q_len = qs[-2] if qs else None
        cache = _cache_source(k, v, df, nodes)
        sites.append(
            AttentionSite(
                loop, len(sites), kind, n, q, k, v, cache, mask,
                masks.classify(mask, causal, q_len), q_len, rep_k,
            )
        )
    return sites


def _eager_chain(softmax: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node | None, fx.Node] | None:
    """From a softmax node: (q, k^T, v, mask, output) of matmul -> [scale] -> [+mask] -> softmax -> matmul."""
    mask = None
    x = softmax.args[0]
    while isinstance(x, fx.Node) and not is_op(x, "matmul"):
        if is_op(x, "add"):
            a, b = x.args[0], x.args[1]
            mask = b if isinstance(b, fx.Node) else mask
            x = a
        elif is_op(x, "select_where"):
            mask = x.args[1] if op_name(x).lstrip(".").startswith("masked_fill") else x.args[0]
            x = x.args[0] if op_name(x).lstrip(".").startswith("masked_fill") else x.args[1]
        elif is_op(x, "scale") or is_op(x, "dtype_cast"):
            x = x.args[0]
        else:
            return None
    if not isinstance(x, fx.Node):
        return None
    q, kt = x.args[0], x.args[1]
    out = softmax
    while True:
        users = list(out.users)
        if len(users) != 1:
            return None
        u = users[0]
        if is_op(u, "dtype_cast") or is_op(u, "dropout"):
            out = u
            continue
        if is_op(u, "matmul") and u.args[0] is out:
            return q, kt, u.args[1], mask, u
        return None


# --- fresh prompts -------------------------------------------------------------------------------


_KEEP_POSITIONS = {"expand", "contiguous", "clone", "to", "long", "int"}


def _same_size(a: Any, b: Any) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(a == b))
    except TypeError:
        return False


def _counts_from_zero(positions: Any, tokens: Any) -> bool:
    """Whether ``positions`` ([B, T] or [T]) holds 0..T-1 in every row, T = ``tokens``: an arange
    built in the graph (start 0, step 1), given a leading dimension and expanded over the batch."""
    shape = shape_of(positions)
    if not shape or not _same_size(shape[-1], tokens):
        return False
    n = positions
    while isinstance(n, fx.Node) and n.op in ("call_function", "call_method"):
        name = op_name(n).lstrip(".")
        if name == "arange":
            if len(n.args) == 1 and "end" not in n.kwargs:  # arange(end)
                start, step = 0, n.kwargs.get("step", 1)
            else:  # arange(start, end[, step])
                start = n.args[0] if n.args else n.kwargs.get("start", 0)
                step = n.args[2] if len(n.args) > 2 else n.kwargs.get("step", 1)
            dt, length = dtype_of(n), shape_of(n)
            # the length is T: with start 0 and step 1, the values are 0..T-1
            return (start == 0 and step == 1 and dt is not None and not dt.is_floating_point and dt != torch.bool
                    and length is not None and _same_size(length[0], tokens))
        if name in _KEEP_POSITIONS:
            n = n.args[0]
        elif name == "unsqueeze" and arg(n, 1, "dim") == 0:
            n = n.args[0]
        elif name == "getitem" and _leading_none(n.args[1]):
            n = n.args[0]
        else:
            return False
    return False


def _leading_none(index: Any) -> bool:
    """x[None] or x[None, :] (a new leading dimension, the rest as it is)."""
    if index is None:
        return True
    return isinstance(index, tuple) and index[:1] == (None,) and all(x == slice(None) or x is Ellipsis for x in index[1:])


def fresh_prompt(structure: LoopStructure) -> bool:
    """Whether this is the prefill of a fresh prompt: every site's cache is written at positions
    0..T-1 that the graph builds itself (the model called without ``input_pos``), so each row's
    keys at or before a query's position are this step's own tokens and no stored prefix exists.
    A static property of the graph: no host sync, no runtime value read."""
    return bool(structure.sites) and all(
        s.cache is not None and s.cache.kind == "inplace" and s.cache.positions is not None
        and _counts_from_zero(s.cache.positions, s.query_len) and s.mask_kind == "causal-position"
        for s in structure.sites
    )


# --- entry point -----------------------------------------------------------------------------------


def recognize(gm: fx.GraphModule) -> LoopStructure:
    """Find the recurrent block, its loop boundaries and attention sites; raise if there is none."""
    df = _Dataflow(gm.graph)
    shared, found = _find_shared(df)
    loops, n_loops = found.bodies, len(found.bodies)
    in_body = set().union(*map(set, loops))
    coda = [n for n in df.nodes if found.depth.get(n, -1) >= 0 and n not in in_body and n not in shared]

    if len(found.carried) != 1:
        listed = ", ".join(describe(x) for x in found.carried) or "none"
        raise LoopMismatchError(
            f"a recurrent block carries exactly one state from loop to loop; found {len(found.carried)}: {listed}"
        )
    (h0, carried), = found.carried.items()
    # H[1] is the loop-1 node that loop 2 reads; H[r] is its counterpart in loop r.
    if carried[0] not in loops[0]:
        # The loop's last operation uses no shared weight (a residual add, not Ouro's norm), so
        # the loop boundary, and with it the state, cannot be placed.
        raise NoRecurrentBlockError(
            f"no supported recurrent block: loop 2 reads {describe(carried[0])}, which is not part of loop 1 "
            f"as its shared weights delimit it (unsupported: every loop must end with an operation on a shared "
            f"weight, such as Ouro's end-of-loop norm). FlashLoop features need an Ouro-style looped model; "
            f"compile with all features off for other models"
        )
    state_index = loops[0].index(carried[0])
    states = [h0] + [loops[r][state_index] for r in range(n_loops)]
    if states[1:-1] != carried:
        raise LoopMismatchError("loop-carried states are not at the same place in every loop")

    sites: list[AttentionSite] = []
    masks = _MaskAnalyzer(df)
    for r in range(n_loops):
        sites.extend(_attention_sites(loops[r], r, df, masks))
    n_layers = len(sites) // n_loops if sites else 0
    if not sites or len(sites) != n_layers * n_loops:
        raise NoRecurrentBlockError(
            f"the recurrent block found ({n_loops} loops) has no attention sites: FlashLoop needs attention "
            f"inside the loop body"
        )

    body0 = set(loops[0])
    invariant_inputs = []
    for n in loops[0]:
        for d in input_nodes(n):
            if d not in body0 and d not in shared and d is not h0 and d not in found.per_loop and found.depth.get(d, -1) == -1:
                invariant_inputs.append(d)
    memo: dict = {}
    roots: dict[Any, fx.Node] = {}
    for d in invariant_inputs:
        root = _root(d)
        roots.setdefault(_struct_key(root, memo), root)
    invariant_inputs = sorted(roots.values(), key=df.pos.get)
    per_loop = [[x] + ys for x, ys in found.per_loop.items()]
    per_loop_by_loop = [[p[r] for p in per_loop] for r in range(n_loops)]

    exit_gates = []
    for r in range(n_loops):
        for u in states[r + 1].users:
            ws = shape_of(arg(u, 1, "weight")) if is_op(u, "linear") else None
            if ws is not None and len(ws) == 2 and ws[0] == 1:
                exit_gates.append(u)
                break
    if len(exit_gates) != n_loops:
        exit_gates = []

    positions = sorted(
        {s.cache.positions for s in sites if s.cache is not None and s.cache.positions is not None},
        key=lambda n: df.pos.get(n, 0),
    )
    return LoopStructure(
        num_loops=n_loops,
        num_layers=n_layers,
        loops=loops,
        states=states,
        shared_weights=sorted(shared, key=df.pos.get),
        loop_inputs=invariant_inputs,
        per_loop_inputs=per_loop_by_loop,
        sites=sites,
        exit_gates=exit_gates,
        coda=coda,
        positions=positions,
    )

