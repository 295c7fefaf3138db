"""The engine tests' tiny models are written once per cache and then held shared by every
pytest-xdist worker for its whole run: a worker that found them missing and then met another
worker's hold must not wait for that worker's run to end (it did: the 0.34.0 engine proof
hung for 10 minutes on one test's setup)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from engine import harness
from vllm_overlay.errors import BusyError

HOLD = """\
import sys
from vllm_overlay import util
util.hold(sys.argv[1], "the engine tests' tiny models")
print("held", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def held(tmp_path):
    """``hold(dest)``: another process holds ``dest``'s lock shared until the test ends."""
    procs = []

    def hold(dest):
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(dest.with_suffix(".lock"))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        procs.append(proc)
        assert proc.stdout.readline().strip() == "held"

    yield hold
    for proc in procs:
        proc.stdin.close()
        proc.wait(timeout=60)


def test_a_worker_takes_the_models_another_worker_wrote_and_holds(tmp_path, monkeypatch, held):
    dest = tmp_path / "engine-models" / "k"
    dest.mkdir(parents=True)
    (dest / "models.json").write_text("{}")
    held(dest)
    monkeypatch.setenv("VLLM_OVERLAY_LOCK_TIMEOUT", "5")  # before the fix: BusyError after 5 s
    harness._write_models(None, dest, "k")  # returns: the models are there; nothing written
    assert (dest / "models.json").read_text() == "{}"


def test_a_worker_gives_up_on_a_hold_without_models(tmp_path, monkeypatch, held):
    """No index and the lock held: nothing to take, so the wait ends at the lock timeout."""
    dest = tmp_path / "engine-models" / "k"
    dest.mkdir(parents=True)
    held(dest)
    monkeypatch.setenv("VLLM_OVERLAY_LOCK_TIMEOUT", "0")
    with pytest.raises(BusyError):
        harness._write_models(None, dest, "k")
