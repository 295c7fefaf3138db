"""Run a change's own tests against an upstream tree without the change.

When a rebase drops a change because upstream now has it, the change's ``tests`` run against
the new, pristine upstream tree: if they fail, upstream's version does not do what ours did.
Test files the change itself adds (or edits) are placed into a scratch copy of that tree
under names no upstream file has, so upstream's own file at the same path (if any) stays.

Runners: vLLM's tests need the CPU test environment of ``vllm_overlay.envs.testenv``; any other
tree (the synthetic upstream of this tool's tests) runs with a plain Python that has pytest.
Either way pytest runs through the one runner (``vllm_overlay.testing.runner``), as `suite`
does: outcomes come from its JUnit report, and Ray's sockets get a short path.
"""

from __future__ import annotations

import os
import sys
import tarfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

from vllm_overlay.envs.childenv import scratch_environ
from vllm_overlay.errors import OverlayError
from vllm_overlay.gitrepo import git
from vllm_overlay.overlay.model import safe_join
from vllm_overlay.testing import runner as pytest_runner
from vllm_overlay.util import atomic_write_bytes, info

TIMEOUT_S = 3600.0


@dataclass
class TestRun:
    """The outcome of one pytest run over a change's tests."""

    __test__ = False  # not a pytest test class

    targets: list[str]
    returncode: int
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    summary: str = ""
    log: str = ""
    python: str = ""
    first_error: str = ""  # the first failing test's message (from the JUnit report)
    failing: list[str] = field(default_factory=list)  # the ids of the tests that failed or errored
    junit: str = ""  # the JUnit report ("" when pytest wrote none)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Proof needs at least one test that passed and none that failed."""
        return self.returncode == 0 and self.passed > 0 and not self.failed and not self.errors

    def counts(self) -> str:
        parts = [f"{self.passed} passed"]
        for name in ("failed", "errors", "skipped"):
            n = getattr(self, name)
            if n:
                parts.append(f"{n} {'error' if name == 'errors' and n == 1 else name}")
        return ", ".join(parts)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping) -> TestRun:
        return cls(**data)


class Runner(Protocol):
    def command(self, tree: Path, workdir: Path) -> tuple[str, dict[str, str]]:
        """(the Python that runs pytest, its environment) for a run in ``tree``."""
        ...


@dataclass(frozen=True)
class PythonRunner:
    """A Python that has pytest; the tree under test is put first on PYTHONPATH."""

    python: str = sys.executable

    def command(self, tree: Path, workdir: Path) -> tuple[str, dict[str, str]]:
        env = scratch_environ(workdir)
        env.update(PYTHONPATH=os.fspath(tree), PYTHONDONTWRITEBYTECODE="1")
        return self.python, env


@dataclass(frozen=True)
class TestEnvRunner:
    """vLLM's CPU test environment (built on first use, then cached)."""

    __test__ = False

    def command(self, tree: Path, workdir: Path) -> tuple[str, dict[str, str]]:
        from vllm_overlay.envs.testenv import ensure_testenv

        env = ensure_testenv(tree)
        return os.fspath(env.python), env.environ(workdir, tree)


def runner_for(tree: Path, test_python: str | None = None) -> Runner:
    """``--test-python`` if given; vLLM's test environment for a vLLM tree; else this Python."""
    if test_python:
        return PythonRunner(test_python)
    if (tree / "requirements" / "common.txt").is_file():
        return TestEnvRunner()
    return PythonRunner()


def export_tree(repo: Path, rev: str, dest: Path) -> Path:
    """Write the files of ``rev`` (a commit in ``repo``) into the new directory ``dest``."""
    dest.mkdir(parents=True)
    tar = dest.parent / f"{dest.name}.tar"
    git("archive", "--format=tar", "-o", str(tar), rev, cwd=repo)
    try:
        with tarfile.open(tar) as tf:
            tf.extractall(dest, filter="data")
    finally:
        tar.unlink()
    return dest


def write_files(tree: Path, files: Mapping[str, bytes | None]) -> None:
    """Write ``files`` (path -> bytes; None: remove it) over ``tree``."""
    for p, data in files.items():
        target = safe_join(tree, p)
        if data is None:
            target.unlink(missing_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)


def _free_name(tree: Path, path: str) -> str:
    """A path beside ``path`` that no file in ``tree`` has (``test_x.py`` -> ``test_x_overlay.py``)."""
    p = PurePosixPath(path)
    for n in range(1, 100):
        suffix = "_overlay" if n == 1 else f"_overlay{n}"
        cand = str(p.with_name(f"{p.stem}{suffix}{p.suffix}"))
        if not safe_join(tree, cand).exists():
            return cand
    raise OverlayError(f"cannot find a free file name beside {path} in {tree}")


