"""Decode-step attention over the packed KV cache vs dense SDPA over a BF16 cache (CUDA only).

    python benchmarks/bench_packed_decode.py [--batch 1 4] [--seq 8192 32768] [--depths 0 1 3]
                                             [--repeats 50] [--warmup 10]
    python benchmarks/bench_packed_decode.py --loop1      # the bulk kernel and the loop-1 site, B1/B4 x 32K

For each (B, S): a cache (1 layer, R=4 loops, H=16 kv heads = query heads, D=128, bf16) is
filled with an S-1 token prompt (depths 0 and 1 dense, depths 2 and 3 for nested random 25% and
10% subsets, as token-sparse prefill leaves them; ``--residuals every``: every depth dense, as a
dense prefill leaves them and bench_decode fills them) and one decode token at every depth; then one
query at position S-1 attends at depth 0, 1, 3 (S-1 stored keys read from the packed tiles + the
in-flight key). Dense: ``scaled_dot_product_attention`` over a BF16 [B, 16, S, 128] cache.

Self-check first: the CUDA op against the ATen body on the same tensors (atol/rtol 1e-2).
Timing: CUDA events around each call, L2 flushed before every repeat, median (and p10/p90) of
``--repeats`` (>= 20) after ``--warmup`` calls; eager launches, and the same call replayed from a
CUDA graph (what a captured decode step pays). Bandwidth: bytes the kernel must read from memory
(codes, fp16 parameters once per group, position->row maps and depth counts once per request,
the BF16 ring, the in-flight key) vs K+V of the dense cache. JSON to $OUT (or ./out) as
packed_decode.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics

import torch

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cuda_times, graph_of  # noqa: E402

from flashloop_compile.lowering import packed_ops as P

from flashloop_compile.lowering import packed_sparse_ops as PS
from flashloop_compile.lowering.kernels import correction as CO, packed_attention as PA, packed_decode as PD, packed_read as PR, sparse_config as SC
from flashloop_compile.passes.kv_quant import local_keys, selected_positions
from flashloop_compile.runtime import PackedKVCache

H, D, R = 16, 128, 4
DT = torch.bfloat16


RESIDUALS = ("prefill", "every")


def fill_cache(B: int, S: int, seed: int = 0, residuals: str = "prefill") -> tuple[PackedKVCache, list]:
    """Prompt of S-1 tokens per row, then one decode token at every depth. ``residuals``:
    "prefill" writes depths 2 and 3 for nested random 25% and 10% of the prompt (what token-sparse
    prefill leaves), "every" writes every depth for every token (a dense prefill, and
    bench_decode's fill). A site's time depends on it: the read-and-attend correction kernel at
    depth 3 takes 46.4 us at B1 x 32K on the first and 50.7 on the second (H100, 548b232,
    benchmarks/results/2026-12-06/resolved-rows).
    Returns the cache and, per depth, the decode token's (k, v, positions)."""
    if residuals not in RESIDUALS:
        raise ValueError(f"residuals must be one of {RESIDUALS}, got {residuals!r}")
    g = torch.Generator(device="cuda").manual_seed(seed)
    cache = PackedKVCache(1, R, B, S, H, D, dtype=DT, device="cuda")
    n = S - 1
    pos_all = torch.arange(n, device="cuda")[None].repeat(B, 1)
    active = torch.ones(B, n, dtype=torch.bool, device="cuda")
    k = torch.randn(B, H, n, D, device="cuda", generator=g, dtype=DT)
    v = torch.randn(B, H, n, D, device="cuda", generator=g, dtype=DT)
    for d in range(R):
        if d >= 2 and residuals == "prefill":
            keep = 0.25 if d == 2 else 0.4  # 25% of the prompt, then 40% of those = 10%
            r = torch.rand(B, n, device="cuda", generator=g)
            active = active & (r < keep)
        if d:
            k = k + (0.05 * torch.randn(k.shape, device="cuda", generator=g)).to(DT)
            v = v + (0.05 * torch.randn(v.shape, device="cuda", generator=g)).to(DT)
        # pack each row's active tokens to the front (ascending), pad with -1
        cnt = active.sum(1)
        T = int(cnt.max())
        order = torch.sort(torch.where(active, pos_all, n + pos_all), dim=1).indices[:, :T]
        pos = torch.gather(pos_all, 1, order)
        pos = torch.where(torch.arange(T, device="cuda")[None] < cnt[:, None], pos, -1)
        idx = order[:, None, :, None].expand(B, H, T, D)
        P.packed_kv_write(cache, 0, torch.gather(k, 2, idx).contiguous(), torch.gather(v, 2, idx).contiguous(), pos, d)
    step = []
    for d in range(R):
        kd = torch.randn(B, H, 1, D, device="cuda", generator=g, dtype=DT)
        vd = torch.randn(B, H, 1, D, device="cuda", generator=g, dtype=DT)
        pd = torch.full((B, 1), n, dtype=torch.long, device="cuda")
        P.packed_kv_write(cache, 0, kd, vd, pd, d)
        step.append((kd, vd, pd))
    torch.cuda.synchronize()
    cache.check_overflow()
    return cache, step


def packed_bytes(cache: PackedKVCache, B: int, p0: int, depth: int) -> int:
    """Bytes a decode step at ``depth`` must read for keys 0..p0-1 (+1 in-flight key, q, out)."""
    lay = cache.layers[0]
    G, NG = cache.group_size, cache.head_dim // cache.group_size
    total = 0
    pos = torch.arange(p0, device="cuda")
    for b in range(B):
        dc = cache.depth_count[b, :p0].long()
        e = torch.clamp(torch.minimum(dc - 1, torch.full_like(dc, depth)), min=0)
        fl = lay.flushed[b].long()[e]
        packed = pos < fl
        n_packed = int(packed.sum())
        n_ring = p0 - n_packed
        per_head = n_packed * (D + 2 * 2 * NG)  # K+V codes, V min/scale per token
        per_head += int(packed.view(-1)[: (p0 // G) * G].view(-1, G).any(1).sum() + (p0 % G > 0)) * D * 2 * 2  # K min/scale per block
        per_head += n_ring * D * 2 * 2  # ring K+V
        maps = p0 * 1 + 2 * R * 4  # depth_count, flushed
        for j in range(1, depth + 1):
            rows = cache.rows[j - 1, b, :p0]
            has = packed & (rows >= 0) & (j <= e)
            maps += p0 * 4  # rows map of depth j
            nres = int(has.sum())
            blocks = int(has.view(-1)[: (p0 // G) * G].view(-1, G).any(1).sum()) if p0 >= G else 0
            per_head += nres * (D + 2 * 2 * NG) + blocks * D * 2 * 2
        total += per_head * H + maps
    total += B * H * 1 * D * 2 * 2  # in-flight key
    total += 2 * B * H * D * 2  # q and out
    return total


def bulk_bytes(cache: PackedKVCache, B: int, p0: int, depth: int, block_n: int) -> int:
    """Bytes _decode_bulk_kernel must read at ``depth``: per row and head, the codes and V
    parameters of its bulk tiles (below every depth's flushed boundary and p0, whole tiles of
    block_n), one K parameter block (min and scale) per tile's block, per residual the present
    rows' codes, V parameters and K blocks, and the rows maps of the bulk."""
    lay = cache.layers[0]
    G, NG = cache.group_size, cache.head_dim // cache.group_size
    total = 0
    for b in range(B):
        n = min(int(lay.flushed[b, : depth + 1].min()), p0) // block_n * block_n
        per_head = n * (D + 2 * 2 * NG) + -(-n // G) * D * 2 * 2
        maps = 0
        for j in range(1, depth + 1):
            has = cache.rows[j - 1, b, :n] >= 0
            per_head += int(has.sum()) * (D + 2 * 2 * NG) + -(-n // G) * D * 2 * 2
            maps += n * 4
        total += (per_head + maps) * H
    return total


FLOOR_GBPS = 4200.0  # the H200's copy bandwidth (issue 31's byte floor)


def loop1(args, l2) -> list[dict]:
    """The loop-1 site of a decode step (one query row per kv head over the packed store) at each
    (B, S, depth): checked against the ATen body, then the whole site replayed from a CUDA graph
    (bulk + tail + combine, L2 flushed) and each kernel's device us from the profiler (eager, L2
    flushed); the bulk kernel's bytes and its share of the 4.2 TB/s floor."""
    rows = []
    for S in args.seq:
        for B in args.batch:
            cache, step = fill_cache(B, S, residuals=args.residuals)
            g = torch.Generator(device="cuda").manual_seed(1)
            q = torch.randn(B, H, 1, D, device="cuda", generator=g, dtype=DT)
            scale = 1.0 / math.sqrt(D)
            tensors = cache.op_tensors(0)
            for depth in args.depths:
                kd, vd, pd = step[depth]

                def site(kd=kd, vd=vd, pd=pd, depth=depth):
                    out = torch.empty_like(q)
                    PA.launch_packed_attention(tensors, q, kd, vd, pd, pd, depth, scale, out)
                    return out

                ref = P.packed_attention_aten(q, kd, vd, pd, pd, depth, *tensors, scale)
                torch.testing.assert_close(site().float(), ref.float(), atol=1e-2, rtol=1e-2)
                site_us = statistics.median(_times(graph_of(site), args.repeats, args.warmup, l2)) * 1e3
                kernels = kernel_us(site, 20, l2)
                bulk_us = next((v for k, v in kernels.items() if "_decode_bulk_kernel" in k), float("nan"))
                bn = PD.FAST_DECODE["block_n"] if depth == 0 else PD.FAST_DECODE["block_n_residual"]
                nb = bulk_bytes(cache, B, S - 1, depth, min(bn, cache.group_size))
                site_bytes = packed_bytes(cache, B, S - 1, depth)
                r = {"batch": B, "seq": S, "depth": depth, "residuals": args.residuals, "bulk_us": bulk_us, "bulk_bytes": nb,
                     "bulk_floor_share": nb / (bulk_us * 1e-6) / 1e9 / FLOOR_GBPS, "site_us": site_us,
                     "site_bytes": site_bytes, "site_floor_share": site_bytes / (site_us * 1e-6) / 1e9 / FLOOR_GBPS,
                     "kernels_us": kernels, "fast_decode": dict(PD.FAST_DECODE)}
                rows.append(r)
                print(f"B={B} S={S} depth={depth}: bulk {bulk_us:.1f} us, {nb / 1e6:.1f} MB, "
                      f"{100 * r['bulk_floor_share']:.1f}% of 4.2 TB/s | site (bulk + tail + combine, graph) "
                      f"{site_us:.1f} us, {site_bytes / 1e6:.1f} MB, {100 * r['site_floor_share']:.1f}% | "
                      + ", ".join(f"{k} {v:.1f}" for k, v in kernels.items()), flush=True)
            del cache
            torch.cuda.empty_cache()
    return rows


def flush_l2(buf: torch.Tensor) -> None:
    buf.zero_()


def _times(fn, repeats: int, warmup: int, l2: torch.Tensor) -> list[float]:
    return cuda_times(fn, warmup, repeats, before=lambda: flush_l2(l2))


def stats(times: list[float]) -> dict:
    qs = statistics.quantiles(times, n=10)
    return {"median_ms": statistics.median(times), "p10_ms": qs[0], "p90_ms": qs[-1], "n": len(times)}


SWEEP = [  # (name, launcher kwargs): the generic path, then the fast path's launch parameters
    ("generic", {"fast": False}),
    # _decode_bulk_kernel (default bn64 w1 s3 x8 at depth 0, bn32 at depths >= 1); around it: tile
    # (at every depth), stages, waves (programs per SM), warps
    *[(f"fast bn{bn} w{w} s{st} x{wv}", {"tuning": {"block_n": bn, "block_n_residual": bn, "num_warps": w,
                                                    "num_stages": st, "waves": wv}})
      for bn, w, st, wv in ((64, 1, 3, 8), (64, 1, 2, 8), (64, 1, 4, 8), (64, 1, 3, 4), (64, 1, 3, 16), (32, 1, 3, 8),
                            (32, 1, 3, 16), (64, 2, 3, 8), (64, 2, 3, 4))],
    # FAST_DECODE tail_programs (default 4): the tail's per-token tiles over several programs per row
    *[(f"fast tail{n}", {"tuning": {"tail_programs": n}}) for n in (1, 2, 4, 8)],
    # packed_read (sparse decode under quantization), the generic kernel vs the bulk one: the whole
    # history (loop 2's reference at other shapes) and 10% scattered keys per head (a correction's
    # selection, sorted as the top-k positions are not: order does not matter to either kernel);
    # not attention variants (the suite's best pick skips them)
    *[(f"read {what} {kernel}", {"read": what, "bulk": kernel == "bulk"})
      for what in ("whole history", "selected keys") for kernel in ("generic", "bulk")],
    # the bulk read's tile (PACKED_READ block_p: positions per program, default 32 at D 128) and warps
    *[(f"read selected keys bulk bp{bp} w{w}", {"read": "selected keys", "bulk": True,
                                                "read_config": {"block_p": bp, "num_warps": w}})
      for bp, w in ((16, 4), (32, 8), (64, 8))],
    # sparse decode's loop-2 reference under quantization (packed_reference_attention, fraction
    # 0.1): the op's body at this shape (the bulk in the code domain), vs the whole history read
    # then the reference over the copy (the body at other shapes; within the bf16 tolerance, the
    # same count)
    ("reference read then attend", {"reference": "read"}),
    ("reference linear", {"reference": "linear"}),
    *[(f"reference linear {name}", {"reference": "linear", "config": cfg})
      for name, cfg in (("split16", {"split_kv": 16}), ("split64", {"split_kv": 64}),
                        ("bn32", {"block_n_linear": 32}), ("stages2", {"num_stages_linear": 2}))],
    # a correction at this depth with loop 2's selection (fraction 0.1): the compact packed_read of
    # the selected keys then correction_attention (the op's body for several query rows per kv
    # head), vs the read-and-attend body (packed_ops.correction_read_attend, the op's body at this
    # shape: the bulk read's tiles attended in registers, one softmax partial per tile, no BF16
    # copy; PACKED_READ attend_block_p: 32 keys per program at depth 2, 16 at depth 3), fixed tiles
    # and warps (one entry of attend_block_p: every depth), and register caps (attend_maxnreg: 128
    # at depths 2-3 by default)
    ("correction read then correct", {"correction": "read"}),
    ("correction read attend", {"correction": "read_attend"}),
    *[(f"correction read attend {tag}", {"correction": "read_attend", "read_config": cfg})
      for tag, cfg in (("bp16", {"attend_block_p": (16,)}), ("bp32", {"attend_block_p": (32,)}),
                       ("w8", {"num_warps": 8}), ("bp64 w8", {"attend_block_p": (64,), "num_warps": 8}),
                       ("cap96", {"attend_maxnreg": (96,)}), ("uncapped", {"attend_maxnreg": (0,)}))],
    # the correction kernel's launch: splits of the selected set (default: about 2 programs per SM)
    *[(f"correction read then correct {name}", {"correction": "read", "config": cfg})
      for name, cfg in (("s16", {"split_corr": 16}), ("s32", {"split_corr": 32}),
                        # software-pipelined gathers (num_stages_corr, 2 by default)
                        ("stages1", {"num_stages_corr": 1}), ("stages3", {"num_stages_corr": 3}),
                        ("bk32 stages2", {"block_k": 32, "num_stages_corr": 2}))],
    # the generic read's tile (PACKED_READ generic_split: bulk tile / split positions per program)
    *[(f"{what} read split{n}", {**kw, "read_config": {"generic_split": n}})
      for what, kw in (("reference linear", {"reference": "linear"}), ("correction read then correct", {"correction": "read"}))
      for n in (1, 8, 16)],
    # the bulk read of a correction's selected keys at more warps or smaller tiles
    *[(f"correction read then correct read {tag}", {"correction": "read", "read_config": cfg})
      for tag, cfg in (("w8", {"num_warps": 8}), ("bp16", {"block_p": 16}), ("bp64 w8", {"block_p": 64, "num_warps": 8}))],
]


def kernel_us(fn, n: int, l2: torch.Tensor) -> dict[str, float]:
    """Device microseconds per call of each kernel ``fn`` launches (eager, L2 flushed before each
    of the ``n`` calls; the flush itself left out), largest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            flush_l2(l2)
            fn()
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as flush_prof:  # the flush's own kernel name
        flush_l2(l2)
        torch.cuda.synchronize()
    flush_name = {e.key for e in flush_prof.key_averages() if e.device_type == DeviceType.CUDA}
    out = {e.key[:60]: e.device_time_total / n for e in prof.key_averages()
           if e.device_type == DeviceType.CUDA and not e.is_user_annotation and e.device_time_total > 0
           and e.key not in flush_name}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def sweep(args, l2, save=lambda rows: None) -> list[dict]:
    """Time every SWEEP variant (graph replay, L2 flushed) per (B, S, depth); checked first.
    ``save(rows)`` after each (B, S): a run cut short by a timeout keeps what it measured."""
    rows = []
    for S in args.seq:
        for B in args.batch:
            cache, step = fill_cache(B, S, residuals=args.residuals)
            g = torch.Generator(device="cuda").manual_seed(1)
            q = torch.randn(B, H, 1, D, device="cuda", generator=g, dtype=DT)
            scale = 1.0 / math.sqrt(D)
            tensors = cache.op_tensors(0)
            for depth in args.depths:
                kd, vd, pd = step[depth]
                ref = P.packed_attention_aten(q, kd, vd, pd, pd, depth, *tensors, scale)
                nbytes = packed_bytes(cache, B, S - 1, depth)
                n_sel = -(-(S - 1) // 10)
                reads = {"whole history": torch.arange(S - 1, device="cuda")[None].expand(B, -1),
                         "selected keys": torch.rand(B, H, S - 1, device="cuda", generator=g).topk(n_sel, -1).indices}
                read_ref = {}  # the ATen read of each position set, once per depth
                mask = (torch.arange(S, device="cuda")[None, :] <= pd)[:, None, None, :]
                ref_args = (q, pd, kd, vd, depth, *tensors, mask, scale, [0.1], [-(-S // 10)])
                two_step = None  # the unfused reference's outputs, which the fused one must equal
                corr_read = None  # the read-then-correct output, which the linear correction must match
                corr_cache = []

                def corr_inputs(ref_args=ref_args, corr_cache=corr_cache):  # loop 2's statistics, once per depth
                    if not corr_cache:
                        corr_cache.append(torch.ops.flashloop.packed_reference_attention(*ref_args))
                    return corr_cache[0]
                corr_inputs()  # outside any graph capture
                for name, kw in [(n, kw) for n, kw in SWEEP if any(n == v[1:] if v.startswith("=") else v in n
                                                                 for v in args.variants.split("|"))]:
                    read = kw.get("read", False)
                    n_read = reads[read].shape[-1] if read else 0
                    out_k = torch.empty(B, H, n_read, D, device="cuda", dtype=DT) if read else None
                    out_v = torch.empty_like(out_k) if read else None

                    def fn(kw=kw, kd=kd, vd=vd, pd=pd, depth=depth, out_k=out_k, out_v=out_v, ref_args=ref_args):
                        if "read_config" in kw or "config" in kw:
                            # PACKED_READ entries / sparse_decode's KernelConfig, read at launch: captured as set here
                            saved_read, saved_cfg = dict(PR.PACKED_READ), SC.DEFAULT_CONFIG
                            PR.PACKED_READ.update(kw.get("read_config", {}))
                            SC.DEFAULT_CONFIG = dataclasses.replace(saved_cfg, **kw.get("config", {}))
                            try:
                                return fn({k: v for k, v in kw.items() if k not in ("read_config", "config")})
                            finally:
                                PR.PACKED_READ.update(saved_read)
                                SC.DEFAULT_CONFIG = saved_cfg
                        if kw.get("reference") == "read":  # the body at other shapes, at this one
                            whole = torch.arange(S, device="cuda")[None].expand(B, -1)
                            k_all, v_all = torch.ops.flashloop.packed_read(*tensors, whole, depth, pd, kd, vd)
                            return torch.ops.flashloop.reference_attention(q, k_all, v_all, *ref_args[-4:])
                        if "reference" in kw:
                            return torch.ops.flashloop.packed_reference_attention(*ref_args)
                        if "correction" in kw:
                            _, keys, count, mass, o_ref, c_ref = corr_inputs()
                            if kw["correction"] == "read_attend":
                                return PS.correction_read_attend(q, keys[0], count[0], mass[0], o_ref, c_ref[0], (pd, kd, vd),
                                                                depth, tensors, scale)
                            sel = selected_positions(keys[0], count[0], H)
                            k_sel = torch.empty(B, H, sel.shape[-1], D, device="cuda", dtype=DT)
                            v_sel = torch.empty_like(k_sel)
                            PR.launch_packed_read(tensors, sel, depth, k_sel, v_sel, inflight=(pd, kd, vd))
                            return CO.correction_attention_triton(q, k_sel, v_sel, local_keys(keys[0], H), count[0],
                                                                  mass[0], o_ref, c_ref[0], scale)
                        if kw.get("read"):
                            PR.launch_packed_read(tensors, reads[kw["read"]], depth, out_k, out_v, bulk=kw["bulk"])
                            return out_k, out_v
                        out = torch.empty_like(q)
                        PA.launch_packed_attention(tensors, q, kd, vd, pd, pd, depth, scale, out, **kw)
                        return out
                    try:
                        if "correction" in kw:
                            got = fn()
                            if kw == {"correction": "read"}:
                                corr_read = got
                            else:  # the read-and-attend correction, or another launch: against read-then-correct
                                corr_read = corr_read if corr_read is not None else fn(kw={"correction": "read"})
                                torch.testing.assert_close(got.float(), corr_read.float(), atol=1e-2, rtol=1e-2)
                        elif "reference" in kw:
                            got = fn()
                            if kw["reference"] == "read":
                                two_step = got
                            else:
                                two_step = two_step if two_step is not None else fn(kw={"reference": "read"})
                                assert torch.equal(got[2], two_step[2]), "linear reference: count differs"
                                for a, b in zip(got, two_step):
                                    if a.is_floating_point():
                                        torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)
                        elif read:
                            if read not in read_ref:
                                read_ref[read] = P.packed_read_aten(*tensors, reads[read], depth, *P.no_inflight(cache, B, q.device))
                            ka, va = read_ref[read]
                            kk, vk = fn()
                            assert torch.equal(ka, kk) and torch.equal(va, vk), "read differs from the ATen body"
                        else:
                            torch.testing.assert_close(fn().float(), ref.float(), atol=1e-2, rtol=1e-2)
                        ms = statistics.median(_times(graph_of(fn), args.repeats, args.warmup, l2))
                    except Exception as e:  # a launch configuration that does not compile
                        rows.append({"batch": B, "seq": S, "depth": depth, "variant": name, "error": str(e)[:300]})
                        print(f"B={B} S={S} depth={depth} {name}: {str(e)[:120]}", flush=True)
                        continue
                    # a read: its share of the packed bytes (scattered keys: a lower bound, the K
                    # parameters are per 64-token block) + the BF16 K/V it writes
                    moved = nbytes * n_read // (S - 1) + 2 * B * H * n_read * D * 2 if read else nbytes
                    if "correction" in kw:  # about the selected tenth of the packed bytes (a lower bound)
                        moved = nbytes // 10
                    kind = ("reference" if "reference" in kw else "correction" if "correction" in kw
                            else "read" if read else "attention")
                    rows.append({"batch": B, "seq": S, "depth": depth, "residuals": args.residuals, "variant": name,
                                 "tuning": kw.get("tuning"), "us": ms * 1e3,
                                 "GBps": moved / (ms * 1e-3) / 1e9, "bytes": moved, "kind": kind})
                    print(f"B={B} S={S} depth={depth} {name}: {ms * 1e3:.1f} us {moved / (ms * 1e-3) / 1e9:.0f} GB/s", flush=True)
                    if args.profile:  # after the timing, which it never touches
                        rows[-1]["kernels_us"] = kernel_us(fn, args.profile, l2)
                        print("    " + ", ".join(f"{k} {v:.1f}" for k, v in rows[-1]["kernels_us"].items()), flush=True)
            del cache
            torch.cuda.empty_cache()
            save(rows)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--seq", type=int, nargs="+", default=[8192, 32768])
    ap.add_argument("--depths", type=int, nargs="+", default=[0, 1, 3])
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--splits", type=int, default=None, help="override the split-K count")
    ap.add_argument("--residuals", choices=RESIDUALS, default="prefill",
                    help="which positions the prompt writes at depths 2 and 3: prefill (25%% and 10%%, as "
                         "token-sparse prefill) or every (as a dense prefill)")
    ap.add_argument("--sweep", action="store_true", help="time the fast-path launch parameters (SWEEP) instead")
    ap.add_argument("--loop1", action="store_true", help="the bulk kernel and the whole loop-1 site instead "
                    "(default shapes B 1 4 x 32K, depths 0 1)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="with --sweep: after each variant's timing, N eager calls under the profiler: device us per kernel")
    ap.add_argument("--variants", default="", help="with --sweep: only variants whose name contains this text, or is it "
                    "with a leading '=' (alternatives separated by |)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_packed_decode needs a CUDA device")
    if args.repeats < 20:
        raise SystemExit("--repeats must be >= 20")
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    l2 = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    if args.loop1:
        if args.seq == ap.get_default("seq"):
            args.seq = [32768]
        if args.depths == ap.get_default("depths"):
            args.depths = [0, 1]
        rows = loop1(args, l2)
        with open(os.path.join(out_dir, "packed_loop1.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
        return
    if args.sweep:
        def save(rows):
            with open(os.path.join(out_dir, "packed_sweep.json"), "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)

        rows = sweep(args, l2, save)
        best = {}
        for r in rows:
            key = (r["batch"], r["seq"], r["depth"])
            if "us" in r and r.get("kind") != "read" and (key not in best or r["us"] < best[key]["us"]):
                best[key] = r
        gen = {(r["batch"], r["seq"], r["depth"]): r for r in rows if r["variant"] == "generic" and "us" in r}
        for key, r in sorted(best.items()):
            print(f"best B={key[0]} S={key[1]} depth={key[2]}: {r['variant']} {r['us']:.1f} us ({r['GBps']:.0f} GB/s); "
                  f"generic {gen[key]['us'] if key in gen else float('nan'):.1f} us")
        return
    records = []
    for S in args.seq:
        for B in args.batch:
            cache, step = fill_cache(B, S, residuals=args.residuals)
            n = S - 1
            g = torch.Generator(device="cuda").manual_seed(1)
            q = torch.randn(B, H, 1, D, device="cuda", generator=g, dtype=DT)
            dense_k = torch.randn(B, H, S, D, device="cuda", generator=g, dtype=DT)
            dense_v = torch.randn(B, H, S, D, device="cuda", generator=g, dtype=DT)
            scale = 1.0 / math.sqrt(D)
            dense = lambda: torch.nn.functional.scaled_dot_product_attention(q, dense_k, dense_v, scale=scale)  # noqa: E731
            dense_eager = _times(dense, args.repeats, args.warmup, l2)
            dense_graph = _times(graph_of(dense), args.repeats, args.warmup, l2)
            dense_bytes = 2 * B * H * S * D * 2 + 2 * B * H * D * 2
            splits = args.splits if args.splits is not None else PD.decode_splits(B, H, 1, S, 64, q.device)
            for depth in args.depths:
                kd, vd, pd = step[depth]
                tensors = cache.op_tensors(0)

                def packed(kd=kd, vd=vd, pd=pd, depth=depth, tensors=tensors):
                    out = torch.empty_like(q)
                    PA.launch_packed_attention(tensors, q, kd, vd, pd, pd, depth, scale, out, num_splits=splits)
                    return out

                ref = P.packed_attention_aten(q, kd, vd, pd, pd, depth, *tensors, scale)
                got = P.packed_attention(cache, 0, q, kd, vd, pd, pd, depth, scale)
                torch.testing.assert_close(got.float(), ref.float(), atol=1e-2, rtol=1e-2)
                torch.testing.assert_close(packed().float(), ref.float(), atol=1e-2, rtol=1e-2)
                eager = _times(packed, args.repeats, args.warmup, l2)
                op_eager = _times(lambda kd=kd, vd=vd, pd=pd, depth=depth: P.packed_attention(cache, 0, q, kd, vd, pd, pd, depth, scale),
                                      args.repeats, args.warmup, l2)
                graph = _times(graph_of(packed), args.repeats, args.warmup, l2)
                nbytes = packed_bytes(cache, B, n, depth)
                rec = {
                    "batch": B, "seq": S, "depth": depth, "residuals": args.residuals, "kv_heads": H, "head_dim": D, "num_splits": splits,
                    "packed_launcher_eager": stats(eager), "packed_op_eager": stats(op_eager), "packed_graph": stats(graph),
                    "dense_sdpa_eager": stats(dense_eager), "dense_sdpa_graph": stats(dense_graph),
                    "packed_bytes": nbytes, "dense_bytes": dense_bytes,
                    "packed_GBps_graph": nbytes / (statistics.median(graph) * 1e-3) / 1e9,
                    "dense_GBps_graph": dense_bytes / (statistics.median(dense_graph) * 1e-3) / 1e9,
                    "speedup_graph": statistics.median(dense_graph) / statistics.median(graph),
                    "cache_nbytes": cache.nbytes().as_dict(),
                }
                records.append(rec)
                print(
                    f"B={B} S={S} depth={depth}: packed {rec['packed_graph']['median_ms'] * 1e3:.1f} us "
                    f"({rec['packed_GBps_graph']:.0f} GB/s of {nbytes / 1e6:.1f} MB), dense SDPA "
                    f"{rec['dense_sdpa_graph']['median_ms'] * 1e3:.1f} us ({rec['dense_GBps_graph']:.0f} GB/s of "
                    f"{dense_bytes / 1e6:.1f} MB); eager op {rec['packed_op_eager']['median_ms'] * 1e3:.1f} us",
                    flush=True,
                )
            del cache, dense_k, dense_v
            torch.cuda.empty_cache()
    path = os.path.join(out_dir, "packed_decode.json")
    with open(path, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "records": records}, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
