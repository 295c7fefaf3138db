"""The precompiled and source strategies: vLLM's own ``setup.py`` on the patched tree.

Both run ``python setup.py bdist_wheel --dist-dir=DIR --py-limited-api=cp38`` in the build
tree with the build environment's interpreter (``--python``), exactly as vLLM's Dockerfile
does; there is no build isolation, so the torch of that environment is the one vLLM sees.

- precompiled: ``VLLM_USE_PRECOMPILED=1`` with ``VLLM_PRECOMPILED_WHEEL_LOCATION`` set to
  the cached official wheel: vLLM copies the compiled kernels (and the Rust frontend) out of
  it and builds the Python parts from the tree. vLLM decides "CUDA" from
  ``torch.version.cuda``; with a CPU torch it would quietly build for CPU (``+cpu``, CPU
  requirements). So ``VLLM_TARGET_DEVICE=cuda`` is set explicitly, preflight refuses a torch
  without CUDA, and the result's version and requirements are checked against the official
  wheel. ``use_existing_torch.py`` is never run (it strips torch from the requirements).
- source: the full CMake/nvcc build. The settings vLLM reads (``TORCH_CUDA_ARCH_LIST``,
  ``MAX_JOBS``, ``NVCC_THREADS``, ``CMAKE_BUILD_TYPE``, the compiler launcher, the
  ``*_SRC_DIR`` directories and ``FETCHCONTENT_BASE_DIR``) are passed through; preflight
  checks nvcc against torch's CUDA, CMake against the tree's minimum and the headers.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from vllm_overlay.errors import BuildError, PreflightError, WrongTargetError
from vllm_overlay.process import run
from vllm_overlay.wheel.metadata import metadata_version, parse_name, requires_dist

SOURCE_DATE_EPOCH = "315532800"  # 1980-01-01T00:00:00Z, the zip epoch: no clock in the output
BUILD_REQUIREMENTS = "requirements/build/cuda.txt"
# vLLM's CMake reads these to build a dependency from a local directory instead of cloning it.
SRC_DIR_VARS: dict[str, str] = {
    "cutlass": "VLLM_CUTLASS_SRC_DIR",
    "flash-attention": "VLLM_FLASH_ATTN_SRC_DIR",
    "flashmla": "FLASH_MLA_SRC_DIR",
    "deepgemm": "DEEPGEMM_SRC_DIR",
    "qutlass": "QUTLASS_SRC_DIR",
    "triton-kernels": "TRITON_KERNELS_SRC_DIR",
    "msa": "FMHA_SM100_SRC_DIR",
}
LAUNCHERS = ("auto", "sccache", "ccache", "none")
TARGET_DEVICES = ("cuda", "empty")
# Variables that would steer vLLM's setup.py away from what the strategy asks for.
_PRECOMPILED_UNSET = ("VLLM_PRECOMPILED_WHEEL_VARIANT", "VLLM_PRECOMPILED_WHEEL_COMMIT")
_SOURCE_UNSET = (
    "VLLM_USE_PRECOMPILED",
    "VLLM_USE_PRECOMPILED_RUST",
    "VLLM_PRECOMPILED_WHEEL_LOCATION",
    *_PRECOMPILED_UNSET,
)
# Shown by --dry-run when set: what the build inherits that matters to it.
_PASSTHROUGH_PREFIXES = ("SCCACHE_", "CCACHE_", "CUDA_HOME", "CUDA_PATH", "CMAKE_ARGS", "CC", "CXX")

_PROBE = r"""
import json, sys, sysconfig
from importlib import metadata
out = {"python": sys.version.split()[0], "executable": sys.executable,
       "include": sysconfig.get_paths()["include"], "packages": {}}
