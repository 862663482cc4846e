"""The benchmark harness (benchmarks/common.py) on CPU: what it hands the backend and how it calls
the result. Two harness bugs made GPU numbers wrong without failing: SymInt example inputs passed
to the compiled function (a negative size at the first dynamic-shape call), and compiling with grad
enabled (training graphs: saved activations and a copy of every mutated cache).

bench_generate.py: its work order and its items' memory bookkeeping. On the H200 its max-batch
search ran between the shapes and every later item ran out of memory (memory was not released).

bench_decode.py --profile: the per-kernel breakdown's buckets and its row (CPU op self time here).
bench_prefill.py: the work each configuration must do (its parts' FLOPs and bytes)."""

import json
import os
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_decode  # noqa: E402
import bench_generate  # noqa: E402
import bench_prefill  # noqa: E402
import bench_snapshot  # noqa: E402
import common  # noqa: E402
from common import capture_graph, compile_variant  # noqa: E402

from flashloop_compile.config import FlashLoopConfig  # noqa: E402
from flashloop_compile.models.ouro import OuroForCausalLM  # noqa: E402


def _prefill_graph(t: int, dynamic: bool):
    model = OuroForCausalLM.from_preset("tiny", dtype=torch.float32, seed=0).eval()
    model.setup_caches(1, t + 16)
    ids = torch.randint(0, model.config.vocab_size, (1, t), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(t)[None].contiguous()
    with torch.no_grad():
        want = model(ids, pos)
    gm, inputs = capture_graph(model, ids, pos, dynamic_tokens=dynamic)
    return want, gm, inputs


def test_dynamic_capture_hands_concrete_sizes_and_the_compiled_graph_runs():
    want, gm, inputs = _prefill_graph(24, dynamic=True)
    assert any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in gm.graph.nodes if n.op == "placeholder")
    assert not any(isinstance(x, torch.SymInt) for x in inputs)
    assert 24 in [x for x in inputs if isinstance(x, int)]
    fn, _, _ = compile_variant(gm, inputs, {"compilation.outline_layers": True})
    with torch.no_grad():
        got = fn(*inputs)
    got = got[0] if isinstance(got, (tuple, list)) else got
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_compile_variant_builds_inference_graphs_even_with_grad_enabled():
    _, gm, inputs = _prefill_graph(8, dynamic=False)
    assert torch.is_grad_enabled()
    fn, _, _ = compile_variant(gm, inputs, {"compilation.outline_layers": True})
    out = fn(*inputs)  # grad enabled, as a benchmark's first call may be
    out = out[0] if isinstance(out, (tuple, list)) else out
    assert not out.requires_grad, "a segment was compiled as a training graph"


def test_generate_work_order_runs_every_shape_before_the_max_batch_search():
    assert bench_generate.work_order(["1x64+4", "2x64+4"], ["dense", "all_on"], max_batch=True) == [
        ("generate", "1x64+4", "dense"), ("generate", "1x64+4", "all_on"),
        ("generate", "2x64+4", "dense"), ("generate", "2x64+4", "all_on"),
        ("max_batch", None, "dense"), ("max_batch", None, "all_on"),
    ]
    assert bench_generate.work_order(["1x64+4"], ["dense"], max_batch=False) == [("generate", "1x64+4", "dense")]


