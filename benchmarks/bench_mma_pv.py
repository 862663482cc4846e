"""Op-level A/B of the code-domain reference PV (loop 2 under quantization, one site): the
tensor-core kernel (flashloop_compile/lowering/kernels/gluon_pv.py) against the tl kernel
(reference_attention._pv_linear_kernel) on the same packed depth-1 V history at the cache's layout
(ouro-1.4b: 16 kv heads x 128, V groups of 64 channels, a token-sparse residual, a BF16 window).
Both are checked against FP64 sums of the decoded values first (O_ref: every key, C_ref: the
selected keys, and the masses), then timed as CUDA graphs (no host launch time): median of
replays with L2 flushed, with the bytes the PV must read against the measured copy bandwidth.

    python3 benchmarks/bench_mma_pv.py --batch 1 4 [--resident 8 12 16]   # GPU
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

from common import copy_bandwidth_gbs, cuda_times, graph_of  # noqa: E402

from flashloop_compile.lowering.kernels import gluon_pv as GP  # noqa: E402
from flashloop_compile.lowering.kernels import reference_attention as RA, sparse_config as SC  # noqa: E402

D, G = GP.HEAD_DIM, GP.GROUP


def make_inputs(B: int, H: int, S: int, device, seed: int = 0, residual_share: float = 0.5, nw: int = 192):
    """A packed depth-1 V history (base for every key, a residual for about residual_share of
    them), normalized probabilities with a tail of invisible keys per row (ragged lengths), the
    top-10% selection's threshold key, and the window buffer: the keys from lo = S - 128 on."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    R, capt = B * H, S
    t = {}
    t["v_base"] = torch.randint(0, 256, (B, H, S, D // 2), generator=g, dtype=torch.uint8)
    t["v_base_scale"] = (torch.rand(B, H, S, D // G, generator=g) * 0.2 + 0.01).half()
    t["v_base_min"] = (-torch.rand(B, H, S, D // G, generator=g) * 1.5).half()
    t["v_res"] = torch.randint(0, 256, (B, H, capt, D // 2), generator=g, dtype=torch.uint8)
    t["v_res_scale"] = (torch.rand(B, H, capt, D // G, generator=g) * 0.02 + 0.001).half()
    t["v_res_min"] = (-torch.rand(B, H, capt, D // G, generator=g) * 0.15).half()
    has = torch.rand(B, S, generator=g) < residual_share
    rows = torch.full((3, B, S), -1, dtype=torch.int32)
    for bi in range(B):
        idx = has[bi].nonzero().flatten()
        rows[0, bi, idx] = torch.arange(idx.numel(), dtype=torch.int32)
    t["rows"] = rows
    t["res_layout"] = torch.tensor([[0, 0, 0, 0], [capt] * 4], dtype=torch.int32)
    lengths = torch.randint(S - S // 8, S + 1, (B,), generator=g)
    lengths[0] = S
    visible = torch.arange(S)[None, :] < lengths.repeat_interleave(H)[:, None]  # [R, S]
    logits = torch.randn(R, S, generator=g) * 2.0
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), -1)
    t["probs"] = torch.where(visible, probs, torch.full_like(probs, -1.0))  # the selection's -1: invisible
    keys = torch.where(visible, probs.view(torch.int32).clamp_max((1 << 30) - 2) + 1, 0)
    k = -(-lengths.repeat_interleave(H) // 10)
    kth = torch.sort(keys, 1, descending=True).values.gather(1, (k - 1)[:, None])[:, 0]
    t["thr"] = kth.to(torch.int32)
    t["cut"] = torch.full((R,), S, dtype=torch.int32)  # ties at the threshold: all in
    t["lo"] = torch.full((B,), S - 128, dtype=torch.int32)
    t["v"] = torch.randn(B, H, nw, D, generator=g).to(torch.bfloat16)
    t = {k_: v_.to(device) for k_, v_ in t.items()}
    t["dims"] = dict(B=B, H=H, S=S, CAPT=capt, NW=nw)
    return t


def reference(t):
    """FP64 (O_ref, C_ref [R, D], mass, selected mass [R]) of the decoded values."""
    B, H, S = t["dims"]["B"], t["dims"]["H"], t["dims"]["S"]
    lo = int(t["lo"][0])

    def decode(codes, mn, sc):
        c = codes.long()
        c = torch.stack([c & 15, c >> 4], -1).flatten(-2).double()  # [.., D]
        return mn.double().repeat_interleave(G, -1) + sc.double().repeat_interleave(G, -1) * c

    v = decode(t["v_base"], t["v_base_min"], t["v_base_scale"])
    r = t["rows"][0].long()
    gi = r.clamp_min(0)[:, None, :].expand(B, H, S)
    res = decode(torch.gather(t["v_res"], 2, gi[..., None].expand(B, H, S, D // 2)),
                 torch.gather(t["v_res_min"], 2, gi[..., None].expand(B, H, S, D // G)),
                 torch.gather(t["v_res_scale"], 2, gi[..., None].expand(B, H, S, D // G)))
    v = v + torch.where((r >= 0)[:, None, :, None], res, 0.0)
    v[:, :, lo:] = 0.0
    nw = min(t["dims"]["NW"], S - lo)
    v[:, :, lo:lo + nw] = t["v"][:, :, :nw].double()
    v = v.reshape(B * H, S, D)
    p = t["probs"].double()
    pa = p.clamp_min(0.0)
    keys = torch.where(p >= 0, p.float().view(torch.int32).clamp_max((1 << 30) - 2) + 1, 0)
    n = torch.arange(S, device=p.device)[None, :]
    sel = (keys > t["thr"][:, None]) | ((keys == t["thr"][:, None]) & (n <= t["cut"][:, None]))
    ps = torch.where(sel, pa, 0.0)
    return (torch.einsum("rs,rsd->rd", pa, v), torch.einsum("rs,rsd->rd", ps, v), pa.sum(1), ps.sum(1))


def launch(kind: str, t, n_sm: int, resident: int = GP.RESIDENT):
    dims = t["dims"]
    B, H, S, CAPT = dims["B"], dims["H"], dims["S"], dims["CAPT"]
    R = B * H
    dev = t["probs"].device
    if kind == "mma":
        chunk, split = GP.splits(n_sm, R, S, resident)
    else:
        cfg = SC.DEFAULT_CONFIG
        chunk, split = SC.split_range(S, cfg.block_n_pv_linear, RA._linear_splits(cfg, n_sm, R))
    po = torch.empty(split, 2 * R, D, dtype=torch.float32, device=dev)
    pm = torch.empty(split, 2 * R, dtype=torch.float32, device=dev)
    v = t["v"]
    if kind == "mma":
        def fn():
            GP.launch_pv(t["probs"], v, t["thr"], t["cut"], po, pm, t["lo"], t["v_base"], t["v_base_min"],
                         t["v_base_scale"], t["v_res"], t["v_res_min"], t["v_res_scale"], t["rows"], t["res_layout"],
                         chunk, split, 1)
    else:
        cfg = SC.DEFAULT_CONFIG
        kb, kr = t["v_base"], t["v_res"]  # K placeholders (the PV kernel reads V only)
        kp = torch.zeros(B, H, S // G, D, dtype=torch.float16, device=dev)
        krp = torch.zeros(3, B, H, S // G, D, dtype=torch.float16, device=dev)
        args = (t["probs"], v, t["thr"], t["cut"], po, pm, t["lo"], S, H, R, 2 * R, v.shape[2], *v.stride(), chunk,
                kb, kp, kp, t["v_base"], t["v_base_min"], t["v_base_scale"], kr, krp, krp, t["v_res"], t["v_res_min"],
                t["v_res_scale"], t["rows"], t["res_layout"], B, S // G, CAPT)

        def fn():
            RA._pv_linear_kernel[(R, split)](*args, D=D, GP=G, BN=cfg.block_n_pv_linear, DEPTH=1,
                                             STAGES=cfg.num_stages_linear, num_warps=cfg.num_warps_linear)
    return fn, po, pm, split


def bench(args):
    dev = torch.device("cuda")
    n_sm = torch.cuda.get_device_properties(dev).multi_processor_count
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    copy_gbs = copy_bandwidth_gbs()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s (read + write)")
    rows_out = []
    for B in args.batch:
        t = make_inputs(B, 16, args.seq, dev)
        o_ref, c_ref, m_all, m_sel = reference(t)
        R = B * 16
        # bytes: base codes + V parameters, the present residuals' codes + parameters, the row map, p
        n_res = int((t["rows"][0] >= 0).sum())
        bytes_ = (R * args.seq * (D // 2 + 8) + n_res * 16 * (D // 2 + 8) + B * args.seq * 4 + R * args.seq * 4)
        points = [("tl", 0)] + [("mma", w) for w in (args.resident or [GP.RESIDENT])]
        for kind, resident in points:
            fn, po, pm, split = launch(kind, t, n_sm, resident)
            fn()
            torch.cuda.synchronize()
            o = po.double().sum(0)
            m = pm.double().sum(0)
            errs = {name: (got - want).abs().max().item() for name, got, want in
                    (("o_ref", o[:R], o_ref), ("c_ref", o[R:], c_ref), ("mass", m[:R], m_all), ("sel_mass", m[R:], m_sel))}
            ms = cuda_times(graph_of(fn), args.warmup, args.repeats, before=flush.zero_)
            us = statistics.median(ms) * 1000
            row = dict(kind=kind, resident=resident, batch=B, seq=args.seq,
                       split=split, us=us, **{f"err_{k}": v for k, v in errs.items()}, o_ref_scale=o_ref.abs().max().item(), gbs=bytes_ / us / 1e3, copy_gbs=copy_gbs,
                       floor_us=bytes_ / copy_gbs / 1e3)
            rows_out.append(row)
            print(json.dumps(row), flush=True)
    out = Path(os.environ.get("OUT", "out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "mma_pv.json").write_text(json.dumps(rows_out, indent=1))
    print(f"{'kind':11} {'res':>3} {'B':>2} {'split':>5} {'us':>8} {'floor us':>8} {'GB/s':>6} {'err O_ref':>9} {'err C_ref':>9} {'err mass':>9}")
    for r in rows_out:
        print(f"{r['kind']:11} {r['resident']:>3} {r['batch']:>2} {r['split']:>5} {r['us']:8.1f} {r['floor_us']:8.1f} {r['gbs']:6.0f} "
              f"{r['err_o_ref']:9.2e} {r['err_c_ref']:9.2e} {r['err_mass']:9.2e}")


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--seq", type=int, default=32768)
    ap.add_argument("--resident", type=int, nargs="*", default=None,
                    help="programs per SM the tensor-core kernel's split targets (gluon_pv.splits; "
                         "default gluon_pv.RESIDENT)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=20)
    bench(ap.parse_args(argv))


if __name__ == "__main__":
    main()
