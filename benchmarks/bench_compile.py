"""Compile times at a real Ouro shape: inductor vs the flashloop backend (features off), one process.

For each graph -- decode (one token at position T-1, static shapes) first, then prefill (T tokens,
dynamic token dimension as the engine marks it) -- and each backend, the whole model goes
through ``torch.compile(model, fullgraph=True)`` after ``torch._dynamo.reset()``, and we time:

* ``first_s``: the first call, synced: Dynamo trace + backend compile + first run (with outlined
  layers the segments compile lazily inside this first run);
* ``dynamo_s`` / ``backend_s``: its split, from a thin wrapper around the backend (time until
  Dynamo hands the graph over, time inside the backend); ``rest_s`` is guards + the first run;
* ``warm_ms``: the second call (host timer, synced; no CUDA graphs, so decode numbers include
  launch overhead), and the median of ``--warm-repeat`` calls.

Backends: ``inductor``; ``flashloop`` with ``options={}`` (every feature off: the graph goes to
Inductor untouched, so this should cost what inductor costs); ``flashloop-outline`` with
``compilation.outline_layers=True`` (still features off, but the backend recognizes the loop and
compiles each distinct layer segment once -- see passes/outline.py). Each compile runs in a
fresh, empty Inductor + Triton cache directory (``torch._inductor.utils.fresh_cache``; the FX
graph / AOT autograd / autotune caches are off as well), so no backend reuses another's
artifacts. One tiny throw-away compile first starts the compile workers and the driver.

Outputs (logits) are checked against eager on the same inputs and caches (the caches are filled
by an eager prefill of T tokens, again before every decode compile, so the decode step sees a
real context and the same one whatever ran before): argmax agreement, whether eager's argmax is
in the compiled top-5 (must hold for >= 95% of tokens), max |diff| / max |eager|, and the relative L2 error ||compiled - eager|| / ||eager||, which must stay within
twice the error low-precision eager itself has against a float32 eager run of the same weights
(the bf16 noise floor; 1e-3 at float32). flashloop rows are also compared with inductor directly
(features off: expected identical; outlined: close, fusion stops at layer boundaries). Rows go
to $OUT/compile.jsonl; a table is printed at the end; the exit status is 1 if any compile failed
or disagrees.

Order: inductor and flashloop for decode, then for prefill (the acceptance rows), then the outlined
ones. ``--deadline`` stops starting compiles whose expected time (from the compiles already
measured in this run) would overrun it; a started compile cannot be stopped, so leave a margin
below the hard limit. Rows are appended as they finish; skipped ones say so.

GPU (ouro-1.4b, bf16, 4K prefill; each unrolled 24 x 4 compile is expected to take minutes, so a
second call with ``--graphs prefill`` may be needed for what the first one skipped):

    timeout 590 python benchmarks/bench_compile.py --deadline 450

CPU smoke run (< 2 min):

    python benchmarks/bench_compile.py --preset tiny --dtype float32 --prefill-tokens 256
"""

from __future__ import annotations

import os

# Before torch is imported: no Inductor / AOT-autograd / autotune cache may serve a later compile.
os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")

import argparse  # noqa: E402
import gc  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

warnings.filterwarnings("ignore", message="dynamo_pgo force disabled")  # the caches are off on purpose

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the package from this checkout, installed or not
from common import Deadline, device, record, sync  # noqa: E402

BACKENDS = {
    "inductor": None,
    "flashloop": {},
    "flashloop-outline": {"compilation.outline_layers": True},
}


