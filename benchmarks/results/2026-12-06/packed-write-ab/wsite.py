"""One 32K packed-write site (B1 x H16 x 128), depths 0..3 each from the state the lower depths
leave; variants = packed_write.py files under .gpurun/wab/v_*.py (plus HEAD's module), checked
bit for bit against HEAD's, device ms under the profiler (restore subtracted).
WSITE_NCU=1: one call per depth of HEAD only (for ncu)."""
import importlib.util, statistics, json, os, sys, time
from pathlib import Path
import torch
from torch.profiler import profile, ProfilerActivity
from flashloop_compile.runtime import PackedKVCache
from flashloop_compile.lowering.kernels import packed_write as HEAD
DEV = "cuda" if torch.cuda.is_available() else "cpu"
d = Path(".gpurun/wab"); out = Path(os.environ.get("OUT", "out")); out.mkdir(exist_ok=True, parents=True)
mods = {"head": HEAD}
if not os.environ.get("WSITE_NCU"):
    for f in sorted(d.glob("v_*.py")):
        spec = importlib.util.spec_from_file_location(f.stem, f); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
        mods[f.stem[2:]] = m
def device_ms(fn, n=5):
    if DEV == "cpu":
        fn(); return 0.0
    res = []
    for _ in range(n):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(); torch.cuda.synchronize()
        res.append(sum(e.device_time_total for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name) / 1e3)
    return statistics.median(res)
R, H, D, T = 4, 16, 128, int(os.environ.get("WSITE_T", 32768))
g = torch.Generator(device=DEV).manual_seed(0)
k = torch.randn(1, H, T, D, device=DEV, dtype=torch.bfloat16, generator=g)
v = torch.randn(1, H, T, D, device=DEV, dtype=torch.bfloat16, generator=g)
pos = torch.arange(T, device=DEV)[None]
u = torch.rand(1, T, device=DEV, generator=g)
calls = {0: pos, 1: pos, 2: pos[u < 0.25][None].contiguous(), 3: pos[u < 0.10][None].contiguous()}
base = PackedKVCache(1, R, 1, T + 256, H, D, dtype=torch.bfloat16, device=DEV)
state = [t.clone() for t in base.op_tensors(0)]
total = {n: 0.0 for n in mods}; rows = []
for dep in range(4):
    p = calls[dep]; sel = p[0]
    kd = (k + dep)[:, :, sel].contiguous(); vd = (v - dep)[:, :, sel].contiguous()
    ref = None; res = {}
    for name, m in mods.items():
        c = base.op_tensors(0)
        def before(): [t.copy_(s) for t, s in zip(c, state)]
        fn = lambda: m.launch_packed_kv_write(c, kd, vd, p, dep)
        try:
            before(); fn(); (torch.cuda.synchronize() if DEV == 'cuda' else None)
            after = [t.clone() for t in c]
            if ref is None: ref = after
            same = all(torch.equal(a, b) for a, b in zip(ref, after))
            if os.environ.get("WSITE_NCU"):
                ms = 0.0
            else:
                before(); fn(); before()
                ms = device_ms(lambda: (fn(), before())[0]) - device_ms(before)
        except Exception as ex:
            print(name, "failed:", repr(ex)[:400], flush=True); ms, same = float("nan"), False
        res[name] = (round(ms, 4), same); total[name] += ms
        print(f"d{dep} rows={p.shape[1]} {name}: {ms:.3f} ms same={same}", flush=True)
    for t, s in zip(base.op_tensors(0), ref): t.copy_(s)
    state = [t.clone() for t in base.op_tensors(0)]
    rows.append(dict(depth=dep, rows=p.shape[1], ms=res))
print("site total:", {n: round(x, 3) for n, x in total.items()}, flush=True)
(out / "wsite.json").write_text(json.dumps(dict(commit=os.environ.get("FLASHLOOP_COMMIT"), rows=rows, total=total), indent=1))
for name, m in mods.items():
    try:
        print(name, sorted({(kk.n_regs, kk.n_spills) for kk in (m._write_flush_kernel.device_caches[0][0].values() if DEV == 'cuda' else [])}))
    except Exception as ex:
        print("no kernel info", repr(ex)[:100])
