"""Compiled-model export on the GPU: ouro-1.4b shape (random weights), every feature on.

Exports the model (flashloop_compile.export), loads the package (flashloop_compile.load_exported),
checks that its decode equals the compiled engine's (prefill, then decode steps from the same
prompts: logits within DECODE_TOL, tokens compared) and prints the package size, the export time,
the load time and the decode step of the loaded package against the engine's (the same call:
``decode(tok, pos)`` of a batch at the end of its prompts; the engine replays its CUDA graph).

    python3 benchmarks/bench_export.py                      # ouro-1.4b, batch 1, 1024 positions
    python3 benchmarks/bench_export.py --max-batch 2 --layers 4

Writes $OUT/bench_export.json (OUT defaults to ./out). Benchmarks assert correctness, never timing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import OUT, cuda_time_ms, device, environment, sync  # noqa: E402

import flashloop_compile  # noqa: E402
from flashloop_compile import FlashLoopConfig, OuroForCausalLM  # noqa: E402
from flashloop_compile.runtime.engine import Engine  # noqa: E402

# bfloat16 logits of a 24 x 4 layer stack: AOTInductor and the backend's Inductor pick their own
# kernels (reduction orders), so the decode logits agree to bf16 rounding, not bit for bit
DECODE_TOL = dict(atol=0.1, rtol=0.05)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="ouro-1.4b")
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (a shorter export)")
    p.add_argument("--max-batch", type=int, default=1)
    p.add_argument("--max-seq", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--min-prompt", type=int, default=128, help="the shortest exported prompt (one prefill program)")
    p.add_argument("--package", default=None, help="where to write the .pt2 (default $OUT/bench_export_<preset>.pt2)")
    args = p.parse_args()

    dev = device()
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    layers = {} if args.layers is None else {"num_hidden_layers": args.layers}
    model = OuroForCausalLM.from_preset(args.preset, dtype=dtype, device=dev, seed=0, **layers).eval()
    # outlining splits the engine's compile per layer (minutes -> seconds at 24 layers); an exported
    # program is always whole, so it changes nothing in the package but the recorded config
    config = FlashLoopConfig.all_on(**{"compilation.outline_layers": True})
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (args.prompt_len - 7 * i,), generator=g) for i in range(args.max_batch)]
    record = {"env": environment(), "preset": args.preset, "layers": model.config.num_hidden_layers, "dtype": str(dtype),
              "max_batch": args.max_batch, "max_seq": args.max_seq, "prompt_len": args.prompt_len, "config": config.hash()}

    # the compiled engine
    engine = Engine(model, config, max_batch=args.max_batch, max_seq=args.max_seq, max_new_tokens=args.new_tokens)
    t0 = time.perf_counter()
    engine.warm_up(args.prompt_len, args.max_batch)
    record["engine_warm_up_s"] = time.perf_counter() - t0
    engine_tokens = engine.generate(prompts, args.new_tokens).tokens
    engine_step, engine_logits = _decode_step(engine, prompts)

    # export, load
    OUT.mkdir(parents=True, exist_ok=True)
    path = Path(args.package or OUT / f"bench_export_{args.preset}.pt2")
    t0 = time.perf_counter()
    flashloop_compile.export(model, config, path, max_batch=args.max_batch, max_seq=args.max_seq,
                             max_new_tokens=args.new_tokens, min_prompt=args.min_prompt)
    record["export_s"] = time.perf_counter() - t0
    record["package_bytes"] = path.stat().st_size
    t0 = time.perf_counter()
    loaded = flashloop_compile.load_exported(path, config=config, device=dev, dtype=dtype)
    sync()
    record["load_s"] = time.perf_counter() - t0
    loaded_tokens = loaded.generate(prompts, args.new_tokens).tokens
    loaded_step, loaded_logits = _decode_step(loaded, prompts)

    diff = (loaded_logits - engine_logits).abs().max().item()
    agree = sum(a == b for x, y in zip(loaded_tokens, engine_tokens) for a, b in zip(x, y))
    total = sum(len(x) for x in engine_tokens)
    record.update(decode_logits_max_abs_diff=diff, token_agreement=f"{agree}/{total}",
                  engine_decode_ms=engine_step, loaded_decode_ms=loaded_step, form=loaded.form)
    print(f"package {path}: {record['package_bytes'] / 2**30:.2f} GiB ({loaded.form}, programs {list(loaded.meta['programs'])})")
    print(f"export {record['export_s']:.1f} s; load {record['load_s']:.1f} s; engine warm-up {record['engine_warm_up_s']:.1f} s")
    print(f"decode step (batch {args.max_batch}, context {args.prompt_len}): engine {engine_step['median_ms']:.3f} ms "
          f"({'CUDA graph' if dev == 'cuda' else 'no graph on cpu'}), loaded package {loaded_step['median_ms']:.3f} ms")
    print(f"decode logits max |diff| {diff:.4f}; generated tokens agree {agree}/{total}")
    (OUT / "bench_export.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    torch.testing.assert_close(loaded_logits, engine_logits, **DECODE_TOL)
    return 0


def _decode_step(runner, prompts):
    """Prefill the prompts, then time decode(tok, pos) at the end of the prompts (the same step
    rewritten each call); the first step's logits."""
    if getattr(runner, "packed", None) is not None:
        runner.packed.reset()
    logits = runner.prefill(prompts)
    tok = logits.argmax(-1)
    pos = torch.tensor([len(p) for p in prompts], device=tok.device)
    first = runner.decode(tok, pos).float().clone()
    return cuda_time_ms(lambda: runner.decode(tok, pos), warmup=3, repeat=20), first


if __name__ == "__main__":
    sys.exit(main())
