"""The read-and-attend correction site (packed, one query row per kv head) at 32K with the package
on PYTHONPATH: checked against the ATen body, then graph replays (L2 flushed), median us."""
import math, statistics, sys, os, json, time
import torch
sys.path.insert(0, "benchmarks")
import bench_packed_decode as BPD
from common import graph_of
from flashloop_compile.lowering import packed_sparse_ops as PS
from flashloop_compile.lowering.kernels import packed_read as PR
from flashloop_compile.lowering.kernels.correction import correction_combine_triton
H, D, DT = BPD.H, BPD.D, BPD.DT
l2 = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
label = os.environ.get("LABEL", "?")
T0 = time.time()
rows = []
for spec in os.environ.get("CASES", "prefill:1 prefill:4").split():
    resid, B = spec.split(":"); B = int(B)
    S = 32768
    cache, step = BPD.fill_cache(B, S, residuals=resid)
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(B, H, 1, D, device="cuda", generator=g, dtype=DT)
    scale = 1.0 / math.sqrt(D)
    tensors = cache.op_tensors(0)
    for depth in (2, 3):
        kd, vd, pd = step[depth]
        mask = (torch.arange(S, device="cuda")[None, :] <= pd)[:, None, None, :]
        ref_args = (q, pd, kd, vd, depth, *tensors, mask, scale, [0.1], [-(-S // 10)])
        out_, keys, count, mass, o_ref, c_ref = torch.ops.flashloop.packed_reference_attention(*ref_args)
        keys, count, mass, c_ref = keys[0], count[0], mass[0], c_ref[0]
        q3 = (q.float() + 0.5 * torch.randn(q.shape, device="cuda", generator=g)).to(DT)
        def fn():
            pm, pl, pa, nt = PR.launch_packed_read_attend(tensors, q3, keys, count, depth, scale, inflight=(pd, kd, vd))
            out = torch.empty_like(q3)
            correction_combine_triton(pm, pl, pa, mass, o_ref, c_ref, out, num_warps=4 if nt <= 32 else 8)
            return out
        ref = PS.packed_correction_attention_aten(q3, keys, count, mass, o_ref, c_ref, pd, kd, vd, depth, *tensors, scale)
        got = fn()
        err = (got.float() - ref.float()).abs().max().item()
        us = statistics.median(BPD._times(graph_of(fn), 50, 10, l2)) * 1e3
        kus = BPD.kernel_us(fn, 5, l2)
        att = next((v for k, v in kus.items() if "_read_attend" in k), float("nan"))
        rows.append(dict(label=label, resid=resid, B=B, depth=depth, us=us, attend_us=att, err=err))
        print(f"{label:5s} {resid:7s} B={B} depth={depth}: site {us:7.1f} us  attend kernel {att:6.1f} us  maxerr {err:.1e}  [{time.time()-T0:.0f}s]", flush=True)
    del cache
    torch.cuda.empty_cache()
OUT = os.environ.get("OUT", "/tmp")
with open(os.path.join(OUT, "corr_site.jsonl"), "a") as f:
    for r in rows:
        f.write(json.dumps(r) + "\n")
