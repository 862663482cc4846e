"""Which AOTInductor packages load on this machine (issue 33: load_pt2 segfaults on CUDA for our package).
Tiny models, each package loaded in a child process (a segfault shows as rc -11)."""
import os, sys, subprocess, time, json
from pathlib import Path
import torch
OUT = Path(os.environ.get("OUT", "out")); OUT.mkdir(parents=True, exist_ok=True)
W = Path("/tmp/aoti"); W.mkdir(exist_ok=True)
CHILD = r'''
import sys, faulthandler, time, torch
faulthandler.enable()
path, how = sys.argv[1], sys.argv[2]
t = time.perf_counter()
if how == "load_package":
    m = torch._inductor.aoti_load_package(path)
    y = m(torch.randn(4, 64, device="cuda", dtype=torch.bfloat16))
    print("ok load_package", tuple(y.shape), round(time.perf_counter() - t, 2), flush=True)
else:
    from torch.export.pt2_archive._package import load_pt2
    c = load_pt2(path, load_weights_from_disk=(how == "pt2_disk"), device_index=0)
    for n, r in sorted(c.aoti_runners.items()):
        y = r([torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)])
        print("ok", n, tuple(y[0].shape), flush=True)
    print("ok load_pt2", round(time.perf_counter() - t, 2), flush=True)
'''
(W / "child.py").write_text(CHILD)
class Lin(torch.nn.Module):
    def __init__(s, n=64):
        super().__init__(); s.l = torch.nn.Linear(n, n); s.register_buffer("b2", torch.ones(n))
    def forward(s, x): return torch.relu(s.l(x)) + s.b2
def ep(m):
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    return torch.export.export(m, (x,))
m1 = Lin().cuda().bfloat16(); m2 = Lin().cuda().bfloat16()
PICKLE = {"aot_inductor.package_constants_in_so": False, "aot_inductor.package_constants_on_disk_format": "pickle_weights"}
cases = []
def single(name, opts):
    p = W / f"{name}.pt2"
    torch._inductor.aoti_compile_and_package(ep(m1), package_path=str(p), inductor_configs=opts)
    return p
def multi(name, opts):
    from torch.export.pt2_archive._package import package_pt2
    files = {}
    for n, m in (("a", m1), ("b", m2)):
        e = ep(m)
        files[n] = torch._inductor.aot_compile(e.module(), *e.example_inputs, options={"aot_inductor.package": True, **opts})
    p = W / f"{name}.pt2"
    package_pt2(str(p), aoti_files=files)
    return p
plan = [
    ("single_default", single, {}, ["load_package", "pt2_nodisk"]),
    ("single_pickle", single, PICKLE, ["pt2_disk"]),
    ("multi_in_so", multi, {"aot_inductor.package_constants_in_so": True}, ["pt2_nodisk"]),
    ("multi_pickle", multi, PICKLE, ["pt2_disk"]),
]
for name, make, opts, hows in plan:
    t = time.perf_counter()
    try:
        p = make(name, opts)
    except Exception as ex:
        print(f"{name}: build failed {type(ex).__name__}: {str(ex)[:300]}", flush=True); continue
    print(f"{name}: built {time.perf_counter() - t:.1f} s {p.stat().st_size/1e6:.2f} MB", flush=True)
    for how in hows:
        r = subprocess.run([sys.executable, str(W / "child.py"), str(p), how], capture_output=True, text=True, timeout=120)
        (OUT / "aoti_min.log").open("a").write(f"\n### {name} {how} rc={r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}\n")
        print(f"  {how:12s} rc={r.returncode} {(r.stdout.strip().splitlines() or [''])[-1][:150]}", flush=True)
