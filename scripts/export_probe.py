"""Where the GPU load of an exported package crashes (issue 33: bench_export's load segfaults in
AOTIModelPackageLoader's constructor on the H200). Exports the tiny preset cut to one layer, with
features off and all on, under several AOTInductor packaging options. Each package is then loaded
in a child process three ways: raw load_pt2 with weights from disk, raw without, and
load_exported + generate. A segfault shows as rc -11. Run from the repository root on a GPU:

    PYTHONPATH=$PWD python scripts/export_probe.py [variant ...]   # logs under $OUT (default out/)
"""
import json, os, subprocess, sys, time, faulthandler
from pathlib import Path
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
faulthandler.enable()
import torch
import flashloop_compile
from flashloop_compile import FlashLoopConfig
from passes.conftest import SMALL, small
OUT = Path(os.environ.get("OUT", "out")); OUT.mkdir(parents=True, exist_ok=True)
CHILD = r'''
import sys, json, faulthandler, time
faulthandler.enable()
import torch
mode, path = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
if mode.startswith("raw"):
    from torch.export.pt2_archive._package import load_pt2
    c = load_pt2(path, load_weights_from_disk=(mode == "raw_disk"), device_index=0)
    print("loaded", sorted(c.aoti_runners), round(time.perf_counter() - t0, 2), flush=True)
else:
    from flashloop_compile import load_exported
    m = load_exported(path)
    print("loaded", round(time.perf_counter() - t0, 2), flush=True)
    out = m.generate([list(range(3, 31))], 4).tokens
    print("tokens", json.dumps(out), flush=True)
'''
(OUT / "child.py").write_text(CHILD)
model = small().to("cuda", torch.bfloat16)
variants = [
    ("off_default", FlashLoopConfig(), {}),
    ("off_in_so", FlashLoopConfig(), {"aot_inductor.package_constants_in_so": True, "aot_inductor.package_constants_on_disk_format": None}),
    ("off_blob", FlashLoopConfig(), {"aot_inductor.package_constants_on_disk_format": "binary_blob"}),
    ("all_on_default", FlashLoopConfig.all_on(**SMALL), {}),
    ("all_on_in_so", FlashLoopConfig.all_on(**SMALL), {"aot_inductor.package_constants_in_so": True, "aot_inductor.package_constants_on_disk_format": None}),
]
only = sys.argv[1:] or [v[0] for v in variants]
for name, cfg, opts in variants:
    if name not in only:
        continue
    path = OUT / f"{name}.pt2"
    t0 = time.perf_counter()
    try:
        flashloop_compile.export(model, cfg, path, max_batch=1, max_seq=64, min_prompt=33 if name.startswith("all") else 64,
                                 batch_buckets=(1,), inductor_configs=opts)
    except Exception as ex:
        print(f"{name}: export failed {type(ex).__name__}: {str(ex)[:400]}", flush=True); continue
    print(f"{name}: exported {time.perf_counter() - t0:.1f} s, {path.stat().st_size / 1e6:.1f} MB", flush=True)
    for mode in ("raw_disk", "raw_nodisk", "engine"):
        r = subprocess.run([sys.executable, str(OUT / "child.py"), mode, str(path)], capture_output=True, text=True, timeout=240,
                           env={**os.environ, "TORCH_SHOW_CPP_STACKTRACES": "1"})
        (OUT / f"{name}-{mode}.log").write_text(r.stdout + "\n---\n" + r.stderr)
        tail = (r.stdout.strip().splitlines() or [""])[-1][:200]
        err = [l for l in r.stderr.splitlines() if "Error" in l or "error" in l][-2:]
        print(f"  {mode:10s} rc={r.returncode} {tail} {err}", flush=True)
