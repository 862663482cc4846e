"""The ``flashloop`` torch.compile backend.

``torch.compile(model, backend="flashloop", options=...)`` with ``options`` the flat dict of
:class:`FlashLoopConfig` or the config itself. The effective configuration is resolved once per
compile and logged with its hash. Unless every feature is off, the graph Dynamo captured is
recognized (:mod:`flashloop_compile.passes.recognize`) and the enabled feature passes rewrite it
into ``flashloop`` ops. In every configuration, features off included, linears sharing an input
then become one GEMM over weights concatenated at compile time
(:mod:`flashloop_compile.passes.fuse_projections`, exact; ``compilation.fuse_projections``), and
Inductor compiles the result, so norms, projections and MLPs still fuse around the ops. Runtime
tensors the passes read (step plan, packed cache, fused weights) become trailing graph inputs that
the returned callable supplies, the same tensor objects on every call.

Recompiles: the dense model keeps one static cache per (loop, layer) and takes positions as a
tensor, so a decode graph (one token per row) has the same shapes at every context length and
compiles once. Prefill graphs specialize on the prompt length unless the token dimension is
marked dynamic (``dynamic=True`` or ``torch._dynamo.mark_dynamic(input_ids, 1)``); the generator
pads prompts to length buckets instead.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.fx as fx

from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.passes.fuse_projections import FusedProjections, fuse_projections
from flashloop_compile.passes.manager import PassManager, RewriteReport, propagate_fake_values
from flashloop_compile.runtime.provider import ModelStateProvider

__all__ = ["flashloop_backend", "make_backend", "last_report", "pass_manager"]

log = logging.getLogger("flashloop_compile")

_reports: list[RewriteReport] = []


def last_report() -> RewriteReport | None:
    """What the most recent flashloop compile recognized and rewrote (diagnostics, tests)."""
    return _reports[-1] if _reports else None


def pass_manager(config: FlashLoopConfig, phase: str | None = None) -> PassManager:
    """The passes of ``config`` with the runtime's state of each model (step plan, packed KV cache);
    ``phase="decode"``: every graph is a decode step (k query rows per row: speculative verification)."""
    return PassManager(config, runtime=ModelStateProvider(), phase=phase)


def flashloop_backend(gm: fx.GraphModule, example_inputs: list[Any], options: Any = None, **kwargs: Any):
    if kwargs:
        raise TypeError(
            f"backend='flashloop' takes options=..., not {sorted(kwargs)}; mode= is an inductor setting"
        )
    return _compile(gm, example_inputs, FlashLoopConfig.coerce(options), inner="inductor")


def make_backend(options: Any = None, *, inner: str = "inductor", phase: str | None = None):
    """A backend callable with a fixed config; ``inner="eager"`` runs the rewritten graph without
    Inductor (fast CPU tests of the rewrites themselves). ``phase="decode"`` rewrites every graph
    as a decode step, whatever its query length: a multi-query decode (``Engine.verify``'s k
    tokens per row) gets the decode rewrites (sparse decode's loop-2 selection per query row), not
    the prefill ones. The callable's ``flashloop_options`` are its (config, inner, phase)."""
    if inner not in ("inductor", "eager"):
        raise ValueError(f"inner must be 'inductor' or 'eager', got {inner!r}")
    if phase not in (None, "decode"):
        raise ValueError(f"phase must be None (from the query length) or 'decode', got {phase!r}")
    config = FlashLoopConfig.coerce(options)

    def backend(gm: fx.GraphModule, example_inputs: list[Any]):
        return _compile(gm, example_inputs, config, inner, phase)

    backend.flashloop_options = (config, inner, phase)
    return backend


def _compile(gm: fx.GraphModule, example_inputs: list[Any], config: FlashLoopConfig, inner: str,
             phase: str | None = None):
    manager = pass_manager(config, phase)
    report = manager.run(gm, example_inputs)
    fused = fuse_projections(gm, example_inputs) if config.compilation.fuse_projections else FusedProjections()
    report.fused_linears, report.fused_gemms = fused.linears, fused.gemms
    if fused.gemms:
        # the narrowed outputs are strided views of the fused GEMM: their consumers' recorded
        # values (which outlined segments compile from) must carry those strides
        propagate_fake_values(gm)
    manager.cuts = [fused.replaced.get(c, c) for c in manager.cuts]
    log.info("%s; config %s; passes %s", report, config, manager.uuid())
    _reports.append(report)
    del _reports[:-16]
    return fused.wrap(_compile_rewritten(gm, example_inputs, manager, report, inner))


def _compile_rewritten(gm: fx.GraphModule, example_inputs: list[Any], manager: PassManager, report: RewriteReport, inner: str):
    compiler = _eager if inner == "eager" else _inductor
    if manager.cuts:
        from flashloop_compile.passes.outline import outline_segments

        top, report.segments = outline_segments(gm, manager.cuts, compiler)
        log.info("%s", report)
        return top.forward
    from torch._guards import detect_fake_mode

    from flashloop_compile.passes.graph import lift_runtime_buffers

    lifted, runtime = lift_runtime_buffers(gm)
    if not runtime:
        return compiler(gm, example_inputs)
    # Static shapes: AOTAutograd would give a real tensor it has no record of a fresh symbol per
    # dimension; a fake tensor of the backend's fake mode it takes as it is.
    mode = detect_fake_mode()
    examples = [mode.from_tensor(t, static_shapes=True) for t in runtime] if mode is not None else runtime
    fn = compiler(lifted, list(example_inputs) + examples)

    def with_runtime_inputs(*args: Any) -> Any:
        return fn(*args, *runtime)

    return with_runtime_inputs


def _eager(gm: fx.GraphModule, example_inputs: list[Any]):
    return gm.forward


def _inductor(gm: fx.GraphModule, example_inputs: list[Any]):
    """Inductor without the generated module's benchmark harness, which needs a size hint for
    every symbol: an outlined segment of a dynamic-token graph, then compiled from real inputs,
    carried the outer graph's symbols without hints and torch 2.11 asserted on CUDA (segments are
    now compiled from their symbolic example values; the harness stays off, it is debug output)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    from flashloop_compile.lowering.lowering_key import LoweringKey

    # the compile caches keyed on the package's source too (lowering_key.py: without it, a process
    # running another checkout reuses an earlier artifact)
    user_pass = inductor_config.post_grad_custom_post_pass
    key = user_pass if isinstance(user_pass, LoweringKey) else LoweringKey(user_pass)
    with inductor_config.patch(benchmark_harness=False, post_grad_custom_post_pass=key):
        return compile_fx(gm, example_inputs)


def register() -> None:
    """Make ``backend="flashloop"`` resolvable without the installed entry point (source checkouts)."""
    from torch._dynamo.backends.registry import _BACKENDS, register_backend

    if "flashloop" not in _BACKENDS:
        register_backend(name="flashloop")(flashloop_backend)

