"""The one way this tool starts a child process, and the one way it stops one.

Every child starts in ``_start``: an argument list (never a shell string), stdin from
/dev/null (or ``input``), in a process group of its own (its children, setup.py's compilers
or pytest's workers, go with it), and a program that is not there is an ``OverlayError``
saying to install it. There are three ways to run one:

- ``run(*cmd)``: wait for it and capture its output. On a non-zero exit (with ``check``) the
  ``CommandError`` renders the command, the return code, stdout and stderr, and ``hint``
  (what to do next).
- ``run(*cmd, log=PATH, what=...)``: long work. The output (stdout and stderr together, in
  order) goes to the log line by line as it comes, so ``tail -f LOG`` follows it, and
  stderr shows what runs (``progress.Status``: in place on a terminal, a plain line every
  ``interval`` seconds elsewhere); a killed or failed run leaves the log there, and the
  error names it. ``terminal``: on a terminal the child gets one of its own and draws on
  ours (twine's bar); the log gets what shows.
- ``run_bytes(*cmd)``: ``run`` with bytes in and out (git's blobs, merges and diffs).
- ``group(cmd, ...)``: the running child, for a caller that watches it while it runs (the
  pytest runner's progress lines and its time limit).
- ``start(cmd, ...)``: a child another library reads while it runs (GitPython's persistent
  ``cat-file --batch``): in its group, piped, stopped by the caller with ``stop``.

The stop policy, for every child: its whole process group gets SIGINT, then SIGTERM, then
SIGKILL, each ``GRACE`` seconds after the last, until the child exits; what remains of the
group then is killed (``stop``). A child is stopped so when its time runs out (``timeout``),
when a ``group`` block ends with it still running (an error, a time limit), and when the
tool is interrupted: while a child runs, SIGTERM to the tool is a KeyboardInterrupt as Ctrl-C
is (``sigterm_interrupts``), so a stopped tool leaves no child behind. The interrupt goes on
(``main`` exits 130); a log gets the rest of the child's output and a closing line, and
stderr says where the log is.
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
import termios
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, BinaryIO, TextIO

from vllm_overlay import progress
from vllm_overlay.errors import CommandError, CommandTimeout, missing_program

GRACE = 10.0  # seconds a stopped child gets at each signal before the next
_ESCAPES = re.compile(rb"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07]*\x07|[@-Z\\-_])")


@dataclass(frozen=True)
class Output:
    """What a child that ran to its end gave: its return code and its output."""

    returncode: int
    stdout: str
    stderr: str


@dataclass(frozen=True)
class BytesOutput:
    """What ``run_bytes`` returns: stdout as the child wrote it, stderr as text (undecodable
    bytes kept as surrogates)."""

    returncode: int
    stdout: bytes
    stderr: str


def run(
    *cmd: str | os.PathLike[str],
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    input: str | None = None,
    hint: str = "",
    timeout: float | None = None,
    log: str | os.PathLike[str] | None = None,
    what: str = "",
    interval: float | None = None,
    header: str = "",
    terminal: bool = False,
    stream: TextIO | None = None,
) -> Output:
    """Run a command and wait for it (see the module's docstring).

    Without ``log``: stdout and stderr captured apart. With ``log``: both together, in order,
    returned as ``stdout``, written to ``log`` after ``header``, with ``what`` running shown
    on ``stream`` (stderr); no ``input``. ``timeout``: seconds before the child is stopped
    and a ``CommandError`` says it timed out.
    """
    argv = tuple(os.fspath(c) for c in cmd)
    if log is not None:
        return _run_logged(
            argv, log=Path(log), what=what or os.path.basename(argv[0]), cwd=cwd, env=env,
            check=check, hint=hint, timeout=timeout, interval=interval, header=header,
            terminal=terminal, stream=stream,
        )  # fmt: skip
    rc, stdout, stderr = _communicate(argv, cwd, env, input, timeout, hint, text=True)
    if check and rc != 0:
        raise CommandError(argv, rc, stdout, stderr, hint)
    return Output(rc, stdout, stderr)


def run_bytes(
    *cmd: str | os.PathLike[str],
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    check: bool = True,
    input: bytes | None = None,
    hint: str = "",
    timeout: float | None = None,
) -> BytesOutput:
    """``run`` (without ``log``) with bytes in and out: ``input`` and stdout are bytes."""
    argv = tuple(os.fspath(c) for c in cmd)
    rc, stdout, stderr = _communicate(argv, cwd, env, input, timeout, hint, text=False)
    err = stderr.decode(errors="surrogateescape")
    if check and rc != 0:
        raise CommandError(argv, rc, stdout.decode(errors="replace"), err, hint)
    return BytesOutput(rc, stdout, err)


def _communicate(
    argv: tuple[str, ...], cwd: str | os.PathLike[str] | None, env: Mapping[str, str] | None,
    input: Any, timeout: float | None, hint: str, *, text: bool,
) -> tuple[int, Any, Any]:  # fmt: skip
    """Start the child, feed it ``input``, wait for it; past ``timeout`` it is stopped and a
    ``CommandTimeout`` says so (with ``hint``)."""
    proc = _start(argv, cwd=cwd, env=env, text=text, stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE,
                  stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL)  # fmt: skip
    with proc, _watched(proc):
        try:
            stdout, stderr = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            how = stop(proc)
            stdout, stderr = proc.communicate()  # what it wrote, to the end
            if not text:
                stdout, stderr = (x.decode(errors="replace") for x in (stdout, stderr))
            why = f"timed out after {timeout:g} s (stopped by {how})"
            raise CommandTimeout(argv, -1, stdout, stderr, f"{why}; {hint}" if hint else why) from e
    return proc.returncode, stdout, stderr


def start(
    cmd: Sequence[str], *, cwd: str | os.PathLike[str] | None, env: Mapping[str, str] | None,
    stdin: int = subprocess.DEVNULL,
) -> subprocess.Popen[bytes]:  # fmt: skip
    """``cmd`` running in a process group of its own, stdout and stderr piped (bytes), for a
    caller that reads it as it runs and stops it with ``stop`` when done."""
    return _start(tuple(cmd), cwd=cwd, env=env, stdin=stdin, stdout=subprocess.PIPE,
                  stderr=subprocess.PIPE)  # fmt: skip


@contextlib.contextmanager
def group(
    cmd: Sequence[str], *, cwd: str | os.PathLike[str] | None, env: Mapping[str, str] | None,
    stdout: int | IO[Any],
) -> Iterator[subprocess.Popen[bytes]]:  # fmt: skip
    """``cmd`` running, its output (stdout and stderr together) to ``stdout``: the caller
    waits for it. A child still running when the block ends is stopped (``stop``)."""
    proc = _start(tuple(cmd), cwd=cwd, env=env, stdout=stdout, stderr=subprocess.STDOUT)
    with _watched(proc):
        yield proc


def stop(proc: subprocess.Popen[Any]) -> str:
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


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While the child runs, SIGTERM is a KeyboardInterrupt (the child is stopped, a log
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


def _start(
    argv: tuple[str, ...], *, cwd: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None, stdout: int | IO[Any], stderr: int | IO[Any],
    stdin: int = subprocess.DEVNULL, text: bool = False,
) -> subprocess.Popen[Any]:  # fmt: skip
    """The one place a child starts: in a process group of its own (see the module)."""
    try:
        return subprocess.Popen(
            argv, cwd=cwd, env=dict(env) if env is not None else None, stdin=stdin,
            stdout=stdout, stderr=stderr, text=text, start_new_session=True,
        )  # fmt: skip
    except FileNotFoundError as e:
        raise missing_program(argv[0], e) from e


@contextlib.contextmanager
def _watched(proc: subprocess.Popen[Any]) -> Iterator[None]:
    """SIGTERM interrupts while the block runs; the child is stopped if it outlives it."""
    try:
        with sigterm_interrupts():
            yield
    finally:
        if proc.poll() is None:
            stop(proc)


class _LogLines:
    """The log of one streamed run: each of the child's lines written and flushed as it
    comes (a terminal's redraws reduced to what shows), kept, and shown to the status."""

    def __init__(self, f: BinaryIO, raw: bool, status: progress.Status) -> None:
        self.f, self.raw, self.status = f, raw, status
        self.lines: list[str] = []
        self.pending = b""  # a line begun and not yet ended

    def feed(self, data: bytes) -> None:
        *lines, self.pending = (self.pending + data).split(b"\n")
        for line in lines:
            self.line(line)

    def line(self, line: bytes) -> None:
        if self.raw:
            line = _ESCAPES.sub(b"", line.rstrip(b"\r")).rsplit(b"\r", 1)[-1]
        self.note(line + b"\n")
        text = line.decode(errors="replace")
        self.lines.append(text)
        self.status.output(text)

    def note(self, data: bytes | str) -> None:
        self.f.write(data.encode() if isinstance(data, str) else data)
        self.f.flush()

    def text(self) -> str:
        return "\n".join(self.lines) + ("\n" if self.lines else "")


def _run_logged(
    argv: tuple[str, ...], *, log: Path, what: str, cwd: str | os.PathLike[str] | None,
    env: Mapping[str, str] | None, check: bool, hint: str, timeout: float | None,
    interval: float | None, header: str, terminal: bool, stream: TextIO | None,
) -> Output:  # fmt: skip
    """``run``'s streaming mode (see the module's docstring)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    status = progress.Status(what, log, stream=stream, spinner=not terminal,
                             interval=progress.interval_default() if interval is None else interval)  # fmt: skip
    raw = terminal and status.tty
    with open(log, "wb") as f:
        out = _LogLines(f, raw, status)
        if header:
            out.note(header.rstrip("\n") + "\n")
        out.note(f"$ {shlex.join(argv)}\n")
        master = slave = -1
        if raw:
            master, slave = _pty(status.stream)
        try:
            proc = _start(argv, cwd=cwd, env=env, stdout=slave if raw else subprocess.PIPE,
                          stderr=subprocess.STDOUT)  # fmt: skip
        finally:
            if raw:
                os.close(slave)
        fd = master if raw else proc.stdout.fileno()  # type: ignore[union-attr]
        try:
            with _watched(proc):
                rc = _follow(proc, fd, out, status, raw, timeout, what, log)
        finally:
            if raw:
                os.close(master)
            elif proc.stdout is not None:
                proc.stdout.close()
        out.note(f"--- exit code {rc} after {status.so_far()}\n")
    text = out.text()
    if rc == 0:
        status.end(f"{what}: done in {status.so_far()}")
    else:
        status.end(f"{what}: failed (exit code {rc}) after {status.so_far()}; its output is "
                   f"in {log}")  # fmt: skip
        if check:
            more = f"Its full output is in {log}."
            raise CommandError(argv, rc, text, "", f"{hint} {more}" if hint else more)
    return Output(rc, text, "")


def _pty(stream: TextIO) -> tuple[int, int]:
    """A new terminal (master, slave) as wide as ``stream``'s."""
    master, slave = pty.openpty()
    with contextlib.suppress(OSError):
        size = fcntl.ioctl(stream.fileno(), termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(slave, termios.TIOCSWINSZ, size)
    return master, slave


def _follow(
    proc: subprocess.Popen[bytes], fd: int, out: _LogLines, status: progress.Status, raw: bool,
    timeout: float | None, what: str, log: Path,
) -> int:  # fmt: skip
    """Read the child's output from ``fd`` into the log until it ends; its return code.
    A timeout or an interrupt stops it and says so in the log and on the status line."""
    deadline = None if timeout is None else time.monotonic() + timeout
    status.start()
    try:
        while True:
            wait = progress.REDRAW if status.spinner else max(status.interval, progress.REDRAW)
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            if select.select([fd], [], [], wait)[0]:
                data = _read(fd)
                if not data:
                    break
                if raw:
                    status.stream.flush()
                    os.write(status.stream.fileno(), data)
                out.feed(data)
            status.poll()
            if deadline is not None and time.monotonic() >= deadline:
                stop(proc)
                out.note(f"--- timed out after {timeout} s\n")
                status.end(f"{what}: timed out after {timeout} s; its output is in {log}")
                raise CommandError(tuple(proc.args), -1, "\n".join(out.lines), "",  # type: ignore[arg-type]
                                   f"timed out after {timeout} s; its output is in {log}")  # fmt: skip
        if out.pending:
            out.line(out.pending)
        return proc.wait()
    except KeyboardInterrupt as e:
        how = stop(proc)
        pending = out.pending
        while select.select([fd], [], [], 0)[0] and (data := _read(fd)):
            pending += data
        for line in pending.split(b"\n") if pending else ():
            out.line(line)
        why = str(e) or "Ctrl-C"
        out.note(f"--- interrupted ({why}) after {status.so_far()}; child stopped by {how}\n")
        status.end(f"{what}: interrupted ({why}) after {status.so_far()}; "
                   f"its output so far is in {log}")  # fmt: skip
        raise


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 1 << 16)
    except OSError as e:  # a terminal's master reads EIO once the child side is closed
        if e.errno == errno.EIO:
            return b""
        raise
