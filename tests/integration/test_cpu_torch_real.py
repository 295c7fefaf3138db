"""The index's torch 2.14.0 (its CUDA build) as a CPU build's torch, with real CMake.

vLLM 0.33.0's CPU build needs torch 2.14.0; the index serves only the CUDA build, whose CMake
package refuses to load without a CUDA toolkit and links ``libtorch_cuda``. This builds a
shared library against the real wheel's CMake package, headers and libraries, as vLLM's CPU
extension links (``torch ${TORCH_LIBRARIES}``, cmake/utils.cmake), through our
``TorchConfig.cmake`` (wheel/cputorch.py), and reads what it needs at load time.

network: the torch wheel (555 MB) is fetched once, by its pinned sha256, into the cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest
from fixtures_cpusource import BUILD_PATH
from vllm_overlay.pin.artifacts import ensure_artifact
from vllm_overlay.pin.lockfile import Artifact
from vllm_overlay.wheel import cputorch

pytestmark = pytest.mark.network

# constraints/build-vllm-cpu-0.33.0.txt pins torch==2.14.0; this is the file the index serves
TORCH = Artifact(
    kind="wheel",
    filename="torch-2.14.0-cp311-cp311-manylinux_2_28_x86_64.whl",
    sha256="8d9e232b6376c62f3090237889fb1cb6887c0ece9f73e6c1052e80fc1481f999",
    size=554583496,
    project="torch",
)
PROJECT = """\
cmake_minimum_required(VERSION 3.18)
project(ext LANGUAGES CXX)
find_package(Torch REQUIRED)
add_library(ext SHARED ext.cpp)
target_link_libraries(ext PRIVATE torch ${TORCH_LIBRARIES})
"""
SOURCE = """\
#include <c10/core/Device.h>
int ext_device_index(const char* name) { return c10::Device(name).index(); }  // from libc10
"""


@pytest.fixture(scope="module")
def torch_env(tmp_path_factory) -> Path:
    """A build root whose ``env`` link holds the real wheel's torch (CMake package, headers,
    libraries), laid out as the build environment's site-packages."""
    wheel = ensure_artifact(TORCH)
    root = tmp_path_factory.mktemp("cputorch") / "root"
    site = root.parent / "venv" / "lib" / "python3.11" / "site-packages"
    with zipfile.ZipFile(wheel) as zf:
        members = [n for n in zf.namelist()
                   if n.startswith(("torch/share/cmake/", "torch/include/", "torch/lib/"))]  # fmt: skip
        zf.extractall(site, members)
    root.mkdir()
    (root / "env").symlink_to(root.parent / "venv")
    return root


def _configure_and_build(root: Path, src: Path, build: Path, *args: str):
    src.mkdir(parents=True, exist_ok=True)
    (src / "CMakeLists.txt").write_text(PROJECT)
    (src / "ext.cpp").write_text(SOURCE)
    env = {**os.environ, "PATH": BUILD_PATH}  # cmake and ninja as the CPU build finds them
    cfg = subprocess.run(["cmake", "-S", src, "-B", build, "-G", "Ninja", *args],
                         capture_output=True, text=True, env=env)  # fmt: skip
    if cfg.returncode != 0:
        return cfg
    return subprocess.run(["cmake", "--build", build], capture_output=True, text=True, env=env)


def _needed(so: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", so], capture_output=True, text=True, check=True).stdout
    return [ln.split("[", 1)[1].rstrip("]") for ln in out.splitlines() if "(NEEDED)" in ln]


@pytest.mark.skipif(any(shutil.which(t, path=BUILD_PATH) is None for t in ("cmake", "ninja", "readelf")),
                    reason="needs cmake and ninja (the test extra) and readelf")  # fmt: skip
def test_the_cuda_torch_builds_a_cpu_extension_that_needs_only_its_cpu_libraries(torch_env):
    root = torch_env
    torch_dir = root / "env/lib/python3.11/site-packages/torch/share/cmake/Torch"
    if shutil.which("nvcc") is None:  # as on every CPU build machine: torch's own config refuses
        plain = _configure_and_build(root, root / "plain", root / "plain-build",
                                     f"-DTorch_DIR={torch_dir}")  # fmt: skip
        assert plain.returncode != 0
        assert "uses CUDA but I cannot find the CUDA" in plain.stdout + plain.stderr

    ours = cputorch.write_config(root)
    built = _configure_and_build(root, root / "src", root / "build", f"-DTorch_DIR={ours}")
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    needed = _needed(root / "build" / "libext.so")
    assert {"libtorch.so", "libtorch_cpu.so", "libc10.so"} <= set(needed), needed
    assert not [n for n in needed if "cuda" in n or "nvrtc" in n or "nccl" in n], needed
    # the same libraries a +cpu torch ships: nothing else of torch is asked for
    assert not [n for n in needed if n.startswith("libtorch") and n not in
                ("libtorch.so", "libtorch_cpu.so", "libtorch_python.so")], needed  # fmt: skip
