"""``flashloop-compile``: generate, inspect, memory, bench, export, train, eval, redundancy, calibrate.

``flashloop-compile generate`` is the project's main job: the checkpoint shipped with the
repository (a small looped LM trained on Python source, byte tokens) continues a piece of
Python, dense and with FlashLoop, side by side, with their token agreement, KV bytes and time.

Errors print their message and exit with status 1 (``--debug`` shows the traceback); long work
(compiles, CUDA-graph captures, benchmark items) shows a progress bar on a terminal (``--quiet``
turns it off).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Sequence

import torch

from flashloop_compile import __version__
from flashloop_compile.config import FlashLoopConfig

# The trained checkpoint, found relative to the repository this package is imported from (a
# source checkout or the README's editable install: `pip install -e .`); it is not package data.
DEFAULT_CHECKPOINT = Path(__file__).resolve().parents[1] / "checkpoints" / "ouro-python-6x256"

# The main job's prompt: Python the checkpoint has not seen verbatim, in the style it was trained on.
DEFAULT_PROMPT = '''import os


def find_python_files(root):
    """Return the sorted paths of the Python files under root."""
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
'''

_FEATURES = ("token_sparse_prefill", "sparse_decode_attention", "kv_residual_quantization")


class CLIError(Exception):
    """Bad command-line input: the message says what to change."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


# -- model source, dtype and device (the same flags and defaults in every subcommand) ----------------

def _device(args: argparse.Namespace) -> str:
    if getattr(args, "meta", False):
        return "meta"
    return ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device


def _dtype(args: argparse.Namespace) -> torch.dtype:
    """``auto``: float32 for the quality commands (they measure numerics) and on CPU (faster there
    than BF16), bfloat16 on CUDA; ``memory`` plans a BF16 deployment."""
    if args.dtype != "auto":
        return getattr(torch, args.dtype)
    if args.command == "memory":
        return torch.bfloat16
    if args.command in ("eval", "redundancy", "calibrate") or _device(args) in ("cpu", "meta"):
        return torch.float32
    return torch.bfloat16