try:
    import torch
    out["torch"] = {"version": torch.__version__, "cuda": torch.version.cuda,
                    "hip": getattr(torch.version, "hip", None)}
    try:  # the extension vLLM's CpuPlatform.import_kernels imports here (x86)
        avx512 = torch.cpu._is_avx512_supported()
        bf16 = avx512 and torch.cpu._is_avx512_bf16_supported()
        out["torch"]["x86_target"] = "_C" if bf16 else "_C_AVX512" if avx512 else "_C_AVX2"
    except Exception:
        pass
except Exception as e:
    out["torch"] = {"error": f"{type(e).__name__}: {e}"}
try:
    from torch.utils.cpp_extension import CUDA_HOME  # what vLLM's setup.py uses
    out["cuda_home"] = CUDA_HOME
except Exception:
    out["cuda_home"] = None
for name in sys.argv[1:]:
    try:
        out["packages"][name] = metadata.version(name)
    except metadata.PackageNotFoundError:
        out["packages"][name] = None
print(json.dumps(out))
"""


@dataclass(frozen=True)
class SourceSettings:
    cuda_arch_list: str | None = None
    max_jobs: int | None = None
    nvcc_threads: int | None = None
    cmake_build_type: str = "Release"
    launcher: str = "auto"
    src_dirs: Mapping[str, Path] = field(default_factory=dict)
    fetchcontent_dir: Path | None = None
    target_device: str = "cuda"

    def key_settings(self) -> dict[str, Any]:
        """The settings that change the wheel (recorded in provenance)."""
        return {
            "cmake_build_type": self.cmake_build_type,
            "target_device": self.target_device,
            "torch_cuda_arch_list": self.cuda_arch_list,
        }


@dataclass(frozen=True)
class SetupCommand:
    strategy: str  # "precompiled" | "source"
    python: str
    tree: Path
    dist_dir: Path
    env: dict[str, str]  # set on top of the inherited environment
    unset: tuple[str, ...]

    @property
    def argv(self) -> list[str]:
        return [
            self.python,
            "setup.py",
            "bdist_wheel",
            f"--dist-dir={self.dist_dir}",
            "--py-limited-api=cp38",
        ]

    def environment(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ if base is None else base)
        for k in self.unset:
            env.pop(k, None)
        env.update(self.env)
        return env

    def render(self, base: Mapping[str, str] | None = None) -> str:
        """The exact environment and command, as a shell snippet (for --dry-run)."""
        inherited = dict(os.environ if base is None else base)
        lines = [f"cd {shlex.quote(str(self.tree))}"]
        lines += [f"unset {k}" for k in self.unset if k in inherited]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        passthrough = sorted(
            k
            for k in inherited
            if k not in self.env and k.startswith(_PASSTHROUGH_PREFIXES) and k not in self.unset
        )
        lines += [f"# inherited: {k}={shlex.quote(inherited[k])}" for k in passthrough]
        lines.append(shlex.join(self.argv))
        return "\n".join(lines)


def precompiled_command(
    *, python: str, tree: Path, dist_dir: Path, official: Path, version: str
) -> SetupCommand:
    env = {
        "VLLM_USE_PRECOMPILED": "1",
        "VLLM_PRECOMPILED_WHEEL_LOCATION": str(official),
        "VLLM_VERSION_OVERRIDE": version,
        "VLLM_TARGET_DEVICE": "cuda",
        "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH,
    }
    return SetupCommand("precompiled", python, tree, dist_dir, env, _PRECOMPILED_UNSET)


def source_command(
    *, python: str, tree: Path, dist_dir: Path, version: str, settings: SourceSettings
) -> SetupCommand:
    env = {
        "VLLM_TARGET_DEVICE": settings.target_device,
        "VLLM_VERSION_OVERRIDE": version,
        "CMAKE_BUILD_TYPE": settings.cmake_build_type,
        "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH,
    }
    if settings.cuda_arch_list:
        env["TORCH_CUDA_ARCH_LIST"] = settings.cuda_arch_list
    if settings.max_jobs:
        env["MAX_JOBS"] = str(settings.max_jobs)
    if settings.nvcc_threads:
        env["NVCC_THREADS"] = str(settings.nvcc_threads)
    unset = list(_SOURCE_UNSET)
    if settings.launcher in ("ccache", "none"):
        env["VLLM_DISABLE_SCCACHE"] = "1"
    elif settings.launcher == "sccache":
        unset.append("VLLM_DISABLE_SCCACHE")
    if settings.launcher == "none":
        launchers = " ".join(
            f"-DCMAKE_{lang}_COMPILER_LAUNCHER=" for lang in ("C", "CXX", "CUDA", "HIP")
        )
        extra = os.environ.get("CMAKE_ARGS", "")
        env["CMAKE_ARGS"] = f"{extra} {launchers}".strip()
    for name, path in sorted(settings.src_dirs.items()):
        env[SRC_DIR_VARS[name]] = str(path)
    if settings.fetchcontent_dir:
        env["FETCHCONTENT_BASE_DIR"] = str(settings.fetchcontent_dir)
    return SetupCommand("source", python, tree, dist_dir, env, tuple(unset))


# -- preflight -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Probe:
    """What the build environment's interpreter reports about itself."""

    python: str
    include: str
    torch_version: str | None
    torch_cuda: str | None
    torch_error: str | None
    packages: dict[str, str | None]
    cuda_home: str | None = None  # torch.utils.cpp_extension.CUDA_HOME
    # x86: the extension vLLM imports by torch's view of the CPU (_C, _C_AVX512, _C_AVX2)
    x86_target: str | None = None