def test_generate_item_out_of_memory_is_recorded_and_its_tensors_freed(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "OUT", tmp_path)
    bench = bench_generate.Bench(bench_generate.parse_args(["--preset", "tiny", "--dtype", "float32"]))
    held = []

    def out_of_memory(row):
        caches = torch.zeros(1024)
        held.append(weakref.ref(caches))
        row["fill_s"] = 0.5
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.75 GiB.")

    attempt = bench.run_item({"kind": "max_batch", **bench.base("dense"), "batch": 30, "oom": False}, out_of_memory, 0.0, "test")
    assert held[0]() is None, "the failed item's frame (its tensors) outlived it"
    assert attempt["kind"] == "max_batch" and attempt["oom"] and "3.75 GiB" in attempt["error"]
    assert attempt["fill_s"] == 0.5 and attempt["allocated_at_start_gb"] is None  # None: the CPU
    generate = bench.run_item({"kind": "generate", **bench.base("dense"), "batch": 1}, out_of_memory, 0.0, "test")
    assert generate["kind"] == "oom"  # plot_generate reads "generate" rows as complete
    skipped = bench.run_item({"kind": "generate", **bench.base("dense"), "batch": 1}, None, 1e9, "test")
    assert skipped["kind"] == "skipped" and "needs" in skipped["reason"]
    rows = [json.loads(line) for line in (tmp_path / "generate.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["max_batch", "oom", "skipped"]


def test_generate_bench_on_cpu_runs_the_shapes_then_the_max_batch_search(tmp_path):
    args = ["--preset", "tiny", "--dtype", "float32", "--configs", "dense", "--shapes", "1x64+4,2x64+4",
            "--max-batch-context", "128", "--max-batch-steps", "2"]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_generate.py"), *args], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "generate.jsonl").read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["start", "generate", "generate", "max_batch_accounting", "max_batch", "max_batch_next"]
    items = [r for r in rows if r["kind"] not in ("start", "max_batch_accounting")]
    assert all(r["allocated_at_start_gb"] is None and r["item_s"] > 0 for r in items)  # None: the CPU


def test_generate_summary_models_end_to_end_when_the_deadline_cut_the_decode(capsys):
    # a deadline cut all-on to 61 of 256 tokens: the measured e2e ratio would compare 61 tokens
    # with dense's 256, so it is None and the summary gives TTFT + 255 TPOT on both sides
    bench = bench_generate.Bench(bench_generate.parse_args(["--preset", "tiny", "--dtype", "float32"]))
    dense = {"ttft_ms": 13353.1, "tpot_ms": 29.99, "throughput_tok_s": 48.7, "kv_bytes": 6 * 2**30,
             "new_tokens": 256, "new_tokens_asked": 256}
    on = {**dense, "ttft_ms": 8750.3, "tpot_ms": 56.19, "kv_bytes": 2**30, "new_tokens": 61}
    on["speedup_vs_dense"] = {"end_to_end": None, "tpot": 29.99 / 56.19,
                              "end_to_end_model": bench_generate._modelled_s(dense, 256) / bench_generate._modelled_s(on, 256)}
    bench.done = {("4x32768+256", "dense"): {"row": dense}, ("4x32768+256", "all_on"): {"row": on}}
    bench.summary()
    line = capsys.readouterr().out.splitlines()[1]
    assert "e2e (TTFT + 255 TPOT) 0.91x" in line and "(61 of 256 tokens run)" in line, line


def test_decode_profile_buckets_kernel_names():
    names = {
        "_decode_bulk_kernel": "decode_bulk", "_attn_kernel": "packed_attn", "_combine_kernel": "packed_combine",
        "_read_bulk_kernel": "read_bulk", "_read_kernel": "read", "_write_flush_kernel": "write",
        "_write_tail_kernel": "write", "_scores_kernel": "ref_scores", "_select_level_kernel": "ref_select",
        "_pv_kernel": "ref_pv", "_pv_combine_kernel": "ref_pv", "_correction_combine_kernel": "correction",
        "_scores_linear_kernel": "ref_scores", "_pv_linear_kernel": "ref_pv", "_correction_kernel": "correction",
        "_mma_scores_kernel": "ref_scores", "_prep_kernel": "ref_scores", "_read_attend_kernel": "correction",
        "_reuse_correction_kernel": "correction", "_reuse_combine_kernel": "correction", "_read_values_kernel": "correction",
        "flashloop::packed_reuse_correction_attention_aten": "correction",
        "void pytorch_flash::flash_fwd_splitkv_combine_kernel<Flash_fwd_kernel_traits<128>>": "sdpa",
        "nvjet_tst_128x64_64x8_2x1_v_bz_TNT": "GEMM", "sm90_xmma_gemm_bf16bf16_bf16f32": "GEMM",
        "triton_poi_fused_index_select_0": "inductor", "triton_red_fused__to_copy_add_mean_1": "inductor",
        "flashloop::packed_kv_write_aten": "write", "flashloop::packed_attention_aten": "packed_attn",
        "aten::mm": "GEMM", "Memcpy DtoD (Device -> Device)": "other", "_running_extrema_kernel": "scan",
    }
    assert {n: bench_decode.bucket(n) for n in names} == names


def test_profile_moves_what_select_active_runs_under_its_own_bucket():
    """Token-sparse prefill's select_active is ATen sorts and scatters, which kernel names cannot tell
    apart from other ATen work: the profile moves what runs inside the op (its child ops' self time
    here, its kernels on CUDA) under the op's name, bucket select_rows, and keeps the total."""
    from torch.profiler import ProfilerActivity, profile

    from flashloop_compile.lowering.selection_ops import select_active

    g = torch.Generator().manual_seed(0)
    h1, h2 = torch.randn(1, 64, 16, generator=g), torch.randn(1, 64, 16, generator=g)
    pos = torch.arange(64)[None]
    lens, last = torch.tensor([64]), torch.tensor([-2])
    other = torch.randn(64, 64, generator=g)

    def step():
        torch.sort(other, dim=-1)  # the same ATen op outside select_active stays where it is
        select_active(h1, h2, None, pos, lens, last, None, 0.25, False, 16)

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            step()
    raw = {e.key: (e.self_cpu_time_total, e.count) for e in prof.key_averages() if e.self_cpu_time_total > 0}
    moved = common._attribute_ops(prof.events(), raw, cuda=False)
    assert sum(us for us, _ in moved.values()) == pytest.approx(sum(us for us, _ in raw.values()))
    assert moved["flashloop::select_active"][0] > raw.get("flashloop::select_active", (0.0, 0))[0]
    assert moved["aten::sort"][1] == 2 < raw["aten::sort"][1]  # the two calls outside the op remain
    prof_row = common.kernel_profile(step, step, 2, 1.0)
    assert prof_row["buckets"]["select_rows"]["ms"] > 0


def test_profile_moves_the_kernels_of_select_active_on_cuda():
    """The CUDA path of the same move, on events shaped as torch.profiler's: each CPU op carries the
    kernels it launched (FunctionEvent.kernels), an op nested in another call of itself counts once,
    and a kernel of the same name outside the op stays."""
    from collections import namedtuple

    from torch.autograd import DeviceType

    Kernel = namedtuple("Kernel", ["name", "device", "duration"])

    class Ev:
        def __init__(self, name, kernels=(), children=()):
            self.name = self.key = name
            self.device_type, self.self_cpu_time_total = DeviceType.CPU, 0.0
            self.kernels = [Kernel(n, 0, us) for n, us in kernels]
            self.cpu_children, self.cpu_parent = list(children), None
            for c in self.cpu_children:
                c.cpu_parent = self

    inner = Ev("flashloop::select_active", [("scatter_kernel", 2.0)])
    outer = Ev("flashloop::select_active", children=[Ev("aten::sort", [("sort_kernel", 5.0)]), inner])
    events = [outer, *outer.cpu_children, inner, Ev("aten::sort", [("sort_kernel", 3.0)]), Ev("aten::mm", [("gemm", 10.0)])]
    times = {"sort_kernel": (8.0, 2), "scatter_kernel": (2.0, 1), "gemm": (10.0, 1)}
    assert common._attribute_ops(events, times, cuda=True) == {
        "sort_kernel": (3.0, 1), "gemm": (10.0, 1), "flashloop::select_active": (7.0, 2)}


def test_decode_bench_on_cpu_records_a_profile_of_the_step(tmp_path):
    args = ["--preset", "tiny", "--dtype", "float32", "--shapes", "1x64", "--configs", "sparse+quant",
            "--no-dense-whole", "--profile", "2"]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), *args], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "decode.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r["kind"] == "decode_step"]
    prof = row.get("profile")
    assert prof and "error" not in prof, prof
    assert prof["source"] == "cpu" and prof["replays"] == 2 and prof["ms"] > 0
    buckets = prof["buckets"]
    assert sum(b["ms"] for b in buckets.values()) > 0
    assert all(0 <= b["share"] <= 1 and b["launches"] > 0 for b in buckets.values())
    assert abs(sum(b["share"] for b in buckets.values()) - 1) < 1e-6
    assert {"packed_attn", "write", "GEMM"} <= set(buckets), buckets  # the flashloop ops by name
    parts = {p["part"]: p for p in row["parts"]}
    assert {"projections", "loop 1 attention", "loop 2 selection", "loops 3-4 corrections", "attention as a whole"} <= set(parts)
    assert parts["loop 1 attention"]["ms"] == sum(buckets.get(x, {}).get("ms", 0.0) for x in parts["loop 1 attention"]["buckets"])
    assert all(p["floor_ms"] > 0 for p in parts.values() if p["bytes"] is not None)
    assert row["launches_per_step"] == sum(b["launches"] for b in buckets.values())
    assert 0 < len(prof["top"]) <= 15
    assert "profile sparse+quant 1x64 (cpu" in run.stdout


