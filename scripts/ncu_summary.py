"""A table of ncu's text report (scripts/ncu_kernels.sh): one row per profiled launch, the
throughputs against the peaks, occupancy, issue and the largest warp-stall reasons (cycles a warp
waits per issued instruction, by reason). Usage: python scripts/ncu_summary.py ncu.txt"""

from __future__ import annotations

import re
import sys

COLUMNS = {  # report line -> column
    "Duration": "us", "DRAM Throughput": "dram%", "Memory Throughput": "mem%", "Compute (SM) Throughput": "sm%",
    "Registers Per Thread": "regs", "Achieved Occupancy": "occ%", "Theoretical Occupancy": "theo%",
    "Issued Warp Per Scheduler": "ipc/smsp", "No Eligible": "noelig%", "Warp Cycles Per Issued Instruction": "cyc/inst",
    "L1/TEX Hit Rate": "l1hit%", "L2 Hit Rate": "l2hit%",
}
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")


def parse(text: str) -> list[dict]:
    rows, cur = [], None
    for line in text.splitlines():
        head = re.match(r"\s{2}(\w+)\s+\((\d+), (\d+), (\d+)\)x\((\d+), 1, 1\)", line)
        if head:
            cur = {"kernel": head.group(1), "grid": "x".join(head.group(i) for i in (2, 3, 4)), "stalls": {}}
            rows.append(cur)
            continue
        if cur is None:
            continue
        parts = re.split(r"\s{2,}", line.strip())
        if len(parts) < 2:
            continue
        name, value = parts[0], parts[-1].replace(",", "")
        m = STALL.match(name)
        try:
            v = float(value)
        except ValueError:
            continue
        unit = parts[1] if len(parts) == 3 else ""
        if m:
            cur["stalls"][m.group(1)] = v
        elif name == "Memory Throughput" and unit.endswith("byte/s"):  # Memory Workload Analysis: the rate
            cur["GB/s"] = v * {"Tbyte/s": 1000.0, "Gbyte/s": 1.0, "Mbyte/s": 0.001}.get(unit, float("nan"))
        elif name in COLUMNS:
            cur[COLUMNS[name]] = v * (1000.0 if unit == "ms" else 0.001 if unit == "ns" else 1.0) if name == "Duration" else v
    return rows


def main() -> None:
    rows = parse(open(sys.argv[1]).read())
    cols = list(COLUMNS.values()) + ["GB/s"]
    print(f"{'kernel':24s} {'grid':>11s} " + " ".join(f"{c:>8s}" for c in cols) + "  top stalls (cycles per issued instruction)")
    for r in rows:
        top = sorted(r["stalls"].items(), key=lambda kv: -kv[1])[:4]
        print(f"{r['kernel'][:24]:24s} {r['grid']:>11s} " + " ".join(f"{r.get(c, float('nan')):8.1f}" for c in cols)
              + "  " + ", ".join(f"{k} {v:.1f}" for k, v in top))


if __name__ == "__main__":
    main()
