"""Progress bars for long work (compiles, CUDA-graph captures, benchmark items), on stderr.

A bar is shown only on a terminal (``enabled=None``) or when asked (``enabled=True``); it is
silent when stderr is not a TTY, with ``enabled=False`` and under ``flashloop-compile --quiet``.
While one step runs for minutes (a first compile), a background thread refreshes the bar once a
second so the elapsed time keeps moving.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from tqdm import tqdm

__all__ = ["Progress", "progress_enabled", "COMPILE_HINT"]

# What a first compile costs (2 CPU cores; the H200), said on the bar while it runs.
COMPILE_HINT = "first compile: about 1-6 min on CPU, ~3 min all-on on a GPU"


def progress_enabled(enabled: bool | None) -> bool:
    """``None``: when stderr is a terminal."""
    if enabled is None:
        return bool(getattr(sys.stderr, "isatty", lambda: False)())
    return enabled


class Progress:
    """A tqdm bar over ``total`` steps; ``stage(text)`` says what runs now, ``advance()`` ends a step."""

    def __init__(self, total: int, desc: str, *, enabled: bool | None = None, leave: bool = True,
                 eta: bool = False, unit: str = "step", **kwargs: Any) -> None:
        fmt = "{desc}: {n_fmt}/{total_fmt} {unit}s [{elapsed}" + (" elapsed, ~{remaining} left" if eta else " elapsed") + "]{postfix}"
        self.bar = tqdm(total=total, desc=desc, disable=not progress_enabled(enabled), leave=leave, file=sys.stderr,
                        bar_format=fmt, unit=unit, dynamic_ncols=True, **kwargs)
        self._stop = threading.Event()
        self._ticker = None
        if not self.bar.disable:
            self._ticker = threading.Thread(target=self._tick, daemon=True)
            self._ticker.start()

    def _tick(self) -> None:
        while not self._stop.wait(1.0):
            self.bar.refresh()

    def stage(self, text: str) -> None:
        self.bar.set_postfix_str(text, refresh=True)

    def advance(self, n: int = 1) -> None:
        self.bar.update(n)

    def write(self, line: str) -> None:
        """Print a line (stdout) without breaking the bar."""
        if self.bar.disable:
            print(line, flush=True)
        else:
            tqdm.write(line, file=sys.stdout)

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        self.bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
