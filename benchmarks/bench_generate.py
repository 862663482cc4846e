"""End-to-end generation through the engine: dense vs all features on, same process,
both decoding under the engine's CUDA graphs (one graph per engine: its batch is its only bucket).
Both take the backend's default prefill attention (``compilation.position_attention``, the exact
rewrite of the model's masked SDPA): a fresh prompt's dense loops run causal SDPA over its own K/V
(FlashAttention), so dense is the strongest exact dense; ``--no-position-attention`` keeps the
model's masked SDPA.

Part 1, per shape ``BxPROMPT+NEW`` and configuration: an Engine sized for the shape, a warm-up
``generate`` of 2 tokens (compile + capture), a probe ``generate`` of 2 tokens and three decode
steps on its state (the compiled prefill's and a step's time, to plan the timed run against the
deadline), then the timed ``generate`` of NEW tokens for B synthetic prompts of PROMPT
tokens (greedy). Reported: TTFT (the prefill), TPOT (median decode step, host-timed with the
sampling sync, as the engine measures it), throughput (new tokens of the whole batch per second of
the whole generate), peak memory of the timed generate (torch.cuda.max_memory_allocated after a
reset), the engine's KV bytes, the graphs used, and for all-on the speedup over dense of the same
shape (TTFT, TPOT, end to end) plus token agreement (random weights: informative only).

Part 2 (``--max-batch``), per configuration: the largest batch whose KV fits at
``--max-batch-context`` by the accounting (runtime/memory.py max_batch_for: the device memory
minus the weights and ``--reserve-gb``), then verified: an Engine at that batch is allocated, its
caches are filled *synthetically* (a real B x 32K prefill would cost minutes and its logits alone
would not fit): random K/V for PROMPT = context - NEW positions, written like a prefill writes
them (the dense caches directly; the packed cache through ``flashloop.packed_kv_write`` per layer
and depth in position chunks, loops 3..R for nested subsets of the retention fractions, as
token-sparse prefill leaves them), and only decode steps are timed: the first one compiles and
captures, then ``--max-batch-steps`` steps give the step time and the throughput (B / step). If
that batch runs out of memory the next smaller ones are tried (``--max-batch-retries``). Then an
Engine at batch + 1 is allocated (caches only, no compile) to see whether it is refused, next to
what the accounting says it needs.

Work order (``work_order``): every shape, dense then all-on, then the max-batch part per
configuration, last: it needs the most memory and matters least, so it takes neither memory nor
time from the shapes. Each item (a generate, a max-batch attempt, the batch + 1 allocation) runs in
a function of its own, so its engine dies with its locals, and starts from released memory
(``release``); a failure is recorded as text and its exception dropped before that (its traceback's
frames hold the engine and its caches). Each item's row says what was allocated when it started
(``allocated_at_start_gb``; null on the CPU, where torch does not count) and after its caches
(``allocated_after_caches_gb``), its peak, and the peak over the caches per batch row
(``non_cache_peak_per_row_gb``: activations, scratch, CUDA-graph pools). An item that starts more
than 1 GB over the model's own memory prints a WARNING line: an earlier item's memory was kept.

Under ``--deadline`` an item starts only when its estimate fits the time left, else it is recorded
as "skipped" with the estimate and its basis: a generate item from the last completed one of its
configuration (its compile, and its prefill and decode times scaled by the batch's tokens), a
max-batch attempt from the previous attempt of its configuration or twice the decode-graph capture
of its generate items, ``--min-item-s`` while nothing of its configuration has run. Rows go to
$OUT/generate.jsonl (common.record); ``--plot PATH`` draws them (benchmarks/plot_generate.py,
matplotlib; without it the plot is skipped with a message).

    # GPU machine, from the repository root (no install), results under $OUT. One device call of
    # <= 10 min runs what fits, in order; an all-on item compiles for minutes, so what does not fit
    # is recorded as skipped: a second call runs those (their --shapes; --no-max-batch or --shapes '')
    export PYTHONPATH=$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
    timeout 590 python benchmarks/bench_generate.py --deadline 540 > $OUT/generate.log 2>&1
    timeout 590 python benchmarks/bench_generate.py --shapes 1x8192+256,16x8192+256 --no-max-batch \
        --deadline 540 > $OUT/generate2.log 2>&1
    python benchmarks/bench_generate.py --shapes '' --deadline 300          # only the max-batch part
    # CPU smoke run (tiny preset, rewritten graphs run eagerly, budget = weights + 4 dense slots; < 1 min):
    python benchmarks/bench_generate.py --preset tiny --dtype float32 --shapes 1x192+8,2x192+8 --max-batch-context 256
    # afterwards, on the CPU machine (matplotlib installed):
    python benchmarks/plot_generate.py out/generate.jsonl generate.png
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT, Deadline, config_options, device, error_text, record, sync  # noqa: E402

CONFIGS = {
    "dense": {},
    "all_on": {
        "token_sparse_prefill.enabled": True,
        "sparse_decode_attention.enabled": True,
        "kv_residual_quantization.enabled": True,
    },
}
NAME = "generate"
GIB = 2**30
LEAK_GB = 1.0  # an item starting this much over the model's own memory: an earlier item's was kept
SAFETY = 1.2  # on a time estimate taken from one earlier item
# A max-batch attempt's estimate before any attempt of its config ran: on the H200 (2026-11-30)
# the first decode step at the largest batch (compile + capture) took 1.7x (dense) and over 2x
# (all-on, until it ran out of memory) the capture time of the config's 1x32K generate item.
ATTEMPT_VS_CAPTURE = 2.0


def parse_shape(text: str) -> tuple[int, int, int]:
    """'BxPROMPT+NEW' -> (B, PROMPT, NEW)."""
    try:
        b, rest = text.split("x")
        prompt, new = rest.split("+")
        return int(b), int(prompt), int(new)
    except ValueError:
        raise SystemExit(f"--shapes: expected BxPROMPT+NEW (e.g. 4x32768+256), got {text!r}") from None


def round_up(n: int, m: int = 64) -> int:
    return -(-n // m) * m


def _modelled_s(row: dict, new_tokens: int) -> float:
    """Seconds to generate ``new_tokens`` after the prompt as TTFT + (new_tokens - 1) x TPOT."""
    return (row["ttft_ms"] + (new_tokens - 1) * row["tpot_ms"]) / 1e3


def tokens_that_fit(new: int, step_s: float, room_s: float) -> int:
    """How many of ``new`` tokens a timed generate runs in ``room_s`` seconds (after its prefill)
    at ``step_s`` a decode step: all if they fit, else as many as do, never fewer than 2 (one
    decode step is what TPOT needs)."""
    if step_s <= 0 or (new - 1) * step_s * SAFETY <= room_s:
        return new
    return max(2, min(new, 1 + int(room_s / (step_s * SAFETY))))


def work_order(shapes: list[str], configs: list[str], max_batch: bool) -> list[tuple[str, str | None, str]]:
    """(part, shape, config) in run order: every shape, its configs in order (dense first: the
    speedups refer to it), then the max-batch search per config, the most memory-hungry and least
    important part."""
    items: list[tuple[str, str | None, str]] = [("generate", s, n) for s in shapes for n in configs]
    if max_batch:
        items += [("max_batch", None, n) for n in configs]
    return items


def release(model) -> None:
    """Free what earlier items left: Dynamo's compiled code, the model's caches, unreachable cycles
    (e.g. a dropped exception's frames, which hold engines and caches), the allocator's cached
    blocks; and start a new peak."""
    torch._dynamo.reset()
    model.clear_caches()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    reset_peak()


def allocated_gb() -> float | None:
    """Memory the allocator holds in tensors (GB); None on the CPU, where torch does not count it."""
    return torch.cuda.memory_allocated() / 1e9 if torch.cuda.is_available() else None


def peak_gb() -> float | None:
    return torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None


def reset_peak() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


class Bench:
    def __init__(self, args) -> None:
        from flashloop_compile.config import FlashLoopConfig
        from flashloop_compile.models.ouro import OuroForCausalLM

        self.args = args
        self.deadline = Deadline(args.deadline)
        self.dtype = getattr(torch, args.dtype)
        self.model = OuroForCausalLM.from_preset(args.preset, dtype=self.dtype, device=device(), seed=args.seed).eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.model_gb = allocated_gb()  # weights and the model's own buffers: what every item starts from
        self.inner = args.inner if args.inner != "auto" else ("inductor" if device() == "cuda" else "eager")
        self.configs = {
            n: FlashLoopConfig.from_dict({**config_options(n, CONFIGS, self.model.config.num_loops),
                                          "compilation.outline_layers": args.outline,
                                          "compilation.position_attention": args.position_attention,
                                          **json.loads(args.options)})
            for n in args.configs.split(",")
        }
        self.done: dict[tuple, dict] = {}  # (shape, config) -> row (and its tokens), for the speedups and estimates
        self.attempt_s: dict[str, float] = {}  # config -> seconds of its last max-batch attempt

    # -- helpers ----------------------------------------------------------------------------------
    def engine(self, name: str, batch: int, max_seq: int, new_tokens: int, row: dict):
        """An Engine whose only CUDA-graph bucket is ``batch`` (every decode step replays one
        graph); ``row`` gets what is allocated once its caches are."""
        from flashloop_compile.backend import make_backend
        from flashloop_compile.runtime.engine import Engine

        cfg = self.configs[name]
        engine = Engine(self.model, cfg, max_batch=batch, max_seq=max_seq, max_new_tokens=new_tokens, batch_buckets=(batch,),
                        backend=make_backend(cfg, inner=self.inner))
        row["allocated_after_caches_gb"] = allocated_gb()
        return engine

    def base(self, name: str) -> dict:
        cfg = self.configs[name]
        return {"preset": self.args.preset, "dtype": self.args.dtype, "config": name, "config_hash": cfg.hash(),
                "options": cfg.to_dict(), "inner": self.inner, "outline": self.args.outline}

    def run_item(self, row: dict, fn, need_s: float, basis: str) -> dict:
        """One work item: ``fn(row)`` fills ``row``, which is recorded and returned.

        Skipped (a "skipped" row) when the estimate ``need_s`` (from ``basis``) and --margin-s do
        not fit the time left. Otherwise it starts from released memory; a failure keeps what
        ``fn`` measured before it, with the peak and the error, recorded as text: the exception is
        dropped with the except block, before the next item's release."""
        left = self.deadline.left()
        if need_s + self.args.margin_s > left:
            skipped = {**row, "kind": "skipped", "reason": f"deadline: needs ~{need_s:.0f} s ({basis}), {left:.0f} s left"}
            record(NAME, skipped)
            return skipped
        release(self.model)
        row["allocated_at_start_gb"] = start = allocated_gb()
        if start is not None and start > self.model_gb + LEAK_GB:
            print(f"WARNING: {row['kind']} {row['config']} batch {row['batch']} starts with {start:.2f} GB allocated, "
                  f"{start - self.model_gb:.2f} GB over the model's own: an earlier item's memory was not released",
                  flush=True)
        t0 = time.perf_counter()
        try:
            fn(row)
        except torch.cuda.OutOfMemoryError as e:
            # a generate item keeps its kind "oom": plot_generate reads "generate" rows as complete
            row.update(kind="oom" if row["kind"] == "generate" else row["kind"], oom=True, error=str(e)[:400])
        except Exception as e:  # one broken item must not cost the rest of the run
            row.update(kind="error", error=error_text(e))
        row["item_s"] = time.perf_counter() - t0
        row.setdefault("peak_memory_gb", peak_gb())
        after = row.get("allocated_after_caches_gb")
        if after is not None and row["peak_memory_gb"] is not None:
            row["non_cache_peak_gb"] = row["peak_memory_gb"] - after
            row["non_cache_peak_per_row_gb"] = row["non_cache_peak_gb"] / row["batch"]
        record(NAME, row)
        return row

    def last_generate(self, name: str) -> dict | None:
        """The row of the config's last completed generate item."""
        rows = [d["row"] for (_, n), d in self.done.items() if n == name]
        return rows[-1] if rows else None

    # -- part 1: end-to-end generation ------------------------------------------------------------
    def generate(self, shape: str, name: str) -> None:
        """The generate item of ``shape`` and config ``name``, if its estimate fits the deadline."""
        row = {"kind": "generate", **self.base(name), "part": "generate", "shape": shape, "batch": parse_shape(shape)[0]}
        self.run_item(row, functools.partial(self._timed_generate, shape, name), *self.generate_need_s(shape, name))

    def generate_need_s(self, shape: str, name: str) -> tuple[float, str]:
        """A generate item's estimate and its basis: the config's last completed item's compile
        (its warm-up less its prefill), three prefills and 4 + NEW decode steps scaled by the
        batch's tokens (a step never below the measured one: every step reads the weights);
        --min-item-s before any."""
        last = self.last_generate(name)
        if last is None:
            return self.args.min_item_s, "--min-item-s: nothing of this config ran yet"
        b, prompt, new = parse_shape(shape)
        scale = b * (prompt + new) / (last["batch"] * (last["prompt"] + last["new_tokens"]))
        compile_s = max(0.0, last["warmup_s"] - last["ttft_ms"] / 1e3)
        prefills_s = 3 * last["ttft_ms"] / 1e3 * scale  # the warm-up's, the probe's, the timed one
        steps_s = (4 + new) * last["tpot_ms"] / 1e3 * max(scale, 1.0)
        return (SAFETY * (compile_s + prefills_s + steps_s),
                f"from {last['shape']}: compile {compile_s:.0f} s, prefills {prefills_s:.0f} s, decode {steps_s:.0f} s")

    def _timed_generate(self, shape: str, name: str, row: dict) -> None:
        from flashloop_compile.cli import _synthetic_prompt

        b, prompt, new = parse_shape(shape)
        vocab = self.model.config.vocab_size
        prompts = [_synthetic_prompt(vocab, prompt, self.args.seed + i) for i in range(b)]
        engine = self.engine(name, b, round_up(prompt + new), new, row)
        sync()
        t0 = time.perf_counter()
        engine.generate(prompts, 2)  # compile (prefill + decode) and capture
        sync()
        warmup_s = time.perf_counter() - t0
        # probes on the compiled engine, to fit the timed run in the deadline: a prefill (the
        # warm-up's includes its compile, 100+ s for all-on, and would plan too few tokens), then
        # decode steps on its state
        warm = engine.generate(prompts, 2)
        tok = torch.tensor([t[-1] for t in warm.tokens], device=device())
        pos = torch.full((b,), prompt + 1, device=device())
        probe = []
        for _ in range(max(0, min(3, new - 3))):
            sync()
            t1 = time.perf_counter()
            tok = engine.decode(tok, pos).argmax(-1)
            sync()
            probe.append(time.perf_counter() - t1)
            pos = pos + 1
        step_est = max(probe) if probe else (max(warm.token_latency_s) if warm.token_latency_s else 0.0)
        n_new = tokens_that_fit(new, step_est, self.deadline.left() - self.args.margin_s - warm.prefill_s)
        reset_peak()
        sync()
        t0 = time.perf_counter()
        result = engine.generate(prompts, n_new)
        sync()
        total_s = time.perf_counter() - t0
        mem = engine.memory()
        lat = sorted(result.token_latency_s)
        generated = sum(len(t) for t in result.tokens)
        row.update({
            "prompt": prompt, "new_tokens": n_new, "new_tokens_asked": new, "max_seq": engine.max_seq,
            "ttft_ms": result.prefill_s * 1e3, "tpot_ms": result.tpot_s * 1e3,
            "tpot_p10_ms": lat[len(lat) // 10] * 1e3 if lat else None,
            "tpot_p90_ms": lat[(9 * len(lat)) // 10] * 1e3 if lat else None,
            "decode_mean_ms": statistics.fmean(lat) * 1e3 if lat else None,
            "probe_step_ms": [x * 1e3 for x in probe], "probe_prefill_ms": warm.prefill_s * 1e3,
            "total_s": total_s, "generated_tokens": generated, "throughput_tok_s": generated / total_s,
            "decode_tok_s": b / result.tpot_s if lat else None,
            "peak_memory_gb": peak_gb(), "kv_bytes": mem.bytes, "kv_dense_bytes": mem.dense_bytes,
            "kv_ratio": mem.ratio, "kv_packed": mem.packed,
            "graphs": engine.num_graphs, "cuda_graphs": engine.cuda_graphs and engine.num_graphs > 0,
            "capture_s": engine.capture_s, "warmup_s": warmup_s, "weights_gb": self.weight_bytes / 1e9,
        })
        dense = self.done.get((shape, "dense"))
        if name != "dense" and dense is not None:
            d = dense["row"]
            row["speedup_vs_dense"] = {
                "ttft": d["ttft_ms"] / row["ttft_ms"], "tpot": d["tpot_ms"] / row["tpot_ms"],
                "end_to_end": d["total_s"] / total_s if d["new_tokens"] == n_new else None,
                # TTFT + (asked - 1) x TPOT on both sides: the asked generation's time when the
                # deadline cut this item's (or dense's) decode short
                "end_to_end_model": _modelled_s(d, new) / _modelled_s(row, new),
                "throughput": row["throughput_tok_s"] / d["throughput_tok_s"],
                "kv_bytes": d["kv_bytes"] / row["kv_bytes"],
            }
            pairs = [(x, y) for a, c in zip(dense["tokens"], result.tokens) for x, y in zip(a, c)]
            row["agreement_with_dense"] = sum(x == y for x, y in pairs) / max(len(pairs), 1)
        self.done[(shape, name)] = {"row": row, "tokens": result.tokens}

    def summary(self) -> None:
        """One line per timed generation (the rows are in $OUT/generate.jsonl)."""
        for (shape, name), done in self.done.items():
            r = done["row"]
            sp = r.get("speedup_vs_dense") or {}
            e2e = f"  vs dense: e2e {sp['end_to_end']:.2f}x, TPOT {sp['tpot']:.2f}x" if sp.get("end_to_end") else ""
            if sp and not sp.get("end_to_end"):
                e2e = (f"  vs dense: e2e (TTFT + {r['new_tokens_asked'] - 1} TPOT) {sp['end_to_end_model']:.2f}x, "
                       f"TPOT {sp['tpot']:.2f}x ({r['new_tokens']} of {r['new_tokens_asked']} tokens run)")
            print(f"{shape:>14} {name:>7}: TTFT {r['ttft_ms']:9.1f} ms  TPOT {r['tpot_ms']:8.2f} ms  "
                  f"{r['throughput_tok_s']:9.1f} tok/s  KV {r['kv_bytes'] / GIB:7.2f} GiB{e2e}", flush=True)

    # -- part 2: the largest batch at a long context ----------------------------------------------
    def budget(self) -> tuple[float, float]:
        """(budget, reserve) in bytes: the device's memory (or --budget-gb), --reserve-gb. On the
        CPU (smoke runs) the weights plus 4 dense slots, no reserve."""
        a = self.args
        if a.budget_gb is not None:
            return a.budget_gb * GIB, a.reserve_gb * GIB
        if torch.cuda.is_available():
            return float(torch.cuda.mem_get_info()[1]), a.reserve_gb * GIB
        from flashloop_compile.config import FlashLoopConfig
        from flashloop_compile.runtime.memory import kv_memory

        slot = kv_memory(self.model.config, FlashLoopConfig(), 1, a.max_batch_context).bytes
        return float(self.weight_bytes + 4 * slot), 0.0

    def max_batch(self, name: str) -> None:
        """The accounted batch, then attempts descending from it until one decodes, then batch + 1
        allocated; each attempt an item of its own."""
        from flashloop_compile.runtime.memory import kv_memory, max_batch_for

        a, cfg, mcfg = self.args, self.configs[name], self.model.config
        context, new = a.max_batch_context, a.max_batch_new_tokens
        budget, reserve = self.budget()
        one = kv_memory(mcfg, cfg, 1, context, max_new_tokens=new)
        per_slot = one.bytes + one.scratch  # KV and decode scratch, as max_batch_for counts
        accounted = max_batch_for(mcfg, cfg, context, budget, weight_bytes=self.weight_bytes, max_new_tokens=new,
                                  reserve_bytes=reserve)
        what = {**self.base(name), "part": "max_batch", "context": context, "new_tokens": new}
        record(NAME, {
            "kind": "max_batch_accounting", **what, "max_batch": accounted, "budget_gib": budget / GIB,
            "reserve_gib": reserve / GIB, "weights_gib": self.weight_bytes / GIB, "kv_per_slot_gib": one.bytes / GIB,
            "scratch_per_slot_gib": one.scratch / GIB,
            "need_next_gib": (self.weight_bytes + reserve + (accounted + 1) * per_slot) / GIB,
        })
        if accounted < 1:
            record(NAME, {"kind": "max_batch", **what, "batch": 0, "error": "not even one slot fits the budget"})
            return
        batch = accounted
        for _ in range(a.max_batch_retries + 1):
            need, basis = self.attempt_need_s(name)
            row = {"kind": "max_batch", **what, "batch": batch, "accounted_batch": accounted, "oom": False}
            outcome = self.run_item(row, functools.partial(self._decode_at, name, batch), need, basis)
            if "item_s" in outcome:
                self.attempt_s[name] = outcome["item_s"]
            if outcome["kind"] == "max_batch" and not outcome["oom"]:
                need_next = self.weight_bytes + reserve + (batch + 1) * per_slot
                row = {"kind": "max_batch_next", **what, "batch": batch + 1, "accounted_batch": accounted,
                       "accounting_need_gib": need_next / GIB, "budget_gib": budget / GIB,
                       "exceeds_budget": need_next > budget, "allocated": False}
                self.run_item(row, functools.partial(self._allocate_only, name, batch + 1), 0.0, "allocation only")
                return
            if not outcome.get("oom") or batch == 1:
                return
            batch = max(1, batch - max(1, round(0.1 * batch)))

    def attempt_need_s(self, name: str) -> tuple[float, str]:
        """A max-batch attempt's estimate and its basis: the longer of the config's previous
        attempt and ATTEMPT_VS_CAPTURE x its last generate item's decode capture; --min-item-s
        before either."""
        last = self.last_generate(name)
        from_capture = ATTEMPT_VS_CAPTURE * last["capture_s"] if last is not None else None
        previous = self.attempt_s.get(name)
        if from_capture is None and previous is None:
            return self.args.min_item_s, "--min-item-s: nothing of this config ran yet"
        need = max(x for x in (from_capture, previous) if x is not None)
        return SAFETY * need, f"previous attempt {previous or 0:.0f} s, {ATTEMPT_VS_CAPTURE:g} x capture {from_capture or 0:.0f} s"

    def _decode_at(self, name: str, batch: int, row: dict) -> None:
        """Caches at ``batch``, filled synthetically, then decode steps timed; ``row`` gets each
        stage's time as it passes (an attempt that runs out of memory shows where)."""
        a = self.args
        context, new = a.max_batch_context, a.max_batch_new_tokens
        prompt = context - new
        engine = self.engine(name, batch, context, new, row)
        t0 = time.perf_counter()
        fill_synthetic(engine, prompt, a.fill_chunk, a.seed)
        sync()
        row.update(prompt=prompt, fill="synthetic", fill_s=time.perf_counter() - t0)
        g = torch.Generator().manual_seed(a.seed)
        tok = torch.randint(0, self.model.config.vocab_size, (batch,), generator=g).to(device())
        pos = torch.full((batch,), prompt, device=device())
        t0 = time.perf_counter()
        tok = engine.decode(tok, pos).argmax(-1)  # compile + capture
        sync()
        row["first_step_s"] = time.perf_counter() - t0
        pos = pos + 1
        steps = min(a.max_batch_steps, new - 2)
        times = []
        for _ in range(steps):
            if times and not self.deadline.allows(a.margin_s):
                break
            t1 = time.perf_counter()
            tok = engine.decode(tok, pos).argmax(-1)
            tok.tolist()  # the host sync a generation step has (sampling)
            times.append(time.perf_counter() - t1)
            pos = pos + 1
        if engine.packed is not None:
            engine.packed.check_overflow()
        mem = engine.memory()
        step = statistics.median(times) if times else float("nan")
        row.update({
            "steps": len(times), "step_ms": step * 1e3,
            "step_mean_ms": statistics.fmean(times) * 1e3 if times else None,
            "throughput_tok_s": batch / step if times else None,
            "kv_bytes": mem.bytes, "kv_ratio": mem.ratio, "kv_packed": mem.packed,
            "peak_memory_gb": peak_gb(), "graphs": engine.num_graphs,
        })

    def _allocate_only(self, name: str, batch: int, row: dict) -> None:
        """An Engine's caches at ``batch``, no compile, no forward (they stay on the model until the
        next item's release)."""
        self.engine(name, batch, self.args.max_batch_context, self.args.max_batch_new_tokens, row)
        row["allocated"] = True
        if torch.cuda.is_available():
            free, _ = torch.cuda.mem_get_info()
            row.update(allocated_gb=torch.cuda.memory_allocated() / 1e9, free_after_gib=free / GIB)


def fill_synthetic(engine, prompt: int, chunk: int, seed: int) -> None:
    """Random K/V at positions 0..prompt-1 of every slot, stored as a prefill stores them.

    Dense caches: written directly. Packed cache: ``packed_kv_write`` per layer and depth, in
    position chunks (depth by depth within a chunk, as the loops run), loops 3..R only for the
    tokens a token-sparse prefill keeps: nested sets of ceil(retention * prompt) tokens (one fixed
    random ranking), so the residual rows match what the cache was sized for."""
    model, dev = engine.model, engine.device
    g = torch.Generator(device=dev).manual_seed(seed)
    for cache in model.model.kv_caches:
        if cache.has_storage:
            for buf in (cache.k_cache, cache.v_cache):
                buf[:, :, :prompt].normal_(generator=g)
    packed = engine.packed
    if packed is None:
        return
    from flashloop_compile.lowering.packed_ops import packed_kv_write

    packed.reset()
    cfg, tsp = model.config, engine.config.token_sparse_prefill
    b, h, d_head, loops = packed.max_batch, packed.kv_heads, packed.head_dim, packed.num_loops
    retention = tsp.retention if tsp.enabled else (1.0,) * loops
    rank = torch.empty(prompt, dtype=torch.long, device=dev)
    rank[torch.randperm(prompt, generator=g, device=dev)] = torch.arange(prompt, device=dev)
    keep = [rank < math.ceil(r * prompt) for r in retention]  # nested: one ranking, non-increasing fractions
    for start in range(0, prompt, chunk):
        end = min(start + chunk, prompt)
        pos = torch.arange(start, end, device=dev)
        k = torch.randn(b, h, end - start, d_head, generator=g, device=dev, dtype=packed.dtype)
        v = torch.randn(b, h, end - start, d_head, generator=g, device=dev, dtype=packed.dtype)
        per_depth = []
        for depth in range(loops):
            sel = keep[depth][start:end]
            if bool(sel.all()):
                per_depth.append((k, v, pos[None].expand(b, -1).contiguous()))
            else:
                idx = sel.nonzero().flatten()
                per_depth.append((k[:, :, idx].contiguous(), v[:, :, idx].contiguous(), pos[idx][None].expand(b, -1).contiguous()))
        for layer in range(cfg.num_hidden_layers):
            for depth, (kd, vd, pd) in enumerate(per_depth):
                if pd.shape[1]:
                    packed_kv_write(packed, layer, kd, vd, pd, depth)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--dtype", default="bfloat16", help="float32 for CPU smoke runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shapes", default="1x32768+256,4x32768+256,1x8192+256,16x8192+256",
                    help="BxPROMPT+NEW, comma-separated, in priority order ('' for none)")
    ap.add_argument("--configs", default="dense,all_on",
                    help=f"of {sorted(CONFIGS)} or quality-harness names (all-on@retention=1.0/0.1); dense first "
                         "(speedups refer to it)")
    ap.add_argument("--outline", action=argparse.BooleanOptionalAction, default=True,
                    help="compile each distinct layer once (compilation.outline_layers)")
    ap.add_argument("--options", default="{}", help="JSON object of FlashLoopConfig flat keys laid over every config "
                    "(e.g. '{\"compilation.fuse_projections\": false}' for an A/B of one option)")
    ap.add_argument("--position-attention", action=argparse.BooleanOptionalAction, default=None,
                    help="compilation.position_attention in every config, dense included: the fastest exact prefill "
                         "attention (causal SDPA for a fresh prompt, flashloop.position_attention at given positions); "
                         "default: wherever it applies; --position-attention: required; --no-position-attention: the "
                         "model's own masked SDPA (dense 1x32K prefill 3343 ms, benchmarks/RESULTS.md)")
    ap.add_argument("--inner", choices=["auto", "inductor", "eager"], default="auto",
                    help="compile the rewritten graph with inductor, or run it eagerly; auto: inductor on CUDA, eager on the CPU")
    ap.add_argument("--max-batch", action=argparse.BooleanOptionalAction, default=True,
                    help="the largest batch at --max-batch-context: accounting, then allocation and decode")
    ap.add_argument("--max-batch-context", type=int, default=32768, help="positions per slot (a multiple of 64)")
    ap.add_argument("--max-batch-new-tokens", type=int, default=256)
    ap.add_argument("--max-batch-steps", type=int, default=16, help="timed decode steps at the largest batch")
    ap.add_argument("--max-batch-retries", type=int, default=2, help="smaller batches to try when the accounted one runs out of memory")
    ap.add_argument("--budget-gb", type=float, default=None, help="GiB for weights + KV + reserve (default: the device's memory)")
    ap.add_argument("--reserve-gb", type=float, default=8.0, help="GiB kept for activations (decode scratch is counted per request)")
    ap.add_argument("--fill-chunk", type=int, default=4096, help="positions per packed write of the synthetic fill")
    ap.add_argument("--deadline", type=float, default=540)
    ap.add_argument("--min-item-s", type=float, default=90,
                    help="seconds an item is estimated to need while nothing of its config has run")
    ap.add_argument("--margin-s", type=float, default=20, help="seconds kept free at the end of the timed runs")
    ap.add_argument("--plot", help="PNG of the results (benchmarks/plot_generate.py; needs matplotlib)")
    args = ap.parse_args(argv)
    if not device() == "cuda":
        args.min_item_s = min(args.min_item_s, 5)
        args.margin_s = min(args.margin_s, 2)
    if 2 * args.max_batch_new_tokens > args.max_batch_context:
        args.max_batch_new_tokens = max(2, args.max_batch_context // 8)
        print(f"--max-batch-new-tokens: at most half of --max-batch-context; using {args.max_batch_new_tokens}", flush=True)
    return args


def main() -> None:
    args = parse_args()
    bench = Bench(args)
    names = list(bench.configs)
    shapes = [s for s in args.shapes.split(",") if s.strip()]
    for s in shapes:
        parse_shape(s)
    record(NAME, {"kind": "start", "preset": args.preset, "args": vars(args), "inner": bench.inner,
                  "weights_gb": bench.weight_bytes / 1e9, "model_allocated_gb": bench.model_gb})
    for part, shape, name in work_order(shapes, names, args.max_batch):
        if part == "generate":
            bench.generate(shape, name)
        else:
            bench.max_batch(name)
    bench.summary()
    if args.plot:
        from plot_generate import plot, read_rows

        plot(read_rows(OUT / f"{NAME}.jsonl"), args.plot)
    print("done", flush=True)


if __name__ == "__main__":
    main()