def probe_python(python: str, packages: Sequence[str]) -> Probe:
    out = run(
        python, "-c", _PROBE, *packages,
        hint=f"The build environment's interpreter {python} could not run. Pass --python with "
        "the interpreter of an environment that holds vLLM's build requirements.",
    )  # fmt: skip
    try:
        data = json.loads(out.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError) as e:
        raise PreflightError(f"{python} printed no environment report: {out.stdout!r}") from e
    torch = data.get("torch") or {}
    return Probe(
        python=data["python"],
        include=data["include"],
        torch_version=torch.get("version"),
        torch_cuda=torch.get("cuda"),
        torch_error=torch.get("error"),
        packages=data.get("packages", {}),
        cuda_home=data.get("cuda_home"),
        x86_target=torch.get("x86_target"),
    )


def build_requirements(text: str | None) -> list[Requirement]:
    """The Python build requirements of the tree (requirements/build/cuda.txt, or cpu.txt for
    our own CPU build) that apply to this machine."""
    reqs = []
    for line in (text or "").splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate():
            reqs.append(req)
    return reqs


def _version_ok(have: str, spec: SpecifierSet) -> bool:
    try:
        return spec.contains(Version(have), prereleases=True)
    except InvalidVersion:
        return False


def check_environment(
    probe: Probe,
    reqs: Sequence[Requirement],
    *,
    python: str,
    target_device: str = "cuda",
) -> list[str]:
    """Problems with the build interpreter's packages and torch (empty: fine)."""
    problems = []
    torch_req = next((r for r in reqs if r.name == "torch"), None)
    if probe.torch_version is None:
        problems.append(
            f"torch is not importable in {python} ({probe.torch_error}). vLLM's setup.py "
            f"imports it; install the CUDA build of {torch_req or 'torch'} in that environment."
        )
    elif target_device == "cuda":
        if probe.torch_cuda is None:
            problems.append(
                f"torch {probe.torch_version} in {python} is not a CUDA build "
                "(torch.version.cuda is None). vLLM would build a +cpu wheel with CPU "
                f"requirements from it. Install the CUDA build of {torch_req or 'torch'} "
                "there, or use --strategy repack (which needs no torch)."
            )
        if torch_req is not None and not _version_ok(probe.torch_version, torch_req.specifier):
            problems.append(
                f"torch {probe.torch_version} in {python} does not satisfy the tree's "
                f"{torch_req} ({BUILD_REQUIREMENTS}); install that version."
            )
    skip = {"torch", "cmake", "ninja"}
    missing_reqs = False
    for r in reqs:
        if r.name in skip:
            continue
        have = probe.packages.get(r.name)
        if have is None:
            problems.append(f"{r} is not installed in {python} ({BUILD_REQUIREMENTS}).")
            missing_reqs = True
        elif r.specifier and not _version_ok(have, r.specifier):
            problems.append(f"{r.name} {have} in {python} does not satisfy {r}.")
            missing_reqs = True
    if missing_reqs:
        problems.append(
            f"Install the tree's build requirements into that environment: "
            f"`{python} -m pip install -r {BUILD_REQUIREMENTS}` (from the build tree)."
        )
    return problems


