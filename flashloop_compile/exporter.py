"""Compiled-model export: the FlashLoop prefill and decode programs of one model and configuration
in one AOTInductor package (``.pt2``), run by :func:`flashloop_compile.load_exported` without the
model's Python class.

    flashloop_compile.export(model, FlashLoopConfig.all_on(), "model.pt2", max_batch=4, max_seq=1024)

The graphs are the ones the ``flashloop`` backend compiles: an :class:`~flashloop_compile.runtime.
engine.Engine` runs the model once per program under a backend that applies the same passes
(passes/manager.py, then projection fusion) and keeps the rewritten graph instead of compiling it.
Each graph is then exported (``torch.export``: the prefill with a dynamic prompt length, one decode
program per batch bucket) and compiled by AOTInductor. Weights are constants of the programs,
stored once in the package; the caches (dense or packed), the step plan and the token inputs are
program inputs the loader allocates from the package's cache-layout description. Layer outlining
(``compilation.outline_layers``) only splits compiles: an exported program is always whole.

On CUDA the Triton kernels of the ``flashloop`` ops are compiled into the package; on CPU the
package calls the ops' registered CPU bodies (the loader imports the op library, which registers
them).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch import Tensor

from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.runtime.engine import BATCH_BUCKETS, config_label
from flashloop_compile.runtime.exported import (
    DENSE_LAYOUT_VERSION, FORMAT, FORMAT_VERSION, METADATA_FILE, MIN_PROMPT_TOKENS, ExportError, prefill_name,
    decode_name,
)

__all__ = ["export"]


log = logging.getLogger("flashloop_compile.export")


@dataclasses.dataclass
class _Capture:
    gm: fx.GraphModule  # the rewritten graph, runtime buffers lifted to trailing inputs
    inputs: list[Any]  # its example inputs (the model's tensors, then the runtime buffers)


def _capture_backend(config: FlashLoopConfig, captures: list[_Capture]):
    """The backend's passes (backend._compile) without Inductor: keep the rewritten graph, run it eagerly."""
    from flashloop_compile.backend import pass_manager
    from flashloop_compile.passes.fuse_projections import FusedProjections, fuse_projections
    from flashloop_compile.passes.graph import lift_runtime_buffers
    from flashloop_compile.passes.manager import propagate_fake_values

    def backend(gm: fx.GraphModule, example_inputs: list[Any]):
        manager = pass_manager(config)
        manager.run(gm, example_inputs)
        fused = fuse_projections(gm, example_inputs) if config.compilation.fuse_projections else FusedProjections()
        if fused.gemms:
            propagate_fake_values(gm)
        lifted, runtime = lift_runtime_buffers(gm)
        captures.append(_Capture(lifted, list(example_inputs) + list(runtime)))

        def run(*args: Any) -> Any:
            return lifted(*args, *runtime)

        return fused.wrap(run)

    return backend


class _Program(torch.nn.Module):
    """One captured graph as a module of (input_ids, input_pos, state): the model's weights and
    other tensors become buffers (program constants), the zero-byte dense-cache stand-ins of a
    packed configuration are rebuilt inside, and symbolic sizes are read off the token inputs."""

    def __init__(self, capture: _Capture, state_names: dict[int, str], standins: set[int],
                 constants: dict[int, tuple[str, Tensor]]) -> None:
        super().__init__()
        self.gm = capture.gm
        self.plan: list[tuple[str, Any]] = []
        placeholders = [n for n in capture.gm.graph.nodes if n.op == "placeholder"]
        ids_node = next(n for n in placeholders if "input_ids" in n.name)
        # a fresh prompt's prefill builds its positions in the graph: no input_pos placeholder
        pos_node = next((n for n in placeholders if "input_pos" in n.name), None)
        token_vals = [_val(ids_node), _val(pos_node) if pos_node is not None else None]
        self.state_order: list[str] = []
        for node, x in zip(placeholders, capture.inputs):
            if isinstance(x, (int, torch.SymInt)):  # a dynamic size: a dimension of the token inputs
                self.plan.append(("size", _size_source(_val(node), token_vals)))
            elif node is ids_node:
                self.plan.append(("ids", None))
            elif node is pos_node:
                self.plan.append(("pos", None))
            elif id(x) in state_names:
                self.plan.append(("state", len(self.state_order)))
                self.state_order.append(state_names[id(x)])
            elif id(x) in standins:
                self.plan.append(("standin", (tuple(x.shape), x.dtype)))
            elif isinstance(x, Tensor):
                name, tensor = constants.setdefault(id(x), (f"c{len(constants)}", x))
                if not hasattr(self, name):
                    self.register_buffer(name, tensor, persistent=True)
                self.plan.append(("const", name))
            else:
                raise ExportError(f"export: the captured graph takes {type(x).__name__} {x!r} as input {node.name}, "
                                  "which a program cannot take (only tensors and the prompt length)")

    def forward(self, input_ids: Tensor, input_pos: Tensor, state: list[Tensor]):
        args: list[Any] = []
        for kind, ref in self.plan:
            if kind == "ids":
                args.append(input_ids)
            elif kind == "pos":
                args.append(input_pos)
            elif kind == "state":
                args.append(state[ref])
            elif kind == "standin":
                args.append(torch.zeros(1, dtype=ref[1], device=input_ids.device).expand(ref[0]))
            elif kind == "const":
                args.append(getattr(self, ref))
            else:
                args.append((input_ids, input_pos)[ref[0]].shape[ref[1]])
        return self.gm(*args)[0]


