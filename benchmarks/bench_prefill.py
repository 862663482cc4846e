"""Prefill latency at a real Ouro shape: dense vs token-sparse vs all features, same process.

Per (batch, tokens) the prefill graph is traced by Dynamo with a dynamic token dimension, as the
engine traces it (token-sparse prefill needs it; `--no-dynamic` traces static shapes, dense
only), with caches of prompt + `--headroom` positions; each configuration compiles a copy with the
flashloop backend. Timed with CUDA events (warm-up, median of repeats); peak memory per config.

    python benchmarks/bench_prefill.py --shapes 1x8192,1x32768 --deadline 480
    python benchmarks/bench_prefill.py --shapes 1x32768 --configs dense,all_on --profile 1   # device time per kernel family

Each row records the FLOPs of useful work its configuration must do (``prefill_parts``) and the
TFLOP/s reached; with ``--profile`` also every part of the prefill against its floor (FLOPs at the
matrix-multiply rate, bytes at the copy bandwidth, both measured in the run) and the share reached.
Token-sparse prefill's row selection (``flashloop::select_active``: ATen sorts and scatters) is a
part of its own, ``active-row selection``: the profile counts what runs inside the op there
(``common.ATTRIBUTED_OPS``), not in the glue.

The prompt is fresh (positions 0..T-1): the model is traced without ``input_pos``, as the engine
calls a prompt's first chunk, so the backend's default (``compilation.position_attention``) runs
the dense loops' attention as causal SDPA over the prompt's own K/V (FlashAttention: bucket
``sdpa`` of the profile) and only token-sparse loops 3..R use ``position_attention``
(``prefill_attn``). Other traces of the same prompt, each checked against ``dense``'s output:

- ``dense_position``, ``token_sparse_position``: traced with ``input_pos`` given, as a chunk over
  a stored prefix is: every site through ``flashloop.position_attention`` (or, quantized,
  ``packed_attention``);
- ``dense_masked``: the model's own SDPA masked over the whole cache
  (``compilation.position_attention: false``; 30.7 ms a site at 32K on the H200, RESULTS.md);
- ``dense_causal``: the model traced with its attention replaced by causal SDPA over cache
  positions [0, T) by hand (what a dense server's FlashAttention prefill costs, independent of the
  backend's rewrite); ``speedup_vs_dense_causal`` compares with it.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    PACKED_BYTES_PER_VALUE, Deadline, capture_graph, compile_variant, config_options, copy_bandwidth_gbs, cuda_time_ms,
    device, error_text, kernel_profile, matmul_tflops, part_table, print_parts, print_profile, record, sync,
)

CONFIGS = {
    "dense": {},  # the backend's default: a fresh prompt's attention is causal SDPA
    "dense_causal": {},  # a different trace: see the module docstring
    "dense_position": {},  # traced at given positions: position_attention at every site
    "dense_masked": {"compilation.position_attention": False},  # the model's masked SDPA
    "token_sparse": {"token_sparse_prefill.enabled": True},
    "token_sparse_position": {"token_sparse_prefill.enabled": True},  # traced at given positions
    "kv_quant": {"kv_residual_quantization.enabled": True},
    "all_on": {
        "token_sparse_prefill.enabled": True,
        "sparse_decode_attention.enabled": True,
        "kv_residual_quantization.enabled": True,
    },
}
# how each config's graph is traced: "fresh" (no input_pos), "positions" (input_pos given) or
# "causal" (the hand-written causal SDPA)
TRACES = {"dense_causal": "causal", "dense_position": "positions", "token_sparse_position": "positions"}


# dense computed another way: each is checked against dense's output when both run
EXACT_DENSE = ("dense_causal", "dense_position", "dense_masked")


# The parts of a prefill (issue 32's table), each with the profile buckets its kernels fall in
# and its floor: the work it must do at the matrix-multiply rate of the run (projections: every
# decoder layer's linears over the rows a loop computes, lm_head over every token, as the traced
# graph computes logits for the whole prompt; attention: 4 * D FLOPs per query head and visible
# key, causal) or the bytes it must move at the copy bandwidth (the packed write: each written
# row's K/V read once in BF16 and its codes and parameters written, the predecessor's codes and
# parameters read at depth d > 0: (2 + 0.5625 (1 + d)) bytes per value, d = the loop's depth).
# A token-sparse loop computes the nested top-k of the prompt's rows (FlashLoopConfig's budgets);
# its attention counts the causal keys of the rows it kept where the packed cache records them
# (depth_count), and (T + 1) / 2 a row otherwise, which holds for kept rows spread over the prompt.


def prefill_parts(name: str, b: int, t: int, cfg, linear_params: int, head_params: int,
                  kept_keys: list[float] | None = None) -> list[dict]:
    """[{part, buckets, flops, bytes}] of one prefill of config ``name``: b prompts of t tokens.
    ``kept_keys``: per loop, the causal keys the rows it kept attend to, summed over the batch
    (:func:`kept_causal_keys`); without it a token-sparse loop's kept rows count (t + 1) / 2 keys
    each."""
    from flashloop_compile.config import FlashLoopConfig

    conf = FlashLoopConfig.from_dict(config_options(name, CONFIGS, cfg.num_loops))
    tsp, quant = conf.token_sparse_prefill, conf.kv_residual_quantization.enabled
    loops, layers = cfg.num_loops, cfg.num_hidden_layers
    rows = list(tsp.budgets(t)) if tsp.enabled else [t] * loops  # rows each loop computes, per prompt
    pair_flops = 4 * cfg.head_dim * cfg.num_attention_heads  # per (query, visible key), QK and PV
    causal = t * (t + 1) / 2

    def attn_flops(n: int, r: int) -> float:  # n of the t rows active at loop r
        if kept_keys is not None:
            return layers * pair_flops * kept_keys[r]
        return b * layers * pair_flops * (causal if n == t else n * (t + 1) / 2)

    parts = [{"part": "projections", "buckets": ("GEMM",), "bytes": None,
              "flops": 2 * b * (linear_params * sum(rows) + head_params * t)}]
    dense_loops = [r for r in range(loops) if rows[r] == t]
    sparse_loops = [r for r in range(loops) if rows[r] < t]
    if TRACES.get(name, "fresh") == "fresh" and sparse_loops:  # fresh prompt: full loops on SDPA
        parts += [
            {"part": f"attention, loops 1-{len(dense_loops)} (causal SDPA)", "buckets": ("sdpa",), "bytes": None,
             "flops": sum(attn_flops(rows[r], r) for r in dense_loops)},
            {"part": f"attention, loops {len(dense_loops) + 1}-{loops} (token-sparse)",
             "buckets": ("prefill_attn", "packed_attn"), "bytes": None,
             "flops": sum(attn_flops(rows[r], r) for r in sparse_loops)},
        ]
    else:
        parts.append({"part": "attention, every loop", "buckets": ("sdpa", "prefill_attn", "packed_attn"), "bytes": None,
                      "flops": sum(attn_flops(n, r) for r, n in enumerate(rows))})
    if quant:
        values = 2 * b * cfg.num_key_value_heads * cfg.head_dim * layers  # K and V of one row, every layer
        parts.append({"part": "packed write, reads, scans", "buckets": ("write", "read_bulk", "read", "scan"),
                      "bytes": sum(rows[d] * values * (2 + PACKED_BYTES_PER_VALUE * (1 + d)) for d in range(loops)),
                      "flops": None})
    if tsp.enabled:  # the nested top-k of loops 3..R (select_active: sorts and scatters, its own line)
        parts.append({"part": "active-row selection", "buckets": ("select_rows",), "bytes": None, "flops": None})
    parts.append({"part": "glue (Inductor, other)", "buckets": ("inductor", "other"), "bytes": None, "flops": None})
    return parts


def written_packed_cache(state, name: str, loops: int):
    """The packed cache a prefill of config ``name`` writes (None without KV quantization). The
    model's state outlives a configuration: a token-sparse run after an all-on one still holds the
    all-on cache, whose depth_count it never writes (it read as no kept rows, no attention work)."""
    from flashloop_compile.config import FlashLoopConfig

    if state is None or not FlashLoopConfig.from_dict(config_options(name, CONFIGS, loops)).kv_residual_quantization.enabled:
        return None
    return state.packed


def kept_causal_keys(depth_count: torch.Tensor, loops: int) -> list[float]:
    """Per loop r, the causal keys of the rows it computed, summed over the prompts: the packed
    cache's depth_count [B, T] (rows written at depths 0..depth_count - 1, token-sparse prefill's
    nested sets) counts row p at loop r where depth_count[p] > r, and row p attends to p + 1 keys."""
    dc = depth_count.long()
    keys = torch.arange(1, dc.shape[1] + 1, device=dc.device, dtype=torch.float64)
    return [float(((dc > r).double() * keys).sum()) for r in range(loops)]


def useful_flops(parts: list[dict]) -> float:
    """FLOPs a prefill must do: its parts' (projections and attention)."""
    return sum(p["flops"] or 0.0 for p in parts)


