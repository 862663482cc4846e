"""Plot benchmarks/bench_generate.py results: per shape, dense vs all-on TTFT, TPOT, throughput
and memory; the largest batch at the long context (accounted and verified) and its throughput.

Runs where matplotlib is installed (the CPU machine; the GPU image may lack it):

    python benchmarks/plot_generate.py out/generate.jsonl generate.png

Rows appended by several runs to one file: the last row per (kind, shape, config) wins.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def read_rows(path: str | Path) -> list[dict]:
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                rows.append(json.loads(line))
    return rows


def _latest(rows: list[dict], kind: str, *keys: str) -> dict[tuple, dict]:
    """The last row of ``kind`` per value of ``keys``; rows that ran out of memory only where
    nothing else exists for their key."""
    out: dict[tuple, dict] = {}
    for r in rows:
        if r.get("kind") == kind:
            key = tuple(r.get(k) for k in keys)
            if not r.get("oom") or key not in out or out[key].get("oom"):
                out[key] = r
    return out


def speedup_over_dense(gen: dict[tuple, dict], shape: str, config: str, value, higher_is_better: bool = False) -> float | None:
    """``config``'s speedup over dense's row of the same shape, from the two plotted rows (rows of
    several runs carry no speedup field of their own); None for dense itself or a missing row."""
    if config == "dense" or (shape, config) not in gen or (shape, "dense") not in gen:
        return None
    mine, dense = value(gen[(shape, config)]), value(gen[(shape, "dense")])
    if not mine or not dense:
        return None
    return mine / dense if higher_is_better else dense / mine


def plot(rows: list[dict], path: str) -> bool:
    """Write the PNG; False (with a message) when matplotlib is missing or there is nothing to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path} (run benchmarks/plot_generate.py where it is)")
        return False
    gen = _latest(rows, "generate", "shape", "config")
    mb = {c: r for (c,), r in _latest(rows, "max_batch", "config").items()}
    acc = {c: r for (c,), r in _latest(rows, "max_batch_accounting", "config").items()}
    if not gen and not mb and not acc:
        print(f"no generate or max_batch rows: no plot written to {path}")
        return False
    shapes = list(dict.fromkeys(s for s, _ in gen))
    configs = list(dict.fromkeys(c for _, c in gen)) or ["dense", "all_on"]
    panels = [
        ("TTFT (prefill) ms", lambda r: r["ttft_ms"]),
        ("TPOT (median decode step) ms", lambda r: r["tpot_ms"]),
        ("throughput, new tokens/s", lambda r: r["throughput_tok_s"]),
        ("peak memory GB / KV GB (hatched)", lambda r: r.get("peak_memory_gb")),
    ]
    n = len(panels) + (1 if mb or acc else 0)  # the largest-batch panel only where there are its rows
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4.5))
    width = 0.8 / max(len(configs), 1)
    for ax, (title, value) in zip(axes, panels):
        for j, c in enumerate(configs):
            xs = [i + j * width for i in range(len(shapes))]
            ys = [(value(gen[(s, c)]) if (s, c) in gen else None) for s in shapes]
            ys = [y if y is not None else 0.0 for y in ys]
            ax.bar(xs, ys, width, label=c, color=f"C{j}")
            if title.startswith("peak"):
                kv = [gen[(s, c)]["kv_bytes"] / 1e9 if (s, c) in gen else 0.0 for s in shapes]
                ax.bar(xs, kv, width, fill=False, hatch="//", edgecolor="black")
            if not title.startswith("peak"):
                for x, s in zip(xs, shapes):
                    ratio = speedup_over_dense(gen, s, c, value, higher_is_better=title.startswith("throughput"))
                    if ratio is not None:
                        ax.annotate(f"{ratio:.2f}x", (x, value(gen[(s, c)])), ha="center", va="bottom", fontsize=7)
        ax.set_xticks([i + width * (len(configs) - 1) / 2 for i in range(len(shapes))])
        ax.set_xticklabels(shapes, rotation=20, fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    if mb or acc:
        _largest_batch(axes[-1], mb, acc)
    first = next(iter(gen.values()), None) or next(iter(mb.values()), None) or next(iter(acc.values()))
    fig.suptitle(f"{first.get('preset')} {first.get('gpu', '')} commit {first.get('commit', '?')} {first.get('date', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
    return True


def _largest_batch(ax, mb: dict[str, dict], acc: dict[str, dict]) -> None:
    """Per config: the largest batch the accounting allows and the one decoded, with its throughput."""
    names = list(dict.fromkeys(list(acc) + list(mb)))
    accounted = [acc.get(c, {}).get("max_batch", 0) for c in names]
    verified = [mb[c]["batch"] if c in mb and not mb[c].get("oom") else 0 for c in names]
    xs = list(range(len(names)))
    ax.bar([x - 0.2 for x in xs], accounted, 0.4, label="accounted")
    ax.bar([x + 0.2 for x in xs], verified, 0.4, label="verified (decoded)")
    for x, c in zip(xs, names):
        r = mb.get(c)
        if r and r.get("throughput_tok_s"):
            ax.annotate(f"{r['throughput_tok_s']:.0f} tok/s", (x + 0.2, r["batch"]), ha="center", va="bottom", fontsize=7)
    ctx = next((r.get("context") for r in list(acc.values()) + list(mb.values())), "?")
    ax.set_xticks(xs)
    ax.set_xticklabels(names)
    ax.set_title(f"largest batch at context {ctx}", fontsize=10)
    ax.legend(fontsize=8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("jsonl", help="generate.jsonl written by bench_generate.py")
    ap.add_argument("png")
    args = ap.parse_args()
    plot(read_rows(args.jsonl), args.png)


if __name__ == "__main__":
    main()
