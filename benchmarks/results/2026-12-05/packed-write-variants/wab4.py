"""Packed write variants, one 32K site (B1 x H16 x 128), each depth from the state the lower depths leave
(restored before each call), device time under the profiler (restore subtracted), caches bit for bit
against HEAD's kernel. Variants are source transforms of HEAD's packed_write.py."""
import importlib.util, statistics, json, os, re, time
from pathlib import Path
import torch
from torch.profiler import profile, ProfilerActivity
from flashloop_compile.runtime import PackedKVCache
from flashloop_compile.lowering import packed_ops as P
t_start = time.time()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
d = Path(".gpurun/ab4"); out = Path(os.environ.get("OUT", "out")); out.mkdir(exist_ok=True, parents=True)
src = (d / "head_write.py").read_text()
FAST = '''
@triton.jit
def _codes_fast(x, mn, sc):
    m32 = mn.to(tl.float32)
    s32 = sc.to(tl.float32)
    pos = s32 > 0.0
    safe = tl.where(pos, s32, 1.0)
    y = tl.math.div_rn(tl.full(safe.shape, 1.0, tl.float32), safe)
    a = x - m32
    q = a * y
    near = tl.abs(q - tl.floor(q) - 0.5) < 7.62939453125e-06
    if tl.max(tl.max(near.to(tl.int32), 1), 0) > 0:
        q = tl.where(near, tl.math.div_rn(a, safe), q)
    r = (q + 12582912.0) - 12582912.0
    r = tl.minimum(tl.maximum(r, 0.0), 15.0)
    return tl.where(pos, r, 0.0).to(tl.int32)

'''
def fast(s):
    s = s.replace("_codes(", "_codes_fast(").replace("@triton.jit(do_not_specialize=[\"depth_arg\"])\ndef _write_flush_kernel", FAST + "@triton.jit(do_not_specialize=[\"depth_arg\"])\ndef _write_flush_kernel", 1)
    return s
def warps(s, w0, w1):
    t = "num_warps=4 if rt else 8"; assert t in s
    return s.replace(t, f"num_warps={w1} if rt else {w0}")
def rt(s, n):
    return re.sub(r"^ACTIVE_ROWS_TILE = .*$", f"ACTIVE_ROWS_TILE = {n}", s, flags=re.M)
VARIANTS = {
    "head": src,
    "w4": warps(src, 4, 4),
    "w2": warps(src, 2, 4),
    "rt8": rt(src, 8),
    "fast": fast(src),
    "fast_w4": warps(fast(src), 4, 4),
}
only = os.environ.get("WAB_VARIANTS")
if only:
    VARIANTS = {k: v for k, v in VARIANTS.items() if k in only.split(",") or k == "head"}
def load(name, text):
    f = d / f"v_{name}.py"; f.write_text(text)
    spec = importlib.util.spec_from_file_location(f"v_{name}", f); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); return m
mods = {n: load(n, s) for n, s in VARIANTS.items()}
print(torch.cuda.get_device_name() if DEV == "cuda" else "cpu", flush=True)
def device_ms(fn, n=5):
    if DEV != "cuda":
        fn(); return 0.0
    res = []
    for _ in range(n):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(); torch.cuda.synchronize()
        res.append(sum(e.device_time_total for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "Memcpy" not in e.name) / 1e3)
    return statistics.median(res)
R, H, D, T = 4, int(os.environ.get("WAB_H", 16)), 128, int(os.environ.get("WAB_T", 32768))
g = torch.Generator(device=DEV).manual_seed(0)
k = torch.randn(1, H, T, D, device=DEV, dtype=torch.bfloat16, generator=g)
v = torch.randn(1, H, T, D, device=DEV, dtype=torch.bfloat16, generator=g)
pos = torch.arange(T, device=DEV)[None]
u = torch.rand(1, T, device=DEV, generator=g)
calls = {0: pos, 1: pos, 2: pos[u < 0.25][None].contiguous(), 3: pos[u < 0.10][None].contiguous()}
base = PackedKVCache(1, R, 1, T + 256, H, D, dtype=torch.bfloat16, device=DEV)
state = [t.clone() for t in base.op_tensors(0)]
rows, total = [], {n: 0.0 for n in mods}
for dep in range(4):
    p = calls[dep]; n = p.shape[1]
    sel = p[0]
    kd = (k + dep)[:, :, sel].contiguous(); vd = (v - dep)[:, :, sel].contiguous()
    ref = None; res = {}
    for name, m in mods.items():
        c = base.op_tensors(0)
        def before(): [t.copy_(s) for t, s in zip(c, state)]
        fn = lambda: m.launch_packed_kv_write(c, kd, vd, p, dep)
        try:
            before(); fn()
            if DEV == "cuda": torch.cuda.synchronize()
            after = [t.clone() for t in c]
            if ref is None: ref = after
            same = all(torch.equal(a, b) for a, b in zip(ref, after))
            before(); fn(); before()
            ms = device_ms(lambda: (fn(), before())[0]) - device_ms(before)
        except Exception as ex:
            print(name, "failed:", repr(ex)[:300], flush=True); ms, same = float("nan"), False
        res[name] = (round(ms, 4), same); total[name] += ms
        print(f"d{dep} rows={n} {name}: {ms:.3f} ms same={same}  (t={time.time() - t_start:.0f}s)", flush=True)
    for t, s in zip(base.op_tensors(0), ref): t.copy_(s)
    state = [t.clone() for t in base.op_tensors(0)]
    rows.append(dict(depth=dep, rows=n, ms=res))
    (out / "wab4.json").write_text(json.dumps(dict(device=DEV, commit=os.environ.get("FLASHLOOP_COMMIT"), rows=rows, total=total), indent=1))
print("site total:", {n: round(x, 3) for n, x in total.items()}, flush=True)
for name, m in mods.items():
    try:
        print(name, sorted({(kk.n_regs, kk.n_spills) for kk in m._write_flush_kernel.device_caches[0][0].values()}))
    except Exception as ex:
        print("no kernel info", repr(ex)[:100])
