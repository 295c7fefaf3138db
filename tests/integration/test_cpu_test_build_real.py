"""The test build's edits on the real release's tree (network: the pinned sdist, cached).

The unit tests edit the synthetic CPU project laid out as vLLM's; this applies every edit of
every kind of test build (each x86 extension) to the pinned release's own
cmake/cpu_extension.cmake, csrc/cpu/ and the files the full build edits, so a release whose
layout moved is caught here, not half way through a compile. What the edited tree compiles
to is the engine tests' to prove (they compile the test build wherever the lock pins a
source build, CI included).
"""

from __future__ import annotations

import io
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest
from vllm_overlay.overlay.project import Project
from vllm_overlay.pin.trees import upstream_repo
from vllm_overlay.wheel import cpuedits

pytestmark = pytest.mark.network

ROOT = Path(__file__).resolve().parents[2]
GCC = "c++ (Debian 12.2.0-14+deb12u1) 12.2.0"
FILES = ("cmake", "csrc/cpu", "pyproject.toml", "requirements", "vllm/platforms/__init__.py")


@pytest.fixture(scope="module")
def real_tree(tmp_path_factory) -> Path:
    """The pinned release's files the CPU build edits, as the sdist has them."""
    lock = Project(ROOT).lock()
    repo, base = upstream_repo(lock)
    dest = tmp_path_factory.mktemp("real-cpu-tree")
    archive = subprocess.run(["git", "archive", "--format=tar", base, "--", *FILES], cwd=repo,
                             check=True, capture_output=True).stdout  # fmt: skip
    with tarfile.open(fileobj=io.BytesIO(archive)) as tf:
        tf.extractall(dest, filter="data")
    return dest


@pytest.mark.parametrize("target", cpuedits.X86_TARGETS)
def test_every_test_build_edit_applies_to_the_real_release(real_tree, tmp_path, target):
    tree = tmp_path / "tree"
    shutil.copytree(real_tree, tree)  # a fresh copy per target
    cpuedits.edit_tree(tree, GCC, test_target=target)
    cmake = (tree / "cmake/cpu_extension.cmake").read_text()
    x86 = cmake[cmake.index("set(VLLM_EXT_SRC_AVX512") :]  # the x86 extensions' section
    x86 = x86[: x86.index("\nelse()\n")]
    assert re.findall(r"define_extension_target\(\s*(\w+)", x86) == [target]
    assert "dnnl" not in x86
    assert "if (FALSE)  # vllm-overlay test build: no oneDNN" in cmake
    bindings = (tree / "csrc/cpu/torch_bindings.cpp").read_text()
    assert (
        "  // Quantization\n#if 0  // vllm-overlay test build: no oneDNN (dnnl_kernels.cpp)\n"
        "  // Helper function to release oneDNN handlers\n" in bindings
    )  # the whole condition (three lines) gone, the block's own lines kept
    leftover = [str(p) for p in (tree / "csrc/cpu").rglob("*") if p.is_file()
                and "#include <torch/all.h>" in p.read_text(errors="replace")]  # fmt: skip
    assert leftover == []
