"""`vllm-overlay cache prune` against other real processes: one that uses an environment (it
holds the environment's shared lock, as every process that ensured it does until it exits),
and a prune killed with SIGKILL at every point of its work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from vllm_overlay import util
from vllm_overlay.envs import cache, envbuild, testenv

DAY = 86400.0
USER = """
import sys, time
from vllm_overlay.envs import envbuild
envbuild.hold(sys.argv[1])
print("holding", flush=True)
time.sleep(600)
"""


def _env(recipe_hash: str, files: int = 10, age_days: float = 10) -> Path:
    path = envbuild.root() / recipe_hash
    (path / "venv" / "bin").mkdir(parents=True)
    (path / "venv" / "bin" / "python").write_text("")
    for i in range(files):
        (path / "venv" / f"f{i:05}").write_text("x" * 100)
    (path / envbuild.RECIPE).write_text(json.dumps({"format": testenv.FORMAT}))
    (path / envbuild.MARKER).write_text(json.dumps({"recipe_hash": recipe_hash, "slot": "s"}))
    t = time.time() - age_days * DAY
    os.utime(path, (t, t))
    return path


def _vo(*args: str) -> list[str]:
    return [sys.executable, "-m", "vllm_overlay", *args]


def test_prune_passes_by_an_environment_another_process_uses(tmp_path):
    used, free = _env("aaaa"), _env("bbbb")
    user = subprocess.Popen([sys.executable, "-c", USER, "aaaa"], stdout=subprocess.PIPE,
                            text=True, env=dict(os.environ))  # fmt: skip
    try:
        assert user.stdout.readline().strip() == "holding"
        out = subprocess.run(_vo("cache", "prune", "--older-than", "1d"), capture_output=True,
                             text=True, check=False, cwd=tmp_path)  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert used.is_dir() and not free.exists()
        assert f"kept (in use by another process): test-env {used}" in out.stdout
    finally:
        user.kill()
        user.wait()
    # The user is gone (its lock with it): the next prune takes the environment.
    out = subprocess.run(_vo("cache", "prune", "--older-than", "1d"), capture_output=True,
                         text=True, check=False, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0 and not used.exists(), out.stderr


def _complete_or_gone(path: Path, files: int) -> bool:
    """The entry is whole where a run looks (marker, interpreter, every file) or absent."""
    if not os.path.lexists(path):
        return True
    return envbuild.read_marker(path) is not None and len(list((path / "venv").glob("f*"))) == files


def test_a_prune_killed_at_any_point_leaves_no_half_removed_entry(tmp_path):
    """SIGKILL at growing delays into the prune of a 4000-file environment: wherever the
    kill lands (before the rename, between it and the delete, during the delete, after),
    the entry is whole at its place or gone, and the next prune leaves no trash behind."""
    files = 4000
    for delay in (0.0, 0.2, 0.4, 0.6, 0.8, 1.0, 1.5, 2.0, 3.0):
        path = _env("aaaa", files)
        proc = subprocess.Popen(_vo("cache", "prune", "--older-than", "1d"), cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert _complete_or_gone(path, files), f"half an entry at {path} after {delay} s"
        trash = util.cache_dir() / cache.TRASH
        # The next run empties the trash and takes (or finishes taking) the entry.
        assert subprocess.run(_vo("cache", "prune", "--older-than", "1d"), cwd=tmp_path,
                              capture_output=True, check=False).returncode == 0  # fmt: skip
        assert not path.exists() and list(trash.iterdir()) == []
