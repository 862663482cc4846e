"""Selection A/B on one GPU: radix_select of HEAD (5 kernels + fill) against the candidate select
(3 kernels), same probability rows, outputs equal first; device time of the selection kernels from
the profiler (median over 3 profiled batches of 20 calls), and the graph-replayed call.

Ran on the tree of select_candidates.patch (4ab830d) with 47895ad's selection.py copied to
.gpurun/sel_old.py; the decode steps: bench_decode.py --shapes 1x32768 --no-dense-whole --configs
sparse+quant --profile 1 on each tree, one device call (H200, 2026-12-06)."""
import importlib.util, json, math, os, statistics, sys
import torch
sys.path.insert(0, os.getcwd())
from flashloop_compile.lowering.kernels import selection as new, sparse_config as SC
from flashloop_compile.lowering.kernels.common import sm_count
spec = importlib.util.spec_from_file_location("sel_old", ".gpurun/sel_old.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
dev = torch.device("cuda"); n_sm = sm_count(dev); cfg = SC.DEFAULT_CONFIG; launch = SC.Launcher(False)
out = []
for b in (1, 4):
    for s in (8192, 32768):
        for sigma in (0.1, 1.0, 3.0):
            rows = b * 16
            g = torch.Generator(device="cuda").manual_seed(0)
            scores = torch.randn(rows, s, device=dev, generator=g) * sigma
            m = scores.max(-1, keepdim=True).values
            part_m, part_l = m.contiguous(), torch.exp(scores - m).sum(-1, keepdim=True)
            k = math.ceil(0.1 * s)
            kk = torch.full((1, rows), k, dtype=torch.int32, device=dev)
            probs = torch.empty_like(scores)
            def run(mod):
                probs.copy_(scores)
                return mod.radix_select(probs, part_m, part_l, kk, mod.radix_digits(), s, rows, 1, k, 1, b, 16, 1,
                                        n_sm, cfg, launch, dev)
            ro, rn = run(old), run(new)
            for a, c, name in zip(ro, rn, ("keys", "thr", "cut")):
                assert torch.equal(a, c), (b, s, sigma, name)
            # candidates per row (the finish kernel's work)
            pk = torch.where(probs >= 0, probs.view(torch.int32).clamp_max((1 << 30) - 2) + 1, 0)
            kth = pk.sort(-1, descending=True).values[:, k - 1:k]
            ncand = ((pk >> 22) == (kth >> 22)).sum(-1).float().mean().item()
            row = {"batch": b, "seq": s, "sigma": sigma, "candidates_per_row": ncand}
            for name, mod in (("old", old), ("new", new)):
                for _ in range(3):
                    run(mod)
                torch.cuda.synchronize()
                meds = []
                for rep in range(3):
                    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                        for _ in range(20):
                            run(mod)
                        torch.cuda.synchronize()
                    tot, launches = 0.0, 0
                    for e in prof.key_averages():
                        if "_select" in e.key:
                            tot += e.device_time_total; launches += e.count
                    meds.append(tot / 20)
                row[f"{name}_select_us"] = statistics.median(meds)
                row[f"{name}_launches"] = launches // 20
                gr = torch.cuda.CUDAGraph()
                st = torch.cuda.Stream(); st.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(st):
                    run(mod)
                torch.cuda.current_stream().wait_stream(st)
                with torch.cuda.graph(gr):
                    run(mod)
                ts = []
                for _ in range(30):
                    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
                    e0.record(); [gr.replay() for _ in range(20)]; e1.record(); torch.cuda.synchronize()
                    ts.append(e0.elapsed_time(e1) * 1000 / 20)
                row[f"{name}_graph_us"] = statistics.median(ts)
            print(json.dumps(row), flush=True)
            out.append(row)
print(f"{'B':>2} {'S':>6} {'sig':>4} {'cand':>6} | {'old sel us':>10} {'new sel us':>10} {'ratio':>6} | {'old graph':>9} {'new graph':>9} (incl. a copy)")
for r in out:
    print(f"{r['batch']:>2} {r['seq']:>6} {r['sigma']:>4} {r['candidates_per_row']:>6.0f} | {r['old_select_us']:>10.1f} {r['new_select_us']:>10.1f} {r['old_select_us']/r['new_select_us']:>6.2f} | {r['old_graph_us']:>9.1f} {r['new_graph_us']:>9.1f}")
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "selection_ab.json"), "w"), indent=1)
