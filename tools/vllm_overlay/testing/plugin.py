"""The pytest plugin `vllm-overlay suite` loads into vLLM's test run.

It is copied into the run directory and loaded with ``-p vllm_overlay_suite_plugin`` by the
test environment's Python, so it imports nothing from vllm_overlay. It:

- records each test's markers as a JUnit property (``vllm_overlay.markers``), so the report
  can say which failing tests upstream marks ``cpu_test`` (expected to pass without a GPU);
- writes the ids of the collected tests (``collected.txt``: what did not run is the rest)
  and a small progress file (``progress.json``) that the runner shows while pytest works;
- deselects the tests listed in the file ``VLLM_OVERLAY_SUITE_DESELECT`` names (a targeted
  baseline: what passed on the patched tree is not run again) and writes the ids it
  deselected (``deselected.txt``), so the runner still knows everything that was collected;
- arms a hard watchdog for every test (faulthandler's, a C thread that needs no GIL): a
  test still running ``VLLM_OVERLAY_SUITE_HARD_TIMEOUT`` seconds after it started, which
  pytest-timeout's signal could not interrupt (stuck in C code), gets its stacks dumped to
  ``hang-<worker>.txt`` and its worker exits; pytest-xdist then reports that test as failed
  ("crashed") and starts a new worker, and this plugin rewrites that report to say why.

Files go to the directory named by ``VLLM_OVERLAY_SUITE_DIR``; without it the plugin does
nothing.
"""

from __future__ import annotations

import faulthandler
import json
import os
import time
from collections.abc import Generator
from pathlib import Path
from typing import Any

import pytest

# The names this plugin shares with the runner (testing/contract.py, which the tool imports
# without pytest). The plugin is copied alone into the test run, so it repeats them; a test
# asserts they agree.
DIR_ENV = "VLLM_OVERLAY_SUITE_DIR"
HARD_TIMEOUT_ENV = "VLLM_OVERLAY_SUITE_HARD_TIMEOUT"
DESELECT_ENV = "VLLM_OVERLAY_SUITE_DESELECT"
DESELECTED = "deselected.txt"
MARKERS_PROPERTY = "vllm_overlay.markers"
COLLECTED = "collected.txt"
PROGRESS = "progress.json"
HANG_PREFIX = "hang-"
_IGNORED_MARKERS = {"parametrize", "usefixtures", "filterwarnings"}


def _outdir() -> Path | None:
    d = os.environ.get(DIR_ENV)
    return Path(d) if d else None


def _worker_id(config: pytest.Config) -> str | None:
    workerinput = getattr(config, "workerinput", None)
    return workerinput["workerid"] if workerinput else None


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        names = sorted({m.name for m in item.iter_markers()} - _IGNORED_MARKERS)
        item.user_properties.append((MARKERS_PROPERTY, ",".join(names)))
    listed = os.environ.get(DESELECT_ENV)
    if not listed:
        return
    skip = set(Path(listed).read_text().splitlines())
    keep = [i for i in items if i.nodeid not in skip]
    dropped = [i for i in items if i.nodeid in skip]
    out = _outdir()
    if out is not None:  # every xdist worker collects the same; the last write wins
        _write_atomic(out / DESELECTED, "".join(f"{i.nodeid}\n" for i in dropped))
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_collection_finish(session: pytest.Session) -> None:
    out = _outdir()
    if out is not None and _PROGRESS.controller:
        _write_atomic(out / COLLECTED, "".join(f"{i.nodeid}\n" for i in session.items))
        _PROGRESS.start(len(session.items))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    out = _outdir()
    if out is not None and not (out / COLLECTED).exists():
        _write_atomic(out / COLLECTED, "".join(f"{i}\n" for i in ids))
        _PROGRESS.start(len(ids))


class _Progress:
    """Per-test outcomes as reports arrive (in the controller), flushed at most once a second."""

    def __init__(self) -> None:
        self.controller = True
        self.total: int | None = None
        self.outcomes: dict[str, str] = {}
        self.last_write = 0.0

    def start(self, total: int) -> None:
        self.total = total
        self.flush(force=True)

    def record(self, report: pytest.TestReport) -> None:
        nodeid = report.nodeid
        prev = self.outcomes.get(nodeid)
        if report.failed:
            state = "failed" if report.when in ("call", "???") else "error"
            if prev != "failed":
                self.outcomes[nodeid] = state
        elif report.skipped and prev is None:
            self.outcomes[nodeid] = "skipped"
        elif report.passed and report.when == "call" and prev is None:
            self.outcomes[nodeid] = "passed"
        self.flush()

    def flush(self, force: bool = False) -> None:
        out = _outdir()
        now = time.monotonic()
        if out is None or not self.controller or (not force and now - self.last_write < 1.0):
            return
        self.last_write = now
        counts: dict[str, int] = {}
        for state in self.outcomes.values():
            counts[state] = counts.get(state, 0) + 1
        doc = {"total": self.total, "done": len(self.outcomes), "counts": counts}
        _write_atomic(out / PROGRESS, json.dumps(doc, sort_keys=True) + "\n")


_PROGRESS = _Progress()


def pytest_configure(config: pytest.Config) -> None:
    _PROGRESS.controller = _worker_id(config) is None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _PROGRESS.controller and _outdir() is not None:
        _PROGRESS.record(report)


def pytest_sessionfinish(session: pytest.Session) -> None:
    _PROGRESS.flush(force=True)


def _hang_file(config: pytest.Config) -> Path | None:
    out = _outdir()
    return None if out is None else out / f"{HANG_PREFIX}{_worker_id(config) or 'main'}.txt"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(
    item: pytest.Item, nextitem: pytest.Item | None
) -> Generator[None, Any, None]:
    path = _hang_file(item.config)
    limit = float(os.environ.get(HARD_TIMEOUT_ENV, "0") or 0)
    if path is None or limit <= 0:
        yield
        return
    with open(path, "w") as f:
        f.write(f"{item.nodeid}\n")
        f.flush()
        faulthandler.dump_traceback_later(limit, exit=True, file=f)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()
    path.unlink(missing_ok=True)


@pytest.hookimpl(optionalhook=True)
def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: Any) -> None:
    """pytest-xdist: a worker died while running ``crashitem``; say why, if we know.

    The report becomes the test's failure (xdist leaves its phase unknown, which JUnit
    would record as an error of setup)."""
    report.when = "call"
    out = _outdir()
    gateway = getattr(getattr(report, "node", None), "gateway", None)
    worker = getattr(gateway, "id", None)
    hang = out / f"{HANG_PREFIX}{worker}.txt" if out is not None and worker else None
    text = hang.read_text(errors="replace") if hang is not None and hang.exists() else ""
    first, _, dump = text.partition("\n")
    if first == crashitem and dump.strip():  # the watchdog fired and dumped the stacks
        limit = os.environ.get(HARD_TIMEOUT_ENV, "?")
        report.longrepr = (
            f"HardTimeout: the test was still running after {limit} s and the per-test timeout "
            f"could not interrupt it (stuck outside Python); its worker was stopped.\n{dump}"
        )
    else:
        report.longrepr = (
            f"WorkerCrash: {report.longrepr}: the worker process died during this test "
            "(a segfault, an abort or os._exit); its output is in the run's pytest.log."
        )
