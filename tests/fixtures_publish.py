"""Helpers for tests/test_publish.py: real wheels, real servers on 127.0.0.1, a clean env.

Nothing here talks to anything but the loopback interface, and nothing writes outside the
directories the tests pass in.
"""

from __future__ import annotations

import base64
import ctypes
import functools
import hashlib
import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from vllm_overlay.main import main

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
    unrecorded: Mapping[str, str] | None = None,
    drop: Sequence[str] = (),
    tampered: Mapping[str, str] | None = None,
) -> Path:
    """Write a small, valid wheel (METADATA, WHEEL, RECORD with hashes) and return its path.

    ``metadata_name`` / ``metadata_version`` make METADATA disagree with the file name;
    ``stored`` writes members uncompressed (so a test can flip their bytes in place);
    ``unrecorded`` adds members that RECORD does not list; ``drop`` leaves out members by
    their name under the .dist-info directory ("WHEEL"); ``tampered`` writes members with
    other content than RECORD's hash and size say (a sound zip, a wrong RECORD). The same
    arguments always give the same bytes.
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
    for gone in drop:
        del members[f"{dist_info}/{gone}"]
    record = [f"{p},{_record_hash(d.encode())},{len(d.encode())}" for p, d in members.items()]
    members[f"{dist_info}/RECORD"] = "\n".join([*record, f"{dist_info}/RECORD,,"]) + "\n"
    members.update(unrecorded or {})
    members.update(tampered or {})
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
    drop = ("PIP_", "UV_", "TWINE_", "VLLM_OVERLAY_")
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


def uv_install(
    env: Mapping[str, str], index_url: str, req: str, target: Path
) -> subprocess.CompletedProcess[str]:
    """``uv pip install --target`` from ``index_url`` only, with no uv config or cache."""
    args = ["pip", "install", "--no-config", "--no-cache", "--python", PY, "--no-deps"]
    args += ["--index-url", index_url, "--target", str(target), req]
    return subprocess.run(
        [PY, "-m", "uv", *args],
        env=dict(env),
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )


class Server:
    """A server subprocess on 127.0.0.1 with its log in a file; stop() always reaps it."""

    def __init__(self, argv: Sequence[str], url: str, log: Path, env: Mapping[str, str]) -> None:
        self.url = url
        self.log = log
        self._log_file = open(log, "wb")  # closed in stop()
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


def start_pypiserver(packages: Path, htpasswd: Path, log: Path, env: Mapping[str, str]) -> Server:
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
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # passlib imports crypt
        from passlib.apache import HtpasswdFile

    ht = HtpasswdFile(str(path), new=True)
    ht.set_password(user, password)
    ht.save()


JSON_TYPE = "application/vnd.pypi.simple.v1+json"


class _NegotiatingHandler(http.server.SimpleHTTPRequestHandler):
    """What docs/publishing.md asks of a web server: a directory request whose Accept header
    names the PEP 691 JSON type gets that directory's index.json, served with that type."""

    served: list[tuple[str, str]]  # (request path, file sent), set per server

    def translate_path(self, path: str) -> str:
        local = super().translate_path(path)
        accept = self.headers.get("Accept", "")
        if os.path.isdir(local) and JSON_TYPE in accept:
            candidate = os.path.join(local, "index.json")
            if os.path.isfile(candidate):
                local = candidate
        self.served.append((path, os.path.basename(local)))
        return local

    def guess_type(self, path: str | os.PathLike[str]) -> str:
        if os.fspath(path).endswith(os.sep + "index.json"):
            return JSON_TYPE
        return super().guess_type(path)

    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def negotiating_server(directory: Path) -> Iterator[tuple[str, list[tuple[str, str]]]]:
    """A content-negotiating static server on 127.0.0.1 in a thread: (base URL, log)."""
    served: list[tuple[str, str]] = []
    handler = type("Handler", (_NegotiatingHandler,), {"served": served})
    factory = functools.partial(handler, directory=str(directory))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), factory)
    httpd.socket.setblocking(False)  # as synthetic.IndexServer's: accept() never blocks
    thread = threading.Thread(target=httpd.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/", served
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


def _drop_dac_capabilities() -> None:
    """preexec_fn for root: the program exec'd next lacks CAP_DAC_OVERRIDE and
    CAP_DAC_READ_SEARCH, so it obeys file modes like any user (needs CAP_SETPCAP)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_drop, cap_dac_override, cap_dac_read_search = 24, 1, 2
    for cap in (cap_dac_override, cap_dac_read_search):
        if libc.prctl(pr_capbset_drop, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def obeying_modes() -> Callable[[], None] | None:
    """The preexec_fn that makes a child process unable to ignore a read-only mode."""
    return _drop_dac_capabilities if os.geteuid() == 0 else None


def run_publish_cli(
    args: Sequence[str | os.PathLike[str]], env: Mapping[str, str]
) -> subprocess.CompletedProcess[str]:
    """``python -m vllm_overlay publish ARGS`` as a process that obeys file modes."""
    return subprocess.run(
        [PY, "-m", "vllm_overlay", "publish", *map(str, args)],
        env=dict(env),
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        preexec_fn=obeying_modes(),  # fine: the test process forks from one thread
        timeout=120,
    )


@contextmanager
def read_only(directory: Path, env: Mapping[str, str]) -> Iterator[bool]:
    """chmod 555 ``directory``; yields whether a process from ``run_publish_cli`` really
    cannot add to it (False only where root cannot drop CAP_DAC_OVERRIDE)."""
    directory.chmod(0o555)
    probe = directory / ".probe"
    try:
        try:
            touched = (
                subprocess.run(
                    [
                        PY,
                        "-c",
                        "import pathlib, sys; pathlib.Path(sys.argv[1]).touch()",
                        str(probe),
                    ],
                    env=dict(env),
                    capture_output=True,
                    preexec_fn=obeying_modes(),
                ).returncode
                == 0
            )
        except subprocess.SubprocessError:  # prctl refused: no CAP_SETPCAP
            touched = True
        yield not touched
    finally:
        directory.chmod(0o755)
        probe.unlink(missing_ok=True)


# ---- fixtures shared by the publish tests (unit and real-wheel) ----

USER = "uploader"
PASSWORD = "pw-Zq8x-s3cr3t"  # distinctive, so a leak into any output is easy to spot
PY3_WHEEL = "vllm-0.24.0+ovl.1.abc-py3-none-any.whl"
ABI3_WHEEL = f"vllm-0.24.0+ovl.1.abc-{REAL_TAG}.whl"
REAL_WHEEL = os.environ.get("VLLM_OVERLAY_REAL_WHEEL")
# Captured at import, before the fixtures below isolate the environment: the real build
# reuses the real download cache (the official wheel is 279 MB).
REAL_CACHE = os.environ.get("VLLM_OVERLAY_CACHE") or str(
    Path(os.environ.get("HOME", "/root")) / ".cache" / "vllm-overlay"
)
ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- fixtures


@pytest.fixture
def publish_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Every test (and every subprocess it starts) gets a HOME, caches and pip config
    inside tmp_path, no proxies and no index or credential variables from outside."""
    env = clean_env(tmp_path / "home")
    for key in list(os.environ):
        if key not in env:
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@dataclass(frozen=True)
class CliResult:
    rc: int
    out: str
    err: str

    @property
    def all(self) -> str:
        return self.out + self.err


@pytest.fixture
def publish_cli(capsys: pytest.CaptureFixture[str]) -> Callable[..., CliResult]:
    """Run ``vllm-overlay publish ARGS`` in-process (twine still runs as a subprocess)."""

    def run(*args: str | os.PathLike[str]) -> CliResult:
        capsys.readouterr()
        rc = main(["publish", *map(str, args)])
        captured = capsys.readouterr()
        return CliResult(rc, captured.out, captured.err)

    return run


@pytest.fixture
def wheels(tmp_path: Path) -> Path:
    return tmp_path / "wheels"


@pytest.fixture
def serve(tmp_path: Path, publish_env: dict[str, str]) -> Iterator[Callable[[Path], Server]]:
    """Start ``python -m http.server`` over a directory; stopped at teardown."""
    servers: list[Server] = []

    def start(directory: Path) -> Server:
        log = tmp_path / f"http-{len(servers)}.log"
        servers.append(start_http_server(directory, log, publish_env))
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


@dataclass(frozen=True)
class PyPI:
    server: Server
    url: str
    packages: Path


@pytest.fixture(scope="module")
def pypi(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PyPI]:
    """One pypiserver for the module: uploads need USER/PASSWORD, downloads are open, and
    it never falls back to a public index. Tests use distinct versions."""
    root = tmp_path_factory.mktemp("pypiserver")
    packages = root / "packages"
    packages.mkdir()
    write_htpasswd(root / "htpasswd", USER, PASSWORD)
    env = clean_env(root / "home")
    server = start_pypiserver(packages, root / "htpasswd", root / "server.log", env)
    try:
        yield PyPI(server, server.url, packages)
    finally:
        server.stop()


@pytest.fixture
def credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_OVERLAY_INDEX_USERNAME", USER)
    monkeypatch.setenv("VLLM_OVERLAY_INDEX_PASSWORD", PASSWORD)


def tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (the lock file is empty by design)."""
    return {
        str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()
    }


def pip_download(
    env: dict[str, str], index_url: str, req: str, dest: Path, *options: str
) -> subprocess.CompletedProcess[str]:
    args = ["download", "--no-deps", "--index-url", index_url, "-d", str(dest), *options, req]
    return pip(args, env)
