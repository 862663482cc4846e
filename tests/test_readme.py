"""Every code block in README.md runs as written: the python blocks in a fresh interpreter, every
shell command but those that make the environment (venv, activate, pip install) or run the whole
suite (this test runs inside it); ``flashloop-compile`` runs as ``python -m flashloop_compile``,
from the repository root as the README's commands do."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.S | re.M)

# Environment setup and the full suite: run by .ci/run itself, never from inside the suite.
SKIPPED = (
    re.compile(r"^python3 -m venv \S+$"),
    re.compile(r"^\. \S+/bin/activate$"),
    re.compile(r"^pip install torch==2\.13\.0 -e (\.|'\.\[\w+\]')$"),
    re.compile(r"^python3 -m pytest -q -n 2$"),
)


def _blocks(lang: str) -> list[str]:
    return [body for kind, body in BLOCK.findall((ROOT / "README.md").read_text()) if kind == lang]


def _commands() -> list[str]:
    lines = [line.strip() for body in _blocks("bash") for line in body.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def test_the_readme_has_the_blocks_this_test_runs():
    assert len(_blocks("python")) >= 1
    kinds = {kind for kind, _ in BLOCK.findall((ROOT / "README.md").read_text())}
    assert kinds <= {"python", "bash", "text"}, kinds  # a new kind of block needs a way to run here
    commands = _commands()
    assert "flashloop-compile generate" in commands  # the first command: the main job
    assert commands.index("flashloop-compile generate") < min(i for i, c in enumerate(commands) if "pytest" in c)


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    suite = [c for c in _commands() if "pytest" in c]
    assert suite == ["python3 -m pytest -q -n 2"]
    assert ci[-1] == suite[0]
    assert "python3 -m pip install -q torch==2.13.0 -e '.[test]'" in ci


@pytest.mark.parametrize("command", [c for c in _commands() if not any(p.match(c) for p in SKIPPED)])
def test_shell_command_runs(command):
    argv = shlex.split(command)
    if argv[0] == "flashloop-compile":
        argv = [sys.executable, "-m", "flashloop_compile"] + argv[1:]
    else:
        pytest.fail(f"README runs {command!r}: teach this test how to run it, or skip it explicitly")
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_python_block_runs(index, tmp_path):
    script = tmp_path / f"readme_block_{index}.py"
    script.write_text(_blocks("python")[index])
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
