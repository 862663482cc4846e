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
