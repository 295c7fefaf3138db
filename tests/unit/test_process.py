"""The one runner's capture mode under its stop policy: real children, real signals."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from procs import gone
from vllm_overlay import process
from vllm_overlay.errors import CommandError, OverlayError

# A child that starts a grandchild (its pid printed first), then sleeps; both ignore SIGINT,
# so the stop has to go on to SIGTERM for the whole group.
FAMILY = textwrap.dedent("""\
    import signal, subprocess, sys, time
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    g = subprocess.Popen([sys.executable, "-c",
                          "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                          "time.sleep(600)"])
    print(g.pid, flush=True)
    print("on stderr", file=sys.stderr, flush=True)
    time.sleep(600)
""")


def test_a_stop_goes_past_an_ignored_sigint_and_takes_the_whole_group(monkeypatch):
    """The stop policy on a family that ignores SIGINT: the child is stopped by a later
    signal, and the grandchild goes with it. The test waits for the family to be up (the
    grandchild's pid on the pipe), so no timer decides what it sees."""
    monkeypatch.setattr(process, "GRACE", 0.5)
    cmd = [sys.executable, "-c", FAMILY]
    with process.group(cmd, cwd=None, env=None, stdout=subprocess.PIPE) as proc:
        grandchild = int(proc.stdout.readline())  # printed after both ignore SIGINT
        how = process.stop(proc)
    assert how in ("SIGTERM", "SIGKILL")  # SIGINT alone could not stop it
    assert proc.returncode < 0 and gone(grandchild)


def test_a_capture_that_times_out_is_stopped_and_says_so():
    with pytest.raises(CommandError, match="timed out after 1 s") as e:
        process.run(sys.executable, "-c", "import time; time.sleep(600)", timeout=1)
    assert e.value.returncode == -1


def test_a_capture_renders_what_failed():
    with pytest.raises(CommandError) as e:
        process.run(sys.executable, "-c", "import sys; print('out'); sys.exit('err')",
                    hint="Do this next.")  # fmt: skip
    assert (e.value.returncode, e.value.stdout, e.value.stderr) == (1, "out\n", "err\n")
    assert str(e.value).endswith("Do this next.") and "return code: 1" in str(e.value)
    out = process.run("cat", input="in\n", check=False)
    assert out == process.Output(0, "in\n", "")
    with pytest.raises(OverlayError, match="no-such-program-here is not installed"):
        process.run("no-such-program-here")
