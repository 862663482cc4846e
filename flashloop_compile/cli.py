"""``flashloop-compile``: generate, inspect, memory, bench, train, eval, redundancy, calibrate.

``flashloop-compile generate --preset tiny`` is the project's main job on its embedded default:
it runs dense and FlashLoop on a synthetic prompt and prints the tokens, their agreement and the
KV bytes of each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Sequence

import torch

from flashloop_compile.config import FlashLoopConfig


def _load_model(args: argparse.Namespace):
    from flashloop_compile.models.ouro import OuroForCausalLM

    dtype = getattr(torch, args.dtype)
    if args.checkpoint:
        return OuroForCausalLM.from_pretrained(args.checkpoint, dtype=dtype, device=args.device)
    return OuroForCausalLM.from_preset(args.preset, dtype=dtype, device=args.device, seed=args.seed)


def _config(args: argparse.Namespace, default_all_on: bool) -> FlashLoopConfig:
    if args.options:
        return FlashLoopConfig.from_dict(json.loads(args.options))
    return FlashLoopConfig.all_on() if default_all_on else FlashLoopConfig()


def _synthetic_prompt(vocab: int, length: int, seed: int) -> torch.Tensor:
    """A prompt with repeated spans (so attention has something to find), seeded."""
    g = torch.Generator().manual_seed(seed)
    span = torch.randint(0, vocab, (max(length // 4, 1),), generator=g)
    return torch.cat([span.repeat(4), torch.randint(0, vocab, (length,), generator=g)])[:length]


def cmd_generate(args: argparse.Namespace) -> int:
    if args.engine == "compiled":
        return _generate_compiled(args)
    from flashloop_compile.reference import ReferenceFlashLoop

    model = _load_model(args).eval()
    config = _config(args, default_all_on=True).resolve(model.config.num_loops)
    prompt = _synthetic_prompt(model.config.vocab_size, args.prompt_len, args.seed)
    print(f"model: {args.checkpoint or args.preset} ({model.config.num_hidden_layers} layers x {model.config.num_loops} loops)")
    print(f"prompt: {args.prompt_len} synthetic tokens, {args.new_tokens} new tokens, greedy")
    print(f"flashloop: {config}")
    runs = {}
    for name, cfg in (("dense", FlashLoopConfig()), ("flashloop", config)):
        engine = ReferenceFlashLoop(model, cfg)
        req = engine.request()
        t0 = time.perf_counter()
        tok = req.prefill(prompt).logits[-1].argmax()
        tokens = [int(tok)]
        for _ in range(args.new_tokens - 1):
            tok = req.decode(tok[None]).logits[-1].argmax()
            tokens.append(int(tok))
        runs[name] = (tokens, req.store.nbytes(), time.perf_counter() - t0)
    for name, (tokens, _, seconds) in runs.items():
        print(f"{name:>9} tokens ({seconds:.2f} s): {' '.join(map(str, tokens))}")
    dense, flash = runs["dense"][0], runs["flashloop"][0]
    same = sum(a == b for a, b in zip(dense, flash))
    prefix = next((i for i, (a, b) in enumerate(zip(dense, flash)) if a != b), len(dense))
    print(f"agreement with dense: {same}/{len(dense)} tokens, identical prefix {prefix}")
    d_bytes, f_bytes = runs["dense"][1], runs["flashloop"][1]
    print(
        f"KV bytes: dense {d_bytes.total:,}; flashloop {f_bytes.total:,} (payload {f_bytes.payload:,}, "
        f"min/scale {f_bytes.params:,}, maps {f_bytes.maps:,}, tail {f_bytes.tail:,}); ratio {d_bytes.total / max(f_bytes.total, 1):.2f}x"
    )
    return 0


def _generate_compiled(args: argparse.Namespace) -> int:
    """Dense and FlashLoop through the compiled engine (backend='flashloop'), same prompts."""
    from flashloop_compile.runtime.engine import Engine

    model = _load_model(args).eval()
    config = _config(args, default_all_on=True).resolve(model.config.num_loops)
    prompts = [_synthetic_prompt(model.config.vocab_size, args.prompt_len - 7 * i, args.seed + i) for i in range(args.batch)]
    max_seq = -(-(args.prompt_len + args.new_tokens) // 64) * 64 + 64
    print(f"model: {args.checkpoint or args.preset}; {args.batch} prompts of ~{args.prompt_len} tokens, {args.new_tokens} new")
    runs = {}
    for name, cfg in (("dense", FlashLoopConfig()), ("flashloop", config)):
        torch._dynamo.reset()
        engine = Engine(model, cfg, max_batch=args.batch, max_seq=max_seq, max_new_tokens=args.new_tokens)
        engine.generate(prompts, 2)  # compile and capture outside the timing
        t0 = time.perf_counter()
        result = engine.generate(prompts, args.new_tokens)
        seconds = time.perf_counter() - t0
        runs[name] = result
        toks = sum(len(t) for t in result.tokens)
        print(f"{name:>9}: TTFT {result.prefill_s * 1e3:.1f} ms, TPOT {result.tpot_s * 1e3:.2f} ms, "
              f"{toks / seconds:.1f} tokens/s; {'; '.join(engine.memory().lines())}")
    same = sum(a == b for x, y in zip(runs["dense"].tokens, runs["flashloop"].tokens) for a, b in zip(x, y))
    total = sum(len(x) for x in runs["dense"].tokens)
    print(f"agreement with dense: {same}/{total} tokens")
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    """KV bytes per request and the largest batch that fits, dense vs each configuration."""
    from flashloop_compile.models.ouro import PRESETS, OuroConfig
    from flashloop_compile.runtime.memory import kv_memory, max_batch_for

    if args.checkpoint:
        import json as _json
        from pathlib import Path

        mcfg = OuroConfig.from_dict(_json.loads((Path(args.checkpoint) / "config.json").read_text()))
    else:
        mcfg = PRESETS[args.preset]
    n_params = (
        mcfg.vocab_size * mcfg.hidden_size * (1 if mcfg.tie_word_embeddings else 2)
        + mcfg.num_hidden_layers * (
            mcfg.hidden_size * mcfg.head_dim * (2 * mcfg.num_attention_heads + 2 * mcfg.num_key_value_heads)
            + 3 * mcfg.hidden_size * mcfg.intermediate_size + 4 * mcfg.hidden_size
        )
    )
    weights = n_params * 2
    budget = args.budget_gb * 2**30
    configs = {"dense": FlashLoopConfig(), "quant": FlashLoopConfig.from_switches(False, False, True),
               "all_on": FlashLoopConfig.all_on()}
    if args.options:
        configs["options"] = _config(args, default_all_on=True)
    print(f"{'config':>8} {'KV/request GiB':>15} {'ratio':>6} {'max batch':>10} {'scratch/request GiB':>20}   (context {args.context}, "
          f"{args.new_tokens} new tokens, budget {args.budget_gb} GiB, BF16 weights {weights / 2**30:.2f} GiB)")
    for name, cfg in configs.items():
        km = kv_memory(mcfg, cfg, 1, args.context, max_new_tokens=args.new_tokens)
        mb = max_batch_for(mcfg, cfg, args.context, budget, weight_bytes=weights, max_new_tokens=args.new_tokens,
                           reserve_bytes=args.reserve_gb * 2**30)
        print(f"{name:>8} {km.bytes / 2**30:>15.3f} {km.ratio:>6.2f} {mb:>10} {km.scratch / 2**30:>20.3f}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Prefill / decode / end-to-end grid through the engine: dense, each feature, all on."""
    import json as _json

    from flashloop_compile.backend import make_backend
    from flashloop_compile.runtime.engine import Engine

    model = _load_model(args).eval()
    names = args.configs.split(",")
    grid = {
        "dense": {}, "token_sparse": {"token_sparse_prefill.enabled": True},
        "sparse_decode": {"sparse_decode_attention.enabled": True}, "quant": {"kv_residual_quantization.enabled": True},
        "all_on": {f"{g}.enabled": True for g in ("token_sparse_prefill", "sparse_decode_attention", "kv_residual_quantization")},
    }
    rows = []
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            for name in names:
                cfg = FlashLoopConfig.from_dict({**grid[name], "compilation.outline_layers": args.outline,
                                                 "compilation.position_attention": args.position_attention})
                prompts = [_synthetic_prompt(model.config.vocab_size, context, args.seed + i) for i in range(batch)]
                max_seq = -(-(context + args.new_tokens) // 64) * 64 + 64
                torch._dynamo.reset()
                engine = Engine(model, cfg, max_batch=batch, max_seq=max_seq, max_new_tokens=args.new_tokens,
                                backend=make_backend(cfg, inner=args.inner))
                engine.generate(prompts, 2)  # compile + capture
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
                print(f"{name:>13} ctx {context:>6} b {batch:>3}: TTFT {row['ttft_ms']:8.1f} ms  TPOT {row['tpot_ms']:7.2f} ms  "
                      f"{row['throughput_tok_s']:8.1f} tok/s  KV {mem.bytes / 2**20:9.1f} MiB ({mem.ratio:.2f}x)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            _json.dump(rows, f, indent=2)
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
    from flashloop_compile.models.ouro import OuroForCausalLM
    from flashloop_compile.passes import PassManager, recognize

    if args.checkpoint:
        model = OuroForCausalLM.from_pretrained(args.checkpoint, device="meta" if args.meta else "cpu")
    else:
        model = OuroForCausalLM.from_preset(args.preset, device="meta" if args.meta else "cpu")
    config = _config(args, default_all_on=True).resolve(model.config.num_loops)
    print(f"model: {args.checkpoint or args.preset}; flashloop: {config}")
    from flashloop_compile.runtime.memory import kv_memory

    for line in kv_memory(model.config, config, args.batch, args.max_seq).lines():
        print(f"KV cache (batch {args.batch} x {args.max_seq} positions): {line}")
    manager = PassManager(config)
    for phase, gm in capture_graphs(model, args.batch, args.prompt_len, args.max_seq).items():
        structure = recognize(gm)
        print(f"\n== {phase} graph (batch {args.batch}, {args.prompt_len if phase == 'prefill' else 1} tokens) ==")
        print(structure.summary(), end="")
        print("rewrites:")
        for line in manager.plan(structure) or ["none (all features off)"]:
            print(f"  {line}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashloop-compile", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    def model_args(sp: argparse.ArgumentParser) -> None:
        src = sp.add_mutually_exclusive_group()
        src.add_argument("--preset", default="tiny", help="random-init model shape: tiny, ouro-1.4b, ouro-2.6b")
        src.add_argument("--checkpoint", help="HF-layout model directory (config.json + safetensors)")
        sp.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
        sp.add_argument("--device", default="cpu")
        sp.add_argument("--seed", type=int, default=0)
        sp.add_argument("--options", help="FlashLoopConfig as a flat JSON dict (default: every feature on)")

    g = sub.add_parser("generate", help="dense vs FlashLoop greedy generation on a synthetic prompt")
    model_args(g)
    g.add_argument("--prompt-len", type=int, default=320)
    g.add_argument("--new-tokens", type=int, default=24)
    g.add_argument("--engine", choices=["reference", "compiled"], default="reference",
                   help="reference: the explicit eager FlashLoop (fast on CPU); compiled: backend='flashloop' + CUDA graphs")
    g.add_argument("--batch", type=int, default=1, help="prompts per batch (compiled engine)")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("memory", help="KV bytes per request and the largest batch that fits a budget, per configuration")
    model_args(m)
    m.add_argument("--context", type=int, default=32768)
    m.add_argument("--new-tokens", type=int, default=256)
    m.add_argument("--budget-gb", type=float, default=139.0)
    m.add_argument("--reserve-gb", type=float, default=8.0, help="activations (decode scratch is counted per request)")
    m.set_defaults(func=cmd_memory)

    b = sub.add_parser("bench", help="prefill / decode / end-to-end grid: dense, each feature, all on (same run)")
    model_args(b)
    b.add_argument("--configs", default="dense,token_sparse,sparse_decode,quant,all_on")
    b.add_argument("--contexts", default="192,320")
    b.add_argument("--batches", default="1,2")
    b.add_argument("--new-tokens", type=int, default=16)
    b.add_argument("--inner", choices=["inductor", "eager"], default="inductor",
                   help="compile the rewritten graph with inductor, or run it eagerly (quick CPU runs)")
    b.add_argument("--outline", action=argparse.BooleanOptionalAction, default=True, help="compile each distinct layer once")
    b.add_argument("--position-attention", action=argparse.BooleanOptionalAction, default=True,
                   help="prefill attention masked by position through flashloop.position_attention in every config, dense "
                        "included (exact: the stronger dense); --no-position-attention keeps the model's masked SDPA")
    b.add_argument("--json")
    b.add_argument("--plot", help="PNG of TTFT, TPOT and KV memory against context")
    b.set_defaults(func=cmd_bench)

    i = sub.add_parser("inspect", help="print the recognized loop structure and the rewrites each enabled feature makes")
    model_args(i)
    i.add_argument("--batch", type=int, default=2)
    i.add_argument("--prompt-len", type=int, default=16)
    i.add_argument("--max-seq", type=int, default=128)
    i.add_argument("--meta", action=argparse.BooleanOptionalAction, default=None,
                   help="trace on the meta device (no weights allocated; default for non-tiny presets)")
    i.set_defaults(func=cmd_inspect)
    _add_quality_commands(sub)
    return p


# -- quality: train, eval, redundancy, calibrate (flashloop_compile/quality; docs/QUALITY.md) -------------


def _quality_device(name: str) -> str:
    return ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name


def _quality_model(args: argparse.Namespace):
    from flashloop_compile.models.ouro import OuroForCausalLM

    device, dtype = _quality_device(args.device), getattr(torch, args.dtype)
    if args.checkpoint:
        model = OuroForCausalLM.from_pretrained(args.checkpoint, dtype=dtype, device=device)
    else:
        model = OuroForCausalLM.from_preset(args.preset, dtype=dtype, device=device, seed=args.seed)
    return model.eval(), args.checkpoint or args.preset


def _quality_corpus(args: argparse.Namespace):
    from flashloop_compile.quality.corpus import Corpus

    kw = {"heldout_percent": args.heldout_percent, "valid_percent": getattr(args, "valid_percent", 3)}
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
        if key in ("func", "command") or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            parts.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            parts += [flag, str(value)]
    return " ".join(shlex.quote(p) for p in parts)


def cmd_train(args: argparse.Namespace) -> int:
    from flashloop_compile.quality.train import TrainConfig, train

    cfg = TrainConfig(
        layers=args.layers, hidden=args.hidden, head_dim=args.head_dim, intermediate=args.intermediate,
        seq_len=args.seq_len, batch=args.batch, lr=args.lr, warmup_steps=args.warmup, aux_weight=args.aux_weight,
        dropout=args.dropout, valid_percent=args.valid_percent, select_best=args.select_best, save_dtype=args.save_dtype,
        seconds=args.seconds, max_steps=args.max_steps, log_every=args.log_every, eval_every=args.eval_every,
        seed=args.seed, heldout_percent=args.heldout_percent, compile=args.compile, device=_quality_device(args.device),
        corpus_max_docs=args.max_docs, corpus_max_doc_bytes=args.max_doc_bytes,
    )
    train(cfg, args.out, corpus=_quality_corpus(args), command=_train_command(args),
          log=lambda m: print(m, flush=True))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from flashloop_compile.quality.evaluate import EvalSettings, parse_configs, quality_table

    model, name = _quality_model(args)
    configs = parse_configs(args.configs, model.config.num_loops)
    settings = EvalSettings(
        docs=args.docs, contexts=_ints(args.contexts), continuation=args.continuation,
        retrieval_context=args.retrieval_context, depths=_floats(args.depths), retrieval_trials=args.trials,
        n_boot=args.n_boot, seed=args.seed, split=args.split,
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
                           progress=lambda m: print(m, flush=True), on_config=save_partial)
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
    base = FlashLoopConfig.from_dict(json.loads(args.base)) if args.base else FlashLoopConfig.all_on()
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


def _add_quality_commands(sub) -> None:
    def source(sp: argparse.ArgumentParser) -> None:
        src = sp.add_mutually_exclusive_group()
        src.add_argument("--preset", default="tiny", help="random-init model shape (default tiny)")
        src.add_argument("--checkpoint", help="HF-layout model directory (config.json + model.safetensors)")
        sp.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
        sp.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
        sp.add_argument("--seed", type=int, default=0)

    def corpus(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--corpus-root", help="directory of *.py documents (default: this interpreter's stdlib)")
        sp.add_argument("--heldout-percent", type=int, default=5)

    def outputs(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--json", help="write the full results as JSON here")
        sp.add_argument("--markdown", help="write the markdown tables here")

    t = sub.add_parser("train", help="train a small Ouro model from scratch on the stdlib source (byte level)")
    t.add_argument("--out", required=True, help="checkpoint directory (HF layout + train_log.txt + command.txt)")
    t.add_argument("--seconds", type=float, default=300.0, help="training time budget (the LR schedule spans it)")
    t.add_argument("--max-steps", type=int, default=None)
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
    corpus(t)
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("eval", help="held-out perplexity and needle retrieval per FlashLoop config vs dense, with CIs")
    source(e)
    corpus(e)
    e.add_argument("--configs", nargs="+", default=["default"],
                   help="set names (default, combos, sweep, full), names like all-on@retention=0.5/0.25@keep_last, or .json files")
    e.add_argument("--docs", type=int, default=16, help="held-out documents per context length")
    e.add_argument("--contexts", default="1024,2048", help="context lengths (tokens), comma-separated")
    e.add_argument("--continuation", type=int, default=32, help="scored tokens after each context (<= 64 keeps one decode call exact)")
    e.add_argument("--retrieval-context", type=int, default=1024)
    e.add_argument("--depths", default="0.1,0.5,0.9", help="needle depths (needle start / context)")
    e.add_argument("--trials", type=int, default=8, help="retrieval prompts per depth (0: no retrieval)")
    e.add_argument("--n-boot", type=int, default=1000)
    e.add_argument("--max-seconds", type=float, default=None, help="skip the configs that would not finish within this budget")
    e.add_argument("--split", default="heldout", choices=["heldout", "train"])
    outputs(e)
    e.set_defaults(func=cmd_eval)

    r = sub.add_parser("redundancy", help="the paper's redundancy findings measured on a model (dense trajectory)")
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

    c = sub.add_parser("calibrate", help="derive retention and key fraction from calibration sequences and an error threshold")
    source(c)
    corpus(c)
    c.add_argument("--seqs", type=int, default=16)
    c.add_argument("--seq-len", type=int, default=1024)
    c.add_argument("--split", default="train", choices=["heldout", "train"])
    c.add_argument("--threshold", type=float, default=0.05)
    c.add_argument("--base", help="base FlashLoopConfig as flat JSON (default: every feature on)")
    c.add_argument("--per-loop-key-fraction", action="store_true")
    c.add_argument("--strict", action="store_true", help="raise retentions until the end-to-end state error is below the threshold too")
    c.add_argument("--out", help="write the calibrated FlashLoopConfig (flat dict) here")
    outputs(c)
    c.set_defaults(func=cmd_calibrate)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "meta", False) is None:
        args.meta = bool(args.checkpoint is None and args.preset != "tiny")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