def stage_tests(
    tree: Path, tests: Sequence[str], ours: Mapping[str, bytes]
) -> tuple[list[str], list[str]]:
    """Pytest targets for ``tests`` in ``tree``, and notes on what was placed where.

    A test file the change carries (``ours``: path -> our bytes) is written under a free name
    beside its path, so it runs even where upstream has a file of the same name.
    """
    targets: list[str] = []
    notes: list[str] = []
    placed: dict[str, str] = {}
    for entry in tests:
        path, sep, node = entry.partition("::")
        if path in ours:
            if path not in placed:
                name = _free_name(tree, path)
                atomic_write_bytes(safe_join(tree, name), ours[path])
                placed[path] = name
                if safe_join(tree, path).exists():
                    notes.append(
                        f"our {path} ran as {PurePosixPath(name).name}, beside upstream's own "
                        "file of that name"
                    )
            rel = placed[path]
        else:
            rel = path
            if not safe_join(tree, path).exists():
                raise OverlayError(
                    f"test {entry!r} names {path}, which neither the new upstream tree nor the "
                    "change has. Fix the change's `tests` in overlay/overlay.toml."
                )
        targets.append(os.fspath(tree / rel) + (sep + node if sep else ""))
    return targets, notes


def run_tests(
    runner: Runner, tree: Path, targets: Sequence[str], workdir: Path, log: Path
) -> TestRun:
    """Run pytest over ``targets`` from ``workdir`` (the one runner; outcomes from its JUnit
    report, written beside ``log``); the full output goes to ``log``."""
    return run_groups(runner, tree, {"all": targets}, workdir, log)["all"]


def run_groups(
    runner: Runner, tree: Path, groups: Mapping[str, Sequence[str]], workdir: Path, log: Path
) -> dict[str, TestRun]:
    """One pytest run over several groups of targets (one interpreter start, one
    collection), its results told apart by group: each test belongs to the group whose
    target file it is in."""
    every = [t for ts in groups.values() for t in ts]
    workdir.mkdir(parents=True, exist_ok=True)
    python, env = runner.command(tree, workdir)
    info(f"running {len(every)} test target(s) against {tree}")
    run = pytest_runner.run_pytest(
        python,
        ["--rootdir", os.fspath(tree), *every],
        cwd=workdir,
        environ=env,
        files=pytest_runner.RunFiles(log.parent / f"{log.stem}-files", log_file=log),
        label="proof",
        limit=TIMEOUT_S,
    )
    if len(groups) == 1:  # the whole run is the group's: its exit code too
        [(name, targets)] = groups.items()
        return {name: to_test_run(list(targets), python, run)}
    out = {}
    for name, targets in groups.items():
        files = {os.path.relpath(t.partition("::")[0], tree).replace(os.sep, "/") for t in targets}
        mine = {k: r for k, r in run.results.items() if k.partition("::")[0] in files}
        part = pytest_runner.PytestRun(
            returncode=1 if any(r.failing for r in mine.values()) else (
                run.returncode if run.junit is None else 0),
            results=mine, collected=tuple(k for k in run.collected if k in mine),
            junit=run.junit, log=run.log, seconds=run.seconds,
        )  # fmt: skip
        out[name] = to_test_run(list(targets), python, part)
    return out


def to_test_run(targets: list[str], python: str, run: pytest_runner.PytestRun) -> TestRun:
    """The ``TestRun`` of one pytest run, from its JUnit report."""
    n = run.counts()
    result = TestRun(
        targets=targets,
        returncode=run.returncode,
        passed=n["passed"],
        failed=n["failed"],
        errors=n["error"],
        skipped=n["skipped"],
        log=os.fspath(run.log),
        python=python,
        junit=os.fspath(run.junit) if run.junit is not None else "",
    )
    if run.junit is None:
        result.summary = f"pytest did not finish (exit code {run.returncode}, no JUnit report)"
    elif not run.results:
        result.summary = f"no tests ran (pytest exit code {run.returncode})"
    else:
        result.summary = f"{result.counts()} in {run.seconds:.1f}s"
    failing = [r for r in run.results.values() if r.failing]
    result.first_error = f"{failing[0].nodeid}: {failing[0].summary}" if failing else ""
    result.failing = [r.nodeid for r in failing]
    return result
