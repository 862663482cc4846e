"""Op-level A/B of the code-domain reference scores (loop 2 under quantization, one site): the
tensor-core kernel (flashloop_compile/lowering/kernels/gluon_scores.py: _prep_kernel +
_mma_scores_kernel) against the tl kernel (reference_attention._scores_linear_kernel) on the same packed
depth-1 history at the cache's layout (ouro-1.4b: 16 kv heads x 128; a token-sparse residual).
Both are checked against FP64 scores of the decoded keys first (max abs error, and the split
partials' log-sum-exp), then timed: median of CUDA-event repeats with L2 flushed, with the bytes the
scores must move against the measured copy bandwidth.

    python3 benchmarks/bench_mma_scores.py --batch 1 4 [--splits 16 33 66 132]   # GPU

At B4 x 32K: 105 us (+ prep) against 200 us for the tl kernel (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import copy_bandwidth_gbs, cuda_times  # noqa: E402

from flashloop_compile.lowering.kernels import gluon_scores as GS  # noqa: E402
from flashloop_compile.lowering.kernels import reference_attention as RA, sparse_config as SC  # noqa: E402

HEAD_DIM, GROUP, TILE = GS.HEAD_DIM, GS.GROUP, GS.TILE


def make_inputs(B: int, H: int, S: int, device, seed: int = 0, residual_share: float = 0.5):
    """Packed depth-1 history (flushed bulk only) at the production layout: base codes and K block
    parameters, a token-sparse residual (about residual_share of the keys), a causal mask."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    NB = S // GROUP
    CAPT = S
    t = {}
    t["q"] = torch.randn(B, H, 1, HEAD_DIM, generator=g).to(torch.bfloat16)
    t["k_base"] = torch.randint(0, 256, (B * H, S, HEAD_DIM // 2), generator=g, dtype=torch.uint8)
    t["k_base_scale"] = (torch.rand(B * H, NB, HEAD_DIM, generator=g) * 0.2 + 0.01).half()
    t["k_base_min"] = (-torch.rand(B * H, NB, HEAD_DIM, generator=g) * 1.5).half()
    t["k_res"] = torch.randint(0, 256, (B * H, CAPT, HEAD_DIM // 2), generator=g, dtype=torch.uint8)
    t["k_res_scale"] = (torch.rand(1, B, H, NB, HEAD_DIM, generator=g) * 0.02 + 0.001).half()
    t["k_res_min"] = (-torch.rand(1, B, H, NB, HEAD_DIM, generator=g) * 0.15).half()
    has = torch.rand(B, S, generator=g) < residual_share
    rows = torch.full((3, B, S), -1, dtype=torch.int32)  # R - 1 = 3 depths
    for bi in range(B):
        idx = has[bi].nonzero().flatten()
        rows[0, bi, idx] = torch.arange(idx.numel(), dtype=torch.int32)
    t["rows"] = rows
    t["res_layout"] = torch.tensor([[0, 0, 0, 0], [CAPT, CAPT, CAPT, CAPT]], dtype=torch.int32)
    lengths = torch.randint(S - S // 8, S + 1, (B,), generator=g)
    lengths[0] = S
    t["mask"] = (torch.arange(S)[None, :] < lengths[:, None])[:, None, None, :].expand(B, H, 1, S).to(torch.uint8).contiguous()
    t = {k: v.to(device) for k, v in t.items()}
    t["dims"] = dict(B=B, H=H, S=S, NB=NB, CAPT=CAPT)
    return t


def reference_scores(t, scale):
    """Scores in FP64 from the decoded keys (base + residual where present), masked."""
    dims = t["dims"]
    B, H, S, NB = dims["B"], dims["H"], dims["S"], dims["NB"]

    def codes(x):  # [.., D/2] bytes -> [.., D] codes (low nibble = even channel)
        x = x.long()
        return torch.stack([x & 15, x >> 4], -1).flatten(-2).double()

    kb = codes(t["k_base"]).view(B, H, S, HEAD_DIM)
    sc = t["k_base_scale"].double().view(B, H, NB, 1, HEAD_DIM).expand(B, H, NB, GROUP, HEAD_DIM).reshape(B, H, S, HEAD_DIM)
    mn = t["k_base_min"].double().view(B, H, NB, 1, HEAD_DIM).expand(B, H, NB, GROUP, HEAD_DIM).reshape(B, H, S, HEAD_DIM)
    k = mn + sc * kb
    rows = t["rows"][0].long()  # [B, S]
    has = rows >= 0
    kr_all = codes(t["k_res"]).view(B, H, -1, HEAD_DIM)
    kr = torch.gather(kr_all, 2, rows.clamp_min(0)[:, None, :, None].expand(B, H, S, HEAD_DIM))
    rsc = t["k_res_scale"][0].double().view(B, H, NB, 1, HEAD_DIM).expand(B, H, NB, GROUP, HEAD_DIM).reshape(B, H, S, HEAD_DIM)
    rmn = t["k_res_min"][0].double().view(B, H, NB, 1, HEAD_DIM).expand(B, H, NB, GROUP, HEAD_DIM).reshape(B, H, S, HEAD_DIM)
    k = k + torch.where(has[:, None, :, None], rmn + rsc * kr, 0.0)
    s = torch.einsum("bhd,bhsd->bhs", t["q"][:, :, 0].double(), k) * scale
    return torch.where(t["mask"][:, :, 0] != 0, s, float("-inf")).view(B * H, S)


def launch(kind: str, t, scale, split: int):
    dims = t["dims"]
    B, H, S, NB, CAPT = dims["B"], dims["H"], dims["S"], dims["NB"], dims["CAPT"]
    rows_n = B * H
    chunk = -(-S // split)
    chunk = -(-chunk // TILE) * TILE
    split = -(-S // chunk)
    dev = t["q"].device
    probs = torch.empty(rows_n, S, dtype=torch.float32, device=dev)
    pm = torch.empty(rows_n, split, dtype=torch.float32, device=dev)
    pl = torch.empty(rows_n, split, dtype=torch.float32, device=dev)
    q, mask = t["q"], t["mask"]
    if kind.startswith("mma"):
        lo = torch.full((B,), S, dtype=torch.int32, device=dev)  # the whole history in the code domain
        kwin = torch.zeros(B, H, 1, HEAD_DIM, dtype=q.dtype, device=dev)
        cache = dict(k_base=t["k_base"].view(B, H, S, HEAD_DIM // 2), k_base_min=t["k_base_min"].view(B, H, NB, HEAD_DIM),
                     k_base_scale=t["k_base_scale"].view(B, H, NB, HEAD_DIM),
                     k_res=t["k_res"].view(B, H, CAPT, HEAD_DIM // 2), k_res_min=t["k_res_min"],
                     k_res_scale=t["k_res_scale"], rows=t["rows"], res_layout=t["res_layout"])
        launches = []

        def record(kernel, grid):  # kind "mma_main": the prep's tables once, then the scores kernel alone
            def go(*args, **kwargs):
                launches.append((kernel, grid, args, kwargs))
                return kernel[grid](*args, **kwargs)
            return go

        GS.launch_scores(q, kwin, mask, probs, pm, pl, lo, **cache, scale=scale, chunk=chunk, split=split, depth=1,
                         run=record)
        if kind == "mma_main":
            kernel, grid_, args, kwargs = launches[1]
            fn = lambda: kernel[grid_](*args, **kwargs)  # noqa: E731
        else:
            fn = lambda: GS.launch_scores(q, kwin, mask, probs, pm, pl, lo, **cache, scale=scale,  # noqa: E731
                                          chunk=chunk, split=split, depth=1)
        return fn, probs, pm, pl
    else:
        cfg = SC.DEFAULT_CONFIG
        lo = torch.full((B,), S, dtype=torch.int32, device=dev)
        kwin = torch.zeros(B, H, 1, HEAD_DIM, dtype=q.dtype, device=dev)
        vb = t["k_base"]
        vpar = torch.zeros(B * H, S, 2, dtype=torch.float16, device=dev)
        args = (q, kwin, mask, probs, pm, pl, lo, S, H, scale, 0,
                q.stride(0), q.stride(1), q.stride(3), *kwin.stride(), mask.stride(0), mask.stride(1), mask.stride(3),
                chunk, split, t["k_base"], t["k_base_min"], t["k_base_scale"], vb, vpar, vpar,
                t["k_res"], t["k_res_min"], t["k_res_scale"], t["k_res"], vpar, vpar, t["rows"], t["res_layout"],
                B, NB, CAPT)
        kw = dict(D=HEAD_DIM, GP=GROUP, BN=cfg.block_n_linear, DEPTH=1, STAGES=cfg.num_stages_linear,
                  num_warps=cfg.num_warps_linear)
        fn = lambda: RA._scores_linear_kernel[(rows_n, split)](*args, **kw)  # noqa: E731
    return fn, probs, pm, pl


def bench(args):
    dev = torch.device("cuda")
    n_sm = torch.cuda.get_device_properties(dev).multi_processor_count
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    rows_out = []
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    for B in args.batch:
        t = make_inputs(B, 16, args.seq, dev)
        scale = float(HEAD_DIM) ** -0.5
        ref = reference_scores(t, scale)
        default_split = RA._linear_splits(SC.DEFAULT_CONFIG, n_sm, B * 16)
        # bytes the scores must read: codes, K parameters (FP16 scale + min per block, channel and
        # stream), the residual row map, the mask; and write: the scores
        NB = args.seq // GROUP
        bytes_ = (t["k_base"].numel() + int((t["rows"][0] >= 0).sum()) * 16 * (HEAD_DIM // 2)
                  + B * 16 * NB * HEAD_DIM * 2 * 2 * 2 + B * args.seq * 4 + B * 16 * args.seq * (1 + 4))
        points = [("tl", default_split)] + [(k, sp) for k in args.kinds for sp in (args.splits or [default_split])]
        for kind, split in points:
            fn, probs, pm, pl = launch(kind, t, scale, split)
            fn()
            torch.cuda.synchronize()
            fin = torch.isfinite(ref)
            err = ((probs.double() - ref).abs()[fin]).max().item()
            inf_ok = bool(torch.equal(torch.isinf(probs), ~fin))
            # the split partials against the scores they summarize
            lse = torch.logsumexp(ref, 1)
            got = (pm + torch.log(pl)).double()
            lse_err = (torch.logsumexp(got, 1) - lse).abs().max().item()
            ms = cuda_times(fn, args.warmup, args.repeats, before=flush.zero_)
            us = statistics.median(ms) * 1000
            row = dict(kind=kind, batch=B, seq=args.seq, split=split, us=us, max_abs_err=err, lse_err=lse_err,
                       inf_pattern_ok=inf_ok, gbs=bytes_ / us / 1e3, copy_gbs=copy_gbs,
                       floor_us=bytes_ / copy_gbs / 1e3)
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "mma_scores.json").write_text(json.dumps(rows_out, indent=1))
    print(f"{'kind':14} {'B':>2} {'split':>5} {'us':>8} {'floor us':>8} {'GB/s':>6} {'max err':>9} {'lse err':>9}")
    for r in rows_out:
        print(f"{r['kind']:14} {r['batch']:>2} {r['split']:>5} {r['us']:8.1f} {r['floor_us']:8.1f} {r['gbs']:6.0f} "
              f"{r['max_abs_err']:9.2e} {r['lse_err']:9.2e}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--kinds", nargs="+", default=["mma", "mma_main"], choices=["mma", "mma_main"],
                    help="tensor-core variants timed after the tl kernel (mma_main: the scores kernel without its prep)")
    ap.add_argument("--splits", type=int, nargs="*", help="split counts of the Gluon variants (default: the production's)")
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    bench(args)


if __name__ == "__main__":
    main()
