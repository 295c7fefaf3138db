"""Helpers for tests/test_publish.py: real wheels, real servers on 127.0.0.1, a clean env.

Nothing here talks to anything but the loopback interface, and nothing writes outside the
directories the tests pass in.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

PY = sys.executable
REAL_TAG = "cp38-abi3-manylinux_2_28_x86_64"
# What `pip download` needs to accept REAL_TAG on any machine.
REAL_TAG_PIP_OPTIONS = (
    "--platform",
    "manylinux_2_28_x86_64",
    "--only-binary=:all:",
    "--python-version",
    "3.11",
    "--implementation",
    "cp",
    "--abi",
    "abi3",
)
_DATE = (2024, 1, 1, 0, 0, 0)


def _record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def make_wheel(
    dest: Path,
    *,
    name: str = "vllm",
    version: str = "0.24.0+ovl.1.abc",
    tag: str = "py3-none-any",
    requires_python: str | None = ">=3.10",
    payload: str = "",
    metadata_name: str | None = None,
    metadata_version: str | None = None,
    filename: str | None = None,
    stored: bool = False,
) -> Path:
    """Write a small, valid wheel (METADATA, WHEEL, RECORD with hashes) and return its path.

    ``metadata_name`` / ``metadata_version`` make METADATA disagree with the file name;
    ``stored`` writes members uncompressed (so a test can flip their bytes in place). The
    same arguments always give the same bytes.
    """
    dist = re.sub(r"[-_.]+", "_", name)
    dist_info = f"{dist}-{version}.dist-info"
    metadata = [
        "Metadata-Version: 2.1",
        f"Name: {metadata_name or name}",
        f"Version: {metadata_version or version}",
        "Summary: a test wheel for vllm-overlay publish",
    ]
    if requires_python:
        metadata.append(f"Requires-Python: {requires_python}")
    purelib = "true" if tag.endswith("-none-any") else "false"
    members = {
        f"{dist}/__init__.py": f"__version__ = {version!r}\n{payload}",
        f"{dist_info}/METADATA": "\n".join(metadata) + "\n\n",
        f"{dist_info}/WHEEL": (
            f"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: {purelib}\nTag: {tag}\n"
        ),
    }
    record = [f"{p},{_record_hash(d.encode())},{len(d.encode())}" for p, d in members.items()]
    members[f"{dist_info}/RECORD"] = "\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n"
    dest.mkdir(parents=True, exist_ok=True)
    path = dest / (filename or f"{dist}-{version}-{tag}.whl")
    compression = zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED
    with zipfile.ZipFile(path, "w", compression) as zf:
        for member, data in members.items():
            info = zipfile.ZipInfo(member, _DATE)
            info.external_attr = 0o644 << 16
            info.compress_type = compression
            zf.writestr(info, data)
    return path


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env(home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for pip, twine and servers: no user config, cache, proxy or index."""
    drop = ("PIP_", "UV_", "TWINE_", "VLLM_OVERLAY_", "PYTHONPATH")
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.upper().startswith(drop) and not k.lower().endswith("_proxy")
    }
    home.mkdir(parents=True, exist_ok=True)
    env.update(
        HOME=str(home),
        XDG_CACHE_HOME=str(home / ".cache"),
        XDG_CONFIG_HOME=str(home / ".config"),
        XDG_DATA_HOME=str(home / ".local" / "share"),
        PIP_CONFIG_FILE=os.devnull,
        PIP_NO_CACHE_DIR="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
        PYTHON_KEYRING_BACKEND="keyring.backends.null.Keyring",
        NO_PROXY="127.0.0.1,localhost",
        no_proxy="127.0.0.1,localhost",
        PYTHONDONTWRITEBYTECODE="1",
    )
    env.update(extra or {})
    return env


def pip(
    args: Sequence[str], env: Mapping[str, str], timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """Run this interpreter's pip; never raises on failure (tests look at the result)."""
    return subprocess.run(
        [PY, "-m", "pip", *args],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


class Server:
    """A server subprocess on 127.0.0.1 with its log in a file; stop() always reaps it."""

    def __init__(self, argv: Sequence[str], url: str, log: Path, env: Mapping[str, str]) -> None:
        self.url = url
        self.log = log
        self._log_file = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            list(argv),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env),
        )

    def wait_ready(self, probe: str, timeout: float = 20.0) -> None:
        """Poll ``probe`` until the server answers; fail with its log if it does not."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                with urllib.request.urlopen(probe, timeout=2):
                    return
            except urllib.error.HTTPError:
                return  # it answers; the status does not matter here
            except OSError:
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server {self.url} did not start:\n{self.log_text()}")

    def log_text(self) -> str:
        self._log_file.flush()
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log_file.close()


def start_pypiserver(
    packages: Path, htpasswd: Path, log: Path, env: Mapping[str, str]
) -> Server:
    """pypiserver with authenticated uploads and no fallback to any public index."""
    port = free_port()
    argv = [PY, "-m", "pypiserver", "run", "-p", str(port), "-i", "127.0.0.1"]
    argv += ["-a", "update", "-P", str(htpasswd), "--disable-fallback", "--server", "wsgiref"]
    argv += [str(packages)]
    server = Server(argv, f"http://127.0.0.1:{port}/", log, env)
    server.wait_ready(f"http://127.0.0.1:{port}/health")
    return server


def start_http_server(directory: Path, log: Path, env: Mapping[str, str]) -> Server:
    """``python -m http.server`` over ``directory``; its request log goes to ``log``."""
    port = free_port()
    argv = [PY, "-u", "-m", "http.server", "--bind", "127.0.0.1", str(port)]
    argv += ["--directory", str(directory)]
    server = Server(argv, f"http://127.0.0.1:{port}/", log, env)
    server.wait_ready(f"http://127.0.0.1:{port}/")
    return server


def write_htpasswd(path: Path, user: str, password: str) -> None:
    from passlib.apache import HtpasswdFile

    ht = HtpasswdFile(str(path), new=True)
    ht.set_password(user, password)
    ht.save()
