"""The one clean environment for the Pythons this tool starts for tests and environments.

``clean_environ()`` is ``os.environ`` without the variables that would leak another Python
setup into a child (``LEAKY``); ``scratch_environ(workdir)`` adds temporary files under a
work directory and Ray's session files in a short one (``ray_tmpdir``). The test
environment (``testenv.TestEnv.environ``), the suite, a rebase's proofs and the installer
all start from these.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

# Inherited variables that would change what a child Python imports or how tests run: every
# Python this tool starts for tests or environments gets ``clean_environ()``.
LEAKY = (
    "PYTHONPATH",
    "PYTHONHOME",
    "PYTHONSTARTUP",
    "PYTHONSAFEPATH",
    "PYTHONUSERBASE",
    "PYTHONPYCACHEPREFIX",
    "PYTHONDONTWRITEBYTECODE",
    "VIRTUAL_ENV",
    "CONDA_PREFIX",
    "__PYVENV_LAUNCHER__",
    "PYTEST_ADDOPTS",
    "PYTEST_PLUGINS",
    "PYTEST_XDIST_AUTO_NUM_WORKERS",
    "VLLM_PLUGINS",
    "VLLM_TARGET_DEVICE",
    "VLLM_OVERLAY_TREE",
    "HF_HUB_CACHE",
    "HF_HOME",
    "HUGGINGFACE_HUB_CACHE",
    "TRANSFORMERS_CACHE",
)

# Ray puts AF_UNIX sockets under $RAY_TMPDIR/ray/session_<date>_<time>_<usec>_<pid>/sockets/
# (about 75 bytes more), and such a path may not exceed 107 bytes. Under a deep work directory
# every test that starts Ray would fail, so its directory is a short one in /tmp.
SOCKET_PATH_MAX = 107
RAY_SOCKET_SUFFIX = "/ray/session_2026-01-01_00-00-00_000000_4194304/sockets/raylet.12345"
RAY_PREFIX = "vo-ray-"


def clean_environ() -> dict[str, str]:
    """``os.environ`` without the variables that would leak another Python setup into a child
    Python (the one way every test run and environment build gets its environment)."""
    return {k: v for k, v in os.environ.items() if k not in LEAKY}


CLIENT_TMP_PREFIX = "vo-client-"  # a client environment's TMPDIR (AF_UNIX sockets in it)
RPC_PREFIX = "vo-rpc-"  # vLLM's ZeroMQ ipc:// sockets (VLLM_RPC_BASE_PATH), same limit


def short_dir(workdir: Path, prefix: str) -> Path:
    """A short directory in /tmp named after ``workdir`` (created here), for AF_UNIX socket
    paths that may not exceed SOCKET_PATH_MAX bytes."""
    base = Path("/tmp") if os.access("/tmp", os.W_OK) else Path(tempfile.gettempdir())
    digest = hashlib.sha256(os.fspath(Path(workdir).resolve()).encode()).hexdigest()[:12]
    path = base / f"{prefix}{digest}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def ray_tmpdir(workdir: Path) -> Path:
    """A short directory for Ray's session files, named after ``workdir`` (created here).

    Removed after a run by ``vllm_overlay.testing.runner``; see SOCKET_PATH_MAX.
    """
    return short_dir(workdir, RAY_PREFIX)


def scratch_environ(workdir: Path) -> dict[str, str]:
    """``clean_environ()`` with temporary files under ``workdir`` and Ray's in a short dir."""
    tmp = Path(workdir).resolve() / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = clean_environ()
    env.update(
        TMPDIR=os.fspath(tmp),
        RAY_TMPDIR=os.fspath(ray_tmpdir(workdir)),
        PYTHONNOUSERSITE="1",
    )
    return env