def test_step_parts_cover_the_step_floor_kv_bytes():
    """The attention parts' K/V bytes add up to the step floor's KV term (the selection's
    probability row aside), for every config; the projections are the decoder layers' weights
    once per loop and lm_head once."""
    model = OuroForCausalLM.from_preset("tiny", dtype=torch.float32, seed=0)
    cfg = model.config
    for name in bench_decode.CONFIGS:
        parts = bench_decode.step_parts(name, 2, 256, cfg, 1000.0, 10.0)
        kv = sum(p["bytes"] for p in parts if p["bytes"] is not None and p["part"] not in ("projections", "loop 2 selection"))
        want = bench_decode.kv_read_bytes(name, 2, 256, cfg, cfg.num_key_value_heads, cfg.head_dim,
                                          cfg.num_hidden_layers, cfg.num_loops)
        assert abs(kv - want) <= 1e-9 * want, (name, kv, want)
        assert parts[0] == {"part": "projections", "buckets": ("GEMM",), "bytes": 1000.0 * cfg.num_loops + 10.0}


def test_gpu_samples_summarize_clock_power_and_throttle_reasons():
    # nvidia-smi's CSV while the decode step's replays run: a capped clock, which slows the timed
    # step but not its kernels' profiled device time, shows here
    text = ("1980, 612.40, 61, 0x0000000000000000\n"
            "1755, 699.80, 63, 0x0000000000000004\n"  # SW power cap
            "1830, 688.00, 63, 0x0000000000000004\n"
            "18")  # cut off at termination
    g = common.parse_gpu_samples(text)
    assert g == {"samples": 3, "sm_mhz_median": 1830.0, "sm_mhz_min": 1755.0, "power_w_median": 688.0,
                 "power_w_max": 699.8, "temp_c_max": 63.0, "event_reasons": "0x4"}
    assert common.parse_gpu_samples("1980, 612.40, 61\n")["event_reasons"] == "0x0"  # older drivers: no reasons
    assert common.parse_gpu_samples("[N/A], [N/A], [N/A], [N/A]\n") is None
    with common.GpuSampler() as s:  # without CUDA / nvidia-smi: nothing sampled, nothing raised
        pass
    assert s.summary is None


