"""vllm-overlay publish: a static index served by http.server and a real pypiserver, both on
127.0.0.1, read back by the real pip. No mocks; nothing is written outside tmp_path."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from fixtures_publish import (
    PY,
    REAL_CACHE,
    REAL_TAG,
    REAL_TAG_PIP_OPTIONS,
    REAL_WHEEL,
    ROOT,
    PyPI,
    pip_download,
    sha256_of,
)
from isolation import SHARED_CACHE_LOCK_TIMEOUT
from vllm_overlay.pin.lockfile import read_lock

pytestmark = pytest.mark.usefixtures("publish_env")


def build_real_wheel(out: Path) -> Path:
    """The real built wheel: VLLM_OVERLAY_REAL_WHEEL if set, else `vllm-overlay build` now."""
    if REAL_WHEEL:
        return Path(REAL_WHEEL)
    env = {
        **os.environ,
        "VLLM_OVERLAY_CACHE": REAL_CACHE,
        "VLLM_OVERLAY_LOCK_TIMEOUT": SHARED_CACHE_LOCK_TIMEOUT,
    }
    proc = subprocess.run(
        [
            PY,
            "-m",
            "vllm_overlay",
            "--project",
            str(ROOT),
            "build",
            "--out",
            str(out),
            "--variant",
            "vllm",
            "--platform",
            REAL_TAG.rsplit("-", 1)[-1],
        ],  # fmt: skip
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.mark.network
def test_publish_real_wheel(
    tmp_path: Path, publish_cli, serve, pypi: PyPI, credentials: None, publish_env
) -> None:
    wheel = build_real_wheel(tmp_path / "dist")
    version = read_lock(ROOT / "upstream.lock").upstream.version
    assert wheel.name.startswith(f"vllm-{version}+") and wheel.name.endswith(f"-{REAL_TAG}.whl")
    digest = sha256_of(wheel)
    index = tmp_path / "index"
    assert publish_cli(wheel, "--to", index).rc == 0
    static = serve(index)
    dest = tmp_path / "from-static"
    got = pip_download(
        publish_env, f"{static.url}simple/", f"vllm=={version}", dest, *REAL_TAG_PIP_OPTIONS
    )
    assert got.returncode == 0, got.stdout + got.stderr
    assert sha256_of(dest / wheel.name) == digest

    r = publish_cli(wheel, "--to", pypi.url)
    assert r.rc == 0, r.err
    # The module's server also holds the small test wheels, so pin the exact version.
    exact = f"vllm=={wheel.name.split('-')[1]}"
    dest = tmp_path / "from-server"
    got = pip_download(publish_env, f"{pypi.url}simple/", exact, dest, *REAL_TAG_PIP_OPTIONS)
    assert got.returncode == 0, got.stdout + got.stderr
    assert sha256_of(dest / wheel.name) == digest