def cmake_minimum(cmakelists: str | None) -> Version | None:
    m = re.search(r"cmake_minimum_required\s*\(\s*VERSION\s+([0-9.]+)", cmakelists or "", re.I)
    return Version(m.group(1)) if m else None


def tool_version(argv: Sequence[str], pattern: str) -> str | None:
    """The version a tool prints (None: not installed or unrecognised)."""
    if shutil.which(argv[0]) is None and not Path(argv[0]).is_file():
        return None
    out = run(*argv, check=False)
    m = re.search(pattern, out.stdout + out.stderr)
    return m.group(1) if m else None


def cuda_home(env: Mapping[str, str]) -> Path | None:
    """Where torch's cpp_extension (and so vLLM's setup.py) finds CUDA: $CUDA_HOME,
    $CUDA_PATH, the directory above the nvcc on PATH, else /usr/local/cuda."""
    for key in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(key):
            return Path(env[key])
    nvcc = shutil.which("nvcc", path=env.get("PATH"))
    if nvcc:
        return Path(nvcc).parent.parent
    default = Path("/usr/local/cuda")
    return default if default.is_dir() else None


def check_toolchain(
    probe: Probe,
    settings: SourceSettings,
    *,
    cmakelists: str | None,
    env: Mapping[str, str],
    version_of: Callable[[Sequence[str], str], str | None] = tool_version,
) -> list[str]:
    """Problems with nvcc, CMake, headers and the compiler launcher for a source build."""
    if settings.target_device != "cuda":
        return []
    problems = []
    home = Path(probe.cuda_home) if probe.cuda_home else cuda_home(env)
    nvcc = str(home / "bin" / "nvcc") if home else "nvcc"
    nvcc_version = version_of([nvcc, "--version"], r"release (\d+\.\d+)")
    if nvcc_version is None:
        problems.append(
            "nvcc was not found (looked at $CUDA_HOME, $CUDA_PATH, PATH and /usr/local/cuda). "
            "Install the CUDA toolkit matching torch's CUDA and set CUDA_HOME."
        )
    elif probe.torch_cuda and nvcc_version != ".".join(probe.torch_cuda.split(".")[:2]):
        problems.append(
            f"nvcc ({nvcc}) is CUDA {nvcc_version} but torch {probe.torch_version} was built "
            f"for CUDA {probe.torch_cuda}; they must agree. Point CUDA_HOME at the CUDA "
            f"{probe.torch_cuda} toolkit or install the torch build for CUDA {nvcc_version}."
        )
    if home is not None and not (home / "include" / "cuda_runtime.h").is_file():
        problems.append(
            f"{home}/include/cuda_runtime.h is missing: {home} (CUDA_HOME as torch finds it) "
            "holds no CUDA development headers. Set CUDA_HOME to the CUDA toolkit's root "
            "(e.g. /usr/local/cuda), or install its headers."
        )
    if not (Path(probe.include) / "Python.h").is_file():
        problems.append(
            f"Python.h is missing from {probe.include}: install the Python development headers "
            f"(python{probe.python.rsplit('.', 1)[0]}-dev) for the build interpreter."
        )
    need = cmake_minimum(cmakelists) or Version("3.26")
    have = version_of(["cmake", "--version"], r"cmake version (\d+\.\d+(?:\.\d+)?)")
    if have is None:
        problems.append(f"cmake is not on PATH; install CMake >= {need} (`pip install cmake`).")
    elif Version(have) < need:
        problems.append(
            f"cmake {have} is older than the {need} the tree's CMakeLists.txt requires; "
            f"install CMake >= {need} (`pip install 'cmake>={need}'`) and put it first on PATH."
        )
    for launcher in ("sccache", "ccache"):
        if settings.launcher == launcher and shutil.which(launcher, path=env.get("PATH")) is None:
            problems.append(f"--launcher {launcher}: {launcher} is not on PATH; install it.")
    for name, path in sorted(settings.src_dirs.items()):
        if not Path(path).is_dir():
            problems.append(f"--src-dir {name}={path}: not a directory.")
    return problems


