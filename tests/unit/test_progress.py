"""Long work shows itself (process.run with a log, progress.py): real child processes, their logs
read while they run, interrupted by real signals, shown on a pipe and on a real terminal (pty).

Nothing here waits on the clock: each test synchronizes on what it made (a line in the log, a
file the child waits for, the end of a pipe). The "still running" interval is 0, so that line
comes after every line the child prints."""

from __future__ import annotations

import os
import pty
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from vllm_overlay import process
from vllm_overlay.errors import CommandError

# A child that prints its first lines (stdout and stderr), then waits for a file the test
# makes once it has read them in the log (60 s at most: a broken test does not hang).
CHILD = textwrap.dedent("""\
    import os, sys, time
    go = sys.argv[1]
    print("first line", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    print(f"pid {os.getpid()}", flush=True)
    end = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < end:
        time.sleep(0.01)
    print("after go", flush=True)
    sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
""")

# The tool's side, in a process of its own: process.run streaming the child into a log, under
# main's handling of Ctrl-C (exit 130).
RUNNER = textwrap.dedent("""\
    import signal, sys
    from vllm_overlay import process
    # as at a terminal: pytest-xdist's workers start children with SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    child, go, log = sys.argv[1:4]
    try:
        process.run(sys.executable, child, go, log=log, what="the child", interval=0)
    except KeyboardInterrupt:
        print("vllm-overlay: interrupted", file=sys.stderr)
        sys.exit(130)
""")


def wait_for(path: Path, text: str) -> str:
    """``path``'s text once it holds ``text`` (what the test synchronizes on)."""
    end = time.monotonic() + 60
    while time.monotonic() < end:
        got = path.read_text() if path.exists() else ""
        if text in got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"{path} never held {text!r}: {got!r}")


@pytest.fixture
def child(tmp_path: Path) -> Path:
    p = tmp_path / "child.py"
    p.write_text(CHILD)
    return p


def test_the_log_holds_the_first_lines_while_the_child_runs(tmp_path, child):
    log, go = tmp_path / "logs" / "child.log", tmp_path / "go"
    got: dict = {}

    def tool() -> None:
        try:
            process.run(sys.executable, child, go, "3", log=log, what="the child", interval=0)
        except CommandError as e:
            got["error"] = e

    t = threading.Thread(target=tool)
    t.start()
    try:
        seen = wait_for(log, "pid ")
        # The child is blocked on the go file: these lines came while it ran.
        assert "first line\n" in seen and "to stderr\n" in seen and "after go" not in seen
        assert seen.startswith("$ ") and str(child) in seen.splitlines()[0]
    finally:
        go.touch()
        t.join()
    text = log.read_text()
    assert text.index("first line") < text.index("after go") < text.index("--- exit code 3")
    # A failure names the log, and carries the output (both streams, in order).
    err = got["error"]
    assert err.returncode == 3 and f"Its full output is in {log}." in str(err)
    assert "first line\nto stderr\n" in err.stdout


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_run_stops_the_child_and_keeps_the_log(tmp_path, child, sig):
    log, go = tmp_path / "child.log", tmp_path / "go-never-made"
    # The runner's stderr goes to a file: a pipe nobody drains while the test waits for the
    # log would fill with its "still running" lines and stall it.
    err_file = tmp_path / "runner.err"
    with open(err_file, "w") as err_out:
        runner = subprocess.Popen(
            [sys.executable, "-c", RUNNER, child, go, log],
            stdout=subprocess.DEVNULL, stderr=err_out, text=True,
        )  # fmt: skip
    try:
        seen = wait_for(log, "pid ")
        pid = int(seen.split("pid ")[1].split()[0])
        runner.send_signal(sig)
        runner.wait(timeout=600)  # a guard against a hang only: the stop takes <= 3 graces
    finally:
        if runner.poll() is None:
            runner.kill()
    err = err_file.read_text()
    assert runner.returncode == 130, err
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the child is gone (stopped and reaped)
    text = log.read_text()
    assert "first line\nto stderr\n" in text and "after go" not in text
    assert f"--- interrupted (signal {sig.name})" in text or (
        sig == signal.SIGINT and "--- interrupted (Ctrl-C)" in text
    )
    assert f"its output so far is in {log}" in err


