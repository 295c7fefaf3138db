"""Build the overlay's wheel: choose a strategy, build in scratch space, verify, then place.

The library behind ``vllm-overlay build``: ``build(project, options)`` returns where the
wheel is. A build is keyed by its provenance record's ``build_key`` (the official wheel's
sha256, the overlay's digest, the strategy and its settings, this tool's version): when the
output directory already holds a wheel with that key, nothing is done. Otherwise the wheel
is written under ``.work/build/``, verified, and only then linked into the output
directory, never over a file of the same name with other content. An interrupted or failed
build leaves nothing in the output directory.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_overlay.errors import BuildError, LockFileError, UsageError
from vllm_overlay.gitrepo import git, show_bytes
from vllm_overlay.overlay.checkout import apply_overlay, is_checkout, plan
from vllm_overlay.overlay.model import Overlay, overlay_digest
from vllm_overlay.overlay.project import Project
from vllm_overlay.pin.artifacts import cached_path, ensure_artifact
from vllm_overlay.pin.lockfile import Artifact, Lock
from vllm_overlay.pin.trees import upstream_repo
from vllm_overlay.util import exclusive_lock, info, link_new, sha256_bytes
from vllm_overlay.wheel.metadata import WheelName, local_label, overlay_version, parse_name
from vllm_overlay.wheel.provenance import (
    ChangedFile,
    changed_files,
    provenance,
    read_from_wheel,
    render,
)
from vllm_overlay.wheel.repack import OfficialWheel, RepackInput, read_official, repack
from vllm_overlay.wheel.setupbuild import (
    BUILD_REQUIREMENTS,
    PreflightError,
    SetupCommand,
    SourceSettings,
    build_requirements,
    check_built,
    check_environment,
    check_toolchain,
    precompiled_command,
    probe_python,
    run_setup,
    source_command,
)
from vllm_overlay.wheel.verify import Expectation, VerifyResult, verify_wheel

STRATEGIES = ("auto", "repack", "precompiled", "source")
DEFAULT_PLATFORM = "manylinux_2_28_x86_64"
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
) -> StrategyChoice:
    """The strategy to use and why; refuses a requested one that cannot carry the change."""
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


# -- options, plan, result -----------------------------------------------------------------


@dataclass(frozen=True)
class BuildOptions:
    strategy: str = "auto"
    out: Path = Path("dist")
    keep_release_version: bool = False
    platform: str = DEFAULT_PLATFORM
    index_url: str | None = None
    python: str = sys.executable  # the build environment (precompiled, source)
    source: SourceSettings = field(default_factory=SourceSettings)
    dry_run: bool = False
    install_check: bool = True


@dataclass(frozen=True)
class BuildPlan:
    project: Project
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
        for f in self.files:
            if f.path == path:
                return f.content.decode("utf-8", errors="replace")
        data = show_bytes(self.repo, self.base, path)
        return None if data is None else data.decode("utf-8", errors="replace")

    def expectation(self, official_path: Path | None) -> Expectation:
        return Expectation(
            files=self.files,
            overlay_digest=self.digest,
            upstream_commit=self.lock.upstream.commit,
            official=official_path,
            pinned_wheels={a.filename: a.sha256 for a in self.lock.wheels()},
        )


@dataclass
class BuildResult:
    path: Path | None  # None for a dry run
    strategy: str
    reason: str
    version: str
    up_to_date: bool = False
    seconds: float = 0.0
    verified: VerifyResult | None = None
    dry_run_text: str = ""


def package_name(lock: Lock) -> str:
    return lock.upstream.name.replace("-", "_")


def official_for(lock: Lock, platform: str) -> Artifact | None:
    try:
        return lock.wheel(platform)
    except LockFileError:
        return None


def plan_build(project: Project, opts: BuildOptions) -> BuildPlan:
    """Everything decided before any work: strategy, version, provenance and its key."""
    if opts.strategy not in STRATEGIES:
        raise UsageError(f"--strategy must be one of {', '.join(STRATEGIES)}")
    lock, overlay = project.lock(), project.overlay()
    repo, base = upstream_repo(lock, index_url=opts.index_url)
    planned = plan(lock, overlay, repo, base)
    package = package_name(lock)
    files = changed_files(lock, overlay, planned, package)
    classes = {f.path: classify(f.path, package, added=f.kind == "added") for f in files}
    official = official_for(lock, opts.platform)
    choice = choose_strategy(opts.strategy, files, classes, official, opts.platform)
    digest = overlay_digest(overlay.dir)
    label = local_label(overlay.revision, digest)
    if choice.strategy == "source" and opts.source.target_device != "cuda":
        label += f".{opts.source.target_device}"  # never mistaken for a CUDA build
    version = overlay_version(lock.upstream.version, label)
    version_py = lock.upstream.version if opts.keep_release_version else version
    settings: dict[str, Any] = {}
    if choice.strategy == "source":
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
    )
    return BuildPlan(
        project, lock, overlay, repo, base, digest, files, choice, version, version_py,
        base_wheel, doc,
    )  # fmt: skip


# -- the output directory ------------------------------------------------------------------


def _candidates(out: Path, p: BuildPlan) -> list[Path]:
    dist = parse_name(p.official.filename).distribution if p.official else p.package
    return sorted(out.glob(f"{dist}-{p.version}-*.whl"))


def up_to_date(out: Path, p: BuildPlan) -> Path | None:
    """A wheel in ``out`` built from exactly these inputs, if there is one."""
    for path in _candidates(out, p):
        try:
            doc = read_from_wheel(path)
        except BuildError:
            continue
        if doc is not None and doc.get("build_key") == p.key:
            return path
    return None


def describe_difference(old: dict[str, Any] | None, new: dict[str, Any]) -> str:
    if old is None:
        return "it has no vllm-overlay provenance record"
    keys = sorted(k for k in set(old) | set(new) if k != "build_key" and old.get(k) != new.get(k))
    return "its provenance differs in: " + ", ".join(keys) if keys else "other bytes"


def _refuse(dest: Path, p: BuildPlan) -> BuildError:
    try:
        old = read_from_wheel(dest)
    except BuildError:
        old = None
    return BuildError(
        f"{dest} already exists and was not built from these inputs "
        f"({describe_difference(old, p.provenance)}). It is never overwritten: a version "
        "must not name two different wheels. Move it away (or build into another --out), "
        "or bump `revision` in overlay/overlay.toml if the overlay changed."
    )


def place(tmp: Path, dest: Path, p: BuildPlan) -> bool:
    """Put ``tmp`` at ``dest`` without ever replacing another file; False if identical."""
    try:
        return link_new(tmp, dest)
    except FileExistsError:
        raise _refuse(dest, p) from None


# -- scratch space -------------------------------------------------------------------------


@contextlib.contextmanager
def scratch(project: Project) -> Iterator[Path]:
    """A private temporary directory under .work/build, removed afterwards (also on ^C)."""
    root = project.work_dir / "build"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a killed build
    tmp = Path(tempfile.mkdtemp(prefix="tmp-", dir=root))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def build_tree(p: BuildPlan, opts: BuildOptions) -> Path:
    """The patched tree setup.py runs in: .work/build/<strategy>/vllm, reset for each build.

    CMake's build/ and .deps/ directories are kept between builds (incremental rebuilds,
    stable paths for ccache/sccache); everything else untracked is removed first.
    """
    dest = p.project.work_dir / "build" / p.choice.strategy / "vllm"
    if dest.exists() and is_checkout(dest):
        git("reset", "-q", "--hard", cwd=dest)
        git("clean", "-q", "-ffdx", "-e", "/build/", "-e", "/.deps/", cwd=dest)
    elif dest.exists():
        shutil.rmtree(dest)
    apply_overlay(p.lock, p.overlay, dest, index_url=opts.index_url)
    return dest


# -- strategies ----------------------------------------------------------------------------


def check_official_files(official: OfficialWheel, p: BuildPlan) -> None:
    """The files the overlay patches must be in the official wheel, as the pinned tree has
    them; otherwise the wheel was not built from this tree and repack cannot place the fix."""
    for f in p.files:
        if not f.in_wheel or f.kind != "patch":
            continue
        want = p.lock.base[f.path]
        if official.member(f.path) is None:
            raise BuildError(
                f"{f.path}: the pinned tree has this file (upstream.lock [base] {want}) and "
                f"change {f.change_id!r} patches it, but the official wheel "
                f"{official.path.name} does not contain it. Repack cannot place the change; "
                "build with --strategy precompiled, and check the pin (`vllm-overlay lock "
                "--check`)."
            )
        got = "sha256:" + sha256_bytes(official.read(f.path))
        if got != want:
            raise BuildError(
                f"{f.path}: the official wheel {official.path.name} holds another version of "
                f"this file ({got}) than the pinned tree ({want}); the wheel was not built "
                "from this tree, so repack would mix the two. Build with --strategy "
                "precompiled, and check the pin (`vllm-overlay lock --check`)."
            )


def _repack(p: BuildPlan, opts: BuildOptions, out_dir: Path) -> tuple[Path, Path]:
    assert p.official is not None
    official = ensure_artifact(p.official, index_url=opts.index_url)
    wheel = read_official(official)
    check_official_files(wheel, p)
    inp = RepackInput(
        official=official,
        version=p.version,
        replace={f.path: f.content for f in p.files if f.in_wheel and f.kind == "patch"},
        add={f.path: f.content for f in p.files if f.in_wheel and f.kind == "added"},
        version_py=None if opts.keep_release_version else p.version,
        provenance=render(p.provenance),
    )
    return official, repack(inp, out_dir, wheel)


def setup_command(p: BuildPlan, opts: BuildOptions, tree: Path, dist_dir: Path) -> SetupCommand:
    if p.choice.strategy == "precompiled":
        assert p.official is not None
        return precompiled_command(
            python=opts.python,
            tree=tree,
            dist_dir=dist_dir,
            official=cached_path(p.official),
            version=p.version,
        )
    return source_command(
        python=opts.python, tree=tree, dist_dir=dist_dir, version=p.version, settings=opts.source
    )


def preflight(p: BuildPlan, opts: BuildOptions, env: dict[str, str]) -> list[str]:
    reqs = build_requirements(p.tree_text(BUILD_REQUIREMENTS))
    probe = probe_python(opts.python, [r.name for r in reqs])
    target = opts.source.target_device if p.choice.strategy == "source" else "cuda"
    problems = check_environment(probe, reqs, python=opts.python, target_device=target)
    if p.choice.strategy == "source":
        problems += check_toolchain(
            probe, opts.source, cmakelists=p.tree_text("CMakeLists.txt"), env=env
        )
    return problems


def _touches_requirements(p: BuildPlan) -> bool:
    return any(
        f.path.startswith("requirements/") or f.path in ("setup.py", "pyproject.toml")
        for f in p.files
    )


def _setup_build(
    p: BuildPlan, opts: BuildOptions, scratch_dir: Path, out_dir: Path
) -> tuple[Path | None, Path]:
    probe_cmd = setup_command(p, opts, Path("."), scratch_dir)
    problems = preflight(p, opts, probe_cmd.environment())
    if problems:
        raise PreflightError(
            f"preflight for --strategy {p.choice.strategy} failed; nothing was built:\n"
            + "\n".join(f"  - {x}" for x in problems)
        )
    official_path = None
    official_meta = None
    if p.official is not None and p.choice.strategy == "precompiled":
        official_path = ensure_artifact(p.official, index_url=opts.index_url)
        ow = read_official(official_path)
        official_meta = ow.read(f"{ow.dist_info}/METADATA")
    tree = build_tree(p, opts)
    cmd = setup_command(p, opts, tree, scratch_dir / "setup-dist")
    info(f"running vLLM's setup.py ({p.choice.strategy}) in {tree}")
    log = p.project.work_dir / "build" / "logs" / f"{p.choice.strategy}.log"
    built = run_setup(cmd, log)
    check_built(
        built,
        version=p.version,
        official_metadata=official_meta if opts.source.target_device == "cuda" else None,
        compare_requirements=not _touches_requirements(p),
    )
    tags = parse_name(p.official.filename).tags if official_path and p.official else None
    final = repack(
        RepackInput(
            official=built,
            version=p.version,
            replace={},
            version_py=p.lock.upstream.version if opts.keep_release_version else None,
            provenance=render(p.provenance),
            tags=tags,
        ),
        out_dir,
    )
    return official_path, final


# -- the build -----------------------------------------------------------------------------


def dry_run_text(p: BuildPlan, opts: BuildOptions) -> str:
    expected = p.expected_name()
    lines = [
        f"strategy: {p.choice.strategy} ({p.choice.reason})",
        f"version:  {p.version} (vllm.__version__ = {p.version_py})",
        f"output:   {opts.out / expected.filename if expected else str(opts.out) + '/'}",
        f"build key: {p.key}",
    ]
    if p.official is not None and p.choice.strategy != "source":
        lines.append(f"official wheel: {p.official.filename} (sha256 {p.official.sha256})")
    if p.choice.strategy in ("precompiled", "source"):
        tree = p.project.work_dir / "build" / p.choice.strategy / "vllm"
        cmd = setup_command(
            p, opts, tree, p.project.work_dir / "build" / "tmp-XXXXXXXX" / "setup-dist"
        )
        lines += ["", "# the environment and command:", cmd.render(), ""]
        problems = preflight(p, opts, cmd.environment())
        lines.append("preflight: ok" if not problems else "preflight problems:")
        lines += [f"  - {x}" for x in problems]
    return "\n".join(lines)


def build(project: Project, opts: BuildOptions) -> BuildResult:
    """Build (or find up to date) the overlay's wheel in ``opts.out``; verify it first."""
    started = time.monotonic()
    p = plan_build(project, opts)
    result = BuildResult(None, p.choice.strategy, p.choice.reason, p.version)
    if opts.dry_run:
        result.dry_run_text = dry_run_text(p, opts)
        return result
    info(f"strategy: {p.choice.strategy} ({p.choice.reason})")
    out = opts.out if opts.out.is_absolute() else Path.cwd() / opts.out
    done = up_to_date(out, p)
    if done is not None:
        result.path, result.up_to_date = done, True
        return result
    expected = p.expected_name()
    if expected is not None and (out / expected.filename).exists():
        raise _refuse(out / expected.filename, p)
    lock_file = project.work_dir / "build" / ".lock"
    with exclusive_lock(lock_file, "the build area .work/build"), scratch(project) as tmp:
        staged = tmp / "out"
        staged.mkdir()
        if p.choice.strategy == "repack":
            official, final = _repack(p, opts, staged)
        else:
            official, final = _setup_build(p, opts, tmp, staged)
        info(f"verifying {final.name}")
        result.verified = verify_wheel(final, p.expectation(official), install=opts.install_check)
        dest = out / final.name
        wrote = place(final, dest, p)
        if not wrote:
            info(f"{dest} already holds this exact wheel")
    result.path = dest
    result.seconds = time.monotonic() - started
    return result


def expectation_for(
    project: Project, doc: dict[str, Any] | None, *, index_url: str | None = None
) -> Expectation:
    """What the project says a wheel with provenance ``doc`` must hold (for verify)."""
    lock, overlay = project.lock(), project.overlay()
    repo, base = upstream_repo(lock, index_url=index_url)
    files = changed_files(lock, overlay, plan(lock, overlay, repo, base), package_name(lock))
    official = None
    bw = (doc or {}).get("base_wheel")
    if bw:
        pinned = [a for a in lock.wheels() if a.filename == bw["filename"]]
        if pinned and pinned[0].sha256 == bw["sha256"]:
            official = ensure_artifact(pinned[0], index_url=index_url)
    return Expectation(
        files=files,
        overlay_digest=overlay_digest(overlay.dir),
        upstream_commit=lock.upstream.commit,
        official=official,
        pinned_wheels={a.filename: a.sha256 for a in lock.wheels()},
    )
