"""Preflight of the precompiled and source strategies: before vLLM's ``setup.py`` runs
(``setupbuild.py``), the build environment's interpreter reports its torch, packages and
headers (``probe_python``), and what would make the build fail or build the wrong target is
refused with what to install: the tree's build requirements and torch
(``check_environment``), and for a source build nvcc against torch's CUDA, CMake against
the tree's minimum, the headers and the compiler launcher (``check_toolchain``).
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from vllm_overlay.errors import PreflightError
from vllm_overlay.process import run
from vllm_overlay.wheel.setupbuild import BUILD_REQUIREMENTS, SourceSettings

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
