"""The ``flashloop-compile generate`` command on the tiny preset."""

from __future__ import annotations

import json
import re

import pytest

from flashloop_compile.cli import main
from flashloop_compile.config import ConfigError, FlashLoopConfig
from flashloop_compile.models.ouro import PRESETS
from flashloop_compile.runtime.memory import kv_memory, max_batch_for

ARGS = ["generate", "--preset", "tiny", "--prompt-len", "140", "--new-tokens", "4"]


def test_generate_prints_agreement_and_kv_bytes(capsys):
    assert main(ARGS) == 0
    out = capsys.readouterr().out
    assert "model: tiny (2 layers x 4 loops)" in out
    assert "prompt: 140 synthetic tokens, 4 new tokens, greedy" in out
    # Default: every feature on.
    assert re.search(r"flashloop: FlashLoopConfig\[[0-9a-f]{16}\]\(token_sparse_prefill=on\(.*sparse_decode_attention=on\(.*kv_residual_quantization=on\(", out)
    for name in ("dense", "flashloop"):
        m = re.search(rf"^\s*{name} tokens \([0-9.]+ s\): ((?:\d+ ?){{4}})$", out, re.M)
        assert m and len(m.group(1).split()) == 4, out
    m = re.search(r"^agreement with dense: (\d)/4 tokens, identical prefix (\d)$", out, re.M)
    assert m and int(m.group(2)) <= int(m.group(1)) <= 4, out
    m = re.search(r"^KV bytes: dense ([\d,]+); flashloop ([\d,]+) \(payload [\d,]+, min/scale [\d,]+, maps [\d,]+, tail [\d,]+\); ratio ([\d.]+)x$", out, re.M)
    assert m, out
    dense, flash = (int(m.group(i).replace(",", "")) for i in (1, 2))
    # 140 prompt + 3 fed-back tokens, 2 layers, 4 depths, K and V, 2 kv heads x 64, BF16.
    assert dense == 143 * 2 * 4 * 2 * 128 * 2
    assert 0 < flash < dense and float(m.group(3)) > 1


def test_generate_all_off_matches_dense(capsys):
    assert main(ARGS + ["--options", json.dumps({}), "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    assert "agreement with dense: 4/4 tokens, identical prefix 4" in out
    assert "ratio 1.00x" in out


@pytest.mark.parametrize(
    "options, message",
    [
        ({"token_sparse_prefill.nope": 1}, r"unknown FlashLoop option 'token_sparse_prefill.nope'"),
        ({"bogus": True}, r"unknown FlashLoop option 'bogus'"),
        ({"token_sparse_prefill.enabled": True, "token_sparse_prefill.retention": [1, 1, 0.5]}, r"retention has 3 entries but the model runs 4 loops"),
    ],
)
def test_generate_bad_options(options, message):
    with pytest.raises(ConfigError, match=message):
        main(ARGS + ["--options", json.dumps(options)])


def test_memory_reports_ratios_and_max_batch(capsys):
    assert main(["memory", "--preset", "ouro-1.4b", "--context", "32768", "--new-tokens", "256"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert float(rows["dense"][1]) == 24.0  # 2 x 4 loops x 24 layers x 16 heads x 32768 x 128 x 2 bytes
    assert float(rows["quant"][2]) > 3.4 and float(rows["all_on"][2]) > float(rows["quant"][2])
    assert int(rows["all_on"][3]) > int(rows["dense"][3])
    assert float(rows["dense"][4]) == 0.0 and float(rows["all_on"][4]) > 0.2  # decode scratch per request


def test_capacity_planning_counts_decode_scratch_per_slot():
    # sparse decode + quantization reads a layer's whole history into BF16 K/V per step (and
    # writes an FP32 probability row per query head): the allocation that failed on the H200
    model = PRESETS["ouro-1.4b"]
    one = kv_memory(model, FlashLoopConfig.all_on(), 1, 33024, max_new_tokens=256)
    assert one.scratch == 16 * 33024 * 4 + 2 * 16 * 33024 * 128 * 2
    assert kv_memory(model, FlashLoopConfig(), 1, 33024).scratch == 0
    budget = 3 * 2**30 + 10 * (one.bytes + one.scratch)
    plan = dict(weight_bytes=3 * 2**30, max_new_tokens=256)
    assert max_batch_for(model, FlashLoopConfig.all_on(), 33024, budget, **plan) == 10
    assert max_batch_for(model, FlashLoopConfig.all_on(), 33024, budget - 1, **plan) == 9


def test_bench_grid_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = ["bench", "--preset", "tiny", "--dtype", "float32", "--inner", "eager", "--contexts", "80", "--batches", "1",
            "--new-tokens", "3", "--configs", "dense,all_on", "--json", str(out), "--plot", str(tmp_path / "bench.png")]
    assert main(args) == 0
    rows = json.loads(out.read_text())
    assert [r["config"] for r in rows] == ["dense", "all_on"]
    # every config, dense included, attends its prefill through position_attention unless told not to
    assert all(r["options"]["compilation.position_attention"] for r in rows)
    assert rows[0]["options"]["kv_residual_quantization.enabled"] is False
    assert rows[0]["kv_ratio"] == 1.0 and rows[1]["kv_ratio"] > 1.0
    assert all(r["ttft_ms"] > 0 and r["tpot_ms"] > 0 for r in rows)
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_main_job_runs_without_triton():
    """The README's main job installs no extras: nothing on its path may import Triton."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from flashloop_compile.cli import main\n"
        "raise SystemExit(main(['generate', '--preset', 'tiny', '--prompt-len', '70', '--new-tokens', '2']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "agreement with dense" in proc.stdout
