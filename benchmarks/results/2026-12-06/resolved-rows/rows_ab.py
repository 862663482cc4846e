"""A/B: HEAD's read-and-attend correction against the prototype with each selected key's residual
rows resolved beforehand (rows_proto.py), B x 32K, depths 2 and 3, both cache fills."""
import math, statistics, sys, os, json, time
import torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".gpurun")
import bench_packed_decode as BPD
from common import graph_of
from flashloop_compile.lowering import packed_sparse_ops as PS
from flashloop_compile.lowering.kernels import packed_read as PR
from flashloop_compile.lowering.kernels.correction import correction_combine_triton
import rows_proto as RP

H, D, DT = BPD.H, BPD.D, BPD.DT
l2 = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
OUT = os.environ.get("OUT", "/tmp")
rows, T0 = [], time.time()
for resid, B in [x.split(":") for x in os.environ.get("CASES", "every:1 prefill:1 prefill:4").split()]:
    B, S = int(B), 32768
    cache, step = BPD.fill_cache(B, S, residuals=resid)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, H, 1, D, device="cuda", generator=g, dtype=DT)
    scale = 1.0 / math.sqrt(D)
    tensors = cache.op_tensors(0)
    for depth in (2, 3):
        kd, vd, pd = step[depth]
        mask = (torch.arange(S, device="cuda")[None, :] <= pd)[:, None, None, :]
        out_, keys, count, mass, o_ref, c_ref, probs = torch.ops.flashloop.packed_reference_attention_probs(
            q, pd, kd, vd, depth, *tensors, mask, scale, [0.1], [-(-S // 10)])
        keys, count, mass, c_ref = keys[0], count[0], mass[0], c_ref[0]
        q3 = (q.float() + 0.5 * torch.randn(q.shape, device="cuda", generator=g)).to(DT)
        sel = RP.resolve_rows(tensors, keys, depth)
        def combine(parts):
            pm, pl, pa, nt = parts
            out = torch.empty_like(q3)
            correction_combine_triton(pm, pl, pa, mass, o_ref, c_ref, out, num_warps=4 if nt <= 32 else 8)
            return out
        variants = {
            "head": lambda: combine(PR.launch_packed_read_attend(tensors, q3, keys, count, depth, scale, inflight=(pd, kd, vd))),
            "rows": lambda: combine(RP.launch(tensors, q3, keys, count, depth, scale, inflight=(pd, kd, vd), selrows=sel)),
            "rows96": lambda: combine(RP.launch(tensors, q3, keys, count, depth, scale, inflight=(pd, kd, vd), selrows=sel, maxnreg=96)),
            "resolve": lambda: RP.resolve_rows(tensors, keys, depth),
        }
        ref = PS.packed_correction_attention_aten(q3, keys, count, mass, o_ref, c_ref, pd, kd, vd, depth, *tensors, scale)
        for name in ["head", "rows", "rows96", "head", "rows", "resolve"]:
            fn = variants[name]
            err = 0.0 if name == "resolve" else (fn().float() - ref.float()).abs().max().item()
            us = statistics.median(BPD._times(graph_of(fn), 50, 10, l2)) * 1e3
            kus = BPD.kernel_us(fn, 5, l2)
            rows.append(dict(resid=resid, B=B, depth=depth, name=name, us=us, err=err, kernels=kus))
            print(f"{resid:7s} B={B} depth={depth} {name:7s}: {us:7.1f} us  maxerr {err:.1e}  " +
                  ", ".join(f"{k[:22]} {v:.1f}" for k, v in kus.items()) + f"  [{time.time()-T0:.0f}s]", flush=True)
        json.dump(rows, open(os.path.join(OUT, "rows_ab.json"), "w"), indent=1)
    del cache
    torch.cuda.empty_cache()
