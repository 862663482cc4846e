"""The quality subcommands on the tiny preset with tiny sizes."""

from __future__ import annotations

import json

from flashloop_compile.cli import build_parser, main
from flashloop_compile.config import FlashLoopConfig


def test_train_cli(tmp_path, capsys):
    out = tmp_path / "ck"
    assert main(["train", "--out", str(out), "--seconds", "60", "--max-steps", "3", "--layers", "1", "--hidden", "64",
                 "--head-dim", "32", "--seq-len", "32", "--batch", "2", "--warmup", "1", "--log-every", "1",
                 "--eval-every", "2", "--max-docs", "10", "--device", "cpu", "--packages", "sympy",
                 "--retrieval-fraction", "0.2"]) == 0
    assert "unigram baseline" in capsys.readouterr().out
    assert (out / "model.safetensors").is_file() and (out / "train_log.txt").is_file()
    cmd = (out / "command.txt").read_text().split()
    assert cmd[:4] == ["python3", "-m", "flashloop_compile.cli", "train"]
    # the recorded command spells out every option and parses back to the same run
    from flashloop_compile.cli import build_parser

    again = vars(build_parser().parse_args(cmd[3:]))
    assert again["max_steps"] == 3 and again["hidden"] == 64 and again["compile"] is False and again["select_best"] is True
    assert again["packages"] == ["sympy"] and again["retrieval_fraction"] == 0.2 and again["retrieval_pairs"] == 4
    # the checkpoint evaluates
    assert main(["eval", "--checkpoint", str(out), "--configs", "dense", "--docs", "1", "--contexts", "64",
                 "--continuation", "4", "--trials", "0", "--n-boot", "20"]) == 0
    assert "| `dense` |" in capsys.readouterr().out


def test_eval_cli(tmp_path, capsys):
    js, md = tmp_path / "e.json", tmp_path / "e.md"
    assert main(["eval", "--preset", "tiny", "--configs", "all-on", "tsp@keep_last", "--docs", "2", "--contexts", "64",
                 "--continuation", "4", "--retrieval-context", "96", "--depths", "0.5", "--trials", "1",
                 "--n-boot", "20", "--json", str(js), "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert "| `tsp@keep_last` |" in out and md.read_text().startswith("### Quality vs dense: tiny")
    data = json.loads(js.read_text())
    assert [r["config"] for r in data["rows"]] == ["dense", "all-on", "tsp@keep_last"]
    assert data["settings"]["engine"] == "reference" and "reference FlashLoop" in md.read_text()
    # --engine compiled: each config's compiled engine (tests/quality/test_evaluate.py runs it)
    args = build_parser().parse_args(["eval", "--preset", "tiny", "--engine", "compiled", "--agreement-docs", "3"])
    assert (args.engine, args.agreement_docs) == ("compiled", 3)


def test_redundancy_cli(tmp_path, capsys):
    js = tmp_path / "r.json"
    assert main(["redundancy", "--preset", "tiny", "--seqs", "1", "--seq-len", "96", "--json", str(js)]) == 0
    assert "Nestedness" in capsys.readouterr().out
    data = json.loads(js.read_text())
    assert data["model"] == "tiny" and "int4_error" in data


def test_calibrate_cli(tmp_path, capsys):
    cfg, js = tmp_path / "cfg.json", tmp_path / "cal.json"
    assert main(["calibrate", "--preset", "tiny", "--seqs", "1", "--seq-len", "96", "--threshold", "0.2",
                 "--out", str(cfg), "--json", str(js)]) == 0
    assert "### Calibration" in capsys.readouterr().out
    loaded = FlashLoopConfig.from_dict(json.loads(cfg.read_text())).resolve(4)
    assert json.loads(js.read_text())["config"] == loaded.to_dict()
    # the calibrated file is accepted by eval --configs and by generate --options
    assert main(["generate", "--preset", "tiny", "--prompt-len", "70", "--new-tokens", "2", "--options", cfg.read_text()]) == 0


def test_train_cli_resume(tmp_path, capsys):
    first, rest = tmp_path / "first", tmp_path / "rest"
    base = ["train", "--seconds", "60", "--max-steps", "4", "--layers", "1", "--hidden", "64", "--head-dim", "32",
            "--seq-len", "32", "--batch", "2", "--warmup", "1", "--log-every", "1", "--eval-every", "2", "--max-docs", "10",
            "--device", "cpu"]
    assert main(base + ["--out", str(first), "--resumable", "--call-steps", "2"]) == 0
    assert "continue with --resume" in capsys.readouterr().out
    assert main(base + ["--out", str(rest), "--resume", str(first)]) == 0
    assert "resumed: step 2 of 4" in capsys.readouterr().out
    assert json.loads((rest / "train_state.json").read_text())["step"] == 4
    again = vars(build_parser().parse_args((rest / "command.txt").read_text().split()[3:]))
    assert again["resume"] == str(first) and again["resumable"] is True
    # without --max-steps a resumable run is refused (the error, not a traceback)
    assert main([a for a in base if a not in ("--max-steps", "4")] + ["--out", str(tmp_path / "x"), "--resumable"]) == 1
    assert "needs max_steps" in capsys.readouterr().err
