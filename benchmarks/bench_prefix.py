"""Time to first token of a prompt whose first tokens another row's cache holds (prefix reuse:
``Engine.reuse_prefix``, then ``prefill(cached=)``) against prefilling it whole; ouro-1.4b shapes
in BF16, random weights.

The prompt has ``--context`` tokens, of which the first ``--shared`` fraction is a prefix cached in
row 1 as a request of its own (prefilled alone in row 0, then copied there: what a prefix cache
keeps). Reuse copies that prefix's cache (rounded down to whole selection windows where
token-sparse prefill selects) into row 0 on the device and prefills the rest at its positions;
TTFT is the copy plus that prefill, against the whole prompt's prefill in row 0 (one forward from
position 0), in the same run. Token-sparse prefill needs selection windows to start after a
prefix: both paths run with ``token_sparse_prefill.window = --window`` (and outlined layers, which
compile in seconds). Each path runs
``--warmup`` times first (the first run compiles its graph), then ``--repeat`` times timed with
CUDA events (a host timer on CPU); the record holds the medians. Checked before timing: reuse
gives the logits of the engine prefilling the prefix in row 0 and then the rest in place. One JSON
record per config goes to $OUT/prefix.jsonl.

GPU (one H200):

    python benchmarks/bench_prefix.py --context 32768 --shared 0.9

CPU smoke run (a minute or two):

    python benchmarks/bench_prefix.py --preset tiny --dtype float32 --context 192 --window 32 --inner eager --repeat 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cuda_times, device, kernel_profile, print_profile, record  # noqa: E402

from flashloop_compile.backend import make_backend  # noqa: E402
from flashloop_compile.config import FlashLoopConfig  # noqa: E402
from flashloop_compile.models.ouro import OuroForCausalLM  # noqa: E402
from flashloop_compile.runtime.engine import Engine  # noqa: E402

CONFIGS = {"dense": (False, False, False), "all_on": (True, True, True)}  # FlashLoopConfig.from_switches
NEW_TOKENS = 64


def measure(preset: str, dtype: torch.dtype, name: str, context: int, shared: float = 0.9, window: int = 1024,
            warmup: int = 1, repeat: int = 5, inner: str = "inductor", layers: int | None = None,
            profile: int = 0) -> dict:
    torch._dynamo.reset()
    # outlined layers: each distinct layer compiles once (seconds, not minutes, for the three prefill
    # graphs at 24 layers); both paths run the same graphs' code
    config = FlashLoopConfig.from_switches(*CONFIGS[name], **{"token_sparse_prefill.window": window,
                                                             "compilation.outline_layers": True})
    overrides = {} if layers is None else {"num_hidden_layers": layers}
    model = OuroForCausalLM.from_preset(preset, dtype=dtype, device=device(), **overrides).eval()
    engine = Engine(model, config, max_batch=2, max_seq=context + NEW_TOKENS, max_new_tokens=NEW_TOKENS,
                    backend=make_backend(config, inner=inner))
    prompt = torch.randint(0, model.config.vocab_size, (context,), generator=torch.Generator().manual_seed(0))
    length = int(shared * context)

    # what reuse_prefix keeps of the shared tokens: whole windows where token-sparse prefill selects
    n = length // window * window if config.token_sparse_prefill.selects else length
    t0 = time.perf_counter()
    engine.prefill([prompt[:n]])  # the prefix alone in row 0 ...
    print(f"{name}: prefix of {n} tokens prefilled (compiled) in {time.perf_counter() - t0:.0f} s", flush=True)
    assert engine.reuse_prefix(0, 1, n) == n  # ... kept in row 1
    in_place = engine.prefill([prompt], cached=[n]).clone()  # the prefix, then the rest in row 0 itself
    assert engine.reuse_prefix(1, 0, n) == n
    reused = engine.prefill([prompt], cached=[n])
    assert int(reused.argmax()) == int(in_place.argmax()), "reuse chose another first token than the in-place run"
    torch.testing.assert_close(reused, in_place, atol=1e-3, rtol=1e-3)

    def full():
        engine.prefill([prompt])

    def copy():
        engine.reuse_prefix(1, 0, n)

    def ttft():
        engine.reuse_prefix(1, 0, n)
        engine.prefill([prompt], cached=[n])

    def rest():
        engine.prefill([prompt], cached=[n])

    print(f"{name}: checked reuse against the in-place run at {time.perf_counter() - t0:.0f} s", flush=True)
    med = statistics.median
    full_ms = med(cuda_times(full, warmup, repeat))
    ttft_ms = med(cuda_times(ttft, warmup, repeat))
    copy_ms = med(cuda_times(copy, warmup, repeat))
    rest_ms = med(cuda_times(rest, warmup, repeat, before=copy))  # each rest after a fresh copy, untimed
    profiles = {}
    if profile:  # device time per kernel family of each path (the reused path with its copy)
        profiles = {"full_profile": kernel_profile(full, full, profile, full_ms),
                    "ttft_profile": kernel_profile(ttft, ttft, profile, ttft_ms)}
    return {
        **profiles,
        "bench": "prefix", "preset": preset, "dtype": str(dtype), "config": name, "window": window,
        "layers": model.config.num_hidden_layers, "context": context, "shared": length, "reused": n, "prefilled": context - n,
        "full_ms": full_ms, "ttft_ms": ttft_ms, "copy_ms": copy_ms, "rest_ms": rest_ms,
        "speedup": full_ms / ttft_ms, "warmup": warmup, "repeat": repeat, "timer": "cuda_events"
        if torch.cuda.is_available() else "host",
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--shared", type=float, default=0.9, help="the fraction of the prompt the cached prefix covers")
    ap.add_argument("--window", type=int, default=1024, help="token_sparse_prefill.window of both paths")
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs of each path (the first compiles)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--inner", default="inductor", choices=["inductor", "eager"],
                    help="what compiles the rewritten graphs (eager: a quick CPU smoke run)")
    ap.add_argument("--layers", type=int, default=None, help="override num_hidden_layers (a quicker compile)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after timing, N more runs of each path under the profiler: device time per kernel family")
    ap.add_argument("--configs", default="all_on,dense", help=f"comma-separated, of {sorted(CONFIGS)}")
    args = ap.parse_args(argv)
    unknown = sorted(set(args.configs.split(",")) - set(CONFIGS))
    if unknown:
        ap.error(f"--configs: unknown {unknown}; choose from {sorted(CONFIGS)}")
    if not 0.0 < args.shared < 1.0:
        ap.error(f"--shared must be a fraction in (0, 1), got {args.shared}")
    if args.warmup < 1 or args.repeat < 1:
        ap.error("--warmup and --repeat must be >= 1 (the first run of each path compiles it)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    for name in args.configs.split(","):
        rec = measure(args.preset, getattr(torch, args.dtype), name, args.context, args.shared, args.window,
                      args.warmup, args.repeat, args.inner, args.layers, args.profile)
        record("prefix", rec)
        print(f"{name:7s} {args.context} tokens, {rec['reused']} cached: TTFT {rec['ttft_ms']:.1f} ms (copy "
              f"{rec['copy_ms']:.1f}, rest {rec['rest_ms']:.1f}) against {rec['full_ms']:.1f} ms whole: "
              f"{rec['speedup']:.2f}x", flush=True)
        for path in ("full", "ttft"):
            if f"{path}_profile" in rec:
                print_profile(name, f"{path} {args.context}", rec[f"{path}_profile"])
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
