"""Shared benchmark plumbing: timing with CUDA events, the measured copy bandwidth, a deadline,
records (JSON lines) with the environment, and capturing a model's Dynamo graph once so several
FlashLoop configurations compile from the same trace.

Benchmarks are not tests: they assert correctness before timing, never timing itself.
"""

from __future__ import annotations

import copy
import json
import os
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch

OUT = Path(os.environ.get("OUT", "out"))


def git_commit() -> str:
    """FLASHLOOP_COMMIT where set (the device's copy of the tree may carry a stale .git), else git's
    HEAD."""
    if os.environ.get("FLASHLOOP_COMMIT"):
        return os.environ["FLASHLOOP_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def config_options(name: str, table: dict[str, dict[str, Any]], num_loops: int = 4) -> dict[str, Any]:
    """The FlashLoop options of a ``--configs`` entry: one of the bench's own names (``table``), or
    a name of the quality harness (``all-on@retention=1.0/0.1``: ``quality.evaluate.named_config``)
    as its feature options, so that a point of the quality frontier is timed at the settings its
    quality was measured at. Compilation options stay the bench's."""
    if name in table:
        return dict(table[name])
    from flashloop_compile.quality.evaluate import named_config

    try:
        flat = named_config(name, num_loops).to_dict()
    except ValueError as e:  # ConfigError included
        raise SystemExit(f"--configs: {name!r} is neither one of {sorted(table)} nor a configuration name "
                         f"of the quality harness ({e})") from None
    return {k: v for k, v in flat.items() if not k.startswith("compilation.")}


def environment() -> dict[str, Any]:
    import triton

    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "commit": git_commit(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def device() -> str:
    """cuda when present; the CPU only for smoke runs of the scripts (tiny preset)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Deadline:
    """Stop starting new work once ``seconds`` have passed since creation."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, seconds: float) -> bool:
        return self.left() > seconds


def cuda_times(fn: Callable[[], Any], warmup: int = 5, repeat: int = 30, before: Callable[[], Any] | None = None) -> list[float]:
    """Milliseconds of each of ``repeat`` calls, timed with CUDA events after a warm-up (a host
    timer on CPU: smoke runs only). ``before`` runs ahead of every timed call, untimed (e.g. an
    L2 flush)."""
    for _ in range(warmup):
        fn()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return times


def interleaved_times(fns: list[Callable[[], Any]], warmup: int = 5, repeat: int = 30,
                      before: list[Callable[[], Any]] | None = None) -> list[list[float]]:
    """:func:`cuda_times` of several variants of one operation, their repeats interleaved (A B A B
    ...): a drift over the run (clocks, temperature, the allocator) or an effect of running first
    falls on every variant alike. ``before[i]`` runs ahead of every timed call of ``fns[i]``."""
    before = before or [None] * len(fns)
    for fn in fns:
        for _ in range(warmup):
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeat):
        for i, (fn, pre) in enumerate(zip(fns, before)):
            times[i].extend(cuda_times(fn, warmup=0, repeat=1, before=pre))
    return times


def cuda_time_ms(fn: Callable[[], Any], warmup: int = 5, repeat: int = 30) -> dict[str, float]:
    """Median (and spread) of :func:`cuda_times`."""
    times = sorted(cuda_times(fn, warmup, repeat))
    return {"median_ms": statistics.median(times), "p10_ms": times[len(times) // 10], "p90_ms": times[(9 * len(times)) // 10]}


def graph_of(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` captured as a CUDA graph (run once outside the capture first: compiles, warms up);
    returns the graph's replay."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    return graph.replay


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written."""
    if not torch.cuda.is_available():
        nbytes = 64 << 20
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=device()).random_()
    dst = torch.empty_like(src)
    t = cuda_time_ms(lambda: dst.copy_(src), warmup=3, repeat=10)["median_ms"]
    del src, dst
    return 2 * (nbytes // 2) / (t * 1e-3) / 1e9


# Bytes per K or V value in the packed cache: a 4-bit code plus an FP16 minimum and scale per
# group of 64 values (K per channel over 64 tokens, V per token over 64 channels)
PACKED_BYTES_PER_VALUE = 0.5 + 2 * 2 / 64


def matmul_tflops(n: int = 8192) -> float:
    """Dense BF16 matrix-multiply throughput (an n x n x n product, TFLOP/s): the FLOP floor's
    rate, measured like the copy bandwidth in the run that uses it (float32 and n = 256 on CPU)."""
    if not torch.cuda.is_available():
        n = 256
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    a = torch.randn(n, n, dtype=dtype, device=device())
    b = torch.randn(n, n, dtype=dtype, device=device())
    t = cuda_time_ms(lambda: a @ b, warmup=3, repeat=10)["median_ms"]
    del a, b
    return 2 * n**3 / (t * 1e-3) / 1e12


def part_table(parts: list[dict], profile: dict, gbs: float, tflops: float | None = None, *,
               whole: str = "attention as a whole", whole_parts: tuple[str, ...] | None = None) -> list[dict]:
    """Each part's device ms and launches from the profile's buckets, its floor (``bytes`` at
    ``gbs`` GB/s or ``flops`` at ``tflops`` TFLOP/s) and the share of it reached; then a row
    ``whole`` over ``whole_parts`` (default: every part with a floor but the projections)."""
    buckets = profile.get("buckets", {})
    rows = []
    for p in parts:
        ms = sum(buckets.get(x, {}).get("ms", 0.0) for x in p["buckets"])
        launches = sum(buckets.get(x, {}).get("launches", 0.0) for x in p["buckets"])
        flops = p.get("flops")
        floor = (p["bytes"] / (gbs * 1e9) * 1e3 if p["bytes"] is not None
                 else flops / (tflops * 1e12) * 1e3 if flops is not None and tflops else None)
        rows.append({"part": p["part"], "buckets": list(p["buckets"]), "ms": ms, "launches": launches,
                     "bytes": p["bytes"], "flops": flops, "floor_ms": floor,
                     "share_of_floor": (floor / ms) if floor and ms else None})
    if whole_parts is None:
        sel = [r for r in rows if r["floor_ms"] is not None and r["part"] != "projections"]
    else:
        sel = [r for r in rows if r["part"] in whole_parts]
    ms = sum(r["ms"] for r in sel)
    floor = sum(r["floor_ms"] or 0.0 for r in sel)
    rows.append({"part": whole, "buckets": [x for r in sel for x in r["buckets"]], "ms": ms,
                 "launches": sum(r["launches"] for r in sel), "bytes": sum(r["bytes"] or 0.0 for r in sel),
                 "flops": sum(r["flops"] or 0.0 for r in sel), "floor_ms": floor,
                 "share_of_floor": floor / ms if ms else None})
    return rows


def print_parts(rows: list[dict]) -> None:
    print(f"    {'part':<40} {'ms':>9} {'floor ms':>9} {'share':>6} {'launches':>9}", flush=True)
    for r in rows:
        fl = f"{r['floor_ms']:9.3f}" if r["floor_ms"] is not None else f"{'':>9}"
        sh = f"{r['share_of_floor']:6.0%}" if r["share_of_floor"] is not None else f"{'':>6}"
        print(f"    {r['part']:<40} {r['ms']:9.3f} {fl} {sh} {r['launches']:9.1f}", flush=True)


GPU_QUERY = ("clocks.sm", "power.draw", "temperature.gpu", "clocks_event_reasons.active")


def parse_gpu_samples(text: str) -> dict[str, Any] | None:
    """Summary of ``nvidia-smi --query-gpu=<GPU_QUERY> --format=csv,noheader,nounits`` lines (the
    reasons field may be missing): SM clock median / min, power median / max, the hottest
    temperature, and the OR of the active clock-event (throttle) reason masks."""
    rows = []
    for line in text.splitlines():
        parts = [x.strip() for x in line.split(",")]
        try:
            rows.append((float(parts[0]), float(parts[1]), float(parts[2]), int(parts[3], 16) if len(parts) > 3 else 0))
        except (ValueError, IndexError):
            continue  # a header, a partial line at termination, "[N/A]"
    if not rows:
        return None
    clocks, power, temp, reasons = zip(*rows)
    mask = 0
    for r in reasons:
        mask |= r
    return {"samples": len(rows), "sm_mhz_median": statistics.median(clocks), "sm_mhz_min": min(clocks),
            "power_w_median": statistics.median(power), "power_w_max": max(power), "temp_c_max": max(temp),
            "event_reasons": hex(mask)}


class GpuSampler:
    """SM clock, power, temperature and clock-event reasons sampled by ``nvidia-smi`` every
    ``period_ms`` while the block runs (``.summary``: :func:`parse_gpu_samples`, None without
    nvidia-smi or CUDA). A power- or thermal-capped clock slows a loop of back-to-back graph
    replays that a two-replay profile does not see."""

    def __init__(self, period_ms: int = 50):
        self.period_ms = period_ms
        self.summary: dict[str, Any] | None = None
        self._proc = None

    def __enter__(self) -> "GpuSampler":
        import shutil

        if not torch.cuda.is_available() or shutil.which("nvidia-smi") is None:
            return self
        query = list(GPU_QUERY)
        probe = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(query)}", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)
        if probe.returncode != 0:  # an older driver: no clock-event reasons field
            query = query[:3]
        index = str(torch.cuda.current_device())
        self._proc = subprocess.Popen(
            ["nvidia-smi", "-i", index, f"--query-gpu={','.join(query)}", "--format=csv,noheader,nounits",
             f"-lms={self.period_ms}"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        time.sleep(0.2)  # its first sample before the timed work
        return self

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            out, _ = self._proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            out, _ = self._proc.communicate()
        self.summary = parse_gpu_samples(out)


def graph_replay_ms(fn: Callable[[], Any], repeat: int = 30) -> tuple[dict[str, float], Any, Callable[[], Any]]:
    """Capture ``fn`` in a CUDA graph (after warm-up on a side stream) and time its replays; also
    returns the graph's output and its replay (``fn`` itself on CPU), e.g. for a profile."""
    if not torch.cuda.is_available():
        return cuda_time_ms(fn, warmup=1, repeat=min(repeat, 3)), fn(), fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return cuda_time_ms(graph.replay, warmup=3, repeat=repeat), out, graph.replay


def error_text(e: BaseException) -> str:
    """The exception and the end of its traceback, for a result row."""
    import traceback

    return "".join(traceback.format_exception(e))[-4000:]


def record(name: str, row: dict[str, Any]) -> None:
    """Append one result row (with the environment) to $OUT/<name>.jsonl and print it."""
    OUT.mkdir(parents=True, exist_ok=True)
    row = {**environment(), **row}
    with open(OUT / f"{name}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def capture_graph(model: torch.nn.Module, *args: Any, dynamic_tokens: bool = False) -> tuple[torch.fx.GraphModule, list]:
    """One Dynamo trace of ``model(*args)``: the graph and its real example inputs."""
    got: list = []

    def backend(gm, example_inputs):
        got.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    if dynamic_tokens:
        for a in args:
            torch._dynamo.mark_dynamic(a, 1)
    with torch.no_grad():
        torch.compile(model, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    gm, inputs = got[0]
    # Dynamo hands a dynamic graph's size arguments as SymInts; a direct call needs their values.
    return gm, [x.node.hint if isinstance(x, torch.SymInt) else x for x in inputs]


def compile_variant(gm: torch.fx.GraphModule, example_inputs: list, options: Any, inner: str = "inductor"):
    """Compile a copy of a captured graph with the flashloop backend and ``options``; time it."""
    from flashloop_compile.backend import last_report, make_backend

    t0 = time.perf_counter()
    # Under no_grad, as the graph was traced and as it runs: the backend compiles outlined
    # segments (and a whole graph) here, and with grad enabled AOTAutograd sees parameters that
    # require grad and builds training graphs (saved activations; a functional copy of every
    # mutated KV cache per layer): 2-3x slower decode steps, tens of GB more prefill memory.
    with torch.no_grad():
        fn = make_backend(options, inner=inner)(copy.deepcopy(gm), example_inputs)
    return fn, time.perf_counter() - t0, last_report()


# (bucket, name substrings), first match wins (case-insensitive): CUDA kernel names, and on CPU the
# ops' names (flashloop::*_aten bodies, aten ops, Inductor's compiled graphs). SDPA first (flash's
# split-KV combine kernel ends in _combine_kernel), then Inductor's fusions (named after the ops they
# fuse: index_select, ...), the sparse kernels' combines before the packed one.
BUCKETS = (
    ("sdpa", ("flash_fwd", "fmha", "sdpa", "scaled_dot_product", "efficient_attention")),
    ("inductor", ("triton_", "cpp_fused", "compiledfxgraph")),
    ("correction", ("_correction", "correction_attention", "_read_attend_kernel", "correction_read_attend",
                    "_reuse_combine", "_read_values_kernel", "reuse_read_values")),
    ("ref_pv", ("_pv_kernel", "_pv_linear_kernel", "_pv_combine")),
    ("ref_select", ("_select_first", "_select_level", "_select_compact")),
    ("select_rows", ("flashloop::select_active",)),
    ("ref_scores", ("_scores_kernel", "_scores_linear_kernel", "_mma_scores_kernel", "_prep_kernel",
                    "reference_attention", "mma_linear_scores")),
    ("decode_bulk", ("_decode_bulk_kernel",)),
    ("packed_attn", ("_attn_kernel", "packed_attention")),
    ("packed_combine", ("_combine_kernel",)),
    ("read_bulk", ("_read_bulk_kernel",)),
    ("read", ("_read_kernel", "packed_read")),
    ("write", ("packed_kv_write", "_write", "_flush")),
    ("scan", ("scan_innermost", "cummax", "cummin", "_running_extrema")),
    ("prefill_attn", ("_position_attention", "position_attention", "_prefill_attention")),
    ("GEMM", ("gemm", "gemv", "nvjet", "cutlass", "sm90", "splitk", "aten::mm", "aten::addmm", "aten::bmm")),
)


def bucket(name: str) -> str:
    """The BUCKETS entry of a kernel (or CPU op) name; "other" where none matches."""
    low = name.lower()
    return next((b for b, subs in BUCKETS if any(x in low for x in subs)), "other")


# Ops whose work is generic ATen (sorts, scatters, norms) that kernel names cannot tell apart: the
# profile moves what runs inside each (its kernels on CUDA, its child ops on CPU) under the op's
# own name, which BUCKETS maps to a bucket of its own. Only where the op is traced as a CPU event,
# i.e. not under CUDA graph replay (token-sparse prefill's select_active runs in prefill only).
ATTRIBUTED_OPS = ("flashloop::select_active",)


def _attribute_ops(events, times: dict[str, tuple[float, int]], cuda: bool) -> dict[str, tuple[float, int]]:
    """``times`` with the work of every outermost ATTRIBUTED_OPS call moved under the op's name."""
    moved: dict[str, list] = defaultdict(lambda: [0.0, 0])
    into: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in events:
        if e.name not in ATTRIBUTED_OPS or e.device_type != torch.autograd.DeviceType.CPU:
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name != e.name:
            parent = parent.cpu_parent
        if parent is not None:  # inside an outer call of the same op: counted there
            continue
        stack = [e]
        while stack:
            x = stack.pop()
            stack.extend(x.cpu_children)
            work = [(k.name, k.duration) for k in x.kernels] if cuda else [(x.key, x.self_cpu_time_total)]
            for name, us in work:
                if us > 0:
                    moved[name][0] += us
                    moved[name][1] += 1
                    into[e.name][0] += us
                    into[e.name][1] += 1
    out = dict(times)
    for name, (us, count) in moved.items():
        left_us, left_count = out.get(name, (0.0, 0))
        left_us, left_count = left_us - us, left_count - count
        if left_count > 0 and left_us > 0:
            out[name] = (left_us, left_count)
        else:
            out.pop(name, None)
    for name, (us, count) in into.items():
        out[name] = (us, count)
    return out


def _profiled_us(step, n: int) -> dict[str, tuple[float, int]]:
    """(microseconds, count) per name over ``n`` calls of ``step``: kernel device time on CUDA
    (GPU copies of record_function ranges left out), op self time on CPU; what ATTRIBUTED_OPS run
    under their own names."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with torch.no_grad(), profile(activities=activities) as prof:
        for _ in range(n):
            step()
        sync()
    if cuda:
        times = {e.key: (e.device_time_total, e.count) for e in prof.key_averages()
                 if e.device_type == DeviceType.CUDA and not e.is_user_annotation and e.device_time_total > 0}
    else:
        times = {e.key: (e.self_cpu_time_total, e.count) for e in prof.key_averages() if e.self_cpu_time_total > 0}
    return _attribute_ops(prof.events(), times, cuda)


def kernel_profile(replay, eager, n: int, step_ms: float) -> dict:
    """Per-step time, share and launches of each bucket, of the top 15 names and of every glue kernel
    (buckets "inductor" and "other") over ``n`` calls of
    ``replay`` (the timed CUDA graph); ``eager`` (the compiled step, no graph) is profiled instead
    where the replays show no kernels. ``step_ms``: the timed step, for the share the kernels cover."""
    cuda = torch.cuda.is_available()
    source, times = ("graph" if cuda else "cpu"), _profiled_us(replay, n)
    if cuda and not times:
        source, times = "eager (graph replay not traced)", _profiled_us(eager, n)
    total = sum(us for us, _ in times.values())
    if total <= 0:
        what = "no kernel events (neither the graph replays nor an eager call traced)" if cuda else "no CPU op events"
        return {"error": what, "replays": n}
    per = defaultdict(lambda: [0.0, 0])
    for name, (us, count) in times.items():
        acc = per[bucket(name)]
        acc[0] += us
        acc[1] += count

    def entry(us: float, count: int) -> dict:
        return {"ms": us / n / 1e3, "share": us / total, "launches": count / n}

    top = sorted(times.items(), key=lambda kv: -kv[1][0])[:15]
    return {
        "source": source, "time": "device" if cuda else "cpu_self", "replays": n,
        "ms": total / n / 1e3, "share_of_step": total / n / 1e3 / step_ms,
        "buckets": {b: entry(*v) for b, v in sorted(per.items(), key=lambda kv: -kv[1][0])},
        "top": [{"name": name[:200], "bucket": bucket(name), **entry(*v)} for name, v in top],
        # every kernel outside the named buckets (Inductor's generated ones, ATen's): the glue a
        # config adds around its ops is only visible by name
        "glue": [{"name": name[:200], "bucket": bucket(name), **entry(*v)}
                 for name, v in sorted(times.items(), key=lambda kv: -kv[1][0]) if bucket(name) in ("inductor", "other")],
    }


def print_profile(name: str, shape: str, prof: dict) -> None:
    """The profile's buckets as a short table under the config's row."""
    if "error" in prof:
        print(f"  profile {name} {shape}: {prof['error']}", flush=True)
        return
    print(f"  profile {name} {shape} ({prof['source']}, {prof['time']} time, {prof['replays']} replays): "
          f"{prof['ms']:.3f} ms/step = {prof['share_of_step']:.0%} of the timed step", flush=True)
    for b, e in prof["buckets"].items():
        print(f"    {b:<15} {e['ms']:9.3f} ms {e['share']:6.1%} {e['launches']:7.1f} launches", flush=True)
