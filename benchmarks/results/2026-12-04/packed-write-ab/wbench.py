"""Packed write per site: the new flush (this tree) against the old (HEAD's copy in .gpurun), same run.
Each depth's write timed alone from the state the lower depths left (restored untimed before each
call); caches compared bit for bit between old and new."""
import importlib.util, statistics, sys, json, os
from pathlib import Path
import torch
sys.path.insert(0, "benchmarks")
from common import cuda_times
from flashloop_compile.runtime import PackedKVCache
from flashloop_compile.lowering.kernels import packed_write as NEW
spec = importlib.util.spec_from_file_location("old_pw", ".gpurun/old_packed_write.py")
OLD = importlib.util.module_from_spec(spec); spec.loader.exec_module(OLD)
R, H, D = 4, 16, 128
bw = 4.2e12
rows = []
for T in (8192, 32768):
    g = torch.Generator(device="cuda").manual_seed(0)
    k = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, H, T, D, device="cuda", dtype=torch.bfloat16, generator=g)
    pos = torch.arange(T, device="cuda")[None]
    keep2 = torch.rand(1, T, device="cuda", generator=g) < 0.25
    calls = [(0, pos), (1, pos), (2, torch.where(keep2, pos, -1))]
    caches = {n: PackedKVCache(1, R, 1, T + 256, H, D, dtype=torch.bfloat16, device="cuda") for n in ("old", "new")}
    mods = {"old": OLD, "new": NEW}
    for d, p in calls:
        res = {}
        for name in ("old", "new"):
            c = caches[name]
            saved = [t.clone() for t in c.op_tensors(0)]
            def before(): [t.copy_(s) for t, s in zip(c.op_tensors(0), saved)]
            fn = lambda: mods[name].launch_packed_kv_write(c.op_tensors(0), k + d, v - d, p, d)
            ms = statistics.median(cuda_times(fn, warmup=3, repeat=15, before=before))
            before(); fn(); torch.cuda.synchronize()
            res[name] = ms
        same = all(torch.equal(a, b) for a, b in zip(caches["old"].op_tensors(0), caches["new"].op_tensors(0)))
        n = int((p >= 0).sum())
        # floor: read k, v of the written rows (bf16) + at d>0 the predecessor's codes and params
        # (base + d-1 residual levels, ~0.56 B per element each), write codes + params (~0.56 B/elem)
        elems = n * H * D * 2
        byts = elems * 2 + elems * 0.5625 * (1 + d)
        floor_ms = byts / bw * 1e3
        rows.append(dict(T=T, depth=d, rows=n, old_ms=res["old"], new_ms=res["new"], floor_ms=floor_ms, same=same))
        print(f"T={T:6d} d{d} rows={n:6d} old {res['old']:8.3f} ms  new {res['new']:8.3f} ms  x{res['old']/res['new']:5.2f}  floor {floor_ms:.3f} ms  share {floor_ms/res['new']:.0%}  bit-equal {same}", flush=True)
out = Path(os.environ.get("OUT", "out")); out.mkdir(exist_ok=True, parents=True)
(out / "wbench.json").write_text(json.dumps(rows, indent=1))
