"""The one way this tool runs pytest: `suite` (both sides) and a rebase's proofs use it.

``run_pytest`` runs ``python -m pytest ARGS`` in its own process group (``process.group``:
pytest and its workers are all stopped, as every child is, if we stop early), with:

- our pytest plugin (``vllm_overlay.testing.plugin``: markers, collected ids, progress, hard
  watchdog), copied beside the run and loaded with ``-p``;
- a JUnit report (``junit_family=xunit1``, so test ids are rebuilt exactly), read back into
  one ``TestResult`` per test: outcomes come from the report, never from pytest's text;
- Ray's session directory in a short path (AF_UNIX socket paths may not exceed 107 bytes;
  see ``childenv.ray_tmpdir``), removed afterwards;
- the whole output in a log file and a progress line every ``PROGRESS_EVERY`` seconds.

A failing test is a result, not an exception; what a missing report means is the caller's.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay import process, util
from vllm_overlay.envs import childenv
from vllm_overlay.errors import JunitError, SuiteError
from vllm_overlay.testing import contract as suite_plugin
from vllm_overlay.testing.junit import TestResult, parse_junit_file

PLUGIN_MODULE = "vllm_overlay_suite_plugin"
PROGRESS_EVERY = 20.0
JUNIT_OPTIONS = (
    "-p",
    PLUGIN_MODULE,
    "-p",
    "no:cacheprovider",
    "-o",
    "junit_family=xunit1",
    "-o",
    "junit_logging=all",
    "-o",
    "junit_log_passing_tests=false",
    "-q",
    "-rfE",
    "--color=no",
)


@dataclass(frozen=True)
class RunFiles:
    """Where one run's files go: ``base/{junit.xml,pytest.log,plugin/,out/}`` (the log
    elsewhere if ``log_file`` says so)."""

    base: Path
    log_file: Path | None = None

    @property
    def junit(self) -> Path:
        return self.base / "junit.xml"

    @property
    def log(self) -> Path:
        return self.log_file or self.base / "pytest.log"

    @property
    def plugin(self) -> Path:
        return self.base / "plugin"

    @property
    def out(self) -> Path:  # what the plugin writes
        return self.base / "out"


@dataclass
class PytestRun:
    """What one pytest run gave: its exit code and, from its JUnit report, every test."""

    returncode: int
    results: dict[str, TestResult]
    collected: tuple[str, ...]  # what ran or was to run (deselected tests not included)
    junit: Path | None  # None: pytest wrote no (readable) report
    log: Path
    seconds: float
    deselected: tuple[str, ...] = ()  # collected, then left out as asked (a deselect list)

    def counts(self) -> dict[str, int]:
        out = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
        for r in self.results.values():
            out[r.outcome] += 1
        return out


def run_pytest(
    python: str | os.PathLike[str],
    args: Sequence[str],
    *,
    cwd: Path,
    environ: dict[str, str],
    files: RunFiles,
    label: str,
    limit: float,
    hard_timeout: float | None = None,
) -> PytestRun:
    """``python -m pytest ARGS`` from ``cwd`` with ``environ`` (see the module docstring)."""
    for d in (files.plugin, files.out, files.log.parent, cwd):
        d.mkdir(parents=True, exist_ok=True)
    for stale in (
        files.junit,
        files.out / suite_plugin.COLLECTED,
        files.out / suite_plugin.DESELECTED,
    ):
        stale.unlink(missing_ok=True)
    environ = dict(environ)
    shutil.copyfile(suite_plugin.PLUGIN_FILE, files.plugin / f"{PLUGIN_MODULE}.py")
    environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.fspath(files.plugin), environ.get("PYTHONPATH", "")) if p
    )
    environ[suite_plugin.DIR_ENV] = os.fspath(files.out)
    if hard_timeout:
        environ[suite_plugin.HARD_TIMEOUT_ENV] = str(hard_timeout)
    environ["PYTHONUNBUFFERED"] = "1"
    cmd = [os.fspath(python), "-m", "pytest", *args, "--junitxml", os.fspath(files.junit)]
    cmd += JUNIT_OPTIONS
    started = time.monotonic()
    with _short_ray_tmpdir(environ, cwd):
        rc = _run_with_progress(cmd, environ, cwd, files, label, started, limit)
    seconds = time.monotonic() - started
    try:
        results = parse_junit_file(files.junit)
        junit: Path | None = files.junit
    except JunitError:
        results, junit = {}, None
    collected, deselected = (
        _ids(files.out / name) for name in (suite_plugin.COLLECTED, suite_plugin.DESELECTED)
    )
    return PytestRun(rc, results, collected, junit, files.log, seconds, deselected)


def _ids(path: Path) -> tuple[str, ...]:
    """The test ids the plugin listed in ``path`` (none if it wrote no such file)."""
    return tuple(path.read_text().splitlines()) if path.exists() else ()


@contextlib.contextmanager
def _short_ray_tmpdir(environ: dict[str, str], cwd: Path) -> Iterator[None]:
    """Keep (or make) RAY_TMPDIR short enough for Ray's socket paths; remove it after."""
    current = environ.get("RAY_TMPDIR", "")
    if not current or len(current) + len(childenv.RAY_SOCKET_SUFFIX) > childenv.SOCKET_PATH_MAX:
        environ["RAY_TMPDIR"] = os.fspath(childenv.ray_tmpdir(cwd))
    path = Path(environ["RAY_TMPDIR"])
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield
    finally:
        if path.name.startswith(childenv.RAY_PREFIX):
            shutil.rmtree(path, ignore_errors=True)


def _run_with_progress(
    cmd: list[str],
    environ: dict[str, str],
    cwd: Path,
    files: RunFiles,
    label: str,
    started: float,
    limit: float,
) -> int:
    util.info(f"{label}: running the tests (log: {files.log})")
    with open(files.log, "wb") as log:
        log.write(f"$ {' '.join(cmd)}\n\n".encode())
    with open(files.log, "ab") as log, process.group(cmd, cwd=cwd, env=environ, stdout=log) as proc:
        last = ""
        next_report = started + PROGRESS_EVERY
        while True:
            try:
                return proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if now - started > limit:
                raise SuiteError(
                    f"pytest ({label}) ran longer than {limit / 60:.0f} min and was stopped. "
                    f"Its log: {files.log}."
                )
            if now >= next_report:
                next_report = now + PROGRESS_EVERY
                line = progress_line(label, files.out / suite_plugin.PROGRESS, now - started)
                if line != last:
                    util.info(line)
                    last = line


def progress_line(label: str, progress_file: Path, elapsed: float) -> str:
    try:
        doc = json.loads(progress_file.read_text())
    except (OSError, json.JSONDecodeError):
        return f"{label}: collecting tests ({_duration(elapsed)})"
    total, done, counts = doc.get("total"), doc.get("done", 0), doc.get("counts", {})
    parts = ", ".join(
        f"{counts[k]} {k}" for k in ("passed", "failed", "error", "skipped") if counts.get(k)
    )
    return f"{label}: {done}/{total or '?'} tests ({parts or 'starting'}), {_duration(elapsed)}"


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.1f} min"


def tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "    (no log)"
    return "\n".join("    " + line for line in text.splitlines()[-lines:])
