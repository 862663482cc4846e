"""Packed write A/B: HEAD's flush (old_write + old_codec) against this tree's and launch variants,
same process; each depth's call timed alone from the state the lower depths left; caches bit-equal."""
import importlib.util, statistics, sys, json, os, re
from pathlib import Path
import torch
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".gpurun/ab")
from common import cuda_times
from flashloop_compile.runtime import PackedKVCache
src = Path("flashloop_compile/lowering/kernels/packed_write.py").read_text()
codec = Path("flashloop_compile/lowering/kernels/packed_codec.py").read_text()
d = Path(".gpurun/ab")
(d / "codec_mul.py").write_text(codec.replace("q = tl.math.div_rn(x - m32, safe)", "q = (x - m32) * (1.0 / safe)"))
variants = {"new": src,
            "w4": src.replace("COUNT=False, **meta, num_warps=8", "COUNT=False, **meta, num_warps=4"),
            "w16": src.replace("COUNT=False, **meta, num_warps=8", "COUNT=False, **meta, num_warps=16"),
            "mul": src.replace("from flashloop_compile.lowering.kernels.packed_codec import", "from codec_mul import")}
for n, s in variants.items():
    (d / f"pw_{n}.py").write_text(s)
names = ["old"] + list(variants)
mods = {}
for n in names:
    f = d / ("old_write.py" if n == "old" else f"pw_{n}.py")
    spec = importlib.util.spec_from_file_location(f"pw_{n}", f); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); mods[n] = m
R, H, D = 4, 16, 128
bw = 4.2e12
rows = []
for T in (8192, 32768):
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.arange(T, device="cuda")[None]
    u = torch.rand(1, T, device="cuda", generator=g)
    p2 = torch.where(u < 0.25, pos, -1); p3 = torch.where(u < 0.10, pos, -1)
    # compacted (what token-sparse passes: the active rows' positions, ascending, no padding)
    c2 = pos[u < 0.25][None].contiguous(); c3 = pos[u < 0.10][None].contiguous()
    calls = [(0, pos, "all"), (1, pos, "all"), (2, p2, "25% padded"), (3, p3, "10% padded")]
    caches = {n: PackedKVCache(1, R, 1, T + 256, H, D, dtype=torch.bfloat16, device="cuda") for n in names}
    for dep, p, what in calls:
        res = {}
        for name in names:
            c = caches[name]
            saved = [t.clone() for t in c.op_tensors(0)]
            def before(): [t.copy_(s) for t, s in zip(c.op_tensors(0), saved)]
            fn = lambda: mods[name].launch_packed_kv_write(c.op_tensors(0), k + dep, v - dep, p, dep)
            try:
                ms = statistics.median(cuda_times(fn, warmup=3, repeat=15, before=before))
            except Exception as ex:
                print(name, "failed:", repr(ex)[:300], flush=True); ms = float("nan")
            before(); fn(); torch.cuda.synchronize()
            res[name] = ms
        same = {n: all(torch.equal(a, b) for a, b in zip(caches["old"].op_tensors(0), caches[n].op_tensors(0))) for n in names[1:]}
        n = int((p >= 0).sum())
        elems = n * H * D * 2
        floor_ms = (elems * 2 + elems * 0.5625 * (1 + dep)) / bw * 1e3
        rows.append(dict(T=T, depth=dep, rows=n, ms=res, floor_ms=floor_ms, same=same))
        print(f"T={T:6d} d{dep} {what:10s} rows={n:6d} " + " ".join(f"{k_} {v_:7.3f}" for k_, v_ in res.items())
              + f" | floor {floor_ms:.3f} share(new) {floor_ms/res['new']:.0%} | equal " + ",".join(k_ for k_, v_ in same.items() if v_), flush=True)
for n, m in mods.items():
    try:
        for key, kern in m._write_flush_kernel.device_caches[0][0].items():
            print(f"   {n} compiled: regs {kern.n_regs} spills {kern.n_spills} shared {kern.metadata.shared}")
    except Exception as ex:
        print("   no kernel info:", repr(ex)[:200])
out = Path(os.environ.get("OUT", "out")); out.mkdir(exist_ok=True, parents=True)
(out / "wab.json").write_text(json.dumps(rows, indent=1))
