"""The synthetic upstream of our own CPU build: vLLM's CPU project where the source build
depends on it (a stand-in setup.py that compiles nothing), a synthetic oneDNN tarball, and
the tools preflight asks for (test_cpu_source.py, test_track_engine.py)."""

from __future__ import annotations

import hashlib
import io
import shutil
import tarfile

import pytest
from synthetic import release_files
from vllm_overlay.pin.lockfile import SourceInput

CPU_REQS = (
    "torch==2.11.0+cpu\n"
    "# triton-cpu, only for x86_64 CPUs\n"
    'triton @ https://example.invalid/triton-3.8.0+cpu-cp311.whl ; python_version == "3.11"\n'
    'py-cpuinfo; platform_machine == "aarch64"\n'
)
GATE = (
    'if (NOT (CMAKE_CXX_COMPILER_ID STREQUAL "GNU" AND\n'
    "        CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.3))\n"
    '    message(FATAL_ERROR "X86 backend requires gcc/g++ >= 12.3")\nendif()\n'
)

# vLLM's setup.py where the driver depends on it, for the CPU project: the project's name
# from pyproject.toml, the version from VLLM_VERSION_OVERRIDE (and vllm/_version.py), the
# requirements from requirements/cpu.txt, the kernels from oneDNN's tree
# (FETCHCONTENT_SOURCE_DIR_ONEDNN) into vllm/_C.abi3.so.
FAKE_CPU_SETUP_PY = """\
import os
import re

from setuptools import find_namespace_packages, setup

assert os.environ["VLLM_TARGET_DEVICE"] == "cpu" and os.environ["VLLM_CPU_X86"] == "1"
name = re.search(r'(?m)^name = "([^"]+)"', open("pyproject.toml").read()).group(1)
version = os.environ["VLLM_VERSION_OVERRIDE"]
with open("vllm/_version.py", "w") as f:
    f.write(f"__version__ = version = {version!r}\\n")
onednn = os.environ["FETCHCONTENT_SOURCE_DIR_ONEDNN"]
with open("vllm/_C.abi3.so", "wb") as f:
    f.write(b"kernels built with " + open(os.path.join(onednn, "CMakeLists.txt"), "rb").read())
reqs = [line.split("#")[0].strip() for line in open("requirements/cpu.txt")]
setup(
    name=name,
    version=version,
    packages=find_namespace_packages(include=["vllm*"]),
    package_data={"vllm": ["_C.abi3.so"]},
    install_requires=[r for r in reqs if r],
)
"""
FAKE_PYPROJECT = '[build-system]\nrequires = ["setuptools"]\n\n[project]\nname = "vllm"\n'


# vLLM 0.32.0's platform lookup, as vllm/platforms/__init__.py has it.
PLATFORMS_PY = """\
def vllm_version_matches_substr(substr: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        vllm_version = version("vllm")
    except PackageNotFoundError as e:
        raise e
    return substr in vllm_version
"""


def cpu_release(version: str) -> dict[str, str]:
    """The synthetic release ``version`` as vLLM's CPU project."""
    return {
        **release_files(version),
        "setup.py": FAKE_CPU_SETUP_PY,
        "pyproject.toml": FAKE_PYPROJECT,
        "requirements/cpu.txt": CPU_REQS,
        "requirements/build/cpu.txt": "setuptools\nwheel\ntorch==2.11.0+cpu\n",
        "cmake/cpu_extension.cmake": GATE,
        "vllm/platforms/__init__.py": PLATFORMS_PY,
    }


def onednn_tarball() -> tuple[bytes, SourceInput]:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tf:
        data = b"project(oneDNN)  # the synthetic oneDNN\n"
        info = tarfile.TarInfo("onednn-9.9/CMakeLists.txt")
        info.size, info.mtime = len(data), 315532800
        tf.addfile(info, io.BytesIO(data))
    blob = buf.getvalue()
    si = SourceInput("onednn", "onednn", "9.9+ds-1", "trixie", "onednn_9.9+ds.orig.tar.xz",
                     hashlib.sha256(blob).hexdigest(), len(blob))  # fmt: skip
    return blob, si


needs_tools = pytest.mark.skipif(
    any(shutil.which(t) is None for t in ("c++", "cmake", "ninja")),
    reason="the CPU build's preflight needs c++, cmake and ninja on PATH",
)
