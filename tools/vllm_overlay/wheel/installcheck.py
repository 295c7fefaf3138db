"""verify's install check: a real installer puts the wheel into a temporary directory, and
what it installed is read back.

The installer is uv (``uv pip install --no-deps --no-index --target``) when it is installed
and the wheel's tags fit this interpreter; else pip, which can also install a wheel for
another platform (``--platform``/``--abi``). uv unpacks into a cache inside the same
temporary directory and hard-links from there, on a memory-backed file system when one has
room: for vLLM's ~600 MB of files this is seconds, not the half minute of a pip install.
The install runs as its own process, started before verify reads the archive, so the two
overlap.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import sys
import tempfile
import threading
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from packaging.tags import parse_tag, sys_tags
from packaging.utils import canonicalize_name

from vllm_overlay.errors import OverlayError
from vllm_overlay.process import run
from vllm_overlay.util import find_uv
from vllm_overlay.wheel.metadata import VERSION_PY, WheelName, version_py_version
from vllm_overlay.wheel.provenance import ChangedFile

Installed = Callable[[], tuple[Path | None, list[str]]]


def _platform_args(name: WheelName) -> list[str]:
    """pip options that let it install a wheel built for another platform (or none)."""
    tags = parse_tag(name.tags)
    if tags & set(sys_tags()):
        return []
    args = ["--only-binary=:all:"]
    for t in sorted({t.platform for t in tags}):
        args += ["--platform", t]
    for t in sorted({t.abi for t in tags}):
        args += ["--abi", t]
    return args


def _install_root(path: Path) -> str | None:
    """A memory-backed temporary directory when one has room (an install of vLLM writes
    ~600 MB; on a slow disk that is most of the check's time), else the default."""
    with zipfile.ZipFile(path) as zf:
        need = 3 * sum(i.file_size for i in zf.infolist())
    shm = Path("/dev/shm")
    try:
        st = os.statvfs(shm)
    except OSError:
        return None
    if os.access(shm, os.W_OK) and st.f_bavail * st.f_frsize > need:
        return str(shm)
    return None


def install_command(path: Path, name: WheelName, tmp: Path, target: Path) -> list[str]:
    """The installer's command line: uv where it can, pip otherwise."""
    platform = _platform_args(name)
    uv = None if platform else find_uv()
    if uv is not None:
        return [
            uv, "pip", "install", "--no-deps", "--no-index", "--no-config", "--quiet",
            "--cache-dir", str(tmp / "uv-cache"), "--link-mode", "hardlink",
            "--python", sys.executable, "--target", str(target), str(path),
        ]  # fmt: skip
    return [
        sys.executable, "-m", "pip", "--isolated", "install", "--no-deps", "--no-index",
        "--no-compile", "--disable-pip-version-check", "-q", *platform,
        "--target", str(target), str(path),
    ]  # fmt: skip


def _environ(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UV_", "PIP_"))}
    env["TMPDIR"] = str(tmp / "tmp")
    return env


@contextlib.contextmanager
def installing(path: Path, name: WheelName, *, enabled: bool = True) -> Iterator[Installed]:
    """Start installing ``path`` into a fresh temporary directory now; the yielded function
    waits for it and gives (the install directory, or None; problems). Everything is
    removed on leaving, after the installer has finished."""
    if not enabled:
        yield lambda: (None, [])
        return
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-verify-", dir=_install_root(path)) as t:
        tmp = Path(t)
        (tmp / "tmp").mkdir()
        target = tmp / "site"
        cmd = install_command(path, name, tmp, target)
        outcome: list[str] = []

        def work() -> None:
            try:
                run(*cmd, env=_environ(tmp), hint="the wheel could not be installed.")
            except OverlayError as e:
                outcome.append(f"{Path(cmd[0]).name} install --no-deps --target failed:\n{e}")

        worker = threading.Thread(target=work, name="verify-install", daemon=True)
        worker.start()

        def installed() -> tuple[Path | None, list[str]]:
            worker.join()
            return (None, list(outcome)) if outcome else (target, [])

        try:
            yield installed
        finally:
            worker.join()


def check_installed(
    target: Path, name: WheelName, doc: Mapping[str, Any] | None, files: Sequence[ChangedFile]
) -> list[str]:
    """What the installed tree says: one distribution of the wheel's version, the version
    module's and the changed files as built."""
    dists = [
        d
        for d in importlib.metadata.distributions(path=[str(target)])
        if canonicalize_name(d.metadata["Name"] or "") == canonicalize_name(name.distribution)
    ]
    if len(dists) != 1:
        return [
            f"importlib.metadata finds {len(dists)} {name.distribution} distributions after install"
        ]
    out = []
    got = dists[0].version
    if got != name.version:
        out.append(
            f"importlib.metadata.version({name.distribution!r}) is {got}, expected {name.version}"
        )
    vp = target / VERSION_PY
    if (
        doc is not None
        and vp.is_file()
        and version_py_version(vp.read_bytes()) != doc["version_py"]
    ):
        out.append(f"installed {VERSION_PY} does not report {doc['version_py']}")
    for f in files:
        installed = target / f.path
        if f.in_wheel and not installed.is_file():
            out.append(f"installed tree lacks {f.path}")
        elif f.in_wheel and installed.read_bytes() != f.content:
            out.append(f"installed {f.path} differs from the patched tree's file")
    return out
