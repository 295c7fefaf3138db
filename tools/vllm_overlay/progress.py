"""Long work shows itself: what a child streamed into its log is doing, on stderr.

``process.run(..., log=PATH)`` streams the child's output into its log and shows it here. On
stderr:

- on a terminal, one line redrawn in place (a spinner, what runs, the time so far and the
  child's last line), as pip and uv draw theirs; cleared at the end for a closing line;
- elsewhere (CI, pipes), plain lines: one when it starts (naming the log), one every
  ``interval`` seconds while it runs, one when it ends.
"""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path
from typing import TextIO

INTERVAL_ENV = "VLLM_OVERLAY_PROGRESS_INTERVAL"
DEFAULT_INTERVAL = 30.0  # seconds between "still running" lines off a terminal
REDRAW = 0.1  # seconds between redraws of the line on a terminal
SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"  # uv's
SPINNER_ASCII = "|/-\\"  # pip's, where the terminal cannot show the other
# A build step as Ninja (and so CMake) numbers it: "[123/493] Building CXX object …".
_STEP = re.compile(r"^\[(\d+)/(\d+)\] ")


def interval_default() -> float:
    """$VLLM_OVERLAY_PROGRESS_INTERVAL seconds, else DEFAULT_INTERVAL."""
    try:
        return max(0.0, float(os.environ.get(INTERVAL_ENV, "")))
    except ValueError:
        return DEFAULT_INTERVAL


def elapsed(seconds: float) -> str:
    """``5s``, ``2m05s``, ``1h02m05s``."""
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


class Status:
    """What a long child is doing, on ``stream`` (stderr): see the module's docstring."""

    def __init__(
        self, what: str, log: Path, *, interval: float, stream: TextIO | None = None,
        spinner: bool = True,
    ) -> None:  # fmt: skip
        self.what, self.log, self.interval = what, log, interval
        self.stream = stream or sys.stderr
        self.tty = is_terminal(self.stream)
        self.spinner = spinner and self.tty  # False: the child draws its own (twine's bar)
        enc = (getattr(self.stream, "encoding", "") or "").lower().replace("-", "")
        self.frames = SPINNER if enc == "utf8" else SPINNER_ASCII
        self.started = self._said = self._drawn = time.monotonic()
        self.last = ""
        self.step = ""  # the child's last "[n/N]" build step (Ninja's), if it numbers them
        self.n = 0
        self._shown = False

    def start(self) -> None:
        self.started = self._said = time.monotonic()
        self._say(f"{self.what} (log: {self.log})")
        self._draw()

    def output(self, line: str) -> None:
        if line.strip():
            self.last = line.strip()
            m = _STEP.match(self.last)
            if m:
                self.step = f"step {m.group(1)} of {m.group(2)}"
        self.poll()

    def poll(self) -> None:
        now = time.monotonic()
        if self.spinner:
            if now - self._drawn >= REDRAW:
                self._draw()
        elif not self.tty and now - self._said >= self.interval:
            self._said = now
            at = f", at {self.step}" if self.step else ""
            self._say(f"{self.what}: still running after {self.so_far()}{at} (log: {self.log})")

    def end(self, text: str) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self._shown = False
        self._say(text)

    def so_far(self) -> str:
        return elapsed(time.monotonic() - self.started)

    def _say(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def _draw(self) -> None:
        if not self.spinner:
            return
        self._drawn = time.monotonic()
        frame = self.frames[self.n % len(self.frames)]
        self.n += 1
        text = f"{frame} {self.what} {self.so_far()}" + (f"  {self.last}" if self.last else "")
        width = _columns(self.stream) - 1
        self.stream.write("\r" + text[:width] + "\x1b[K")
        self.stream.flush()
        self._shown = True


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns or 80
    except (OSError, AttributeError, ValueError):
        return 80