def test_decode_bench_isolates_each_config_and_hands_dense_to_the_others(tmp_path):
    # --isolate (the default with CUDA): a process per (shape, config), dense first whatever the
    # order given; the others' rows carry its time as their baseline (a config timed after dense
    # in one process can read 5% slower with the same kernel time)
    args = ["--preset", "tiny", "--dtype", "float32", "--shapes", "1x64", "--configs", "quant,dense",
            "--no-dense-whole", "--isolate"]
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_decode.py"), *args], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "decode.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["kind"] == "decode_step"]
    assert [r["config"] for r in steps] == ["dense", "quant"]
    assert sum(r["kind"] == "copy_bandwidth" for r in rows) == 2  # two processes
    dense, quant = steps
    assert quant["dense_ms"] == {"dense": dense["ms"]}
    assert quant["speedup_vs_dense"] == dense["ms"] / quant["ms"]


def test_generate_plot_from_rows_of_several_runs(tmp_path):
    """plot_generate draws rows appended by several runs (dense and all-on from different
    processes, so no all-on row carries a speedup): the ratios come from the plotted rows,
    lower-is-better for latencies, higher-is-better for throughput; the largest-batch panel only
    where there are its rows."""
    import plot_generate

    def row(config, shape, ttft, tpot, tok_s, **extra):
        return {"kind": "generate", "preset": "tiny", "config": config, "shape": shape, "ttft_ms": ttft, "tpot_ms": tpot,
                "throughput_tok_s": tok_s, "peak_memory_gb": 3.0, "kv_bytes": 1e9, **extra}

    rows = [row("dense", "1x64+8", 100.0, 10.0, 50.0), row("all_on", "1x64+8", 80.0, 12.5, 40.0),
            row("all_on", "1x64+8", 50.0, 8.0, 80.0), row("all_on", "2x64+8", 40.0, 4.0, 10.0)]
    gen = plot_generate._latest(rows, "generate", "shape", "config")
    ttft, tok_s = (lambda r: r["ttft_ms"]), (lambda r: r["throughput_tok_s"])
    assert plot_generate.speedup_over_dense(gen, "1x64+8", "all_on", ttft) == 2.0  # the later all-on row wins
    assert plot_generate.speedup_over_dense(gen, "1x64+8", "all_on", tok_s, higher_is_better=True) == 1.6
    assert plot_generate.speedup_over_dense(gen, "1x64+8", "dense", ttft) is None
    assert plot_generate.speedup_over_dense(gen, "2x64+8", "all_on", ttft) is None  # no dense row of that shape

    png = tmp_path / "generate.png"
    assert plot_generate.plot(rows, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with_batch = rows + [{"kind": "max_batch", "config": "dense", "batch": 5, "context": 32768, "throughput_tok_s": 120.0},
                         {"kind": "max_batch_accounting", "config": "all_on", "max_batch": 28, "context": 32768}]
    assert plot_generate.plot(with_batch, str(tmp_path / "with_batch.png"))
    assert not plot_generate.plot([{"kind": "start"}], str(tmp_path / "none.png"))


def test_generate_plans_the_timed_decode_from_a_compiled_prefill(tmp_path, monkeypatch):
    """The timed run is planned from a probe prefill on the compiled engine, not from the warm-up
    generate's prefill, which includes its compile (100+ s for all-on) and would plan 2 of 256
    tokens with a minute left."""
    import time
    import types

    from flashloop_compile.runtime.engine import GenerationResult
    from flashloop_compile.runtime.memory import KVMemory

    monkeypatch.setattr(common, "OUT", tmp_path)
    bench = bench_generate.Bench(bench_generate.parse_args(
        ["--preset", "tiny", "--dtype", "float32", "--deadline", "60", "--margin-s", "20"]))
    prefills = iter([100.0, 0.5, 0.5])  # the warm-up's (compile), the probe's, the timed one's

    def generate(prompts, n):
        return GenerationResult([[1] * n for _ in prompts], [0.0] * len(prompts), [0.01] * (n - 1), prefill_s=next(prefills))

    def decode(tok, pos):
        time.sleep(0.01)
        return torch.zeros(len(tok), 8)

    engine = types.SimpleNamespace(generate=generate, decode=decode, max_seq=128, num_graphs=1, cuda_graphs=False,
                                   capture_s=0.0, packed=None, memory=lambda: KVMemory(1024, None))
    monkeypatch.setattr(bench, "engine", lambda *a: engine)
    row = {"batch": 1}
    bench._timed_generate("1x64+256", "dense", row)
    assert row["new_tokens"] == 256 and row["probe_prefill_ms"] == 500.0

    assert bench_generate.tokens_that_fit(256, 0.01, 10.0) == 256
    assert bench_generate.tokens_that_fit(256, 0.01, 1.2) == 101  # 1 + 1.2 / (0.01 x SAFETY 1.2)
    assert bench_generate.tokens_that_fit(256, 0.01, -80.0) == 2


def test_snapshot_bench_on_cpu_moves_one_row_exactly_and_counts_its_bytes():
    dense, packed = (bench_snapshot.measure("tiny", torch.float32, name, 192) for name in ("dense", "all_on"))
    assert dense["row_bytes"] == 2 * 4 * 2 * 2 * 192 * 64 * 4  # K and V of R x N sites, H=2, 192 tokens, D=64, fp32
    assert 0 < packed["row_bytes"] <= packed["encoded_bytes"] and dense["row_bytes"] <= dense["encoded_bytes"]


def test_prefill_parts_count_each_configs_work():
    """Dense does every loop's projections over every row and causal attention at every loop;
    token-sparse prefill computes its budgets' rows at loops 3..R with the attention split between
    SDPA (loops 1-2) and the token-sparse kernels; quantization adds the packed write's bytes."""
    model = OuroForCausalLM.from_preset("tiny", dtype=torch.float32, seed=0)
    cfg = model.config
    lin, head = 1000, 10
    b, t = 2, 100
    loops, layers = cfg.num_loops, cfg.num_hidden_layers
    pair = 4 * cfg.head_dim * cfg.num_attention_heads
    dense = {p["part"]: p for p in bench_prefill.prefill_parts("dense", b, t, cfg, lin, head)}
    assert dense["projections"]["flops"] == 2 * b * (lin * t * loops + head * t)
    assert dense["attention, every loop"]["flops"] == b * layers * loops * pair * t * (t + 1) / 2
    assert "packed write, reads, scans" not in dense and "active-row selection" not in dense
    budgets = FlashLoopConfig.all_on().token_sparse_prefill.budgets(t)  # [100, 100, 25, 10]
    for name in ("token_sparse", "all_on"):
        parts = {p["part"]: p for p in bench_prefill.prefill_parts(name, b, t, cfg, lin, head)}
        assert parts["projections"]["flops"] == 2 * b * (lin * sum(budgets) + head * t)
        assert parts["attention, loops 1-2 (causal SDPA)"]["buckets"] == ("sdpa",)
        assert parts["attention, loops 1-2 (causal SDPA)"]["flops"] == b * layers * 2 * pair * t * (t + 1) / 2
        sparse = parts[f"attention, loops 3-{loops} (token-sparse)"]
        assert sparse["flops"] == b * layers * pair * sum(budgets[2:]) * (t + 1) / 2
        assert bench_prefill.useful_flops(list(parts.values())) < bench_prefill.useful_flops(list(dense.values()))
        assert parts["active-row selection"]["buckets"] == ("select_rows",)
    write = {p["part"]: p for p in bench_prefill.prefill_parts("all_on", b, t, cfg, lin, head)}["packed write, reads, scans"]
    row = 2 * b * cfg.num_key_value_heads * cfg.head_dim * layers
    assert write["bytes"] == sum(n * row * (2 + 0.5625 * (1 + d)) for d, n in enumerate(budgets))
    # traced at given positions every site runs one kernel family: one attention part
    pos = {p["part"] for p in bench_prefill.prefill_parts("token_sparse_position", b, t, cfg, lin, head)}
    assert "attention, every loop" in pos


def test_prefill_parts_count_the_kept_rows_keys_where_the_cache_records_them():
    """The token-sparse loops' attention work from the rows they kept (the packed cache's
    depth_count): row p attends to p + 1 keys; rows kept early in the prompt do less work than
    the (t + 1) / 2 a row the bench otherwise assumes."""
    model = OuroForCausalLM.from_preset("tiny", dtype=torch.float32, seed=0)
    cfg = model.config
    t = 8
    dc = torch.tensor([[4, 4, 3, 2, 2, 2, 2, 2]], dtype=torch.uint8)  # loop 3 keeps rows 0-2, loop 4 rows 0-1
    kept = bench_prefill.kept_causal_keys(dc, cfg.num_loops)
    assert kept == [36.0, 36.0, 6.0, 3.0]  # 1 + ... + 8 at the dense loops; 1 + 2 + 3; 1 + 2
    pair = 4 * cfg.head_dim * cfg.num_attention_heads
    parts = {p["part"]: p for p in bench_prefill.prefill_parts("all_on", 1, t, cfg, 1000, 10, kept)}
    sparse = next(p for n, p in parts.items() if n.endswith("(token-sparse)"))
    assert sparse["flops"] == cfg.num_hidden_layers * pair * (6.0 + 3.0)
    assumed = {p["part"]: p for p in bench_prefill.prefill_parts("all_on", 1, t, cfg, 1000, 10)}
    assert assumed["attention, loops 1-2 (causal SDPA)"]["flops"] == parts["attention, loops 1-2 (causal SDPA)"]["flops"]


def test_only_a_configuration_that_writes_the_packed_cache_counts_its_kept_rows():
    """The model's state outlives a configuration: a token-sparse run after an all-on one must not
    read the all-on cache (which it never writes: its depth_count read as no kept rows)."""
    state = types.SimpleNamespace(packed=object())
    assert bench_prefill.written_packed_cache(state, "all_on", 4) is state.packed
    assert bench_prefill.written_packed_cache(state, "kv_quant", 4) is state.packed
    assert bench_prefill.written_packed_cache(state, "token_sparse", 4) is None
    assert bench_prefill.written_packed_cache(state, "dense", 4) is None
    assert bench_prefill.written_packed_cache(None, "all_on", 4) is None


def test_benches_take_the_quality_harness_config_names():
    """A frontier point is timed at the settings its quality was measured at: ``--configs`` takes
    the quality harness's names too; their feature options (never the bench's compilation ones)
    feed the parts' work and floors, and an unknown name is an error that names the choices."""
    model = OuroForCausalLM.from_preset("tiny", dtype=torch.float32, seed=0)
    cfg = model.config
    assert common.config_options("all_on", bench_prefill.CONFIGS) == bench_prefill.CONFIGS["all_on"]
    opts = common.config_options("all-on@retention=1.0/0.1", bench_prefill.CONFIGS, cfg.num_loops)
    assert opts["token_sparse_prefill.retention"] == [1.0, 1.0, 1.0, 0.1]
    assert opts["kv_residual_quantization.enabled"] and opts["sparse_decode_attention.enabled"]
    assert not any(k.startswith("compilation.") for k in opts)
    b, t = 1, 100
    parts = {p["part"]: p for p in bench_prefill.prefill_parts("all-on@retention=1.0/0.1", b, t, cfg, 1000, 10)}
    assert parts["projections"]["flops"] == 2 * b * (1000 * (3 * t + 10) + 10 * t)
    # decode: the key fraction sets the corrections' bytes
    kf = {f: bench_decode.kv_read_bytes(f"sda@key_fraction={f}", 1, 1024, cfg, cfg.num_key_value_heads, cfg.head_dim,
                                        cfg.num_hidden_layers, cfg.num_loops) for f in (0.05, 0.25)}
    assert kf[0.05] < kf[0.25]
    with pytest.raises(SystemExit, match="neither one of .*all_on"):
        common.config_options("al-on", bench_prefill.CONFIGS)


def test_part_table_floors_from_bytes_or_flops():
    parts = [{"part": "projections", "buckets": ("GEMM",), "bytes": None, "flops": 2e12},
             {"part": "write", "buckets": ("write",), "bytes": 3e9, "flops": None},
             {"part": "glue", "buckets": ("inductor",), "bytes": None, "flops": None}]
    prof = {"buckets": {"GEMM": {"ms": 4.0, "launches": 10}, "write": {"ms": 2.0, "launches": 3},
                        "inductor": {"ms": 1.0, "launches": 7}}}
    rows = {r["part"]: r for r in common.part_table(parts, prof, 3000.0, 1000.0, whole="all",
                                                    whole_parts=("projections", "write", "glue"))}
    assert rows["projections"]["floor_ms"] == 2.0 and rows["projections"]["share_of_floor"] == 0.5
    assert rows["write"]["floor_ms"] == 1.0 and rows["write"]["share_of_floor"] == 0.5
    assert rows["glue"]["floor_ms"] is None and rows["glue"]["share_of_floor"] is None
    assert rows["all"]["ms"] == 7.0 and rows["all"]["floor_ms"] == 3.0 and rows["all"]["launches"] == 20


def test_interleaved_times_alternate_the_variants_and_run_each_ones_setup_before_it():
    # an A/B whose variants are timed one block after the other reads an order effect as a
    # difference (bench_packed_prefill --write-against); interleaved, each repeat times A then B
    calls = []
    fns = [lambda: calls.append("a"), lambda: calls.append("b")]
    before = [lambda: calls.append("restore a"), lambda: calls.append("restore b")]
    times = common.interleaved_times(fns, warmup=1, repeat=3, before=before)
    assert [len(t) for t in times] == [3, 3]
    assert calls == ["a", "b"] + ["restore a", "a", "restore b", "b"] * 3


def test_frontier_plot_from_eval_reports(tmp_path):
    """plot_frontier reads `eval --json` reports: the saving is R / sum(retention) (1x with
    token-sparse prefill off), a configuration in a later report replaces the earlier row, and
    --only selects; the PNG is written."""
    import plot_frontier

    def stats(delta):
        return {"ppl": 1.5, "ppl_lo": 1.4, "ppl_hi": 1.6, "bits_per_byte": 0.6, "delta_pct": delta,
                "delta_lo": delta - 0.5, "delta_hi": delta + 0.5}

    def report(rows):
        configs = {"dense": FlashLoopConfig().resolve(4).to_dict(), "all-on": FlashLoopConfig.all_on().resolve(4).to_dict()}
        return {"perplexity": {"1024": {}}, "configs": configs,
                "rows": [{"config": name, "cont@1024": stats(c), "prefill@1024": stats(p)} for name, c, p in rows]}

    first = report([("dense", 0.0, 0.0), ("all-on", 0.2, 2.0)])
    second = report([("all-on", 0.1, 1.5)])
    ctx, points = plot_frontier.frontier_points([first, second])
    assert ctx == "1024" and [p["config"] for p in points] == ["dense", "all-on"]
    assert points[0]["saving"] == 1.0 and points[0]["retention"] is None
    assert points[1]["saving"] == pytest.approx(4 / 2.35) and points[1]["prefill"]["delta_pct"] == 1.5
    assert [p["config"] for p in plot_frontier.frontier_points([first], only=["all-on"])[1]] == ["all-on"]
    with pytest.raises(ValueError, match="no report has rows at context 2048"):
        plot_frontier.frontier_points([first], context="2048")
    (tmp_path / "a.json").write_text(json.dumps(first))
    plot_frontier.main([str(tmp_path / "a.json"), "-o", str(tmp_path / "f.png")])
    assert (tmp_path / "f.png").stat().st_size > 1000
