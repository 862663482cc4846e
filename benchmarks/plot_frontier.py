"""Plot the quality frontier of token-sparse prefill: quality delta against dense (with its 95%
CI) over the prefill layer work saved, one point per configuration, from `flashloop-compile eval
--json` reports (docs/QUALITY.md, "Results").

    python benchmarks/plot_frontier.py eval_cpu.json frontier_cpu.json -o docs/frontier.png
    python benchmarks/plot_frontier.py eval_cpu.json --only dense all-on tsp@retention=0.5/0.25

The saving of retention [r1, ..., rR] is R / sum(r): what token-sparse prefill leaves of dense's
prompt layer work, inverted (computed, not timed). Rows without token-sparse prefill sit at 1x.
Configurations present in several files: the last file's row wins.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def layer_work_saving(flat: dict) -> float:
    """R / sum(retention) for a flat FlashLoopConfig dict; 1.0 with token-sparse prefill off."""
    if not flat.get("token_sparse_prefill.enabled"):
        return 1.0
    retention = [float(r) for r in flat["token_sparse_prefill.retention"]]
    return len(retention) / sum(retention)


def frontier_points(reports: list[dict], context: str | None = None, only: list[str] | None = None) -> tuple[str, list[dict]]:
    """(context, points): per configuration its saving, retention and the continuation and
    prefill delta (%, with CI) at ``context`` (default: the first context of the first report);
    ``only``: these configurations (names as the reports give them)."""
    ctx = context
    points: dict[str, dict] = {}
    for rep in reports:
        ctxs = list(rep.get("perplexity", {}))
        if ctx is None and ctxs:
            ctx = ctxs[0]
        for row in rep.get("rows", []):
            if f"cont@{ctx}" not in row or (only and row["config"] not in only):
                continue
            flat = rep["configs"][row["config"]]
            points[row["config"]] = {
                "config": row["config"],
                "saving": layer_work_saving(flat),
                "retention": flat.get("token_sparse_prefill.retention") if flat.get("token_sparse_prefill.enabled") else None,
                "cont": row[f"cont@{ctx}"],
                "prefill": row[f"prefill@{ctx}"],
            }
    if ctx is None:
        raise ValueError("no report has a perplexity context: run eval with --contexts")
    if not points:
        raise ValueError(f"no report has rows at context {ctx}")
    return ctx, sorted(points.values(), key=lambda p: (p["saving"], p["config"]))


def plot(points: list[dict], context: str, out: str | Path, goal_pct: float = 1.0, goal_saving: float = 1.4) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharex=True)
    for ax, key, title in ((axes[0], "prefill", "inside the prompt"), (axes[1], "cont", "after the prompt (32 tokens)")):
        for p in points:
            st = p[key]
            y, lo, hi = st["delta_pct"], st["delta_lo"], st["delta_hi"]
            ax.errorbar([p["saving"]], [y], yerr=[[y - lo], [hi - y]], fmt="o", capsize=3,
                        color="tab:gray" if p["retention"] is None else "tab:blue")
            label = p["config"] if p["retention"] is None else "/".join(f"{r:g}" for r in p["retention"][2:])
            ax.annotate(label, (p["saving"], y), textcoords="offset points", xytext=(5, 4), fontsize=7)
        ax.axhline(goal_pct, color="tab:red", lw=0.8, ls="--")
        ax.axhline(0.0, color="black", lw=0.5)
        ax.axvline(goal_saving, color="tab:red", lw=0.8, ls=":")
        ax.set_title(f"perplexity {title}, C={context}")
        ax.set_xlabel("prefill layer work saved (dense / token-sparse)")
        ax.set_ylabel("Δ perplexity vs dense, % (95% CI)")
        ax.grid(alpha=0.3)
    fig.suptitle("Token-sparse prefill: quality against layer work (labels: retention of loops 3/4); "
                 f"red: the goal (<= +{goal_pct:g}% at >= {goal_saving:g}x)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", nargs="+", help="eval --json files")
    ap.add_argument("-o", "--out", default="frontier.png")
    ap.add_argument("--context", help="the perplexity context to plot (default: the first report's first)")
    ap.add_argument("--only", nargs="+", help="plot only these configurations")
    args = ap.parse_args(argv)
    reports = [json.loads(Path(p).read_text()) for p in args.reports]
    ctx, points = frontier_points(reports, args.context, args.only)
    plot(points, ctx, args.out)
    for p in points:
        print(f"{p['config']:32s} {p['saving']:.2f}x  prefill {p['prefill']['delta_pct']:+.2f}% "
              f"[{p['prefill']['delta_lo']:+.2f}, {p['prefill']['delta_hi']:+.2f}]  "
              f"continuation {p['cont']['delta_pct']:+.2f}%")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
