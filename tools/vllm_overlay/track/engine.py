"""The engine proof of a tracking run whose target has no official CPU wheel.

Where the rebased ``upstream.lock`` pins vllm-cpu as built from source (``[[source]]``: the
index has no official x86_64 wheel of the target), "ready" must mean proven in the engine,
not only rebased: the tracking run compiles the test build of our vllm-cpu from the target's
sdist in the copy (this machine's one extension, no oneDNN: minutes, not the full build's
most of an hour; timed, the report says how long it took), then runs the copy's own engine
tests (``tests/engine``) at the target, which take the test build too where the lock pins a
source build (the same compiled objects, from the compiler cache). A failure of either makes
the run need a person, with the reason and the log that shows it. The full build is
``make build-wheel``'s, on the branch once it is merged.

Where the lock keeps official CPU wheels, nothing runs here: CI's engine tests prove the
branch as they prove every pull request.
"""

from __future__ import annotations

import os
import sys
import time

from vllm_overlay.errors import OverlayError
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay.project import Project
from vllm_overlay.process import run
from vllm_overlay.track.trackdata import EngineBuild, EngineProof, EngineTests, Wheel
from vllm_overlay.util import info

# The engine tests of the project, relative to its root (the copy's own, at its HEAD).
ENGINE_TESTS = "tests/engine"
# What the report keeps of a failed run's output.
TAIL_LINES = 40


def pins_a_source_build(project: Project) -> bool:
    """The copy's lock pins a build from source."""
    return bool(project.lock().sources)


def prove(
    project: Project, *, settings: Settings, max_jobs: int | None,
    build_python: str | None = None,
) -> EngineProof:  # fmt: skip
    """Compile the test build of what the lock pins as built from source (into
    ``.work/dist`` of the copy; with ``build_python``, in that environment instead of one
    built from the release's constraints file), then run the engine tests; returns the
    report's ``engine`` entry (``ok``, ``build``, ``tests``)."""
    builds = project.lock().source_line()
    build = _build(project, settings=settings, max_jobs=max_jobs, build_python=build_python)
    if not build.ok:
        return EngineProof(False, builds, build)
    tests = _engine_tests(project, max_jobs=max_jobs)
    return EngineProof(tests.ok, builds, build, tests)


def _build(
    project: Project, *, settings: Settings, max_jobs: int | None, build_python: str | None
) -> EngineBuild:
    from vllm_overlay.envs.buildenv import build_env_python
    from vllm_overlay.wheel.build import build
    from vllm_overlay.wheel.plan import BuildOptions
    from vllm_overlay.wheel.setupbuild import SourceSettings
    from vllm_overlay.wheel.strategy import source_platforms

    lock = project.lock()
    platforms = tuple(p for s in lock.sources for p in source_platforms(lock, s.project))
    variants = tuple(dict.fromkeys(s.project for s in lock.sources))
    info(f"compiling the test build of {lock.source_line()} for the engine proof")
    started = time.monotonic()
    try:
        result = build(
            project,
            BuildOptions(
                strategy="auto", out=project.work_dir / "dist", variants=variants,
                platforms=platforms, settings=settings,
                python=build_python or sys.executable,
                build_env=None if build_python else build_env_python,
                source=SourceSettings(max_jobs=max_jobs), test_build=True,
            ),
        )  # fmt: skip
    except OverlayError as e:
        seconds = time.monotonic() - started
        info(f"the test build failed after {seconds:.0f} s")
        return EngineBuild(False, round(seconds, 1), error=str(e))
    seconds = time.monotonic() - started
    wheels = tuple(Wheel(w.path.name, w.up_to_date) for w in result.wheels)
    info(f"built {', '.join(w.name for w in wheels)} in {seconds:.0f} s")
    return EngineBuild(True, round(seconds, 1), wheels)


def _workers() -> list[str]:
    """Two pytest-xdist workers where it is installed (as `make test` runs them): two
    engine sessions at once, each mostly waiting on its engine's processes."""
    try:
        import xdist  # noqa: F401
    except ImportError:
        return []
    return ["-n", "2", "--dist", "worksteal"]


def _engine_tests(project: Project, *, max_jobs: int | None) -> EngineTests:
    tests = project.root / ENGINE_TESTS
    if not tests.is_dir():
        return EngineTests(False, error=f"the project has no {ENGINE_TESTS}: nothing proves "
                           "the target in the engine")  # fmt: skip
    log = project.work_dir / "track-engine.log"
    env = {**os.environ, "MAX_JOBS": str(max_jobs or 2)}
    started = time.monotonic()
    # A base directory of its own: pytest keeps only the newest three under the default
    # one, so another run there (the caller's own pytest) could lose its files to this one.
    proc = run(
        sys.executable, "-m", "pytest", ENGINE_TESTS, "-p", "no:cacheprovider",
        "--basetemp", str(project.work_dir / "track-engine-tmp"),
        "--engine-device", "cpu", "-q", "-ra", *_workers(),
        cwd=project.root, env=env, check=False, log=log, what="the engine tests at the target",
    )  # fmt: skip
    seconds = time.monotonic() - started
    lines = proc.stdout.splitlines()
    summary = next((ln for ln in reversed(lines) if " in " in ln and ("passed" in ln or
                    "failed" in ln or "error" in ln)), "")  # fmt: skip
    return EngineTests(
        ok=proc.returncode == 0,
        seconds=round(seconds, 1),
        returncode=proc.returncode,
        summary=summary.strip("= ").strip(),
        log=str(log),
        tail="\n".join(lines[-TAIL_LINES:]) if proc.returncode else "",
    )
