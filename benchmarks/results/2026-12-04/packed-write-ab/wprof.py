"""Per-kernel device time of the packed write at 32K (torch.profiler), for the kernel and two
probe variants: 4 warps; the codes' division by a reciprocal multiply (not exact: a probe of how
much the arithmetic costs). Also registers and spills of each compiled flush kernel."""
import importlib.util, sys, re, os
from pathlib import Path
import torch
from torch.profiler import profile, ProfilerActivity
from flashloop_compile.runtime import PackedKVCache
src = Path("flashloop_compile/lowering/kernels/packed_write.py").read_text()
codec = Path("flashloop_compile/lowering/kernels/packed_codec.py").read_text()
variants = {"v0": src, "w4": src.replace("COUNT=False, **meta, num_warps=8", "COUNT=False, **meta, num_warps=4"),
            "w16": src.replace("COUNT=False, **meta, num_warps=8", "COUNT=False, **meta, num_warps=16")}
# probe: codes by reciprocal multiply
c2 = codec.replace("q = tl.math.div_rn(x - m32, safe)", "q = (x - m32) * (1.0 / safe)")
d = Path(".gpurun/var"); d.mkdir(exist_ok=True)
(d / "codec_mul.py").write_text(c2)
variants["mulcodes"] = src.replace("from flashloop_compile.lowering.kernels.packed_codec import", "from codec_mul import")
sys.path.insert(0, str(d))
mods = {}
for n, s in variants.items():
    (d / f"pw_{n}.py").write_text(s)
    spec = importlib.util.spec_from_file_location(f"pw_{n}", d / f"pw_{n}.py"); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); mods[n] = m
R, H, D, T = 4, 16, 128, 32768
g = torch.Generator(device="cuda").manual_seed(0)
k = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
v = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
pos = torch.arange(T, device="cuda")[None]
keep2 = torch.rand(1, T, device="cuda", generator=g) < 0.25
calls = [(0, pos), (1, pos), (2, torch.where(keep2, pos, -1))]
for n, m in mods.items():
    c = PackedKVCache(1, R, 1, T + 256, H, D, dtype=torch.bfloat16, device="cuda")
    for dep, p in calls:
        saved = [t.clone() for t in c.op_tensors(0)]
        for _ in range(2):
            [t.copy_(s) for t, s in zip(c.op_tensors(0), saved)]
            m.launch_packed_kv_write(c.op_tensors(0), k, v, p, dep)
        torch.cuda.synchronize()
        [t.copy_(s) for t, s in zip(c.op_tensors(0), saved)]
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            m.launch_packed_kv_write(c.op_tensors(0), k, v, p, dep)
            torch.cuda.synchronize()
        parts = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                nm = e.name[:40]
                parts[nm] = parts.get(nm, 0) + e.device_time_total / 1e3
        tot = sum(parts.values())
        print(f"{n:9s} d{dep} total {tot:7.3f} ms :: " + "; ".join(f"{k_} {v_:.3f}" for k_, v_ in sorted(parts.items(), key=lambda x: -x[1])), flush=True)
    try:
        for key, kern in m._write_flush_kernel.device_caches[0][0].items():
            print(f"   {n} compiled: regs {kern.n_regs} spills {kern.n_spills} shared {kern.metadata.shared}")
    except Exception as ex:
        print("   no kernel info:", repr(ex)[:200])