@contextlib.contextmanager
def causal_prompt_attention():
    """Trace the model with its masked SDPA replaced by causal SDPA over cache positions [0, T)
    (T = the query length): equal for a fresh, unpadded prompt at positions 0..T-1 only."""
    from flashloop_compile.models import ouro

    F = ouro.F

    def sdpa(q, k, v, attn_mask=None, enable_gqa=False):
        t = q.shape[2]
        return F.scaled_dot_product_attention(q, k[:, :, :t], v[:, :, :t], is_causal=True, enable_gqa=enable_gqa)

    ouro.F = types.SimpleNamespace(**{**vars(F), "scaled_dot_product_attention": sdpa})
    try:
        yield
    finally:
        ouro.F = F


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--shapes", default="1x8192,1x32768,1x4096,4x4096")
    ap.add_argument("--configs", default="dense,token_sparse,all_on",
                    help=f"comma-separated, of {sorted(CONFIGS)} or quality-harness names (all-on@retention=1.0/0.1)")
    ap.add_argument("--outline", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dynamic", action=argparse.BooleanOptionalAction, default=True,
                    help="trace with a dynamic token dimension (as the engine does); each shape is traced anyway")
    ap.add_argument("--headroom", type=int, default=256,
                    help="cache positions beyond the prompt (room for decode, as a serving cache has)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after each config's timing, N more prefills under the profiler: time per kernel bucket")
    ap.add_argument("--deadline", type=float, default=480)
    ap.add_argument("--dtype", default="bfloat16", help="float32 for CPU smoke runs")
    args = ap.parse_args()
    deadline = Deadline(args.deadline)

    from flashloop_compile.models.ouro import OuroForCausalLM
    from flashloop_compile.runtime.state import state_for_model

    model = OuroForCausalLM.from_preset(args.preset, dtype=getattr(torch, args.dtype), device=device()).eval()
    cfg = model.config
    # the floors' rates, measured in this run: matrix-multiply TFLOP/s and copy bandwidth
    tflops_peak, gbs = matmul_tflops(), copy_bandwidth_gbs()
    record("prefill", {"kind": "rates", "matmul_tflops": tflops_peak, "copy_gbs": gbs})
    linear_params = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    head_params = model.lm_head.weight.numel()
    for shape in args.shapes.split(","):
        b, t = map(int, shape.split("x"))
        if not deadline.allows(150):
            record("prefill", {"kind": "skipped", "shape": shape, "reason": "deadline"})
            continue
        model.clear_caches()
        gc.collect()
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
        model.setup_caches(b, t + args.headroom)
        # the prompt from its own generator: with random weights the token-sparse loops keep rows
        # that depend on the prompt, and their attention's time on where those rows lie (at c06f84e
        # the rate measurements above drew from the global generator first, so the prompt changed
        # and token-sparse attention took 51 ms against 121 ms at ff3eb82 for the same budgets)
        gen = torch.Generator(device=device()).manual_seed(0)
        ids = torch.randint(0, cfg.vocab_size, (b, t), device=device(), generator=gen)
        pos = torch.arange(t, device=device())[None].expand(b, -1).contiguous()
        traces: dict[str, tuple] = {}

        def trace(kind: str):
            """The graph of one trace kind (see TRACES), captured once per shape."""
            if kind not in traces:
                t0 = time.perf_counter()
                with causal_prompt_attention() if kind == "causal" else contextlib.nullcontext():
                    traced = capture_graph(model, *((ids,) if kind == "fresh" else (ids, pos)), dynamic_tokens=args.dynamic)
                traces[kind] = (*traced, time.perf_counter() - t0)
            return traces[kind]

        dense_ms = causal_ms = dense_out = None
        configs = args.configs.split(",")
        for name in configs:
            if not deadline.allows(90):
                record("prefill", {"kind": "skipped", "shape": shape, "config": name, "reason": "deadline"})
                continue
            options = {**config_options(name, CONFIGS, cfg.num_loops), "compilation.outline_layers": args.outline}
            try:
                graph, graph_inputs, trace_s = trace(TRACES.get(name, "fresh"))
                fn, pass_s, report = compile_variant(graph, graph_inputs, options)
                packed = written_packed_cache(state_for_model(model), name, cfg.num_loops)

                def run():
                    if packed is not None:
                        packed.reset()
                    return fn(*graph_inputs)

                sync()
                t1 = time.perf_counter()
                with torch.no_grad():
                    run()
                sync()
                compile_s = pass_s + time.perf_counter() - t1
                torch.cuda.reset_peak_memory_stats() if torch.cuda.is_available() else None
                with torch.no_grad():
                    timing = cuda_time_ms(run, warmup=1, repeat=args.repeat)
                peak = (torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None)
                check = {}
                # the exact dense variants must compute what dense computes: dense's last output is
                # kept (after dense's peak was read) until the last of them that runs is compared,
                # then dropped, so that no later config's peak memory carries it
                exact_left = [c for c in configs[configs.index(name) + 1:] if c in EXACT_DENSE]
                if name == "dense" and exact_left or name in EXACT_DENSE and dense_out is not None:
                    with torch.no_grad():
                        last = [x for x in torch.utils._pytree.tree_leaves(run()) if isinstance(x, torch.Tensor)][-1]
                    if name == "dense":
                        dense_out = last
                    else:
                        err = ((last.float() - dense_out.float()).abs().max()
                               / dense_out.float().abs().max().clamp_min(1e-6)).item()
                        check = {"max_rel_err_vs_dense": err, "matches_dense": err <= 5e-2}
                        if not exact_left:
                            dense_out = None
                    del last
            except torch.cuda.OutOfMemoryError as e:
                record("prefill", {"kind": "oom", "shape": shape, "config": name, "error": str(e)[:200]})
                torch.cuda.empty_cache() if torch.cuda.is_available() else None
                continue
            except Exception as e:  # one broken variant must not cost the rest of the run
                record("prefill", {"kind": "error", "shape": shape, "config": name, "error": error_text(e)})
                continue
            ms = timing["median_ms"]
            prof = kernel_profile(run, run, args.profile, ms) if args.profile else None
            # the rows the token-sparse loops kept, where the packed cache records them (depth_count
            # of the last prefill): with random weights they are the prompt's, and their keys set
            # the attention's work; a configuration without the cache counts (t + 1) / 2 a row
            dc = packed.depth_count[:b, :t] if packed is not None else None
            kept = kept_causal_keys(dc, cfg.num_loops) if dc is not None else None
            parts = prefill_parts(name, b, t, cfg, linear_params, head_params, kept)
            work = useful_flops(parts)
            table = None
            if prof and "error" not in prof:
                names = tuple(p["part"] for p in parts)
                table = part_table(parts, prof, gbs, tflops_peak, whole="prefill as a whole", whole_parts=names)
            if name == "dense":
                dense_ms = ms
            if name == "dense_causal":
                causal_ms = ms
            record("prefill", {
                "kind": "prefill", "preset": args.preset, "batch": b, "tokens": t, "config": name, "options": options,
                "ms": ms, "p10_ms": timing["p10_ms"], "p90_ms": timing["p90_ms"],
                "speedup_vs_dense": (dense_ms / ms) if dense_ms else None,
                "speedup_vs_dense_causal": (causal_ms / ms) if causal_ms else None, "peak_memory_gb": peak,
                "useful_tflop": work / 1e12, "tflops": work / (ms * 1e-3) / 1e12,
                "attention_keys": "kept rows (depth_count)" if kept is not None else "(t + 1) / 2 per sparse row",
                **({"mean_keys_per_kept_row": [k / max(1.0, float((dc > r).sum())) for r, k in enumerate(kept)]}
                   if kept is not None else {}),
                "trace": TRACES.get(name, "fresh"), "trace_s": trace_s, "compile_s": compile_s, "report": str(report), **check,
                **({"profile": prof} if prof else {}), **({"parts": table} if table else {}),
            })
            print(f"  {name} {shape}: {ms:.1f} ms, {work / 1e12:.4g} TFLOP of useful work at {work / (ms * 1e-3) / 1e12:.4g} "
                  f"TFLOP/s", flush=True)
            if prof:
                print_profile(name, shape, prof)
            if table:
                print(f"  parts {name} {shape}: floors at {tflops_peak:.4g} TFLOP/s (matrix multiply) and {gbs:.0f} GB/s "
                      f"(copy), both measured in this run", flush=True)
                print_parts(table)
            del fn, graph, graph_inputs
        del traces
    print("done", flush=True)


if __name__ == "__main__":
    main()
