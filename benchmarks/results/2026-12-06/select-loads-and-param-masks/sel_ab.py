"""A/B of radix_select alone: HEAD's selection (old_selection.py) against the package's, on
Gaussian score rows; outputs compared exactly; CUDA-graph replays (score copy + select), medians."""
import importlib.util, json, math, os, statistics, sys
import torch
from flashloop_compile.lowering.kernels import selection as NEW
from flashloop_compile.lowering.kernels import sparse_config as SC
spec = importlib.util.spec_from_file_location("old_selection", os.path.join(os.path.dirname(__file__), "old_selection.py"))
OLD = importlib.util.module_from_spec(spec); spec.loader.exec_module(OLD)
dev = torch.device("cuda")
n_sm = torch.cuda.get_device_properties(dev).multi_processor_count
cfg = SC.DEFAULT_CONFIG
launch = SC.Launcher(False)
out = []

def run(mod, scores, probs, pm, pl, kk, s, rows, kmax, bits):
    mod.RADIX_BITS = bits
    probs.copy_(scores)
    return mod.radix_select(probs, pm, pl, kk, mod.radix_digits(), s, rows, 1, kmax, 1, 1, rows, 1, n_sm, cfg, launch, dev)

def graph_of(fn):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): fn()
    return g

def time_graph(g, n=100):
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    g.replay(); torch.cuda.synchronize()
    a.record()
    for _ in range(n): g.replay()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) * 1000 / n

for rows, s, sigma in [(16, 32768, 1.0), (64, 32768, 1.0), (16, 32768, 0.1), (16, 8192, 1.0), (64, 8192, 1.0)]:
    gen = torch.Generator(device=dev).manual_seed(0)
    scores = torch.randn(rows, s, device=dev, generator=gen) * sigma
    pm = scores.max(-1, keepdim=True).values.contiguous()
    pl = torch.exp(scores - pm).sum(-1, keepdim=True).contiguous()
    k = math.ceil(0.1 * s)
    kk = torch.full((1, rows), k, dtype=torch.int32, device=dev)
    kmax = k
    variants = {"head8": (OLD, 8), "new8": (NEW, 8), "new10": (NEW, 10)}
    res = {}
    for name, (mod, bits) in variants.items():
        probs = torch.empty_like(scores)
        r = run(mod, scores, probs, pm, pl, kk, s, rows, kmax, bits)
        torch.cuda.synchronize()
        res[name] = [x.clone() for x in r]
    ok = {n: all(torch.equal(a, b) for a, b in zip(res["head8"], res[n])) for n in res}
    graphs = {}
    for name, (mod, bits) in variants.items():
        probs = torch.empty_like(scores)
        graphs[name] = graph_of(lambda mod=mod, bits=bits, probs=probs: run(mod, scores, probs, pm, pl, kk, s, rows, kmax, bits))
    probs = torch.empty_like(scores)
    graphs["copy"] = graph_of(lambda: probs.copy_(scores))
    t = {n: [] for n in graphs}
    for _ in range(7):
        for n, g in graphs.items():
            t[n].append(time_graph(g))
    med = {n: statistics.median(v) for n, v in t.items()}
    line = (f"rows {rows:3d} S {s:6d} sigma {sigma}: copy {med['copy']:.1f} us; select (minus copy) "
            + "  ".join(f"{n} {med[n] - med['copy']:.1f}" for n in variants) + f"  equal {ok}")
    print(line, flush=True)
    out.append({"rows": rows, "s": s, "sigma": sigma, "us": med, "equal": ok})
os.makedirs(os.environ.get("OUT", "."), exist_ok=True)
json.dump({"gpu": torch.cuda.get_device_name(), "results": out}, open(os.path.join(os.environ.get("OUT", "."), "sel_ab.json"), "w"), indent=1)
