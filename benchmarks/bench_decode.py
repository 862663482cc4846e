"""Decode step time under CUDA graphs at a real Ouro shape: dense vs FlashLoop, same process.

Per (batch, context) the model's decode graph is traced once by Dynamo; each configuration
compiles a copy of it with the flashloop backend (dense = features off). The caches hold random
BF16 K/V for `context` positions (the packed cache is written from the same values through the
packed write op), every row decodes at position context-1, and each configuration's forward is
captured in a CUDA graph and replayed (median of repeats, CUDA events). Reported per row: step
time, speedup vs dense, the bytes a step must read (weights once per loop + KV), that floor at the
measured copy bandwidth, and the achieved share of it. With ``--profile N``, N more replays run
under the profiler after the timing (which they never touch): device time per kernel bucket and the
top kernels per step, in the row's "profile" (CPU op self time on CPU smoke runs).

    python benchmarks/bench_decode.py --shapes 1x32768,4x32768 --deadline 480
    python benchmarks/bench_decode.py --shapes 4x32768 --configs dense,sparse+quant --no-dense-whole --profile 3
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    OUT, Deadline, GpuSampler, capture_graph, compile_variant, copy_bandwidth_gbs, cuda_time_ms, device, error_text, graph_replay_ms,
    record, sync,
)

CONFIGS = {
    "dense": {},
    "quant": {"kv_residual_quantization.enabled": True},
    "sparse": {"sparse_decode_attention.enabled": True},
    "sparse+quant": {"sparse_decode_attention.enabled": True, "kv_residual_quantization.enabled": True},
    # loops 3..R reuse loop 2's probabilities over the selected keys: V only
    "sparse+quant+reuse": {"sparse_decode_attention.enabled": True, "kv_residual_quantization.enabled": True,
                           "sparse_decode_attention.reuse_selected_probabilities": True},
}


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
    ("ref_scores", ("_scores_kernel", "_scores_linear_kernel", "_mma_scores_kernel", "_prep_kernel",
                    "reference_attention", "mma_linear_scores")),
    ("decode_bulk", ("_decode_bulk_kernel",)),
    ("packed_attn", ("_attn_kernel", "packed_attention")),
    ("packed_combine", ("_combine_kernel",)),
    ("read_bulk", ("_read_bulk_kernel",)),
    ("read", ("_read_kernel", "packed_read")),
    ("write", ("packed_kv_write", "_write", "_flush")),
    ("GEMM", ("gemm", "gemv", "nvjet", "cutlass", "sm90", "splitk", "aten::mm", "aten::addmm", "aten::bmm")),
)


def bucket(name: str) -> str:
    """The BUCKETS entry of a kernel (or CPU op) name; "other" where none matches."""
    low = name.lower()
    return next((b for b, subs in BUCKETS if any(x in low for x in subs)), "other")


def _profiled_us(step, n: int) -> dict[str, tuple[float, int]]:
    """(microseconds, count) per name over ``n`` calls of ``step``: kernel device time on CUDA
    (GPU copies of record_function ranges left out), op self time on CPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with torch.no_grad(), profile(activities=activities) as prof:
        for _ in range(n):
            step()
        sync()
    if cuda:
        return {e.key: (e.device_time_total, e.count) for e in prof.key_averages()
                if e.device_type == DeviceType.CUDA and not e.is_user_annotation and e.device_time_total > 0}
    return {e.key: (e.self_cpu_time_total, e.count) for e in prof.key_averages() if e.self_cpu_time_total > 0}


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


def kv_read_bytes(name: str, b: int, s: int, cfg, heads: int, dim: int, layers: int, loops: int) -> float:
    """Bytes of K/V one decode step must read (the floor's KV term)."""
    from flashloop_compile.config import FlashLoopConfig

    conf = FlashLoopConfig.from_dict(CONFIGS[name])
    dense_plane = 2 * b * heads * s * dim * 2  # K and V of one (loop, layer) in BF16
    packed_plane = dense_plane / 4 * (1 + 2 * 2 / 64)  # INT4 codes + FP16 min/scale per 64 values
    frac = conf.sparse_decode_attention.key_fraction[0] if conf.sparse_decode_attention.enabled else 1.0
    if conf.sparse_decode_attention.reuse_selected_probabilities:
        frac /= 2  # the corrections read V only
    total = 0.0
    for depth in range(loops):
        planes = depth + 1 if conf.kv_residual_quantization.enabled else 1
        per = packed_plane * planes if conf.kv_residual_quantization.enabled else dense_plane
        share = frac if (conf.sparse_decode_attention.enabled and depth >= 2) else 1.0
        total += per * share
    return total * layers


