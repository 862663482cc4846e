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
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    OUT, PACKED_BYTES_PER_VALUE, Deadline, GpuSampler, bucket, capture_graph, compile_variant, config_options,
    copy_bandwidth_gbs, cuda_time_ms, device, error_text, graph_replay_ms, kernel_profile, part_table, print_parts,
    print_profile, record, sync,
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


def kv_read_bytes(name: str, b: int, s: int, cfg, heads: int, dim: int, layers: int, loops: int) -> float:
    """Bytes of K/V one decode step must read (the floor's KV term): the attention parts of
    step_parts, the selection's probability row aside (the shape arguments must be cfg's)."""
    if (heads, dim, layers, loops) != (cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers, cfg.num_loops):
        raise ValueError("kv_read_bytes: heads, dim, layers and loops must be the model config's")
    return sum(p["bytes"] for p in step_parts(name, b, s, cfg, 0.0, 0.0)
               if p["bytes"] is not None and p["part"] not in ("projections", "loop 2 selection"))


# The parts of a decode step, each with the profile buckets its kernels fall in and the bytes it
# must read at the least (issue 31's table): the projections read every decoder layer's weights
# once per loop and lm_head once; each attention part its K/V (packed: INT4 codes plus FP16
# minimum and scale per 64 values, one plane per level of the depth it reads); the selection its
# probability row once. Glue, writes and reads of the ring window have no byte floor of their own.
def step_parts(name: str, b: int, s: int, cfg, layer_weight_bytes: float, head_weight_bytes: float) -> list[dict]:
    """[{part, buckets, bytes}] of one decode step of config ``name`` at batch b, context s."""
    from flashloop_compile.config import FlashLoopConfig

    conf = FlashLoopConfig.from_dict(config_options(name, CONFIGS, cfg.num_loops))
    quant = conf.kv_residual_quantization.enabled
    sd = conf.sparse_decode_attention
    heads, dim, layers, loops = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers, cfg.num_loops
    values = b * heads * s * dim  # of K (or V) in one (loop, layer)

    def kv(depth: int) -> float:  # K and V of one layer at ``depth``
        return 2 * values * (PACKED_BYTES_PER_VALUE * (depth + 1) if quant else 2)

    attn = ("decode_bulk", "packed_attn", "packed_combine") if quant else ("sdpa",)
    parts = [{"part": "projections", "buckets": ("GEMM",), "bytes": layer_weight_bytes * loops + head_weight_bytes}]
    if sd.enabled:
        frac = sd.key_fraction[0]
        corr = sum(kv(d) for d in range(2, loops)) * frac * (0.5 if sd.reuse_selected_probabilities else 1.0)
        parts += [
            {"part": "loop 1 attention", "buckets": attn, "bytes": kv(0) * layers},
            {"part": "loop 2 reference: scores", "buckets": ("ref_scores",), "bytes": kv(1) / 2 * layers},
            {"part": "loop 2 reference: PV", "buckets": ("ref_pv",), "bytes": kv(1) / 2 * layers},
            {"part": "loop 2 selection", "buckets": ("ref_select",), "bytes": b * cfg.num_attention_heads * s * 4 * layers},
            {"part": f"loops 3-{loops} corrections", "buckets": ("correction",), "bytes": corr * layers},
        ]
    else:
        parts.append({"part": "attention, every loop", "buckets": attn, "bytes": sum(kv(d) for d in range(loops)) * layers})
    parts.append({"part": "writes, window reads, scans", "buckets": ("write", "read_bulk", "read", "scan"), "bytes": None})
    parts.append({"part": "glue (Inductor, other)", "buckets": ("inductor", "other"), "bytes": None})
    return parts


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
    ap.add_argument("--configs", default="dense,quant,sparse,sparse+quant",
                    help=f"comma-separated, of {sorted(CONFIGS)} or quality-harness names (all-on@key_fraction=0.05)")
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
    layer_weight_bytes = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    head_weight_bytes = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
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
        variants = [(n, {**config_options(n, CONFIGS, cfg.num_loops), "compilation.outline_layers": args.outline})
                    for n in args.configs.split(",")]
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
            kv = kv_read_bytes(base, b, s, cfg, cfg.num_key_value_heads, cfg.head_dim,
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
                    if "error" not in row["profile"]:
                        parts = step_parts(base, b, s, cfg, layer_weight_bytes,
                                           head_weight_bytes)
                        row["parts"] = part_table(parts, row["profile"], bw)
                        row["launches_per_step"] = sum(e["launches"] for e in row["profile"]["buckets"].values())
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
            if "parts" in row:
                print(f"  parts {name} {shape}: {row['launches_per_step']:.0f} launches per step; floors at "
                      f"{bw:.0f} GB/s (copy bandwidth of this run)", flush=True)
                print_parts(row["parts"])
            del fn, out, replay
        del gm, inputs
    print("done", flush=True)


if __name__ == "__main__":
    main()
