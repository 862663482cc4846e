"""Where quantized prefill spends its time: the per-site ops of one prefill at one layer and depth.

    python benchmarks/bench_packed_prefill.py [--tokens 4096 8192] [--repeats 10] [--sweep]

All features on was 7x slower than token-sparse prefill alone on the H200 (8K: 1286 vs 182 ms),
and the gap grows with the prompt (32K: 13.4 vs 1.8 s), which points at something quadratic.
This times, for a fresh prompt of T tokens (B=1, H=16 query = kv heads, D=128, bf16; every key
in flight, nothing stored yet), each op a quantized prefill runs per (loop, layer) site:

- ``sdpa_causal``: dense causal SDPA (what dense prefill runs at loops 1-2);
- ``position_attention``: the token-sparse kernel with every row active (loops 1-2 equivalent);
- ``packed_attention``: flashloop.packed_attention in prefill mode (what quantization puts at
  every site: the in-flight keys go through its even/odd-half tile loop);
- ``packed_kv_write d0`` / ``d1``: the packed write of all T tokens at depth 0 (INT4 base) and
  depth 1 (residuals); its flush kernel walks the groups of a row in one program per (b, h).
- ``write d<n> only``: one depth's write alone, from the state the lower depths left (restored
  before each call, untimed): depths 0-1 of every token, depths 2-3 of token-sparse prefill's
  nested random quarter and tenth; with its byte floor (the BF16 rows read, the predecessor's
  codes and parameters read, the codes written: (2 + 0.5625 (1 + d)) bytes per element) and the
  share of it reached at the copy bandwidth measured in the same run. ``--write-against FILE``
  times another packed_write.py (e.g. ``git show REV:flashloop_compile/lowering/kernels/
  packed_write.py > /tmp/old_write.py``) on the same states and checks its caches bit for bit
  against the current kernel's; both are called through their launchers, with their repeats
  interleaved. With CUDA each depth's write is timed as a CUDA graph's replay: device time,
  without the launcher's host work between its kernels.

``--sweep`` adds packed_attention at other prefill launch parameters (kernels/packed_attention.py
PACKED_PREFILL: tiles, warps, pipeline stages of the whole-row loop) and the packed
write with other counts of flush programs per (batch, head) (launch_packed_kv_write's ``chunks``). Self-check first: every attention variant against causal SDPA (2e-2).
CUDA events, median of ``--repeats`` after warm-up. TFLOP/s count the causal work
4 * D * H * T * (T + 1) / 2. JSON to $OUT (or ./out) as packed_prefill.json; a table last.
Without CUDA: a smoke run on tiny shapes through the ops' ATen bodies (numbers meaningless).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth_gbs, cuda_times, device, environment, graph_of, interleaved_times  # noqa: E402

from flashloop_compile.lowering import packed_ops as P  # noqa: E402
from flashloop_compile.lowering.prefill_ops import position_attention  # noqa: E402
from flashloop_compile.runtime import PackedKVCache  # noqa: E402

R = 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--write-against", type=Path, default=None,
                    help="another packed_write.py: its launcher timed on the same states (caches must be bit-equal)")
    ap.add_argument("--sweep", action="store_true",
                    help="also time packed_attention over prefill launch parameters (block_m, block_n_inflight, num_warps)")
    args = ap.parse_args()
    dev = device()
    cuda = dev == "cuda"
    if not cuda:
        args.tokens, args.heads, args.head_dim, args.repeats = [128], 2, 64, 2
    H, D, dt = args.heads, args.head_dim, torch.bfloat16 if cuda else torch.float32
    rows = []
    other = None
    if args.write_against is not None:
        import importlib.util

        if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--write-against runs Triton launchers: on a machine without CUDA set TRITON_INTERPRET=1")

        spec = importlib.util.spec_from_file_location("write_against", args.write_against)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
    bandwidth = copy_bandwidth_gbs() * 1e9 if cuda else float("nan")
    for T in args.tokens:
        g = torch.Generator(device=dev).manual_seed(0)
        q, k, v = (torch.randn(1, H, T, D, device=dev, dtype=dt, generator=g) for _ in range(3))
        pos = torch.arange(T, device=dev)[None]
        scale = D ** -0.5
        cache = PackedKVCache(1, R, 1, T + 256, H, D, dtype=dt, device=dev)

        def packed():
            return torch.ops.flashloop.packed_attention(q, k, v, pos, pos, 0, *cache.op_tensors(0), scale)

        def launched(tuning):
            from flashloop_compile.lowering.kernels import packed_attention as PA

            def run():
                out = torch.empty_like(q)
                PA.launch_packed_attention(cache.op_tensors(0), q, k, v, pos, pos, 0, scale, out, mode="prefill", tuning=tuning)
                return out
            return run

        def write(depth, chunks=None):
            from flashloop_compile.lowering.kernels import packed_write as PW

            def run():
                cache.reset()
                for d in range(depth + 1):
                    if chunks is None:
                        P.packed_kv_write(cache, 0, k, v, pos, d)
                    else:
                        PW.launch_packed_kv_write(cache.op_tensors(0), k, v, pos, d, chunks=chunks)
            return run

        # one depth's write alone, from the state the lower depths leave (nested token-sparse subsets)
        u = torch.rand(1, T, device=dev, generator=g)
        calls = [pos, pos, pos[u < 0.25][None].contiguous(), pos[u < 0.10][None].contiguous()]
        writes, floors = {}, {}
        cache.reset()
        for d, p in enumerate(calls):
            n = p.shape[1]
            kd, vd = (k[:, :, :n] + d).contiguous(), (v[:, :, :n] - d).contiguous()
            saved = [t.clone() for t in cache.op_tensors(0)]
            restore = (lambda saved=saved: [t.copy_(x) for t, x in zip(cache.op_tensors(0), saved)])
            impls = {"": lambda kd=kd, vd=vd, p=p, d=d: P.packed_kv_write(cache, 0, kd, vd, p, d)}
            if other is not None:  # both through their launchers: the only difference is the module
                from flashloop_compile.lowering.kernels import packed_write as PW

                impls = {tag: lambda kd=kd, vd=vd, p=p, d=d, m=m: m.launch_packed_kv_write(cache.op_tensors(0), kd, vd, p, d)
                         for tag, m in (("", PW), (" (against)", other))}
            results = {}
            for tag, fn in impls.items():
                name = f"write d{d} only{tag}"
                writes[name] = (fn, restore)
                floors[name] = n * H * D * 2 * (2 + 0.5625 * (1 + d)) / bandwidth * 1e3
                restore()
                writes[name][0]()
                results[tag] = [t.clone() for t in cache.op_tensors(0)]
            if other is not None and not all(torch.equal(a, b) for a, b in zip(results[""], results[" (against)"])):
                raise SystemExit(f"self-check failed at T={T}: the write against {args.write_against} differs at depth {d}")
            restore()
            writes[f"write d{d} only"][0]()  # the next depth starts from this one
        cache.reset()  # packed_attention below reads a fresh prompt's cache (each write restores its own state)
        ops = {
            "sdpa_causal": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale),
            "position_attention": lambda: position_attention(q, k, v, pos, scale),
            "packed_attention": packed,
            "packed_kv_write d0": write(0),
            "packed_kv_write d0+d1": write(1),
        }
        if args.sweep and cuda:
            # the prefill kernel over tiles, warps and pipeline stages
            grid = [(64, 64, 4, 3), (64, 32, 4, 3), (128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3),
                    (128, 128, 8, 2), (64, 128, 4, 2), (64, 64, 8, 3)]
            for bm, bni, w, st in grid:
                tuning = {"block_m": bm, "block_n_inflight": bni, "num_warps": w, "num_stages": st}
                ops[f"packed bm{bm} bni{bni} w{w} s{st}"] = launched(tuning)
            for chunks in (16, 64, 256, 1024):
                ops[f"packed_kv_write d0+d1 x{chunks}"] = write(1, chunks)
        ref = ops["sdpa_causal"]().float()
        for name in [n for n in ops if "attention" in n or n.startswith("packed bm")]:
            err = (ops[name]().float() - ref).abs().max().item()
            if err > 2e-2 * max(1.0, ref.abs().max().item()):
                raise SystemExit(f"self-check failed at T={T}: {name} differs from causal SDPA by {err:.3g}")
        flops = 4 * D * H * T * (T + 1) / 2
        for name, fn in ops.items():
            ms = statistics.median(cuda_times(fn, warmup=2, repeat=args.repeats))
            row = {"tokens": T, "op": name, "ms": ms}
            if "attention" in name or name.startswith(("sdpa", "packed bm")):
                row["tflops"] = flops / (ms * 1e-3) / 1e12
            rows.append(row)
        # a depth's write and its --write-against copy with their repeats interleaved: timed one
        # block after the other, a copy that changed only the depth-0 flush read 10-35% faster at
        # every depth, the unchanged ones included (H100, b84d7b1), an effect of the order
        # timed eagerly, the same write read 0.742, 0.852 and 0.994 ms at depth 0 in three processes
        # on one warm H100 (2026-12-06, a4b09c6, results/2026-12-06/write-flush-maxnreg/): eager
        # events also time the host's launch work between the kernels, a graph's replay does not
        for d in range(len(calls)):
            names = [n for n in writes if n.startswith(f"write d{d} only")]
            fns = []
            for n in names:
                fn, restore = writes[n]
                if cuda:
                    restore()  # graph_of runs the write once before capturing it: from its own state
                    fn = graph_of(fn)
                fns.append(fn)
            times = interleaved_times(fns, warmup=2, repeat=args.repeats, before=[writes[n][1] for n in names])
            for name, ts in zip(names, times):
                ms = statistics.median(ts)
                rows.append({"tokens": T, "op": name, "ms": ms, "floor_ms": floors[name], "floor_share": floors[name] / ms})
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "packed_prefill.json").write_text(json.dumps({"env": environment(), "rows": rows}, indent=1))
    print(f"{'T':>6} {'op':<30} {'ms':>9} {'TFLOP/s':>8} {'floor ms':>9} {'share':>6}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['op']:<30} {r['ms']:>9.3f} {r.get('tflops', float('nan')):>8.1f} "
              f"{r.get('floor_ms', float('nan')):>9.3f} {r.get('floor_share', float('nan')):>6.1%}")


if __name__ == "__main__":
    main()
