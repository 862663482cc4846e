"""A/B of register caps (maxnreg) for the packed decode bulk and the packed corrections at 32K, plus
the code-domain correction patch. Each variant checked against the op's ATen body first."""
import importlib.util, math, statistics, sys, os, json, time
import torch
sys.path.insert(0, "benchmarks")
import bench_packed_decode as BPD
from common import graph_of
from flashloop_compile.lowering import packed_ops as P
from flashloop_compile.lowering import packed_sparse_ops as PS
from flashloop_compile.lowering.kernels import packed_attention as PA, packed_decode as PD, packed_read as PR
from flashloop_compile.lowering.kernels.correction import correction_combine_triton, reuse_combine_triton

spec = importlib.util.spec_from_file_location("flashloop_compile.lowering.kernels.packed_read_new", ".gpurun/new_packed_read.py")
NEW = importlib.util.module_from_spec(spec); spec.loader.exec_module(NEW)
H, D, DT = BPD.H, BPD.D, BPD.DT
l2 = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
OUT = os.environ.get("OUT", "/tmp")
rows = []
T0 = time.time()
PARTS = os.environ.get("PARTS", "decode corr").split()
for B in [int(x) for x in os.environ.get("AB_B", "1 4").split()]:
    S = 32768
    cache, step = BPD.fill_cache(B, S)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, H, 1, D, device="cuda", generator=g, dtype=DT)
    scale = 1.0 / math.sqrt(D)
    tensors = cache.op_tensors(0)
    if "decode" in PARTS:
        for depth, regs in ((0, (0, 168, 128, 0)), (1, (0, 168, 0)), (3, (0, 168))):
            kd, vd, pd = step[depth]
            def site(kd=kd, vd=vd, pd=pd, depth=depth):
                out = torch.empty_like(q)
                PA.launch_packed_attention(tensors, q, kd, vd, pd, pd, depth, scale, out)
                return out
            ref = P.packed_attention_aten(q, kd, vd, pd, pd, depth, *tensors, scale)
            for r in regs:
                PD.FAST_DECODE["maxnreg"] = (r,)
                got = site()
                err = (got.float() - ref.float()).abs().max().item()
                us = statistics.median(BPD._times(graph_of(site), 50, 10, l2)) * 1e3
                kus = BPD.kernel_us(site, 10, l2)
                bulk = next((v for k, v in kus.items() if "_decode_bulk_kernel" in k), float("nan"))
                rows.append(dict(part="decode", B=B, depth=depth, maxnreg=r, site_us=us, bulk_us=bulk, err=err))
                print(f"decode B={B} depth={depth} maxnreg={r:3d}: site {us:7.1f} us bulk {bulk:6.1f} us maxerr {err:.1e}  [{time.time()-T0:.0f}s]", flush=True)
            PD.FAST_DECODE["maxnreg"] = (0,)
    if "corr" in PARTS:
        for depth, regs in [x for x in ((2, (0, 128, 0)), (3, (0, 96, 128, 0, 96))) if str(x[0]) in os.environ.get("CDEPTHS", "2 3")]:
            kd, vd, pd = step[depth]
            mask = (torch.arange(S, device="cuda")[None, :] <= pd)[:, None, None, :]
            ref_args = (q, pd, kd, vd, depth, *tensors, mask, scale, [0.1], [-(-S // 10)])
            out_, keys, count, mass, o_ref, c_ref, probs = torch.ops.flashloop.packed_reference_attention_probs(*ref_args)
            keys, count, mass, c_ref, probs = keys[0], count[0], mass[0], c_ref[0], probs[0]
            q3 = (q.float() + 0.5 * torch.randn(q.shape, device="cuda", generator=g)).to(DT)
            def attend(M):
                def fn():
                    pm, pl, pa, nt = M.launch_packed_read_attend(tensors, q3, keys, count, depth, scale, inflight=(pd, kd, vd))
                    out = torch.empty_like(q3)
                    correction_combine_triton(pm, pl, pa, mass, o_ref, c_ref, out, num_warps=4 if nt <= 32 else 8)
                    return out
                return fn
            def values(M):
                def fn():
                    pa = M.launch_packed_read_values(tensors, keys, count, probs, depth, inflight=(pd, vd))
                    out = torch.empty_like(q3)
                    reuse_combine_triton(pa, o_ref, c_ref, out, num_warps=4 if pa.shape[1] <= 32 else 8)
                    return out
                return fn
            ref_a = PS.packed_correction_attention_aten(q3, keys, count, mass, o_ref, c_ref, pd, kd, vd, depth, *tensors, scale)
            ref_v = PS.packed_reuse_correction_attention_aten(keys, count, probs, o_ref, c_ref, pd, vd, depth, *tensors)
            variants = [(f"maxnreg {r}", PR, None, r) for r in regs] + ([("code tf32", NEW, "tf32", 0), ("code bf16", NEW, "bf16", 0)] if os.environ.get("CODE", "1") == "1" else [])
            for kind, mk, ref in [x for x in (("attend", attend, ref_a), ("values", values, ref_v)) if x[0] in os.environ.get("KINDS", "attend values")]:
                for name, M, prec, r in variants:
                    if prec:
                        NEW.CODE_PREC = prec
                    PR.PACKED_READ["attend_maxnreg"] = (r,)
                    fn = mk(M)
                    got = fn()
                    err = (got.float() - ref.float()).abs().max().item()
                    us = statistics.median(BPD._times(graph_of(fn), 50, 10, l2)) * 1e3
                    kus = BPD.kernel_us(fn, 5, l2)
                    NEW.CODE_PREC = "tf32"
                    PR.PACKED_READ["attend_maxnreg"] = (0,)
                    rows.append(dict(part="corr", B=B, depth=depth, kind=kind, name=name, us=us, err=err, kernels=kus))
                    print(f"corr B={B} depth={depth} {kind:7s} {name:12s}: {us:7.1f} us  maxerr {err:.1e}  " + ", ".join(f"{k[:24]} {v:.1f}" for k, v in kus.items()) + f"  [{time.time()-T0:.0f}s]", flush=True)
    del cache
    torch.cuda.empty_cache()
    json.dump(rows, open(os.path.join(OUT, "regs_ab.json"), "w"), indent=1)
