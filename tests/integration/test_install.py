"""The tool installs as a user would install it: `pip install .` and `uv pip install .` into a
clean virtualenv each give a working `vllm-overlay` (dependencies come from the configured
index, pinned by constraints.txt)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_overlay.util import find_uv

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.network, pytest.mark.slow]


def uv_bin() -> str:
    uv = find_uv()  # the tool depends on uv: its venv has it
    assert uv, "uv is missing from the tool's environment (run make venv)"
    return uv


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["HOME"] = os.environ.get("VLLM_OVERLAY_REAL_HOME", env.get("HOME", "/root"))
    return env


def _copy_project(tmp_path: Path) -> Path:
    """The tracked sources only (no .venv, no build output), as a fresh clone has them."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.split(b"\0")
    dest = tmp_path / "src"
    for rel in filter(None, files):
        src = ROOT / rel.decode()
        if src.is_file():
            target = dest / rel.decode()
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    return dest


def _check_cli(venv: Path, tmp_path: Path) -> None:
    cli = venv / "bin" / "vllm-overlay"
    proc = subprocess.run([cli, "--help"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "usage: vllm-overlay" in proc.stdout and "rebase" in proc.stdout
    probe = subprocess.run(
        [venv / "bin" / "python", "-c", "import importlib.util as u; print(u.find_spec('pytest'))"],
        capture_output=True,
        text=True,
    )
    assert probe.stdout.strip() == "None"  # the test extra was not needed, and is not there


def test_pip_install_dot_gives_a_working_cli(tmp_path):
    src = _copy_project(tmp_path)
    venv = tmp_path / "venv-pip"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    proc = subprocess.run(
        [venv / "bin" / "python", "-m", "pip", "install", "-q", "-c", src / "constraints.txt", src],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_cli(venv, tmp_path)


def test_uv_pip_install_dot_gives_a_working_cli(tmp_path):
    src = _copy_project(tmp_path)
    venv = tmp_path / "venv-uv"
    uv = uv_bin()
    env = _env(tmp_path)
    subprocess.run([uv, "venv", "-q", "--python", sys.executable, venv], check=True, env=env)
    proc = subprocess.run(
        [uv, "pip", "install", "-q", "--python", venv / "bin" / "python",
         "-c", src / "constraints.txt", src],
        capture_output=True,
        text=True,
        env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    _check_cli(venv, tmp_path)