def fill_caches(model, context: int) -> None:
    """Random K/V in every (loop, layer) slot for positions 0..context-1."""
    g = torch.Generator(device=device()).manual_seed(0)
    for cache in model.model.kv_caches:
        for buf in (cache.k_cache, cache.v_cache):
            buf.zero_()
            buf[:, :, :context].normal_(generator=g)


def fill_packed(model, context: int) -> None:
    """Write the dense caches' values into the packed cache (all depths, all positions)."""
    from flashloop_compile.lowering.packed_ops import packed_kv_write
    from flashloop_compile.runtime.state import state_for_model

    packed = state_for_model(model).packed
    packed.reset()
    cfg = model.config
    b = model.model.kv_caches[0].k_cache.shape[0]
    pos = torch.arange(context, device=device())[None].expand(b, -1).contiguous()
    for layer in range(cfg.num_hidden_layers):
        for depth in range(cfg.num_loops):
            c = model.model.cache_at(depth, layer)
            k = c.k_cache[:, :, :context].contiguous()
            v = c.v_cache[:, :, :context].contiguous()
            packed_kv_write(packed, layer, k, v, pos, depth)
    sync()


def isolated(args) -> None:
    """main() with each (shape, config) in a process of its own, dense first at each shape (its
    time is handed to the others' rows as their baseline): rows as main() records them."""
    deadline = Deadline(args.deadline)
    configs = args.configs.split(",")
    configs = [c for c in configs if c == "dense"] + [c for c in configs if c != "dense"]
    log = OUT / "decode.jsonl"
    for si, shape in enumerate(args.shapes.split(",")):
        dense_ms: dict[str, float] = {}
        for name in configs:
            if not deadline.allows(120):
                record("decode", {"kind": "skipped", "shape": shape, "config": name, "reason": "deadline"})
                continue
            whole = args.dense_whole and si == 0 and name == "dense"
            cmd = [sys.executable, __file__, "--preset", args.preset, "--shapes", shape, "--configs", name,
                   "--dtype", args.dtype, "--profile", str(args.profile), "--deadline", str(deadline.left()),
                   "--no-isolate", "--dense-ms", json.dumps(dense_ms),
                   "--outline" if args.outline else "--no-outline", "--dense-whole" if whole else "--no-dense-whole"]
            start = log.stat().st_size if log.exists() else 0
            run = subprocess.run(cmd)
            if run.returncode:
                record("decode", {"kind": "error", "shape": shape, "config": name,
                                  "error": f"the isolated process exited with {run.returncode}"})
            if log.exists():
                with open(log) as f:
                    f.seek(start)
                    for line in f:
                        r = json.loads(line)
                        if r.get("kind") == "decode_step" and str(r.get("config", "")).startswith("dense"):
                            dense_ms[r["config"]] = r["ms"]
    print("done", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--shapes", default="1x32768,4x32768,1x8192,4x8192")
    ap.add_argument("--configs", default="dense,quant,sparse,sparse+quant")
    ap.add_argument("--outline", action=argparse.BooleanOptionalAction, default=True,
                    help="FlashLoop configs compile each distinct layer once (compilation.outline_layers)")
    ap.add_argument("--dense-whole", action=argparse.BooleanOptionalAction, default=True,
                    help="also time dense compiled as one whole graph (plain inductor) at the first shape")
    ap.add_argument("--deadline", type=float, default=480)
    ap.add_argument("--dtype", default="bfloat16", help="float32 for CPU smoke runs")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after each config's timing, N more replays under the profiler: time per kernel bucket")
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="one process per shape and config (default: on with CUDA). A config timed after "
                         "another in one process can read slower with the same kernels (sparse + quant at "
                         "4x32K: 32.46 ms after dense in one process, 30.85 ms alone, equal device time)")
    ap.add_argument("--dense-ms", default="{}", help=argparse.SUPPRESS)  # an isolated child's dense baseline
    args = ap.parse_args()
    if args.isolate is None:
        args.isolate = torch.cuda.is_available()
    if args.isolate:
        return isolated(args)
    deadline = Deadline(args.deadline)

    from flashloop_compile.models.ouro import OuroForCausalLM

    bw = copy_bandwidth_gbs()
    record("decode", {"kind": "copy_bandwidth", "gbs": bw})
    model = OuroForCausalLM.from_preset(args.preset, dtype=getattr(torch, args.dtype), device=device()).eval()
    cfg = model.config
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for si, shape in enumerate(args.shapes.split(",")):
        b, s = map(int, shape.split("x"))
        if not deadline.allows(120):
            record("decode", {"kind": "skipped", "shape": shape, "reason": "deadline"})
            continue
        model.clear_caches()
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        model.setup_caches(b, s)
        fill_caches(model, s - 1)
        ids = torch.randint(0, cfg.vocab_size, (b, 1), device=device())
        pos = torch.full((b, 1), s - 1, device=device())
        t0 = time.perf_counter()
        gm, inputs = capture_graph(model, ids, pos)
        trace_s = time.perf_counter() - t0
        dense_ms: dict[str, float] = json.loads(args.dense_ms)
        variants = [(n, {**CONFIGS[n], "compilation.outline_layers": args.outline}) for n in args.configs.split(",")]
        if args.dense_whole and si == 0:
            variants.insert(0, ("dense-whole", {}))
        for name, options in variants:
            if not deadline.allows(150 if name == "dense-whole" else 60):
                record("decode", {"kind": "skipped", "shape": shape, "config": name, "reason": "deadline"})
                continue
            try:
                fn, pass_s, report = compile_variant(gm, inputs, options)
                t1 = time.perf_counter()
                with torch.no_grad():
                    out = fn(*inputs)
                sync()
                compile_s = pass_s + time.perf_counter() - t1
                if options.get("kv_residual_quantization.enabled"):
                    fill_packed(model, s - 1)
                with torch.no_grad():
                    timing, _, replay = graph_replay_ms(partial(fn, *inputs))
            except torch.cuda.OutOfMemoryError as e:
                record("decode", {"kind": "oom", "shape": shape, "config": name, "error": str(e)[:200]})
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
                continue
            except Exception as e:  # one broken variant must not cost the rest of the run
                record("decode", {"kind": "error", "shape": shape, "config": name, "error": error_text(e)})
                continue
            ms = timing["median_ms"]
            base = name.split("-")[0] if name == "dense-whole" else name
            kv = kv_read_bytes(base if base in CONFIGS else "dense", b, s, cfg, cfg.num_key_value_heads, cfg.head_dim,
                               cfg.num_hidden_layers, cfg.num_loops)
            floor_ms = (weight_bytes * cfg.num_loops + kv) / (bw * 1e9) * 1e3
            if name.startswith("dense"):
                dense_ms[name] = ms
            best_dense = min(dense_ms.values()) if dense_ms else None
            row = {
                "kind": "decode_step", "preset": args.preset, "batch": b, "context": s, "config": name,
                "options": options, "ms": ms, "p10_ms": timing["p10_ms"], "p90_ms": timing["p90_ms"],
                "speedup_vs_dense": (best_dense / ms) if best_dense else None,
                "dense_ms": dense_ms,
                "kv_read_gb": kv / 1e9, "floor_ms": floor_ms, "share_of_floor": floor_ms / ms,
                "achieved_gbs": (weight_bytes * cfg.num_loops + kv) / (ms * 1e-3) / 1e9,
                "trace_s": trace_s, "compile_s": compile_s, "report": str(report),
                "max_memory_gb": (torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None),
            }
            if torch.cuda.is_available():  # the GPU's clock and power over 30 more replays, and their time
                try:
                    with GpuSampler() as sampler:
                        again = cuda_time_ms(replay, warmup=3, repeat=30)
                    row["gpu_state"] = sampler.summary
                    row["ms_sampled"] = again["median_ms"]
                except Exception as e:  # (untried on the device when written) never at the timed row's cost
                    row["gpu_state"] = {"error": error_text(e)}
            if args.profile > 0:  # after the timing and the row's measurements: they never see it
                try:
                    row["profile"] = kernel_profile(replay, partial(fn, *inputs), args.profile, ms)
                except Exception as e:  # a profiler failure must not cost the timed row
                    row["profile"] = {"error": error_text(e)}
            record("decode", row)
            if (row.get("gpu_state") or {}).get("samples"):
                g = row["gpu_state"]
                print(f"  gpu {name} {shape}: {row['ms_sampled']:.3f} ms over 30 more replays; SM {g['sm_mhz_median']:.0f} MHz "
                      f"(min {g['sm_mhz_min']:.0f}), {g['power_w_median']:.0f} W (max {g['power_w_max']:.0f}), "
                      f"{g['temp_c_max']:.0f} C, clock-event reasons {g['event_reasons']}", flush=True)
            if "profile" in row:
                print_profile(name, shape, row["profile"])
            del fn, out, replay
        del gm, inputs
    print("done", flush=True)


if __name__ == "__main__":
    main()