# -- running and checking the result -------------------------------------------------------


def run_setup(cmd: SetupCommand, log: Path, *, interval: float | None = None) -> Path:
    """Run setup.py; return the one wheel it wrote. Its output goes to ``log`` as it comes
    (after the exact environment and command), and stderr says it is running (process.run)."""
    cmd.dist_dir.mkdir(parents=True, exist_ok=True)
    hint = (
        f"vLLM's setup.py failed in {cmd.tree}. "
        "Rerun with --dry-run to see the exact environment and command."
    )
    run(*cmd.argv, cwd=cmd.tree, env=cmd.environment(), hint=hint, log=log,
        what=f"setup.py bdist_wheel ({cmd.strategy})", header=cmd.render() + "\n",
        interval=interval)  # fmt: skip
    wheels = sorted(cmd.dist_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise BuildError(
            f"vLLM's setup.py wrote {len(wheels)} wheels into {cmd.dist_dir} "
            f"({[w.name for w in wheels]}); expected one. Its output is in {log}."
        )
    return wheels[0]


def check_built(
    built: Path, *, version: str, official_metadata: bytes | None, compare_requirements: bool
) -> None:
    """Refuse a setup.py result that is not the CUDA wheel of ``version`` (e.g. +cpu)."""
    name = parse_name(built.name)
    with zipfile.ZipFile(built) as zf:
        meta_name = f"{name.dist_info}/METADATA"
        meta = zf.read(meta_name)
    got = metadata_version(meta, f"{built.name}:{meta_name}")
    reqs = requires_dist(meta, meta_name)
    cpu = "cpu" in (Version(got).local or "").split(".") or any(
        re.match(r"^torch\s*==\s*[^;]*\+cpu", r) for r in reqs
    )
    if cpu:
        raise WrongTargetError(
            f"vLLM's setup.py built a CPU wheel ({built.name}, version {got}"
            f"{', requirements pin a +cpu torch' if reqs else ''}): the build environment's "
            "torch is not a CUDA build, so vLLM chose the CPU target. Nothing was written to "
            "the output directory. Install the CUDA torch the tree pins into the build "
            "environment, or use --strategy repack."
        )
    if got != version:
        raise WrongTargetError(
            f"vLLM's setup.py built version {got}, not the {version} it was asked for "
            "(VLLM_VERSION_OVERRIDE). Nothing was written to the output directory."
        )
    if official_metadata is not None and compare_requirements:
        want = requires_dist(official_metadata, "the official wheel's METADATA")
        missing = sorted(set(want) - set(reqs))
        extra = sorted(set(reqs) - set(want))
        if missing or extra:
            diff = "".join(f"\n  - {r}" for r in missing) + "".join(f"\n  + {r}" for r in extra)
            raise WrongTargetError(
                f"the built wheel's requirements differ from the official wheel's:{diff}\n"
                "The overlay does not change requirements, so the build environment made "
                "vLLM resolve another target or strip pins (a CPU torch, or "
                "use_existing_torch.py run on the tree). Nothing was written to the output "
                "directory."
            )
