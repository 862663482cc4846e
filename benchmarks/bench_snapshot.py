"""Cost of moving one request between engines: snapshot (device -> host copy of one row, then the
safetensors encoding) and restore (decoding, then the host -> device copy into another row) at a
context length, dense and packed (every feature on), ouro-1.4b shapes in BF16.

The cache holds random bytes: the cost depends on how many bytes a row has, not on their values.
The row's counters are set as a request of ``--context`` tokens leaves them, with every compact
residual row its capacity plans for in use (the upper bound of a packed row's bytes). A row's
round trip is checked bit-exact before timing. One JSON record per config goes to
$OUT/snapshot.jsonl.

GPU (one H200; the dense row at 32K is 25 GB, held twice in host memory at most):

    python benchmarks/bench_snapshot.py --context 32768

CPU smoke run (seconds):

    python benchmarks/bench_snapshot.py --preset tiny --dtype float32 --context 192 --configs dense,all_on
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT, device, environment, sync  # noqa: E402

from flashloop_compile.config import FlashLoopConfig  # noqa: E402
from flashloop_compile.models.ouro import OuroForCausalLM  # noqa: E402
from flashloop_compile.runtime.engine import Engine  # noqa: E402
from flashloop_compile.runtime.snapshot import RowSnapshot, restore_row, snapshot_row  # noqa: E402

CONFIGS = {"dense": FlashLoopConfig(), "all_on": FlashLoopConfig.all_on()}
NEW_TOKENS = 64


def _timed(fn):
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, (time.perf_counter() - t0) * 1e3


def measure(preset: str, dtype: torch.dtype, name: str, context: int) -> dict:
    config = CONFIGS[name]
    model = OuroForCausalLM.from_preset(preset, dtype=dtype, device=device()).eval()
    engine = Engine(model, config, max_batch=2, max_seq=context + NEW_TOKENS, max_new_tokens=NEW_TOKENS)
    caches = engine.row_caches()
    for t in engine.state_tensors().values():
        if t.is_floating_point():
            t.normal_()
        elif t.dtype == torch.uint8:
            t.random_(0, 256)
    if engine.packed is not None:
        p = engine.packed
        for lay in p.layers:  # a request of `context` tokens: whole blocks flushed, the rest in the tail
            lay.flushed[1] = (context - p.tail) // p.group_size * p.group_size
            lay.row_count[1, 1:] = torch.tensor(p.residual_capacity)
    snap, d2h_ms = _timed(lambda: snapshot_row(caches, 1, context))
    data, encode_ms = _timed(snap.to_bytes)
    row_bytes = snap.nbytes
    del snap  # at most two copies of a row in host memory at once
    decoded, decode_ms = _timed(lambda: RowSnapshot.from_bytes(data))
    encoded_bytes = len(data)
    del data
    _, h2d_ms = _timed(lambda: restore_row(caches, decoded, 0))
    del decoded
    compact = caches.compact_rows(1)
    views = dict(caches.row_views(0, context, compact))
    assert all(torch.equal(views[n], v) for n, v in caches.row_views(1, context, compact)), "round trip is not exact"
    return {
        "bench": "snapshot", "preset": preset, "dtype": str(dtype), "config": name, "context": context,
        "row_bytes": row_bytes, "encoded_bytes": encoded_bytes,
        "snapshot_ms": d2h_ms + encode_ms, "d2h_ms": d2h_ms, "encode_ms": encode_ms,
        "restore_ms": decode_ms + h2d_ms, "decode_ms": decode_ms, "h2d_ms": h2d_ms,
        "d2h_gbs": row_bytes / d2h_ms / 1e6, "h2d_gbs": row_bytes / h2d_ms / 1e6,
        **environment(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="ouro-1.4b")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--configs", default="all_on,dense", help=f"comma-separated, of {sorted(CONFIGS)}")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    for name in args.configs.split(","):
        rec = measure(args.preset, getattr(torch, args.dtype), name, args.context)
        with open(OUT / "snapshot.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{name:7s} {args.context} tokens: {rec['row_bytes'] / 2**30:.2f} GiB row; snapshot {rec['snapshot_ms']:.0f} ms "
              f"(d2h {rec['d2h_ms']:.0f}, encode {rec['encode_ms']:.0f}); restore {rec['restore_ms']:.0f} ms "
              f"(decode {rec['decode_ms']:.0f}, h2d {rec['h2d_ms']:.0f})")
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
