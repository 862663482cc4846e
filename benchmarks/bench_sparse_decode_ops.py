"""Sparse decode ops on CUDA: dense SDPA decode vs flashloop.reference_attention (total and per
kernel) vs flashloop.correction_attention.

    python benchmarks/bench_sparse_decode_ops.py [--fraction 0.1] [--repeats 50]

Self-checking: before timing, every configuration compares the CUDA ops with the ATen bodies on
the same CUDA tensors (counts exact, selected sets equal up to near-ties, FP32 state close).
Times are medians over >= 20 repeats after warm-up (triton.testing.do_bench, L2 flushed between
repeats), eager launches and, separately, replayed CUDA graphs. Achieved bandwidth counts the
bytes that must be read: K and V once for dense and reference attention, the selected K/V rows
for correction attention. Writes JSON to $OUT (or ./out) as sparse_decode_ops.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections import defaultdict

import torch

from flashloop_compile.config import ceil_fraction
from flashloop_compile.lowering import ops

KERNEL_GROUPS = {
    "_scores_kernel": "scores",
    "_select_first_kernel": "select",
    "_select_level_kernel": "select",
    "_select_compact_kernel": "select",
    "_pv_kernel": "pv",
    "_pv_combine_kernel": "pv",
}


def make_inputs(b, s, hq, hkv, d, t=1, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, t, d, device="cuda", generator=g).to(dtype)
    k = torch.randn(b, hkv, s, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(b, hkv, s, d, device="cuda", generator=g).to(dtype)
    qpos = torch.full((b, t), s - 1, device="cuda") - torch.arange(t - 1, -1, -1, device="cuda")  # full caches
    mask = torch.arange(s, device="cuda")[None, None, None, :] <= qpos[:, None, :, None]
    return q, k, v, mask


def _selected(keys, s):
    sel = torch.zeros(*keys.shape[:-1], s + 1, dtype=torch.bool, device=keys.device)
    sel.scatter_(-1, torch.where(keys >= 0, keys, s).long(), True)
    return sel[..., :s]


def self_check(q, k, v, mask, scale, fractions, capacities):
    got = torch.ops.flashloop.reference_attention(q, k, v, mask, scale, fractions, capacities)
    ref = ops._reference_attention_aten(q, k, v, mask, scale, fractions, capacities)
    out, keys, count, mass, o_ref, c_ref = got
    for a, r in zip(got, ref):
        assert a.shape == r.shape and a.dtype == r.dtype, (a.shape, r.shape, a.dtype, r.dtype)
    assert torch.equal(count, ref[2]), "counts differ"
    s = k.shape[2]
    kf = k.float().repeat_interleave(q.shape[1] // k.shape[1], 1)
    vf = v.float().repeat_interleave(q.shape[1] // v.shape[1], 1)
    probs = torch.softmax(((q.float() @ kf.transpose(-1, -2)) * scale).masked_fill(~mask, float("-inf")), -1).nan_to_num(0.0)
    sel, sel_ref = _selected(keys, s), _selected(ref[1], s)
    kth = torch.where(sel_ref, probs, float("inf")).amin(-1, keepdim=True)
    differ = sel ^ sel_ref
    assert not (differ & ((probs - kth).abs() > 1e-4 * kth)).any(), "selected keys differ beyond near-ties"
    assert torch.equal(sel.sum(-1), sel_ref.sum(-1)), "selection sizes differ"
    torch.testing.assert_close(o_ref, ref[4], rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(out, ref[0], rtol=1e-2, atol=1e-2)
    p_sel = probs * sel
    torch.testing.assert_close(mass, p_sel.sum(-1), rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(c_ref, p_sel @ vf, rtol=1e-3, atol=1e-4)
    state = (keys[0], count[0], mass[0], o_ref, c_ref[0])
    corr = torch.ops.flashloop.correction_attention(q, k, v, *state, scale)
    torch.testing.assert_close(corr, ops._correction_attention_aten(q, k, v, *state, scale), rtol=1e-2, atol=1e-2)
    # with unchanged K/V the correction reproduces O_ref
    torch.testing.assert_close(corr.float(), o_ref, rtol=2e-2, atol=2e-2)
    return got, int(differ.sum())


def kernel_breakdown(fn, iters=20):
    """Median-per-call CUDA time of each kernel group, from the profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    per_group = defaultdict(float)
    for evt in prof.key_averages():
        name = evt.key
        group = next((g for kname, g in KERNEL_GROUPS.items() if kname in name), None)
        if group is None:
            if evt.device_type == torch.autograd.DeviceType.CUDA or getattr(evt, "device_time_total", 0) > 0:
                group = "torch_glue"
            else:
                continue
        total = getattr(evt, "device_time_total", None)
        if total is None:
            total = evt.cuda_time_total
        per_group[group] += total / iters / 1000.0  # us -> ms
    return dict(per_group)