def _val(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _size_source(sym: Any, token_vals: list[Any]) -> tuple[int, int]:
    """(token input, dimension) whose size is the symbol ``sym``."""
    for i, v in enumerate(token_vals):
        if isinstance(v, Tensor):
            for d, s in enumerate(v.shape):
                if isinstance(s, torch.SymInt) and str(s) == str(sym):
                    return i, d
    raise ExportError(f"export: the captured graph takes the size {sym} that is not a dimension of input_ids or input_pos")


def export(
    model: torch.nn.Module,
    config: FlashLoopConfig | dict | None,
    path: str | Path,
    *,
    max_batch: int,
    max_seq: int,
    max_new_tokens: int | None = None,
    min_prompt: int = MIN_PROMPT_TOKENS,
    batch_buckets: Sequence[int] = BATCH_BUCKETS,
    inductor_configs: dict[str, Any] | None = None,
) -> Path:
    """Export ``model`` under ``config`` to the AOTInductor package ``path`` (a ``.pt2`` file).

    The package holds the prefill (batch ``max_batch``; a batch's longest prompt from ``min_prompt``
    to ``max_seq`` tokens, the prompt length a ``torch.export`` dynamic dimension), one decode
    program per batch bucket up to ``max_batch``, the weights, the effective FlashLoopConfig and its
    hash, the model config and the cache layout (``max_batch`` slots of ``max_seq`` positions).
    Where the graph's guards split the prompt lengths (token-sparse selection sizes change form
    at short prompts), the prefill is one program per range, as the engine compiles one graph per
    range. ``max_new_tokens`` sizes the packed cache's residual rows as the engine does. Returns
    the path.
    """
    from flashloop_compile.runtime.engine import Engine

    path = Path(path)
    if path.suffix != ".pt2":
        raise ExportError(f"export: the package path must end in .pt2, got {str(path)!r}")
    if not MIN_PROMPT_TOKENS <= min_prompt <= max_seq:
        raise ExportError(f"export: min_prompt={min_prompt} must be in [{MIN_PROMPT_TOKENS}, max_seq={max_seq}] "
                          f"(prompts shorter than {MIN_PROMPT_TOKENS} tokens are padded to it)")
    config = FlashLoopConfig.coerce(config)
    cfg = model.config
    captures: list[_Capture] = []
    t_start = time.perf_counter()
    torch._dynamo.reset()
    engine = Engine(model, config, max_batch=max_batch, max_seq=max_seq, max_new_tokens=max_new_tokens,
                    cuda_graphs=False, batch_buckets=batch_buckets, progress=False,
                    backend=_capture_backend(config.resolve(cfg.num_loops, head_dim=cfg.head_dim), captures))
    config = engine.config
    device, dtype = engine.device, next(model.parameters()).dtype
    buckets = list(engine.buckets)
    state = engine.state_tensors()
    state["plan.seq_lens"], state["plan.last_pos"] = engine.state.plan.seq_lens, engine.state.plan.last_pos
    state_names = {id(t): n for n, t in state.items()}
    standins = {id(t) for c in model.model.kv_caches if not c.has_storage for t in (c.k_cache, c.v_cache)}
    constants: dict[int, tuple[str, Tensor]] = {}
    shared: dict[tuple, list[Tensor]] = {}

    def program(run) -> _Program:
        before = len(captures)
        with torch.no_grad(), torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            run()
        if len(captures) != before + 1:
            raise ExportError(f"export: one forward compiled {len(captures) - before} graphs, not one: a graph break or "
                              "a guard the engine's graph does not hold (run the engine with TORCH_LOGS=recompiles)")
        p = _Program(captures[-1], state_names, standins, constants)
        _share_equal_constants(p, shared)
        return p

    def exported(p: _Program, b: int, t: int, dynamic: bool):
        ids = torch.zeros(b, t, dtype=torch.long, device=device)
        pos = torch.arange(t, device=device)[None].expand(b, -1).contiguous()
        example_state = [state[n] for n in p.state_order]
        dims = None
        if dynamic:
            tokens = torch.export.Dim.DYNAMIC
            dims = {"input_ids": {1: tokens}, "input_pos": {1: tokens}, "state": [None] * len(example_state)}
        return torch.export.export(p, (ids, pos, example_state), dynamic_shapes=dims, strict=False)

    # prefill: one program per prompt-length range, from max_seq down to min_prompt
    eps: dict[str, Any] = {}
    signatures: dict[str, dict[str, Any]] = {}
    prefill: list[dict[str, Any]] = []
    t = max_seq
    while t >= min_prompt:
        n = max(t, MIN_PROMPT_TOKENS)
        p = program(lambda: engine.prefill([torch.zeros(n, dtype=torch.long)] * max_batch))
        ep = exported(p, max_batch, n, dynamic=True)
        lo, hi = _token_range(ep)
        if not lo <= n <= hi:
            raise ExportError(f"export: the prefill exported at {n} tokens holds for [{lo}, {hi}] only")
        name = prefill_name(len(prefill))
        lo = max(lo, min_prompt)
        prefill.append({"name": name, "min": lo, "max": min(hi, max_seq)})
        eps[name] = ep
        signatures[name] = {"batch": max_batch, "tokens": [lo, min(hi, max_seq)], "state": p.state_order}
        t = lo - 1
    for b in buckets:
        p = program(lambda: engine._decode_eager(torch.zeros(b, 1, dtype=torch.long, device=device),
                                                 torch.full((b, 1), max_seq - 1, dtype=torch.long, device=device)))
        name = decode_name(b)
        eps[name] = exported(p, b, 1, dynamic=False)
        signatures[name] = {"batch": b, "tokens": 1, "state": p.state_order}
    torch._dynamo.reset()
    if engine.packed is not None:
        engine.packed.reset()
    t_export = time.perf_counter() - t_start

    options = {
        "aot_inductor.package": True,
        # weights once in the package, shared by every program (stored apart from the .so files)
        "aot_inductor.package_constants_in_so": False,
        "aot_inductor.package_constants_on_disk_format": "pickle_weights",
        **(inductor_configs or {}),
    }
    aoti_files: dict[str, list] = {}
    for name, ep in eps.items():
        t0 = time.perf_counter()
        aoti_files[name] = torch._inductor.aot_compile(ep.module(check_guards=False), *ep.example_inputs, options=options)
        log.info("%s: AOTInductor %.1f s", name, time.perf_counter() - t0)

    metadata = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "form": "aoti",
        "torch_version": torch.__version__,
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "config": config.to_dict(),
        "config_hash": config.hash(),
        "model_type": type(model).__name__,
        "model_config": cfg.to_dict() if hasattr(cfg, "to_dict") else dataclasses.asdict(cfg),
        "vocab_size": cfg.vocab_size,
        "num_loops": cfg.num_loops,
        "head_dim": cfg.head_dim,
        "max_batch": max_batch,
        "max_seq": max_seq,
        "max_new_tokens": max_new_tokens,
        "buckets": buckets,
        "prefill": prefill,
        "programs": signatures,
        "cache_layout": _cache_layout(engine, cfg, dtype),
    }
    from torch.export.pt2_archive._package import package_pt2

    path.parent.mkdir(parents=True, exist_ok=True)
    package_pt2(str(path), aoti_files=aoti_files, extra_files={METADATA_FILE: json.dumps(metadata, indent=1, sort_keys=True)})
    log.info("exported %s (%s) to %s in %.1f s (capture and torch.export %.1f s)", config_label(config), config.hash(),
             path, time.perf_counter() - t_start, t_export)
    return path


