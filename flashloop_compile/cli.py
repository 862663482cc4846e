"""``flashloop-compile``: generate, inspect.

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
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("inspect", help="print the recognized loop structure and the rewrites each enabled feature makes")
    model_args(i)
    i.add_argument("--batch", type=int, default=2)
    i.add_argument("--prompt-len", type=int, default=16)
    i.add_argument("--max-seq", type=int, default=128)
    i.add_argument("--meta", action=argparse.BooleanOptionalAction, default=None,
                   help="trace on the meta device (no weights allocated; default for non-tiny presets)")
    i.set_defaults(func=cmd_inspect)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "meta", False) is None:
        args.meta = bool(args.checkpoint is None and args.preset != "tiny")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
