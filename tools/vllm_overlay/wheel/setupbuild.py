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

The preflight itself is ``preflight.py``; this module makes the command, runs it and checks
its result.
"""

from __future__ import annotations

import os
import re
import shlex
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.version import Version

from vllm_overlay.errors import BuildError, WrongTargetError
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