def _token_range(ep) -> tuple[int, int]:
    """The prompt lengths [lo, hi] the exported prefill holds (hi: a large int when unbounded)."""
    node = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name.endswith("input_ids"))
    size = node.meta["val"].shape[1]
    if not isinstance(size, torch.SymInt):
        return int(size), int(size)
    r = ep.range_constraints[size.node.expr]
    try:
        hi = int(r.upper)
    except (TypeError, ValueError, OverflowError, AttributeError):  # int_oo
        hi = 2**62
    return int(r.lower), hi


def _share_equal_constants(program: _Program, seen: dict[tuple, list[Tensor]]) -> None:
    """Tensors a compile derived from the weights (the fused projection weights) are new objects per
    program: give a program the earlier programs' tensor when equal, so the package stores it once."""
    for module in (program, program.gm):
        for name, t in list(module.named_buffers(recurse=False)) + list(module.named_parameters(recurse=False)):
            key = (tuple(t.shape), t.dtype, t.device)
            match = next((u for u in seen.get(key, []) if u is t or torch.equal(u, t)), None)
            if match is None:
                seen.setdefault(key, []).append(t)
            elif match is not t:
                setattr(module, name, torch.nn.Parameter(match, requires_grad=False) if isinstance(t, torch.nn.Parameter) else match)


def _cache_layout(engine, cfg, dtype: torch.dtype) -> dict[str, Any]:
    from flashloop_compile.lowering.packed_layout import PACKED_LAYOUT_VERSION

    plan = {"max_batch": engine.max_batch}
    if engine.packed is None:
        shape = list(engine.model.model.kv_caches[0].k_cache.shape)
        return {"kind": "dense", "version": DENSE_LAYOUT_VERSION, "caches": len(engine.model.model.kv_caches),
                "shape": shape, "dtype": str(dtype).removeprefix("torch."), "plan": plan}
    p = engine.packed
    return {"kind": "packed", "version": PACKED_LAYOUT_VERSION, "geometry": dataclasses.asdict(p.geometry),
            "residual_capacity": list(p.residual_capacity), "dtype": str(p.dtype).removeprefix("torch."), "plan": plan}