def disable_caches() -> dict[str, Any]:
    """Switch every persistent compile cache off (where this torch has the knob); return what was set."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    done: dict[str, Any] = {}
    for mod, name, value in [
        (torch.compiler.config, "force_disable_caches", True),
        (inductor_config, "force_disable_caches", True),
        (inductor_config, "fx_graph_cache", False),
        (inductor_config, "fx_graph_remote_cache", False),
        (inductor_config, "autotune_local_cache", False),
        (inductor_config, "autotune_remote_cache", False),
        (inductor_config, "bundled_autotune_remote_cache", False),
        (functorch_config, "enable_autograd_cache", False),
        (functorch_config, "enable_remote_autograd_cache", False),
    ]:
        if hasattr(mod, name):
            setattr(mod, name, value)
            done[name] = value
    return done


def fresh_cache():
    """An empty Inductor + Triton cache dir for one compile, in-memory code caches cleared."""
    from torch._inductor import utils

    return (getattr(utils, "fresh_cache", None) or utils.fresh_inductor_cache)()


class TimedBackend:
    """The backend torch.compile gets: records when Dynamo hands over the graph and how long the
    backend takes. ``inductor`` is ``compile_fx`` (what backend="inductor" calls); ``flashloop`` is
    the registered flashloop backend with ``options``."""

    def __init__(self, options: dict | None) -> None:
        self.options = options
        self.enter: list[float] = []
        self.exit: list[float] = []

    def __call__(self, gm, example_inputs):
        self.enter.append(time.perf_counter())
        if self.options is None:
            from torch._inductor.compile_fx import compile_fx

            fn = compile_fx(gm, example_inputs)
        else:
            from flashloop_compile.backend import flashloop_backend

            fn = flashloop_backend(gm, example_inputs, options=self.options)
        self.exit.append(time.perf_counter())
        return fn


def agreement(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """Per token: argmax agreement and whether ref's argmax is in got's top-5; over all logits:
    max |diff| / max |ref| and the relative L2 error ||got - ref|| / ||ref||."""
    got = got.reshape(-1, got.shape[-1])
    ref = ref.reshape(-1, ref.shape[-1])
    ref_top = ref.argmax(-1)
    top5 = got.topk(min(5, got.shape[-1]), dim=-1).indices
    d = got.float() - ref.float()
    diff = d.abs().max().item()
    return {
        "argmax_agree": (got.argmax(-1) == ref_top).float().mean().item(),
        "top5_hit": (top5 == ref_top[:, None]).any(-1).float().mean().item(),
        "max_abs_diff": diff,
        "rel_max_diff": diff / max(ref.float().abs().max().item(), 1e-30),
        "rel_l2": (d.norm() / ref.float().norm().clamp_min(1e-30)).item(),
    }


def timed_call(fn, *args) -> tuple[torch.Tensor, float]:
    sync()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn(*args)
    sync()
    return out, time.perf_counter() - t0


def warmup_compile() -> float:
    """One tiny inductor compile: starts the compile worker pool, CUDA/Triton driver and launcher
    builds, so the first measured backend does not pay them."""
    t0 = time.perf_counter()
    x = torch.randn(64, 64, device=device())
    with fresh_cache():
        torch._dynamo.reset()
        torch.compile(lambda a: torch.relu(a @ a.sin()).sum(-1), backend="inductor")(x)
        sync()
    torch._dynamo.reset()
    return time.perf_counter() - t0


def fp32_references(preset: str, inputs: dict[str, tuple], cache_len: int) -> dict[str, torch.Tensor]:
    """Eager logits of the same model in float32 (same seed: the low-precision weights are these
    rounded), for the noise floor of low-precision eager. Freed before any compile."""
    from flashloop_compile.models.ouro import OuroForCausalLM

    model = OuroForCausalLM.from_preset(preset, dtype=torch.float32, device=device()).eval()
    model.setup_caches(1, cache_len)
    out = {name: timed_call(model, *inputs[name])[0] for name in ("prefill", "decode")}
    del model
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--dtype", default="bfloat16", help="float32 for CPU smoke runs")
    ap.add_argument("--prefill-tokens", type=int, default=4096, help="T: prefill length; decode runs at position T-1")
    ap.add_argument("--pad", type=int, default=64, help="cache positions beyond T (cache holds T + pad)")
    ap.add_argument("--graphs", default="decode,prefill")
    ap.add_argument("--backends", default=",".join(BACKENDS))
    ap.add_argument("--warm-repeat", type=int, default=None, help="warm calls per compile (default 3; 1 on the CPU)")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                    help="one throw-away compile first (default: on CUDA only)")
    ap.add_argument("--deadline", type=float, default=300, help="seconds; no compile starts that would not fit")
    ap.add_argument("--rel-tol", type=float, default=None,
                    help="allowed ||compiled - eager|| / ||eager|| (default: float32 1e-3; otherwise 2x the "
                         "relative L2 error of low-precision eager against float32 eager, at least 1e-3)")
    args = ap.parse_args()
    deadline = Deadline(args.deadline)
    cuda = torch.cuda.is_available()
    repeat = max(1, args.warm_repeat if args.warm_repeat is not None else (3 if cuda else 1))
    dtype = getattr(torch, args.dtype)
    graphs = [g for g in args.graphs.split(",") if g]
    backends = [b for b in args.backends.split(",") if b]
    for name in graphs:
        if name not in ("decode", "prefill"):
            ap.error(f"--graphs: unknown graph {name!r} (decode, prefill)")
    for name in backends:
        if name not in BACKENDS:
            ap.error(f"--backends: unknown backend {name!r} ({', '.join(BACKENDS)})")

    import flashloop_compile  # noqa: F401  (registers backend="flashloop")
    from flashloop_compile.backend import last_report
    from flashloop_compile.models.ouro import OuroForCausalLM

    caches_off = disable_caches()
    base = {"preset": args.preset, "dtype": args.dtype, "tokens": args.prefill_tokens, "pad": args.pad}
    dev = device()
    t = args.prefill_tokens
    cache_len = t + args.pad
    t0 = time.perf_counter()
    model = OuroForCausalLM.from_preset(args.preset, dtype=dtype, device=dev).eval()
    model.setup_caches(1, cache_len)
    build_s = time.perf_counter() - t0
    warm_s = warmup_compile() if (args.warmup if args.warmup is not None else cuda) else None
    record("compile", {**base, "kind": "setup", "build_s": build_s, "warmup_compile_s": warm_s,
                       "caches_off": caches_off, "cpu_count": os.cpu_count(),
                       "compile_threads": getattr(torch._inductor.config, "compile_threads", None)})

    g = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, t), device=dev, generator=g)
    pos = torch.arange(t, device=dev)[None].contiguous()
    inputs = {
        "prefill": (ids, pos),
        "decode": (ids[:, t - 1:].contiguous(), torch.full((1, 1), t - 1, device=dev)),
    }
    # Eager references. The prefill fills every (loop, layer) cache at 0..T-1, so the decode step
    # at T-1 (which rewrites that position with the same token) sees a real context.
    ref32 = fp32_references(args.preset, inputs, cache_len) if dtype != torch.float32 else None
    refs: dict[str, torch.Tensor] = {}
    tol: dict[str, float] = {}
    for name in ("prefill", "decode"):
        out, first = timed_call(model, *inputs[name])
        warm = [timed_call(model, *inputs[name])[1] * 1e3 for _ in range(repeat)]
        refs[name] = out
        row = {**base, "kind": "eager", "graph": name, "first_s": first, "warm_ms": warm[0],
               "warm_median_ms": statistics.median(warm)}
        if ref32 is not None:
            row["vs_fp32"] = agreement(out, ref32[name])
        tol[name] = args.rel_tol if args.rel_tol is not None else (
            max(2 * row["vs_fp32"]["rel_l2"], 1e-3) if ref32 is not None else 1e-3)
        row["rel_tol"] = tol[name]
        if name == "decode":
            row["decode_vs_prefill_last"] = agreement(out, refs["prefill"][:, -1:])
        record("compile", row)
    del ref32
    if "prefill" not in graphs:
        refs.pop("prefill")
    gc.collect()

    rows: list[dict[str, Any]] = []
    measured: dict[tuple[str, str], float] = {}
    failed = False
    # The acceptance compiles (inductor, flashloop features off) for both graphs before the
    # outlined ones, so a tight deadline drops the extra rows first.
    plan = [(g, b) for g in graphs for b in backends if b != "flashloop-outline"]
    plan += [(g, b) for g in graphs for b in backends if b == "flashloop-outline"]
    inductor_out: dict[str, torch.Tensor] = {}
    for graph, backend in plan:
        need = estimate(measured, graph, backend)
        if not deadline.allows(need):
            row = {**base, "kind": "skipped", "graph": graph, "backend": backend, "reason": "deadline",
                   "estimate_s": need, "left_s": deadline.left()}
            record("compile", row)
            rows.append(row)
            continue
        options = BACKENDS[backend]
        timed = TimedBackend(options)
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        if graph == "decode":  # compiled prefills rewrote the caches: back to eager's context
            timed_call(model, *inputs["prefill"])
        try:
            with fresh_cache():
                compiled = torch.compile(model, backend=timed, fullgraph=True)
                args_ = inputs[graph]
                if graph == "prefill":  # as the engine does: prompt lengths do not recompile
                    for a in args_:
                        torch._dynamo.mark_dynamic(a, 1)
                start = time.perf_counter()
                out, first = timed_call(compiled, *args_)
                warm = [timed_call(compiled, *args_)[1] * 1e3 for _ in range(repeat)]
                report = last_report() if options is not None else None
                del compiled
        except Exception as e:  # record and go on: the other backends still tell something
            row = {**base, "kind": "error", "graph": graph, "backend": backend,
                   "error": f"{type(e).__name__}: {str(e)[:400]}"}
            record("compile", row)
            rows.append(row)
            failed = True
            torch._dynamo.reset()
            continue
        torch._dynamo.reset()
        measured[(graph, backend)] = first
        check = agreement(out, refs[graph])
        ok = check["rel_l2"] <= tol[graph] and check["top5_hit"] >= 0.95
        row = {
            **base, "kind": "compile", "graph": graph, "backend": backend, "options": options,
            "first_s": first, "dynamo_s": timed.enter[0] - start if timed.enter else None,
            "backend_s": timed.exit[0] - timed.enter[0] if timed.exit else None,
            "rest_s": first - (timed.exit[0] - start) if timed.exit else None,
            "backend_calls": len(timed.enter),
            "warm_ms": warm[0], "warm_median_ms": statistics.median(warm),
            "vs_eager": check, "ok": ok, "rel_tol": tol[graph],
            "report": str(report) if report is not None else None,
            "segments": dict(report.segments) if report is not None and report.segments else None,
        }
        if backend == "inductor":
            inductor_out[graph] = out
        elif graph in inductor_out:
            row["vs_inductor"] = agreement(out, inductor_out[graph])
        record("compile", row)
        rows.append(row)
        failed |= not ok
        del out
    del inductor_out, refs
    gc.collect()

    order = {b: i for i, b in enumerate(BACKENDS)}
    print_table(sorted(rows, key=lambda r: (graphs.index(r["graph"]), order[r["backend"]])))
    print("done", flush=True)
    if failed:
        sys.exit(1)


def estimate(measured: dict[tuple[str, str], float], graph: str, backend: str) -> float:
    """Seconds a compile is expected to take, from what this run already measured (a compile that
    has started cannot be stopped, so none starts that would overrun the deadline)."""
    same_graph = measured.get((graph, "inductor")) or measured.get((graph, "flashloop"))
    if backend in ("inductor", "flashloop"):
        if same_graph:
            return same_graph
        other = measured.get(("decode", "inductor")) or measured.get(("decode", "flashloop"))
        return 1.3 * other if other else 20.0
    mine = measured.get(("decode", backend))
    if graph == "prefill" and mine:
        return 1.3 * mine
    return 0.5 * same_graph if same_graph else 20.0


def print_table(rows: list[dict[str, Any]]) -> None:
    def f(v, spec):
        return format(v, spec) if isinstance(v, (int, float)) else "-".rjust(int(spec.split(".")[0]))

    print(f"\n{'graph':8} {'backend':18} {'first s':>8} {'dynamo s':>9} {'backend s':>9} {'warm ms':>9} "
          f"{'argmax':>7} {'top5':>6} {'rel L2':>9} {'tol':>8}  note")
    for r in rows:
        check = r.get("vs_eager", {})
        note = r.get("reason") or r.get("error") or ("ok" if r.get("ok") else "DISAGREES")
        if "vs_inductor" in r:
            note += f"; vs inductor max|d| {r['vs_inductor']['max_abs_diff']:.3g}"
        if r.get("segments"):
            note += f"; {sum(r['segments'].values())} segments / {len(r['segments'])} artifacts"
        print(f"{r['graph']:8} {r['backend']:18} {f(r.get('first_s'), '8.1f')} {f(r.get('dynamo_s'), '9.1f')} "
              f"{f(r.get('backend_s'), '9.1f')} {f(r.get('warm_ms'), '9.2f')} "
              f"{f(check.get('argmax_agree'), '7.3f')} {f(check.get('top5_hit'), '6.3f')} "
              f"{f(check.get('rel_l2'), '9.2e')} {f(r.get('rel_tol'), '8.1e')}  {note}")


if __name__ == "__main__":
    main()