def bench(fn, repeats):
    import triton.testing

    times = triton.testing.do_bench(fn, warmup=25, rep=max(100, repeats * 2), return_mode="all")
    assert len(times) >= 20, f"only {len(times)} repeats"
    return statistics.median(times)


def bench_graph(fn, repeats):
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=max(100, repeats * 2), return_mode="median")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768])
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph timings")
    args = parser.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA device"
    torch.backends.cuda.matmul.allow_tf32 = False

    fractions = [args.fraction]
    rows = []
    for b in args.batches:
        for s in args.lengths:
            hq, hkv, d = args.heads, args.kv_heads, args.head_dim
            q, k, v, mask = make_inputs(b, s, hq, hkv, d)
            scale = 1.0 / math.sqrt(d)
            capacities = [ceil_fraction(f, s) for f in fractions]
            (_, keys, count, mass, o_ref, c_ref), swaps = self_check(q, k, v, mask, scale, fractions, capacities)
            state = (keys[0], count[0], mass[0], o_ref, c_ref[0])
            k_exp = k.repeat_interleave(hq // hkv, 1) if hq != hkv else k
            v_exp = v.repeat_interleave(hq // hkv, 1) if hq != hkv else v

            dense = lambda: torch.nn.functional.scaled_dot_product_attention(q, k_exp, v_exp, attn_mask=mask)  # noqa: E731
            reference = lambda: torch.ops.flashloop.reference_attention(q, k, v, mask, scale, fractions, capacities)  # noqa: E731
            correction = lambda: torch.ops.flashloop.correction_attention(q, k, v, *state, scale)  # noqa: E731

            elem = k.element_size()
            kv_bytes = 2 * b * hkv * s * d * elem
            sel_bytes = 2 * int(count[0].clamp_max(keys.shape[-1]).sum()) * d * elem
            row = dict(batch=b, seq=s, heads=hq, kv_heads=hkv, head_dim=d, fraction=args.fraction, near_tie_swaps=swaps)
            row["dense_ms"] = bench(dense, args.repeats)
            row["reference_ms"] = bench(reference, args.repeats)
            row["correction_ms"] = bench(correction, args.repeats)
            row["reference_kernels_ms"] = kernel_breakdown(reference)
            if not args.no_graphs:
                row["dense_graph_ms"] = bench_graph(dense, args.repeats)
                row["reference_graph_ms"] = bench_graph(reference, args.repeats)
                row["correction_graph_ms"] = bench_graph(correction, args.repeats)
            row["kv_bytes"] = kv_bytes
            row["selected_bytes"] = sel_bytes
            for name, nbytes in (("dense", kv_bytes), ("reference", kv_bytes), ("correction", sel_bytes)):
                for suffix in ("", "_graph"):
                    if f"{name}{suffix}_ms" in row:
                        row[f"{name}{suffix}_GBps"] = nbytes / (row[f"{name}{suffix}_ms"] * 1e-3) / 1e9
            rows.append(row)
            del q, k, v, mask, keys, count, mass, o_ref, c_ref, state, k_exp, v_exp
            torch.cuda.empty_cache()

    header = (
        f"{'B':>2} {'S':>6} | {'dense ms':>9} {'GB/s':>6} | {'ref ms':>8} {'GB/s':>6} "
        f"({'scores':>6} {'select':>6} {'pv':>6} {'glue':>6}) | {'corr ms':>8} {'GB/s':>6} | "
        f"{'graph: dense':>12} {'ref':>7} {'corr':>7}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        kb = r["reference_kernels_ms"]
        graph = (
            f"{r['dense_graph_ms']:12.4f} {r['reference_graph_ms']:7.4f} {r['correction_graph_ms']:7.4f}"
            if "dense_graph_ms" in r
            else f"{'-':>12} {'-':>7} {'-':>7}"
        )
        print(
            f"{r['batch']:>2} {r['seq']:>6} | {r['dense_ms']:9.4f} {r['dense_GBps']:6.0f} | "
            f"{r['reference_ms']:8.4f} {r['reference_GBps']:6.0f} "
            f"({kb.get('scores', 0):6.4f} {kb.get('select', 0):6.4f} {kb.get('pv', 0):6.4f} {kb.get('torch_glue', 0):6.4f}) | "
            f"{r['correction_ms']:8.4f} {r['correction_GBps']:6.0f} | {graph}"
        )
    out_dir = os.environ.get("OUT") or "out"
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "sparse_decode_ops.json")
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__)
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    with open(path, "w") as fh:
        json.dump(dict(meta=meta, rows=rows), fh, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
