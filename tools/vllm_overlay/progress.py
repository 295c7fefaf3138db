"""Long work shows itself: a child process streamed into its log, with a status on stderr.

``util.run(..., log=PATH)`` runs here. The child's output (stdout and stderr together, in
order) goes to the log line by line, flushed as it comes, so ``tail -f LOG`` follows it; a
killed or failed run leaves it there. On stderr:

- on a terminal, one line redrawn in place (a spinner, what runs, the time so far and the
  child's last line), as pip and uv draw theirs; cleared at the end for a closing line;
- elsewhere (CI, pipes), plain lines: one when it starts (naming the log), one every
  ``interval`` seconds while it runs, one when it ends.

Ctrl-C or SIGTERM stops the child's whole process group (setup.py's compilers too: SIGINT,
then SIGTERM, then SIGKILL), writes the rest of its output and a closing line to the log, says
where the log is, and goes on as a KeyboardInterrupt (``main`` exits 130).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pty
import re
import select
import shlex
import signal
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TextIO

from vllm_overlay.errors import CommandError, missing_program

INTERVAL_ENV = "VLLM_OVERLAY_PROGRESS_INTERVAL"
DEFAULT_INTERVAL = 30.0  # seconds between "still running" lines off a terminal
REDRAW = 0.1  # seconds between redraws of the line on a terminal
GRACE = 10.0  # seconds a stopped child gets at each signal before the next
SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"  # uv's
SPINNER_ASCII = "|/-\\"  # pip's, where the terminal cannot show the other
_ESCAPES = re.compile(rb"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07]*\x07|[@-Z\\-_])")
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


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While the child runs, SIGTERM is a KeyboardInterrupt (the child is stopped, the log
    kept) instead of this process vanishing with the child left running."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    before = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def _stop(proc: subprocess.Popen) -> str:
    """Stop the child's process group: SIGINT, SIGTERM, then SIGKILL, each given GRACE
    seconds; what remains of the group after the child exits is killed. Returns how."""
    how = "SIGKILL"
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(GRACE)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            continue  # not yet, or a second Ctrl-C: the next signal
        how = sig.name
        break
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    return how


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except OSError as e:  # a terminal's master reads EIO once the child side is closed
        if e.errno == errno.EIO:
            return b""
        raise


def _clean(line: bytes, raw: bool) -> bytes:
    """A line for the log: a terminal's redraws (``\\r``) and escapes reduced to what shows."""
    if not raw:
        return line
    line = _ESCAPES.sub(b"", line.rstrip(b"\r"))
    return line.rsplit(b"\r", 1)[-1]


def run_logged(
    argv: Sequence[str],
    *,
    log: Path,
    what: str,
    cwd: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None,
    check: bool,
    hint: str,
    timeout: float | None,
    interval: float | None,
    header: str,
    terminal: bool,
    stream: TextIO | None = None,
) -> tuple[int, str]:
    """``util.run``'s streaming mode: (return code, the whole output). ``terminal``: on a
    terminal the child gets one of its own and draws on ours (twine's bar); off one, it
    runs as any other."""
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    status = Status(what, log, interval=interval_default() if interval is None else interval,
                    stream=stream, spinner=not terminal)  # fmt: skip
    raw = terminal and status.tty
    out_lines: list[str] = []
    with open(log, "wb") as f:

        def write(line: bytes) -> None:
            line = _clean(line, raw)
            f.write(line + b"\n")
            f.flush()
            text = line.decode(errors="replace")
            out_lines.append(text)
            status.output(text)

        if header:
            f.write(header.rstrip("\n").encode() + b"\n")
        f.write(f"$ {shlex.join(argv)}\n".encode())
        f.flush()
        master = slave = -1
        if raw:
            master, slave = pty.openpty()
            with contextlib.suppress(OSError):
                size = fcntl.ioctl(status.stream.fileno(), termios.TIOCGWINSZ, b"\0" * 8)
                fcntl.ioctl(slave, termios.TIOCSWINSZ, size)
        try:
            proc = subprocess.Popen(
                argv, cwd=cwd, env=dict(env) if env is not None else None,
                stdin=subprocess.DEVNULL, stdout=slave if raw else subprocess.PIPE,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        except FileNotFoundError as e:
            raise missing_program(argv[0], e) from e
        finally:
            if raw:
                os.close(slave)
        fd = master if raw else proc.stdout.fileno()  # type: ignore[union-attr]
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = b""
        status.start()
        try:
            with sigterm_interrupts():
                while True:
                    wait = REDRAW if status.spinner else max(status.interval, REDRAW)
                    if deadline is not None:
                        wait = max(0.0, min(wait, deadline - time.monotonic()))
                    if select.select([fd], [], [], wait)[0]:
                        data = _read(fd)
                        if not data:
                            break
                        if raw:
                            status.stream.flush()
                            os.write(status.stream.fileno(), data)
                        *lines, pending = (pending + data).split(b"\n")
                        for line in lines:
                            write(line)
                    status.poll()
                    if deadline is not None and time.monotonic() >= deadline:
                        _stop(proc)
                        f.write(f"--- timed out after {timeout} s\n".encode())
                        status.end(f"{what}: timed out after {timeout} s; its output is in {log}")
                        raise CommandError(tuple(argv), -1, "\n".join(out_lines), "",
                                           f"timed out after {timeout} s; its output is in {log}")  # fmt: skip
                if pending:
                    write(pending)
                rc = proc.wait()
        except KeyboardInterrupt as e:
            how = _stop(proc)
            while select.select([fd], [], [], 0)[0] and (data := _read(fd)):
                pending += data
            for line in pending.split(b"\n") if pending else ():
                write(line)
            why = str(e) or "Ctrl-C"
            f.write(f"--- interrupted ({why}) after {status.so_far()}; child stopped by {how}\n"
                    .encode())  # fmt: skip
            f.flush()
            status.end(f"{what}: interrupted ({why}) after {status.so_far()}; "
                       f"its output so far is in {log}")  # fmt: skip
            raise
        finally:
            if raw:
                os.close(master)
            elif proc.stdout is not None:
                proc.stdout.close()
        f.write(f"--- exit code {rc} after {status.so_far()}\n".encode())
    text = "\n".join(out_lines) + ("\n" if out_lines else "")
    if rc == 0:
        status.end(f"{what}: done in {status.so_far()}")
    else:
        status.end(f"{what}: failed (exit code {rc}) after {status.so_far()}; its output is "
                   f"in {log}")  # fmt: skip
        if check:
            more = f"Its full output is in {log}."
            raise CommandError(tuple(argv), rc, text, "", f"{hint} {more}" if hint else more)
    return rc, text
