"""A/B of the packed correction kernels (read-and-attend, V-only) at 32K: old (HEAD file) vs new (tree)."""
import importlib.util, math, statistics, sys, os, json
import torch
sys.path.insert(0, "benchmarks")
import bench_packed_decode as BPD
from common import graph_of
from flashloop_compile.lowering import packed_sparse_ops as PS
from flashloop_compile.lowering.kernels.correction import correction_combine_triton, reuse_combine_triton

spec = importlib.util.spec_from_file_location("flashloop_compile.lowering.kernels.packed_read_old", ".gpurun/old_packed_read.py")
OLD = importlib.util.module_from_spec(spec); spec.loader.exec_module(OLD)
spec = importlib.util.spec_from_file_location("flashloop_compile.lowering.kernels.packed_read_new", ".gpurun/new_packed_read.py")
NEW = importlib.util.module_from_spec(spec); spec.loader.exec_module(NEW)
H, D, DT = BPD.H, BPD.D, BPD.DT
l2 = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
rows = []
for B in [int(x) for x in os.environ.get("AB_B", "1 4").split()]:
    S = 32768
    cache, step = BPD.fill_cache(B, S)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, H, 1, D, device="cuda", generator=g, dtype=DT)
    scale = 1.0 / math.sqrt(D)
    tensors = cache.op_tensors(0)
    for depth in (2, 3):
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
        for kind, mk, ref in (("attend", attend, ref_a), ("values", values, ref_v)):
            for name, M, prec in (("old", OLD, None), ("new tf32", NEW, "tf32"), ("new bf16", NEW, "bf16")):
                if prec:
                    NEW.CODE_PREC = prec
                fn = mk(M)
                got = fn()
                err = (got.float() - ref.float()).abs().max().item()
                ok = torch.allclose(got.float(), ref.float(), atol=1e-2, rtol=1e-2)
                rep = graph_of(fn)
                ts = BPD._times(rep, 50, 10, l2)
                us = statistics.median(ts) * 1e3
                kus = BPD.kernel_us(fn, 3, l2)
                NEW.CODE_PREC = "tf32"
                rows.append(dict(B=B, depth=depth, kind=kind, name=name, us=us, err=err, ok=ok, kernels=kus))
                print(f"B={B} depth={depth} {kind:7s} {name}: {us:7.1f} us  maxerr {err:.2e} ok={ok}  " + ", ".join(f"{k[:28]} {v:.1f}" for k, v in kus.items()), flush=True)
    del cache
    torch.cuda.empty_cache()
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "corr_ab.json"), "w"), indent=1)