def test_off_a_terminal_plain_lines(tmp_path, child):
    log, go = tmp_path / "child.log", tmp_path / "go"
    go.touch()
    res = subprocess.run([sys.executable, "-c", RUNNER, child, go, log],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "\r" not in res.stderr and "\x1b" not in res.stderr
    lines = res.stderr.splitlines()
    assert lines[0] == f"the child (log: {log})"
    assert any(ln.startswith("the child: still running after ") for ln in lines[1:-1])
    assert lines[-1].startswith("the child: done in ")
    assert res.stdout == ""  # stdout stays the tool's own


def on_a_terminal(argv: list[str]) -> str:
    """What ``argv`` writes to its stderr when that is a terminal (a real pty)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=slave, env={**os.environ, "TERM": "xterm"})  # fmt: skip
    os.close(slave)
    out = b""
    while True:
        try:
            data = os.read(master, 1 << 16)
        except OSError:  # EIO: every writer closed its side
            break
        if not data:
            break
        out += data
    os.close(master)
    assert proc.wait(timeout=60) == 0
    return out.decode(errors="replace")


def test_on_a_terminal_one_line_updated_in_place(tmp_path, child):
    log, go = tmp_path / "child.log", tmp_path / "go"
    go.touch()
    shown = on_a_terminal([sys.executable, "-c", RUNNER, child, go, log])
    first, _, rest = shown.partition("\n")
    assert first.rstrip("\r") == f"the child (log: {log})"
    # The status line: redrawn in place with a spinner and the time so far, then cleared.
    assert "\r" in rest and "\x1b[K" in rest and re.search(r"\r\S the child \d+s", rest)
    assert rest.count("\n") == 1  # one line below the first, the closing one
    assert "\r\x1b[Kthe child: done in " in rest
    # The log has the child's lines, never the terminal's drawing.
    assert "\x1b" not in log.read_text() and "after go" in log.read_text()


def test_a_child_that_draws_its_own_progress_draws_it_on_the_terminal(tmp_path):
    """terminal=True (twine's bar): the child gets a terminal; the log gets what shows."""
    log = tmp_path / "bar.log"
    draw = r"""import sys
print('is a tty:', sys.stdout.isatty())
print('\x1b[32m 10%\x1b[0m', end='\r', flush=True)
print('\x1b[32m100%\x1b[0m done')"""
    code = (f"from vllm_overlay import process; import sys\n"
            f"process.run(sys.executable, '-c', {draw!r}, log={str(log)!r}, what='bar', "
            "terminal=True)")  # fmt: skip
    shown = on_a_terminal([sys.executable, "-c", code])
    assert "is a tty: True" in shown and "\x1b[32m 10%" in shown  # drawn as the child drew it
    assert "\nis a tty: True\n100% done\n--- exit code 0" in log.read_text()


SUITE_RUNNER = """
import sys
from pathlib import Path
from vllm_overlay import process
cmd = [sys.executable, "-c", "import os, time; print('pid', os.getpid(), flush=True); time.sleep(600)"]
with open(sys.argv[1], "ab") as log, process.group(cmd, env=dict(__import__("os").environ),
                                                   cwd=Path("."), stdout=log) as proc:
    proc.wait()
"""


def test_a_stopped_suite_run_leaves_no_pytest_running(tmp_path):
    """SIGTERM to the tool while vLLM's suite runs (its own process group, for the workers)
    stops that group too: found when a stopped `track --suite` left the suite's pytest
    running."""
    log = tmp_path / "suite.log"
    runner = subprocess.Popen([sys.executable, "-c", SUITE_RUNNER, log],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        pid = int(wait_for(log, "pid ").split("pid ")[1].split()[0])
        runner.send_signal(signal.SIGTERM)
        runner.wait(timeout=600)  # a guard against a hang only
    finally:
        if runner.poll() is None:
            runner.kill()
    assert runner.returncode != 0
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the child is gone (stopped and reaped by the tool)


def test_a_build_that_numbers_its_steps_says_which_step_it_is_at(tmp_path):
    """Off a terminal, each "still running" line names the child's last "[n/N]" step (Ninja's,
    and so CMake's and vLLM's setup.py's): a compile of 493 objects shows how far it got."""
    import io

    from vllm_overlay.progress import Status

    out = io.StringIO()
    status = Status("setup.py", tmp_path / "log", interval=0.0, stream=out)
    status.start()
    status.output("-- Configuring done")
    status.output("[3/43] Building CXX object CMakeFiles/_C.dir/csrc/cpu/activation.cpp.o")
    status.output("../../csrc/cpu/shm.cpp:148:48: warning: compound assignment")
    lines = out.getvalue().splitlines()
    assert not lines[1].endswith(", at step 3 of 43 (log: " + str(tmp_path / "log") + ")")
    assert lines[-1].startswith("setup.py: still running after ")
    assert ", at step 3 of 43 (log: " in lines[-1]  # a later line without a step keeps it
