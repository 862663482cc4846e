"""benchmarks/probe_gluon_scores.py: the code-domain reference scores on tensor cores (Gluon), a probe
timed on the H200 (benchmarks/RESULTS.md, session 13). On CPU: its arithmetic (the A operand and
biases of prep_kernel, codes as 1024 + code) against the FP64 reference, and its compile for
sm_90: the layouts hold (the A-side relabel asserts a trivial conversion) and the key-tile loop
keeps its instruction count."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
SCRIPT = "benchmarks/probe_gluon_scores.py"


def test_the_probe_arithmetic_matches_the_reference_scores():
    run = subprocess.run([sys.executable, SCRIPT, "--emulate"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    err = float(run.stdout.split("max abs ")[1].split()[0])
    assert err < 5e-3, run.stdout  # fp16 A (q * scale) per block: ~1e-3 at scores up to ~3


@pytest.mark.skipif(not (BIN / "ptxas").exists(), reason="the Triton wheel ships no ptxas here")
def test_the_probe_compiles_for_sm90_with_a_third_of_the_instructions_per_tile():
    run = subprocess.run([sys.executable, SCRIPT, "--compile-only"], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"}, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = dict(line.split(" ", 1) for line in run.stdout.splitlines() if line.startswith(("triton ", "gluon")))
    tri, glu = json.loads(rows["triton"]), json.loads(rows["gluon"])
    assert glu["spill_ops"] == 0 and glu["mma"] == 16, glu  # 2 streams x 8 k-chunks per warp and tile
    assert glu["loads"].get("LDG.E.128", 0) >= 4, glu  # a key's 16 code bytes per thread in one load
    assert 3 * glu["loop"] < tri["loop"], (glu["loop"], tri["loop"])  # 300 vs 976 (triton 3.6)
    assert glu["regs"] <= 80, glu
