"""The ``flashloop-compile`` command line: the main job, memory, bench, inspect, export, input errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from flashloop_compile.cli import DEFAULT_CHECKPOINT, main
from flashloop_compile.config import FlashLoopConfig
from flashloop_compile.models.ouro import PRESETS
from flashloop_compile.runtime.memory import kv_memory, max_batch_for

ARGS = ["generate", "--preset", "tiny", "--prompt-len", "140", "--new-tokens", "4"]


def _run(argv, capsys) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_prints_agreement_and_kv_bytes(capsys):
    code, out, _ = _run(ARGS, capsys)
    assert code == 0
    assert "model: tiny: 2 layers x 4 loops, float32 on cpu" in out
    assert "prompt: 140 synthetic tokens (seed 0); 4 new tokens, greedy" in out
    # random weights say so, next to the agreement too
    assert "random, untrained weights" in out and "(random weights: meaningless)" in out
    # Default: every feature on.
    assert re.search(r"flashloop: token_sparse_prefill \+ sparse_decode_attention \+ kv_residual_quantization  "
                     r"\(FlashLoopConfig\[[0-9a-f]{16}\]\(token_sparse_prefill=on\(", out)
    assert re.search(r"^dense \([0-9.]+ s\) +\| flashloop \([0-9.]+ s\)$", out, re.M), out
    m = re.search(r"^agreement with dense: (\d)/4 tokens, identical prefix (\d)", out, re.M)
    assert m and int(m.group(2)) <= int(m.group(1)) <= 4, out
    m = re.search(r"^KV bytes: dense ([\d,]+); flashloop ([\d,]+) \(payload [\d,]+, min/scale [\d,]+, maps [\d,]+, tail [\d,]+\); ratio ([\d.]+)x$", out, re.M)
    assert m, out
    dense, flash = (int(m.group(i).replace(",", "")) for i in (1, 2))
    # 140 prompt + 3 fed-back tokens, 2 layers, 4 depths, K and V, 2 kv heads x 64, float32 (auto on CPU).
    assert dense == 143 * 2 * 4 * 2 * 128 * 4
    assert 0 < flash < dense and float(m.group(3)) > 1
    assert re.search(r"^time: dense [0-9.]+ s, flashloop [0-9.]+ s \(the reference engine", out, re.M)


def test_generate_all_off_matches_dense(capsys):
    code, out, _ = _run(ARGS + ["--options", json.dumps({}), "--dtype", "bfloat16"], capsys)
    assert code == 0
    assert "bfloat16 on cpu" in out
    assert "agreement with dense: 4/4 tokens, identical prefix 4" in out
    assert "ratio 1.00x" in out


@pytest.mark.skipif(not (DEFAULT_CHECKPOINT / "model.safetensors").is_file(), reason="needs the shipped checkpoint")
def test_default_generate_continues_text_with_the_shipped_checkpoint(capsys):
    """The README's first command: the trained checkpoint continues the default Python prompt,
    dense and FlashLoop side by side; a trained model agrees with itself far above chance."""
    code, out, _ = _run(["generate", "--new-tokens", "12"], capsys)
    assert code == 0, out
    assert "model: ouro-python-6x256 (shipped checkpoint): 6 layers x 4 loops, float32 on cpu" in out
    assert "untrained" not in out
    assert "  > def find_python_files(root):" in out
    m = re.search(r"^agreement with dense: (\d+)/12 tokens", out, re.M)
    assert m and int(m.group(1)) >= 6, out
    # the continuation is text: the first columns row after the header holds printable Python
    rows = out.split("------ | ------")[1].strip("-\n ").splitlines()
    assert rows and all(r.isprintable() for r in rows)


def test_generate_text_prompt_on_a_preset(capsys):
    code, out, _ = _run(["generate", "--preset", "tiny", "--prompt", "x = 1\n", "--new-tokens", "2"], capsys)
    assert code == 0
    assert "prompt: 6 bytes of text, 6 tokens; 2 new tokens" in out and "  > x = 1" in out


def test_options_file_written_by_calibrate_is_read(tmp_path, capsys):
    cfg = FlashLoopConfig.from_dict({"kv_residual_quantization.enabled": True})
    path = tmp_path / "calibrated.json"
    path.write_text(json.dumps(cfg.to_dict(), indent=2, sort_keys=True) + "\n")  # as calibrate --out writes
    code, out, _ = _run(ARGS + ["--options", str(path)], capsys)
    assert code == 0
    assert "flashloop: kv_residual_quantization  (" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--options", json.dumps({"token_sparse_prefill.nope": 1})], r"unknown FlashLoop option 'token_sparse_prefill.nope'"),
        (["--options", json.dumps({"bogus": True})], r"unknown FlashLoop option 'bogus'"),
        (["--options", json.dumps({"token_sparse_prefill.enabled": True, "token_sparse_prefill.retention": [1, 1, 0.5]})],
         r"token_sparse_prefill.retention has 3 entries but the model runs 4 loops"),
        (["--options", "no/such/file.json"], r"--options 'no/such/file.json' is neither a JSON object nor a file"),
        (["--options", "{not json"], r"--options: the inline JSON is not valid JSON"),
        (["--prompt-len", "2000"], r"the prompt \(2000 tokens\) \+ --new-tokens 4 is 2004 positions, past the model's "
                                   r"max_position_embeddings=1024"),
    ],
)
def test_generate_errors_print_the_message_and_exit_nonzero(argv, message, capsys):
    code, out, err = _run(ARGS + argv, capsys)
    assert code == 1
    assert re.search(r"^flashloop-compile generate: error: " + message, err, re.M), err
    assert "Traceback" not in err and "--debug" in err


def test_debug_shows_the_traceback():
    from flashloop_compile.config import ConfigError

    with pytest.raises(ConfigError, match="unknown FlashLoop option 'bogus'"):
        main(ARGS + ["--options", json.dumps({"bogus": True}), "--debug"])
    with pytest.raises(ConfigError):
        main(["--debug"] + ARGS + ["--options", json.dumps({"bogus": True})])


@pytest.mark.parametrize("argv, message", [
    (["generate", "--new-tokens", "0"], "argument --new-tokens: must be at least 1, got 0"),
    (["generate", "--prompt-len", "0"], "argument --prompt-len: must be at least 1, got 0"),
    (["memory", "--context", "-3"], "argument --context: must be at least 1, got -3"),
])
def test_nonpositive_sizes_are_rejected(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_memory_reports_ratios_and_max_batch(capsys):
    code, out, _ = _run(["memory", "--preset", "ouro-1.4b", "--context", "32768", "--new-tokens", "256"], capsys)
    assert code == 0
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:]}
    assert float(rows["dense"][1]) == 24.0  # 2 x 4 loops x 24 layers x 16 heads x 32768 x 128 x 2 bytes
    assert float(rows["quant"][2]) > 3.4 and float(rows["all_on"][2]) > float(rows["quant"][2])
    assert int(rows["all_on"][3]) > int(rows["dense"][3])
    assert float(rows["dense"][4]) == 0.0 and float(rows["all_on"][4]) > 0.2  # decode scratch per request
    # the default model is ouro-1.4b and the default dtype BF16: the same table
    assert main(["memory"]) == 0 and capsys.readouterr().out == out


def test_memory_honours_dtype(capsys):
    code, out, _ = _run(["memory", "--preset", "ouro-1.4b", "--dtype", "float32"], capsys)
    assert code == 0 and "float32 weights" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line.split()[0] in ("dense", "quant")}
    assert float(rows["dense"][1]) == 48.0


@pytest.mark.parametrize("argv, message", [
    (["--context", "70000"], r"--context 70000 \+ --new-tokens 256 is 70256 positions, past the model's max_position_embeddings=65536"),
    (["--budget-gb", "10"], r"--budget-gb 10.0 leaves nothing for the KV cache: the weights take [\d.]+ GiB and --reserve-gb 8.0"),
])
def test_memory_rejects_impossible_plans(argv, message, capsys):
    code, _, err = _run(["memory", "--preset", "ouro-1.4b"] + argv, capsys)
    assert code == 1 and re.search(message, err), err


def test_memory_says_why_max_batch_is_zero(capsys):
    code, out, _ = _run(["memory", "--preset", "ouro-1.4b", "--budget-gb", "20"], capsys)
    assert code == 0
    assert re.search(r"^max batch 0: dense needs 24\.\d+ GiB per request.*but only [\d.]+ GiB is left", out, re.M), out


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
    args = ["bench", "--preset", "tiny", "--inner", "eager", "--contexts", "80", "--batches", "1",
            "--new-tokens", "3", "--configs", "dense,all_on", "--json", str(out), "--plot", str(tmp_path / "bench.png")]
    assert main(args) == 0
    rows = json.loads(out.read_text())
    assert [r["config"] for r in rows] == ["dense", "all_on"]
    # every config, dense included, takes the fast exact prefill attention by default (None: wherever it applies)
    assert all(r["options"]["compilation.position_attention"] is None for r in rows)
    assert rows[0]["options"]["kv_residual_quantization.enabled"] is False
    assert rows[0]["kv_ratio"] == 1.0 and rows[1]["kv_ratio"] > 1.0
    assert all(r["ttft_ms"] > 0 and r["tpot_ms"] > 0 for r in rows)
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_rejects_an_unknown_config(capsys):
    code, _, err = _run(["bench", "--preset", "tiny", "--configs", "dense,turbo"], capsys)
    assert code == 1 and "--configs: unknown ['turbo']; choose from dense, token_sparse" in err


def test_inspect_honours_dtype_and_says_larger(capsys):
    """A packed cache larger than the dense one (a short cache: the BF16 tail dominates) says
    'larger', not '0.78x smaller'; --dtype reaches the traced model and the accounting."""
    code, out, _ = _run(["inspect", "--preset", "tiny", "--dtype", "bfloat16", "--max-seq", "64", "--batch", "1",
                         "--prompt-len", "8"], capsys)
    assert code == 0, out
    assert "tiny, bfloat16 on cpu" in out and "dense bfloat16 KV: " in out
    assert re.search(r"packed KV: .*: [\d.]+x larger than dense", out), out
    assert "x smaller" not in out
    code, out, _ = _run(["inspect", "--preset", "tiny", "--max-seq", "1024", "--batch", "1", "--prompt-len", "8",
                         "--options", json.dumps({"kv_residual_quantization.enabled": True})], capsys)
    assert code == 0 and "float32 on cpu" in out and re.search(r"[\d.]+x smaller than dense", out), out


def test_version_and_python_m(capsys):
    from flashloop_compile import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith(f"flashloop-compile {__version__} (torch ")
    proc = subprocess.run([sys.executable, "-m", "flashloop_compile", "memory", "--context", "1024", "--new-tokens", "8"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[1].split()[0] == "dense"


@pytest.mark.parametrize("argv, message", [
    (["--out", "model.zip"], r"--out 'model.zip': the package path must end in \.pt2"),
    (["--out", "m.pt2", "--max-seq", "4096"], r"--max-seq 4096 is 4096 positions, past the model's max_position_embeddings=1024"),
    (["--out", "m.pt2", "--min-prompt", "1"], r"export: min_prompt=1 must be in \[2, max_seq=1024\]"),
])
def test_export_errors_print_the_message(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = _run(["export", "--preset", "tiny"] + argv, capsys)
    assert code == 1
    assert re.search(r"^flashloop-compile export: error: " + message, err, re.M), err


def test_dtype_and_device_defaults_are_the_same_in_every_subcommand():
    from flashloop_compile.cli import build_parser

    parser = build_parser()
    for argv in (["generate"], ["memory"], ["bench"], ["inspect"], ["export", "--out", "m.pt2"], ["eval"], ["redundancy"],
                 ["calibrate"]):
        args = parser.parse_args(argv)
        assert (args.dtype, args.device) == ("auto", "auto"), argv


def test_no_progress_or_warnings_when_not_a_terminal():
    """A CLI call in a pipe prints no progress bar and no warnings (Triton and NumPy are
    dependencies; nothing expected is logged on stderr)."""
    proc = subprocess.run([sys.executable, "-m", "flashloop_compile", "generate", "--preset", "tiny", "--prompt-len", "70",
                           "--new-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr == ""


def test_main_job_runs_without_triton():
    """Nothing on the reference generation path imports Triton (a platform without its wheels)."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from flashloop_compile.cli import main\n"
        "raise SystemExit(main(['generate', '--preset', 'tiny', '--prompt-len', '70', '--new-tokens', '2']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "agreement with dense" in proc.stdout


def test_a_backend_error_inside_torch_compile_prints_as_itself():
    from torch._dynamo.exc import BackendCompilerFailed

    from flashloop_compile.cli import _error_message
    from flashloop_compile.passes.recognize import RecognitionError

    wrapped = BackendCompilerFailed(lambda: None, RecognitionError("no recurrent block: unsupported model"), None)
    assert _error_message(wrapped) == "no recurrent block: unsupported model"
    assert _error_message(OSError("disk full")) == "OSError: disk full"
