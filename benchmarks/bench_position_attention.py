"""Token-sparse prefill attention on CUDA: flashloop.position_attention (Triton, reads the query
positions) vs torch SDPA with the equivalent materialized boolean mask [B, 1, Tq, S] (what the
rewritten graph used before), and, at fraction 1, vs SDPA is_causal=True.

    python benchmarks/bench_position_attention.py [--repeats 20] [--sweep]

Shapes: B=1, H=16 (query and kv heads), D=128, bf16; S in (4096, 8192, 32768); the active
queries are a sorted random subset of the S positions with fraction in (1.0, 0.25, 0.10) (the
full cache is the keys: K/V [B, H, S, D]).

Self-checking: before timing, every configuration compares position_attention with masked SDPA
(and at fraction 1 with causal SDPA) on the same inputs. Times are CUDA-event medians over
>= 10 repeats after warm-up; the mask is built outside the timed SDPA call (the graph builds it
once per forward) and its build time is reported apart. TFLOP/s count only the causal work:
4 * D * H * B * sum_i (q_pos[i] + 1) (QK^T and PV over the visible keys), for every method.
``--sweep`` also times a few tile configurations of the kernel. Writes JSON to $OUT (or ./out)
as position_attention.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import torch
import torch.nn.functional as F

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cuda_times  # noqa: E402

from flashloop_compile.lowering import prefill_ops  # noqa: F401  (registers the op)
from flashloop_compile.lowering.kernels import prefill_attention as pa
from flashloop_compile.lowering.prefill_ops import position_attention

SEQ_LENS = (4096, 8192, 32768)
FRACTIONS = (1.0, 0.25, 0.10)
SWEEP = [
    pa.PrefillConfig(128, 64, 8, 3),
    pa.PrefillConfig(128, 32, 8, 3),
    pa.PrefillConfig(128, 64, 8, 2),
    pa.PrefillConfig(128, 128, 8, 2),
    pa.PrefillConfig(64, 64, 4, 3),
    pa.PrefillConfig(64, 128, 4, 2),
]


def make_inputs(s, fraction, b=1, h=16, d=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tq = max(1, math.ceil(fraction * s))
    q = torch.randn(b, h, tq, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, h, s, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, h, s, d, device="cuda", generator=g).to(dtype)
    if tq == s:
        q_pos = torch.arange(s, device="cuda").expand(b, s).contiguous()
    else:
        q_pos = torch.stack([torch.randperm(s, device="cuda", generator=g)[:tq].sort().values for _ in range(b)])
    return q, k, v, q_pos.to(torch.int64)


def build_mask(q_pos, s):
    return torch.arange(s, device=q_pos.device)[None, None, None, :] <= q_pos[:, None, :, None]  # [B, 1, Tq, S]


def time_ms(fn, repeats, warmup=5):
    times = cuda_times(fn, warmup, repeats)
    return statistics.median(times), min(times)


def causal_flops(q_pos, h, d):
    visible = (q_pos.clamp_min(-1) + 1).sum().item()
    return 4.0 * d * h * visible


def self_check(q, k, v, q_pos, scale, mask, is_dense):
    out = position_attention(q, k, v, q_pos, scale)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    err = (out.float() - ref.float()).abs().max().item()
    assert torch.isfinite(out).all(), "non-finite output"
    assert err < 3e-2, f"position_attention differs from masked SDPA by {err}"
    result = {"max_abs_err_vs_masked_sdpa": err}
    if is_dense:
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        err_c = (out.float() - causal.float()).abs().max().item()
        assert err_c < 3e-2, f"position_attention differs from causal SDPA by {err_c}"
        result["max_abs_err_vs_causal_sdpa"] = err_c
    return result


def bench_one(s, fraction, repeats, sweep):
    q, k, v, q_pos = make_inputs(s, fraction)
    b, h, tq, d = q.shape
    scale = 1.0 / math.sqrt(d)
    flops = causal_flops(q_pos, h, d)
    row = {"B": b, "H": h, "D": d, "S": s, "fraction": fraction, "Tq": tq, "causal_gflop": flops / 1e9}
    mask = build_mask(q_pos, s)
    row.update(self_check(q, k, v, q_pos, scale, mask, tq == s))
    row["kernel_config"] = pa.default_config(q).__dict__

    def tflops(ms):
        return flops / (ms * 1e-3) / 1e12

    methods = {
        "position_attention": lambda: position_attention(q, k, v, q_pos, scale),
        "sdpa_bool_mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale),
    }
    if tq == s:
        methods["sdpa_causal"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    for name, fn in methods.items():
        try:
            med, best = time_ms(fn, repeats)
            row[name] = {"median_ms": med, "min_ms": best, "tflops": tflops(med)}
        except torch.cuda.OutOfMemoryError as e:  # masked SDPA at long contexts
            row[name] = {"error": f"OOM: {e}"[:300]}
            torch.cuda.empty_cache()
    med, _ = time_ms(lambda: build_mask(q_pos, s), repeats)
    row["mask_build_ms"] = med
    if "median_ms" in row["sdpa_bool_mask"]:
        row["speedup_vs_sdpa_bool_mask"] = row["sdpa_bool_mask"]["median_ms"] / row["position_attention"]["median_ms"]
    if "sdpa_causal" in row and "median_ms" in row["sdpa_causal"]:
        row["speedup_vs_sdpa_causal"] = row["sdpa_causal"]["median_ms"] / row["position_attention"]["median_ms"]
    if sweep:
        row["sweep"] = []
        for cfg in SWEEP:
            try:
                out = pa.position_attention_triton(q, k, v, q_pos, scale, config=cfg)
                ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
                err = (out.float() - ref.float()).abs().max().item()
                med, _ = time_ms(lambda: pa.position_attention_triton(q, k, v, q_pos, scale, config=cfg), repeats)
                row["sweep"].append({**cfg.__dict__, "median_ms": med, "tflops": tflops(med), "max_abs_err": err})
            except Exception as e:  # noqa: BLE001  (e.g. out of shared memory)
                row["sweep"].append({**cfg.__dict__, "error": repr(e)[:300]})
    del mask
    torch.cuda.empty_cache()
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seq-lens", type=int, nargs="*", default=list(SEQ_LENS))
    parser.add_argument("--fractions", type=float, nargs="*", default=list(FRACTIONS))
    parser.add_argument("--sweep", action="store_true", help="also time a few kernel tile configurations")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_position_attention.py needs a CUDA device")
    repeats = max(10, args.repeats)
    rows = []
    for s in args.seq_lens:
        for fraction in args.fractions:
            row = bench_one(s, fraction, repeats, args.sweep)
            rows.append(row)
            pa_ms = row["position_attention"].get("median_ms", float("nan"))
            sd_ms = row["sdpa_bool_mask"].get("median_ms", float("nan"))
            line = (f"S={s:6d} frac={fraction:4.2f} Tq={row['Tq']:6d}  position_attention {pa_ms:8.3f} ms "
                    f"({row['position_attention'].get('tflops', float('nan')):6.1f} TFLOP/s)  masked SDPA {sd_ms:8.3f} ms")
            if "sdpa_causal" in row:
                line += f"  causal SDPA {row['sdpa_causal'].get('median_ms', float('nan')):8.3f} ms"
            print(line, flush=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "repeats": repeats,
        "timing": "CUDA events, 5 warm-up calls, median (and min) of repeats; mask built outside SDPA timing",
        "flops": "causal work only: 4 * D * H * B * sum(q_pos + 1)",
        "rows": rows,
    }
    out_dir = os.environ.get("OUT") or "out"
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "position_attention.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
