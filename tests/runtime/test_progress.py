"""Progress bars: shown on a terminal or when asked, silent in a pipe or when told."""

from __future__ import annotations

from flashloop_compile.runtime.progress import Progress, progress_enabled


def test_a_bar_says_what_runs_and_counts_its_steps(capfd):
    with Progress(2, "warm-up", enabled=True) as bar:
        bar.stage("compiling prefill")
        bar.advance()
        bar.write("a result line")
        bar.advance()
    out, err = capfd.readouterr()
    assert "a result line" in out
    assert "warm-up: 2/2" in err and "compiling prefill" in err and "elapsed" in err


def test_silent_in_a_pipe_and_when_told(capfd):
    assert progress_enabled(None) is False  # pytest's captured stderr is not a terminal
    for enabled in (None, False):
        with Progress(3, "bench", enabled=enabled, eta=True) as bar:
            bar.stage("compiling")
            bar.advance(3)
            bar.write("row")
    out, err = capfd.readouterr()
    assert out == "row\nrow\n" and err == ""