def _source(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(checkpoint directory, preset name): exactly one is set."""
    if args.preset:
        return None, args.preset
    if args.checkpoint:
        return args.checkpoint, None
    if args.default_source == "checkpoint":
        if not (DEFAULT_CHECKPOINT / "config.json").is_file():
            raise CLIError(
                f"the default checkpoint is not at {DEFAULT_CHECKPOINT}: it ships with the repository "
                "(checkpoints/ouro-python-6x256) and is found from a source checkout or an editable install "
                "(pip install -e .); pass --checkpoint DIR or --preset tiny"
            )
        return str(DEFAULT_CHECKPOINT), None
    return None, args.default_source


def _model_name(args: argparse.Namespace) -> str:
    checkpoint, preset = _source(args)
    if preset:
        return preset
    return "ouro-python-6x256 (shipped checkpoint)" if Path(checkpoint) == DEFAULT_CHECKPOINT else checkpoint


def _load_model(args: argparse.Namespace):
    from flashloop_compile.models.ouro import OuroForCausalLM

    checkpoint, preset = _source(args)
    dtype, device = _dtype(args), _device(args)
    if checkpoint:
        model = OuroForCausalLM.from_pretrained(checkpoint, dtype=dtype, device=device)
    else:
        model = OuroForCausalLM.from_preset(preset, dtype=dtype, device=device, seed=args.seed)
    return model.eval()


def _model_config(args: argparse.Namespace):
    """The model's shape without loading weights."""
    from flashloop_compile.models.ouro import PRESETS, ModelConfigError, OuroConfig

    checkpoint, preset = _source(args)
    if preset:
        if preset not in PRESETS:
            raise ModelConfigError(f"unknown preset {preset!r}: choose one of {sorted(PRESETS)}")
        return PRESETS[preset]
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        raise CLIError(f"{path} not found: --checkpoint needs an HF model directory (config.json + safetensors)")
    try:
        return OuroConfig.from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise CLIError(f"{path} is not valid JSON: {e}") from None


def _read_options(text: str, flag: str = "--options") -> FlashLoopConfig:
    """A flat FlashLoopConfig dict given inline as JSON or as the path of a JSON file (such as the
    one ``calibrate --out`` writes)."""
    source, where = text, "the inline JSON"
    if not text.lstrip().startswith("{"):
        path = Path(text)
        if not path.is_file():
            raise CLIError(f"{flag} {text!r} is neither a JSON object nor a file: give a flat JSON dict "
                           "('{\"kv_residual_quantization.enabled\": true}') or the path of one (calibrate --out writes one)")
        source, where = path.read_text(), str(path)
    try:
        data = json.loads(source)
    except json.JSONDecodeError as e:
        raise CLIError(f"{flag}: {where} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CLIError(f"{flag}: {where} holds a {type(data).__name__}, not a flat JSON dict of FlashLoop options")
    return FlashLoopConfig.from_dict(data)


def _config(args: argparse.Namespace, default_all_on: bool) -> FlashLoopConfig:
    if args.options:
        return _read_options(args.options)
    return FlashLoopConfig.all_on() if default_all_on else FlashLoopConfig()


def _features(config: FlashLoopConfig) -> str:
    return " + ".join(g for g in _FEATURES if getattr(config, g).enabled) or "all features off (dense)"


def _check_positions(what: str, length: int, limit: int) -> None:
    if length > limit:
        raise CLIError(f"{what} is {length} positions, past the model's max_position_embeddings={limit}: shorten it")


def _synthetic_prompt(vocab: int, length: int, seed: int) -> torch.Tensor:
    """A prompt with repeated spans (so attention has something to find), seeded."""
    g = torch.Generator().manual_seed(seed)
    span = torch.randint(0, vocab, (max(length // 4, 1),), generator=g)
    return torch.cat([span.repeat(4), torch.randint(0, vocab, (length,), generator=g)])[:length]


# -- generate ----------------------------------------------------------------------------------------------

def _printable(text: str) -> str:
    """Control characters (other than newlines) made visible; tabs as four spaces."""
    return "".join(c if c == "\n" or c.isprintable() else "\N{MIDDLE DOT}" for c in text.replace("\t", "    "))


def _text(tokenizer, ids) -> str:
    return _printable(tokenizer.decode(ids).decode("utf-8", errors="replace"))


def _side_by_side(left: tuple[str, str], right: tuple[str, str], width: int) -> list[str]:
    """Two titled texts in columns, each line hard-wrapped to the column (code keeps its spaces)."""
    col = max(20, (width - 3) // 2)

    def wrapped(text: str) -> list[str]:
        out = []
        for line in text.split("\n"):
            out += [line[i : i + col] for i in range(0, max(len(line), 1), col)]
        return out

    a, b = wrapped(left[1]), wrapped(right[1])
    rows = [f"{left[0]:<{col}} | {right[0]}", f"{'-' * col} | {'-' * col}"]
    rows += [f"{x:<{col}} | {y}".rstrip() for x, y in zip(a + [""] * (len(b) - len(a)), b + [""] * (len(a) - len(b)))]
    return rows


def _prompt_ids(args: argparse.Namespace, model, tokenizer) -> tuple[torch.Tensor, str]:
    if args.prompt_len is not None:
        ids = _synthetic_prompt(model.config.vocab_size, args.prompt_len, args.seed)
        return ids, f"{args.prompt_len} synthetic tokens (seed {args.seed})"
    text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
    if not text:
        raise CLIError("--prompt is empty: give some text to continue")
    ids = torch.tensor(tokenizer.encode(text, bos=True), dtype=torch.long)
    return ids, f"{len(text.encode())} bytes of text, {len(ids)} tokens"


def cmd_generate(args: argparse.Namespace) -> int:
    from flashloop_compile.quality.corpus import ByteTokenizer

    model = _load_model(args)
    config = _config(args, default_all_on=True).resolve(model.config.num_loops)
    tokenizer = ByteTokenizer(model.config.vocab_size)
    prompt, described = _prompt_ids(args, model, tokenizer)
    _check_positions(f"the prompt ({len(prompt)} tokens) + --new-tokens {args.new_tokens}",
                     len(prompt) + args.new_tokens, model.config.max_position_embeddings)
    dtype, device = _dtype(args), _device(args)
    print(f"model: {_model_name(args)}: {model.config.num_hidden_layers} layers x {model.config.num_loops} loops, "
          f"{str(dtype).removeprefix('torch.')} on {device}")
    if args.preset:
        print(f"note: --preset {args.preset} has random, untrained weights: its text is noise and its agreement "
              "with dense means nothing (drop --preset for the trained checkpoint)")
    print(f"flashloop: {_features(config)}  ({config})")
    print(f"prompt: {described}; {args.new_tokens} new tokens, greedy")
    if args.prompt_len is None:
        print("".join(f"  > {line}\n" for line in _text(tokenizer, prompt).rstrip("\n").split("\n")), end="")
    if args.engine == "compiled":
        runs = _generate_compiled(args, model, config, prompt)
    else:
        runs = _generate_reference(args, model, config, prompt)
    width = shutil.get_terminal_size((100, 24)).columns
    (d_name, d), (f_name, f) = runs.items()
    print()
    for row in _side_by_side((f"{d_name} ({d['seconds']:.1f} s)", _text(tokenizer, d["tokens"])),
                             (f"{f_name} ({f['seconds']:.1f} s)", _text(tokenizer, f["tokens"])), min(width, 120)):
        print(row)
    print()
    same = sum(a == b for a, b in zip(d["tokens"], f["tokens"]))
    prefix = next((i for i, (a, b) in enumerate(zip(d["tokens"], f["tokens"])) if a != b), len(d["tokens"]))
    print(f"agreement with dense: {same}/{len(d['tokens'])} tokens, identical prefix {prefix}"
          + ("  (random weights: meaningless)" if args.preset else ""))
    print(f"KV bytes: {d_name} {d['kv']}; {f_name} {f['kv']}; ratio {d['kv_total'] / max(f['kv_total'], 1):.2f}x")
    if args.engine == "compiled":
        print(f"time: {d_name} {d['seconds']:.1f} s, {f_name} {f['seconds']:.1f} s (compiled engine, compile excluded)")
    else:
        print(f"time: {d_name} {d['seconds']:.1f} s, {f_name} {f['seconds']:.1f} s (the reference engine: the explicit "
              "eager FlashLoop shows what it computes, not its speed; --engine compiled times the compiled path)")
    return 0


def _generate_reference(args, model, config, prompt) -> dict[str, dict]:
    """Dense and FlashLoop through the explicit eager reference (no compile: quick on CPU)."""
    from flashloop_compile.reference import ReferenceFlashLoop
    from flashloop_compile.runtime.progress import Progress

    runs = {}
    for name, cfg in (("dense", FlashLoopConfig()), ("flashloop", config)):
        req = ReferenceFlashLoop(model, cfg).request()
        with Progress(args.new_tokens, f"{name}: generating", enabled=None if not args.quiet else False,
                      leave=False, unit="token") as bar:
            t0 = time.perf_counter()
            tok = req.prefill(prompt.to(model.lm_head.weight.device)).logits[-1].argmax()
            tokens = [int(tok)]
            bar.advance()
            for _ in range(args.new_tokens - 1):
                tok = req.decode(tok[None]).logits[-1].argmax()
                tokens.append(int(tok))
                bar.advance()
            seconds = time.perf_counter() - t0
        b = req.store.nbytes()
        kv = f"{b.total:,}" if name == "dense" else (
            f"{b.total:,} (payload {b.payload:,}, min/scale {b.params:,}, maps {b.maps:,}, tail {b.tail:,})")
        runs[name] = {"tokens": tokens, "seconds": seconds, "kv": kv, "kv_total": b.total}
    return runs


def _generate_compiled(args, model, config, prompt) -> dict[str, dict]:
    """Dense and FlashLoop through the compiled engine (backend='flashloop'), the same prompts."""
    from flashloop_compile.runtime.engine import Engine

    prompts = [prompt[: max(1, len(prompt) - 7 * i)] for i in range(args.batch)]
    max_seq = min(-(-(len(prompt) + args.new_tokens) // 64) * 64 + 64, model.config.max_position_embeddings)
    runs = {}
    for name, cfg in (("dense", FlashLoopConfig()), ("flashloop", config)):
        torch._dynamo.reset()
        engine = Engine(model, cfg, max_batch=args.batch, max_seq=max_seq, max_new_tokens=args.new_tokens,
                        progress=False if args.quiet else None)
        engine.warm_up(len(prompt), args.batch)  # compile and capture outside the timing
        t0 = time.perf_counter()
        result = engine.generate(prompts, args.new_tokens)
        seconds = time.perf_counter() - t0
        toks = sum(len(t) for t in result.tokens)
        print(f"{name:>9}: TTFT {result.prefill_s * 1e3:.1f} ms, TPOT {result.tpot_s * 1e3:.2f} ms, {toks / seconds:.1f} tokens/s")
        mem = engine.memory()
        runs[name] = {"tokens": result.tokens[0], "seconds": seconds, "kv": f"{mem.bytes:,}", "kv_total": mem.bytes}
    return runs


# -- memory ------------------------------------------------------------------------------------------------

def _gib(n: float) -> str:
    return f"{n / 2**30:.3f} GiB"


def _kv_lines(km, dtype: torch.dtype) -> list[str]:
    """KV accounting in words: the packed cache is 'smaller' or 'larger' than the dense one."""
    name = str(dtype).removeprefix("torch.")
    out = [f"dense {name} KV: {_gib(km.dense_bytes)}"]
    if km.packed:
        p = km.packed
        ratio = km.dense_bytes / p["total"]
        size = f"{ratio:.2f}x smaller" if ratio >= 1 else f"{1 / ratio:.2f}x larger"
        out.append(f"packed KV: {_gib(p['total'])} (payload {_gib(p['payload'])}, min/scale {_gib(p['params'])}, "
                   f"maps {p['maps'] / 2**20:.1f} MiB, tails {p['tails'] / 2**20:.1f} MiB): {size} than dense")
    if km.scratch:
        out.append(f"decode scratch (one layer's working buffers, not cache): {km.scratch / 2**20:.1f} MiB")
    return out


def cmd_memory(args: argparse.Namespace) -> int:
    """KV bytes per request and the largest batch that fits, dense vs each configuration."""
    from flashloop_compile.runtime.memory import kv_memory, max_batch_for

    mcfg = _model_config(args)
    _check_positions(f"--context {args.context} + --new-tokens {args.new_tokens}", args.context + args.new_tokens,
                     mcfg.max_position_embeddings)
    dtype = _dtype(args)
    elem = torch.finfo(dtype).bits // 8
    n_params = (
        mcfg.vocab_size * mcfg.hidden_size * (1 if mcfg.tie_word_embeddings else 2)
        + mcfg.num_hidden_layers * (
            mcfg.hidden_size * mcfg.head_dim * (2 * mcfg.num_attention_heads + 2 * mcfg.num_key_value_heads)
            + 3 * mcfg.hidden_size * mcfg.intermediate_size + 4 * mcfg.hidden_size
        )
    )
    weights = n_params * elem
    budget, reserve = args.budget_gb * 2**30, args.reserve_gb * 2**30
    if budget < weights + reserve:
        raise CLIError(f"--budget-gb {args.budget_gb} leaves nothing for the KV cache: the weights take "
                       f"{weights / 2**30:.2f} GiB and --reserve-gb {args.reserve_gb}; give a larger budget or a smaller reserve")
    configs = {"dense": FlashLoopConfig(), "quant": FlashLoopConfig.from_switches(False, False, True),
               "all_on": FlashLoopConfig.all_on()}
    if args.options:
        configs["options"] = _config(args, default_all_on=True)
    name = str(dtype).removeprefix("torch.")
    print(f"{'config':>8} {'KV/request GiB':>15} {'ratio':>6} {'max batch':>10} {'scratch/request GiB':>20}   (context {args.context}, "
          f"{args.new_tokens} new tokens, budget {args.budget_gb} GiB, {name} weights {weights / 2**30:.2f} GiB, reserve {args.reserve_gb} GiB)")
    too_big = []
    for cname, cfg in configs.items():
        km = kv_memory(mcfg, cfg, 1, args.context, max_new_tokens=args.new_tokens, dtype=dtype)
        mb = max_batch_for(mcfg, cfg, args.context, budget, weight_bytes=weights, max_new_tokens=args.new_tokens,
                           reserve_bytes=reserve)
        print(f"{cname:>8} {km.bytes / 2**30:>15.3f} {km.ratio:>6.2f} {mb:>10} {km.scratch / 2**30:>20.3f}")
        if mb == 0:
            too_big.append(f"{cname} needs {(km.bytes + km.scratch) / 2**30:.3f} GiB per request")
    if too_big:
        print(f"max batch 0: {'; '.join(too_big)}, but only {(budget - weights - reserve) / 2**30:.3f} GiB is left "
              "after the weights and the reserve")
    return 0


# -- bench -------------------------------------------------------------------------------------------------

def cmd_bench(args: argparse.Namespace) -> int:
    """Prefill / decode / end-to-end grid through the engine: dense, each feature, all on."""
    from flashloop_compile.backend import make_backend
    from flashloop_compile.runtime.engine import Engine
    from flashloop_compile.runtime.progress import Progress

    grid = {
        "dense": {}, "token_sparse": {"token_sparse_prefill.enabled": True},
        "sparse_decode": {"sparse_decode_attention.enabled": True}, "quant": {"kv_residual_quantization.enabled": True},
        "all_on": {f"{g}.enabled": True for g in _FEATURES},
    }
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in grid]
    if unknown or not names:
        raise CLIError(f"--configs: unknown {unknown or 'empty list'}; choose from {', '.join(grid)}")
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
        batches = [int(b) for b in args.batches.split(",")]
    except ValueError:
        raise CLIError(f"--contexts and --batches take comma-separated integers, got {args.contexts!r} and {args.batches!r}") from None
    if min(contexts) < 1 or min(batches) < 1:
        raise CLIError("--contexts and --batches must be positive")
    model = _load_model(args)
    limit = model.config.max_position_embeddings
    for context in contexts:
        _check_positions(f"--contexts {context} + --new-tokens {args.new_tokens} (rounded up to whole 64s)",
                         -(-(context + args.new_tokens) // 64) * 64 + 64, limit)
    rows = []
    items = [(c, b, n) for c in contexts for b in batches for n in names]
    with Progress(len(items), "bench", enabled=False if args.quiet else None, eta=True, unit="item") as bar:
        for context, batch, name in items:
            cfg = FlashLoopConfig.from_dict({**grid[name], "compilation.outline_layers": args.outline,
                                             "compilation.position_attention": args.position_attention})
            prompts = [_synthetic_prompt(model.config.vocab_size, context, args.seed + i) for i in range(batch)]
            max_seq = -(-(context + args.new_tokens) // 64) * 64 + 64
            torch._dynamo.reset()
            engine = Engine(model, cfg, max_batch=batch, max_seq=max_seq, max_new_tokens=args.new_tokens,
                            backend=make_backend(cfg, inner=args.inner), progress=False if args.quiet else None)
            bar.stage(f"{name} ctx {context} b {batch}: compiling")
            engine.warm_up(context, batch)
            bar.stage(f"{name} ctx {context} b {batch}: timing {args.new_tokens} tokens")
            if model.lm_head.weight.is_cuda:
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            result = engine.generate(prompts, args.new_tokens)
            seconds = time.perf_counter() - t0
            mem = engine.memory()
            row = {
                "config": name, "config_hash": cfg.hash(), "options": cfg.to_dict(),
                "context": context, "batch": batch, "new_tokens": args.new_tokens,
                "ttft_ms": result.prefill_s * 1e3, "tpot_ms": result.tpot_s * 1e3,
                "throughput_tok_s": sum(len(t) for t in result.tokens) / seconds,
                "kv_bytes": mem.bytes, "kv_ratio": mem.ratio, "graphs": result.graphs,
                "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9 if model.lm_head.weight.is_cuda else None,
            }
            rows.append(row)
            bar.write(f"{name:>13} ctx {context:>6} b {batch:>3}: TTFT {row['ttft_ms']:8.1f} ms  TPOT {row['tpot_ms']:7.2f} ms  "
                      f"{row['throughput_tok_s']:8.1f} tok/s  KV {mem.bytes / 2**20:9.1f} MiB ({mem.ratio:.2f}x)")
            bar.advance()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.plot:
        _plot(rows, args.plot)
    return 0


def _plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path} (pip install -e '.[plot]')")
        return
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(15, 4))
    for name in dict.fromkeys(r["config"] for r in rows):
        sel = [r for r in rows if r["config"] == name and r["batch"] == rows[0]["batch"]]
        ctx = [r["context"] for r in sel]
        a1.plot(ctx, [r["ttft_ms"] for r in sel], marker="o", label=name)
        a2.plot(ctx, [r["tpot_ms"] for r in sel], marker="o", label=name)
        a3.plot(ctx, [r["kv_bytes"] / 2**20 for r in sel], marker="o", label=name)
    for ax, title in ((a1, "prefill (TTFT) ms"), (a2, "decode TPOT ms"), (a3, "KV cache MiB")):
        ax.set_xlabel("context")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    print(f"wrote {path}")


# -- inspect -----------------------------------------------------------------------------------------------

def capture_graphs(model, batch: int, prompt_len: int, max_seq: int) -> dict[str, "torch.fx.GraphModule"]:
    """Dynamo graphs of a prefill (batch x prompt_len) and a decode step (batch x 1)."""
    captured: dict[str, torch.fx.GraphModule] = {}

    def grab(name):
        def backend(gm, example_inputs):
            captured[name] = gm
            return gm.forward

        return backend

    device = model.lm_head.weight.device
    model.setup_caches(batch, max_seq)
    ids = torch.zeros(batch, prompt_len, dtype=torch.long, device=device)
    pos = torch.arange(prompt_len, device=device)[None].expand(batch, -1)
    with torch.no_grad():
        for name, (i, p) in {"prefill": (ids, pos), "decode": (ids[:, :1], pos[:, -1:] + 1)}.items():
            torch._dynamo.reset()
            torch.compile(model, backend=grab(name), dynamic=False, fullgraph=True)(i, p)
    torch._dynamo.reset()
    return captured


def cmd_inspect(args: argparse.Namespace) -> int:
    from flashloop_compile.backend import pass_manager
    from flashloop_compile.passes import recognize
    from flashloop_compile.runtime.memory import kv_memory

    if args.meta is None:  # trace on the meta device for the large presets (no weights allocated)
        args.meta = bool(args.preset and args.preset != "tiny")
    mcfg = _model_config(args)
    _check_positions(f"--max-seq {args.max_seq}", args.max_seq, mcfg.max_position_embeddings)
    if args.prompt_len >= args.max_seq:
        raise CLIError(f"--prompt-len {args.prompt_len} must be below --max-seq {args.max_seq} (the decode step follows it)")
    model = _load_model(args)
    config = _config(args, default_all_on=True).resolve(model.config.num_loops)
    dtype = _dtype(args)
    print(f"model: {_model_name(args)}, {str(dtype).removeprefix('torch.')} on {_device(args)}; flashloop: {config}")
    for line in _kv_lines(kv_memory(model.config, config, args.batch, args.max_seq, dtype=dtype), dtype):
        print(f"KV cache (batch {args.batch} x {args.max_seq} positions): {line}")
    manager = pass_manager(config)
    for phase, gm in capture_graphs(model, args.batch, args.prompt_len, args.max_seq).items():
        structure = recognize(gm)
        print(f"\n== {phase} graph (batch {args.batch}, {args.prompt_len if phase == 'prefill' else 1} tokens) ==")
        print(structure.summary(), end="")
        print("rewrites:")
        for line in manager.plan(structure) or ["none (all features off)"]:
            print(f"  {line}")
    return 0


# -- export ------------------------------------------------------------------------------------------------

def cmd_export(args: argparse.Namespace) -> int:
    """The compiled prefill and decode programs in one AOTInductor package (flashloop_compile.export)."""
    from flashloop_compile.exporter import export
    from flashloop_compile.runtime.engine import BATCH_BUCKETS

    if not args.out.endswith(".pt2"):
        raise CLIError(f"--out {args.out!r}: the package path must end in .pt2")
    mcfg = _model_config(args)
    _check_positions(f"--max-seq {args.max_seq}", args.max_seq, mcfg.max_position_embeddings)
    buckets = _ints(args.batch_buckets) if args.batch_buckets else BATCH_BUCKETS
    model = _load_model(args)
    config = _config(args, default_all_on=True)
    print(f"model: {_model_name(args)}, {str(_dtype(args)).removeprefix('torch.')} on {_device(args)}; flashloop: {_features(config)}")
    print(f"exporting prefill (prompts {args.min_prompt}..{args.max_seq} tokens, batch {args.max_batch}) and decode "
          f"(batch buckets {[b for b in buckets if b <= args.max_batch] or [args.max_batch]}): torch.export + AOTInductor "
          "compile every program (minutes)")
    t0 = time.perf_counter()
    path = export(model, config, args.out, max_batch=args.max_batch, max_seq=args.max_seq, max_new_tokens=args.max_new_tokens,
                  min_prompt=args.min_prompt, batch_buckets=buckets)
    print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.1f} s; "
          f"load it with flashloop_compile.load_exported({str(path)!r})")
    return 0


# -- parser and entry point ----------------------------------------------------------------------------------

def _common(top_level: bool) -> argparse.ArgumentParser:
    """--debug / --quiet, accepted before and after the subcommand."""
    p = argparse.ArgumentParser(add_help=False)
    default = False if top_level else argparse.SUPPRESS
    p.add_argument("--debug", action="store_true", default=default, help="on an error, show the full traceback")
    p.add_argument("-q", "--quiet", action="store_true", default=default, help="no progress bars")
    return p


def model_args(sp: argparse.ArgumentParser, default_source: str = "tiny", options: bool = True) -> None:
    """The model source, dtype and device flags; the same defaults in every subcommand."""
    src = sp.add_mutually_exclusive_group()
    if default_source == "checkpoint":
        preset_help = "random-init (untrained) model shape: tiny, ouro-1.4b, ouro-2.6b (default: the shipped checkpoint)"
        ckpt_help = f"HF-layout model directory (config.json + safetensors); default {DEFAULT_CHECKPOINT}"
    else:
        preset_help = f"random-init (untrained) model shape: tiny, ouro-1.4b, ouro-2.6b (default {default_source})"
        ckpt_help = "HF-layout model directory (config.json + safetensors)"
    src.add_argument("--preset", help=preset_help)
    src.add_argument("--checkpoint", help=ckpt_help)
    sp.set_defaults(default_source=default_source)
    sp.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="auto (default): float32 on CPU, bfloat16 on CUDA; float32 for eval / redundancy / calibrate; "
                         "bfloat16 for memory")
    sp.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda when available)")
    sp.add_argument("--seed", type=int, default=0, help="random weights of a preset, synthetic prompts")
    if options:
        sp.add_argument("--options", help="FlashLoopConfig as a flat JSON dict, inline or a file such as calibrate --out "
                                          "writes (default: every feature on)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashloop-compile", description=__doc__.split("\n\n")[1].replace("\n", " "),
                                parents=[_common(True)])
    p.add_argument("--version", action="version", version=f"flashloop-compile {__version__} (torch {torch.__version__})")
    sub = p.add_subparsers(dest="command", required=True, metavar="command")
    common = _common(False)

    g = sub.add_parser("generate", parents=[common],
                       help="dense vs FlashLoop greedy generation, side by side (default: the shipped checkpoint)")
    model_args(g, default_source="checkpoint")
    text = g.add_mutually_exclusive_group()
    text.add_argument("--prompt", help="text to continue (default: a piece of Python)")
    text.add_argument("--prompt-len", type=_positive_int, help="a synthetic prompt of this many random tokens instead of text")
    g.add_argument("--new-tokens", type=_positive_int, default=20)
    g.add_argument("--engine", choices=["reference", "compiled"], default="reference",
                   help="reference (default): the explicit eager FlashLoop, no compile; compiled: backend='flashloop' "
                        "(+ CUDA graphs on a GPU), compiled first (minutes on CPU)")
    g.add_argument("--batch", type=_positive_int, default=1, help="prompts per batch (compiled engine)")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("memory", parents=[common],
                       help="KV bytes per request and the largest batch that fits a budget, per configuration")
    model_args(m, default_source="ouro-1.4b")
    m.add_argument("--context", type=_positive_int, default=32768)
    m.add_argument("--new-tokens", type=_positive_int, default=256)
    m.add_argument("--budget-gb", type=_positive_float, default=139.0)
    m.add_argument("--reserve-gb", type=float, default=8.0, help="activations (decode scratch is counted per request)")
    m.set_defaults(func=cmd_memory)

    b = sub.add_parser("bench", parents=[common],
                       help="prefill / decode / end-to-end grid: dense, each feature, all on (same run)")
    model_args(b, options=False)
    b.add_argument("--configs", default="dense,token_sparse,sparse_decode,quant,all_on")
    b.add_argument("--contexts", default="192,320")
    b.add_argument("--batches", default="1,2")
    b.add_argument("--new-tokens", type=_positive_int, default=16)
    b.add_argument("--inner", choices=["inductor", "eager"], default="inductor",
                   help="compile the rewritten graph with inductor, or run it eagerly (quick CPU runs)")
    b.add_argument("--outline", action=argparse.BooleanOptionalAction, default=True, help="compile each distinct layer once")
    b.add_argument("--position-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="compilation.position_attention in every config, dense included: the fastest exact prefill "
                        "attention (causal SDPA for a fresh prompt, flashloop.position_attention at given positions); "
                        "default: wherever it applies; --position-attention: required; --no-position-attention: the "
                        "model's masked SDPA")
    b.add_argument("--json")
    b.add_argument("--plot", help="PNG of TTFT, TPOT and KV memory against context")
    b.set_defaults(func=cmd_bench)

    i = sub.add_parser("inspect", parents=[common],
                       help="print the recognized loop structure and the rewrites each enabled feature makes")
    model_args(i)
    i.add_argument("--batch", type=_positive_int, default=2)
    i.add_argument("--prompt-len", type=_positive_int, default=16)
    i.add_argument("--max-seq", type=_positive_int, default=128)
    i.add_argument("--meta", action=argparse.BooleanOptionalAction, default=None,
                   help="trace on the meta device (no weights allocated; default for the presets other than tiny)")
    i.set_defaults(func=cmd_inspect)

    x = sub.add_parser("export", parents=[common],
                       help="the compiled prefill and decode programs, weights and config in one AOTInductor .pt2 package")
    model_args(x, default_source="checkpoint")
    x.add_argument("--out", required=True, help="the package to write (a .pt2 file)")
    x.add_argument("--max-batch", type=_positive_int, default=1, help="cache slots: the prefill batch and the largest decode bucket")
    x.add_argument("--max-seq", type=_positive_int, default=1024, help="positions per slot: the longest prompt + new tokens")
    x.add_argument("--max-new-tokens", type=_positive_int, default=None,
                   help="sizes the packed cache's residual rows as the engine does (default: every position)")
    x.add_argument("--min-prompt", type=_positive_int, default=2, help="the shortest prompt the prefill programs serve")
    x.add_argument("--batch-buckets", help="decode batch buckets, comma-separated (default: the engine's 1,2,4,8,16,32 up to --max-batch)")
    x.set_defaults(func=cmd_export)
    _add_quality_commands(sub, common)
    return p


def _error_message(e: BaseException) -> str:
    """The message alone for input errors; the exception's type too for anything else. A backend
    error raised inside torch.compile is reported as itself, without Dynamo's wrapper."""
    inner = getattr(e, "inner_exception", None)  # torch._dynamo.exc.BackendCompilerFailed
    if isinstance(inner, Exception):
        e = inner
    if isinstance(e, (CLIError, ValueError, TypeError, FileNotFoundError)) or type(e).__module__.startswith("flashloop_compile"):
        return str(e)
    return f"{type(e).__name__}: {e}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if args.debug:
            raise
        print(f"flashloop-compile {args.command}: error: {_error_message(e)}", file=sys.stderr)
        print("(run with --debug for the traceback)", file=sys.stderr)
        return 1


# -- quality: train, eval, redundancy, calibrate (flashloop_compile/quality; docs/QUALITY.md) -------------


def _quality_device(name: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def _quality_model(args: argparse.Namespace):
    return _load_model(args), _model_name(args)


def _quality_corpus(args: argparse.Namespace):
    from flashloop_compile.quality.corpus import Corpus

    kw = {"heldout_percent": args.heldout_percent, "valid_percent": getattr(args, "valid_percent", 3),
          "packages": tuple(getattr(args, "packages", None) or ())}
    return Corpus(root=args.corpus_root, **kw) if args.corpus_root else Corpus(**kw)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _write_outputs(args: argparse.Namespace, payload: dict, markdown: str) -> None:
    print(markdown)
    if getattr(args, "json", None):
        from pathlib import Path

        Path(args.json).write_text(json.dumps(payload, indent=1, sort_keys=True, default=str) + "\n")
        print(f"wrote {args.json}")
    if getattr(args, "markdown", None):
        from pathlib import Path

        Path(args.markdown).write_text(markdown + "\n")
        print(f"wrote {args.markdown}")


def _train_command(args: argparse.Namespace) -> str:
    """The canonical command line of a parsed ``train`` call: every option spelled out, so the
    recorded command reproduces the run even if defaults change."""
    import shlex

    parts = ["python3", "-m", "flashloop_compile.cli", "train"]
    for key, value in vars(args).items():
        if key in ("func", "command", "debug", "quiet", "default_source") or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, (list, tuple)):
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, str(value)]
    return " ".join(shlex.quote(p) for p in parts)


def cmd_train(args: argparse.Namespace) -> int:
    from flashloop_compile.quality.train import TrainConfig, train

    cfg = TrainConfig(
        layers=args.layers, hidden=args.hidden, head_dim=args.head_dim, intermediate=args.intermediate,
        seq_len=args.seq_len, batch=args.batch, lr=args.lr, warmup_steps=args.warmup, aux_weight=args.aux_weight,
        dropout=args.dropout, valid_percent=args.valid_percent, select_best=args.select_best, save_dtype=args.save_dtype,
        seconds=args.seconds, max_steps=args.max_steps, call_steps=args.call_steps, log_every=args.log_every,
        eval_every=args.eval_every,
        seed=args.seed, heldout_percent=args.heldout_percent, compile=args.compile, device=_quality_device(args.device),
        corpus_max_docs=args.max_docs, corpus_max_doc_bytes=args.max_doc_bytes,
        corpus_packages=tuple(args.packages or ()), retrieval_fraction=args.retrieval_fraction,
        retrieval_pairs=args.retrieval_pairs, resumable=args.resumable or args.resume is not None,
        state_cap_mib=args.state_cap_mib,
    )
    args.resumable = cfg.resumable  # recorded as it runs: a resumed run is resumable
    train(cfg, args.out, corpus=_quality_corpus(args), command=_train_command(args),
          log=lambda m: print(m, flush=True), resume=args.resume)
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from flashloop_compile.quality.evaluate import EvalSettings, parse_configs, quality_table

    model, name = _quality_model(args)
    configs = parse_configs(args.configs, model.config.num_loops)
    settings = EvalSettings(
        docs=args.docs, contexts=_ints(args.contexts), continuation=args.continuation,
        retrieval_context=args.retrieval_context, depths=_floats(args.depths), retrieval_trials=args.trials,
        n_boot=args.n_boot, seed=args.seed, split=args.split, agreement_docs=args.agreement_docs,
        multi_needles=args.multi_needles,
    )
    title = f"Quality vs dense: {name}"

    def save_partial(rep) -> None:  # keep what is done if the run is cut short
        from pathlib import Path

        if args.json:
            Path(args.json).write_text(json.dumps(rep.to_json(), indent=1, sort_keys=True, default=str) + "\n")
        if args.markdown:
            Path(args.markdown).write_text(rep.to_markdown(title + " (partial)") + "\n")

    report = quality_table(model, configs, settings, corpus=_quality_corpus(args), model_name=name,
                           retrieval=args.trials > 0 and bool(settings.depths), max_seconds=args.max_seconds,
                           progress=lambda m: print(m, flush=True), on_config=save_partial, engine=args.engine)
    _write_outputs(args, report.to_json(), report.to_markdown(title))
    return 0


def cmd_redundancy(args: argparse.Namespace) -> int:
    from flashloop_compile.quality.corpus import ByteTokenizer
    from flashloop_compile.quality.redundancy import redundancy_report, report_markdown

    model, name = _quality_model(args)
    seqs = _quality_corpus(args).sequences(args.split, args.seqs, args.seq_len, ByteTokenizer(model.config.vocab_size))
    report = redundancy_report(model, seqs, retention=_floats(args.retention), key_fraction=args.key_fraction,
                               group_size=args.group_size)
    report["model"] = name
    _write_outputs(args, report, report_markdown(report, f"Redundancy report: {name} ({args.split} split, {args.seqs} x {args.seq_len} tokens)"))
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from flashloop_compile.quality.calibrate import calibrate
    from flashloop_compile.quality.corpus import ByteTokenizer

    model, name = _quality_model(args)
    base = _read_options(args.base, "--base") if args.base else FlashLoopConfig.all_on()
    seqs = _quality_corpus(args).sequences(args.split, args.seqs, args.seq_len, ByteTokenizer(model.config.vocab_size))
    result = calibrate(model, seqs, args.threshold, base=base, per_loop_key_fraction=args.per_loop_key_fraction,
                       strict=args.strict)
    payload = result.to_json()
    payload["model"] = name
    if args.out:
        Path(args.out).write_text(json.dumps(result.config.to_dict(), indent=2, sort_keys=True) + "\n")
        print(f"wrote {args.out} (flat FlashLoopConfig: --options / FlashLoopConfig.from_dict)")
    _write_outputs(args, payload, result.to_markdown())
    return 0


def _add_quality_commands(sub, common: argparse.ArgumentParser) -> None:
    def source(sp: argparse.ArgumentParser) -> None:
        model_args(sp, default_source="tiny", options=False)

    def corpus(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--corpus-root", help="directory of *.py documents (default: this interpreter's stdlib)")
        sp.add_argument("--heldout-percent", type=int, default=5)

    def outputs(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--json", help="write the full results as JSON here")
        sp.add_argument("--markdown", help="write the markdown tables here")

    t = sub.add_parser("train", parents=[common], help="train a small Ouro model from scratch on the stdlib source (byte level)")
    t.add_argument("--out", required=True, help="checkpoint directory (HF layout + train_log.txt + command.txt)")
    t.add_argument("--seconds", type=float, default=300.0,
                   help="training time budget (the LR schedule spans it; with --resumable: this call's wall budget only)")
    t.add_argument("--max-steps", type=int, default=None,
                   help="step budget (required with --resumable / --resume: the LR schedule spans it across calls)")
    t.add_argument("--call-steps", type=int, default=None,
                   help="stop this call after this many steps (a per-call budget like --seconds; the schedule spans --max-steps)")
    t.add_argument("--resumable", action=argparse.BooleanOptionalAction, default=False,
                   help="also write train_state.json + train_state-*.safetensors (BF16 weights and AdamW moments) to --out")
    t.add_argument("--resume", default=None, metavar="DIR",
                   help="continue the run a --resumable call wrote to DIR (same options except --seconds, --call-steps, "
                        "--log-every, --eval-every, --device, --state-cap-mib)")
    t.add_argument("--state-cap-mib", type=float, default=48.0,
                   help="refuse to start a resumable run whose state (shards + model.safetensors) would exceed this")
    t.add_argument("--layers", type=int, default=6)
    t.add_argument("--hidden", type=int, default=256)
    t.add_argument("--head-dim", type=int, default=64)
    t.add_argument("--intermediate", type=int, default=None, help="MLP width (default 3 x hidden)")
    t.add_argument("--seq-len", type=int, default=1024)
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--lr", type=float, default=2e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--aux-weight", type=float, default=0.3, help="weight of the earlier loops' mean cross-entropy")
    t.add_argument("--dropout", type=float, default=0.1, help="residual dropout while training")
    t.add_argument("--valid-percent", type=int, default=3, help="share of files (by path hash) for checkpoint selection")
    t.add_argument("--select-best", action=argparse.BooleanOptionalAction, default=True,
                   help="save the weights with the best valid bits/byte (else the last step's)")
    t.add_argument("--log-every", type=int, default=25)
    t.add_argument("--eval-every", type=int, default=100, help="valid bits/byte every this many steps (a multiple of --log-every)")
    t.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False, help="torch.compile the loss")
    t.add_argument("--save-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="dtype of the saved weights (the model is evaluated as saved)")
    t.add_argument("--device", default="auto")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--max-docs", type=int, default=None, help="use only the first N train documents (tests)")
    t.add_argument("--max-doc-bytes", type=int, default=None, help="truncate every document (tests)")
    t.add_argument("--packages", nargs="*", default=None,
                   help="installed packages whose Python sources join the stdlib corpus (e.g. torch triton sympy)")
    t.add_argument("--retrieval-fraction", type=float, default=0.0,
                   help="share of the training bytes that are synthetic needle documents (key-value lines, asked again)")
    t.add_argument("--retrieval-pairs", type=int, default=4, help="needles per synthetic retrieval document")
    corpus(t)
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", parents=[common], help="held-out perplexity and needle retrieval per FlashLoop config vs dense, with CIs")
    source(e)
    corpus(e)
    e.add_argument("--configs", nargs="+", default=["default"],
                   help="set names (default, combos, sweep, full), names like all-on@retention=0.5/0.25@keep_last, or .json files")
    e.add_argument("--docs", type=int, default=16, help="held-out documents per context length")
    e.add_argument("--packages", nargs="*", default=None,
                   help="installed packages whose held-out Python files join the stdlib's (as the model was trained)")
    e.add_argument("--contexts", default="1024,2048", help="context lengths (tokens), comma-separated")
    e.add_argument("--continuation", type=int, default=32, help="scored tokens after each context (<= 64 keeps one decode call exact)")
    e.add_argument("--retrieval-context", type=int, default=1024)
    e.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths (needle start / context)")
    e.add_argument("--trials", type=int, default=8, help="retrieval prompts per depth (0: no retrieval)")
    e.add_argument("--multi-needles", type=int, default=0,
                   help="also retrieval prompts with this many needles (one asked, the others distractors with "
                        "other keys), as their own table (0: none)")
    e.add_argument("--n-boot", type=int, default=1000)
    e.add_argument("--max-seconds", type=float, default=None, help="skip the configs that would not finish within this budget")
    e.add_argument("--split", default="heldout", choices=["heldout", "train"])
    e.add_argument("--engine", default="reference", choices=["reference", "compiled"],
                   help="reference: the explicit reference (any device, slow); compiled: the production path, each "
                        "config's compiled engine (the kernels users run; on CPU the Triton interpreter)")
    e.add_argument("--agreement-docs", type=int, default=2,
                   help="with --engine compiled: documents per context also run on the reference, for the table of "
                        "compiled-vs-reference logits (token agreement, logit error; 0: none)")
    outputs(e)
    e.set_defaults(func=cmd_eval)

    r = sub.add_parser("redundancy", parents=[common], help="the paper's redundancy findings measured on a model (dense trajectory)")
    source(r)
    corpus(r)
    r.add_argument("--seqs", type=int, default=8)
    r.add_argument("--seq-len", type=int, default=1024)
    r.add_argument("--split", default="heldout", choices=["heldout", "train"])
    r.add_argument("--retention", default="0.25,0.10", help="top-k fractions for coverage and nestedness")
    r.add_argument("--key-fraction", type=float, default=0.10)
    r.add_argument("--group-size", type=int, default=64)
    outputs(r)
    r.set_defaults(func=cmd_redundancy)

    c = sub.add_parser("calibrate", parents=[common], help="derive retention and key fraction from calibration sequences and an error threshold")
    source(c)
    corpus(c)
    c.add_argument("--seqs", type=int, default=16)
    c.add_argument("--seq-len", type=int, default=1024)
    c.add_argument("--split", default="train", choices=["heldout", "train"])
    c.add_argument("--threshold", type=float, default=0.05)
    c.add_argument("--base", help="base FlashLoopConfig as a flat JSON dict, inline or a file (default: every feature on)")
    c.add_argument("--per-loop-key-fraction", action="store_true")
    c.add_argument("--strict", action="store_true", help="raise retentions until the end-to-end state error is below the threshold too")
    c.add_argument("--out", help="write the calibrated FlashLoopConfig (flat dict) here")
    outputs(c)
    c.set_defaults(func=cmd_calibrate)


if __name__ == "__main__":
    sys.exit(main())
