"""The skips a run may have, each with its reason; under ``CI=true`` any other skip fails.

A skip hides a test: CI that stays green while a test starts skipping for a new reason (a
tool gone from the machine, a runner the pinned release deleted) proves less than it says.
So this list is the one place a skip is allowed, and this plugin (tests/conftest.py loads it)
turns every other skip into a failure under ``CI=true`` (what CI sets; ``.ci/run`` too),
naming the test and its reason. Elsewhere (a developer's machine without Chromium, an aarch64
machine) a skip stays a skip. Parametrizations that the pinned release cannot run are not
collected at all (tests/engine: ``harness.at_pin``), so they need no entry here.

The check runs where the test ran (``pytest_runtest_makereport``: a pytest-xdist worker, or
the one process), so the failure travels to the controller as any other; a skip raised while
collecting a module is checked the same way (``pytest_make_collect_report``).
tests/unit/test_expected_skips.py shows a new skip failing a run and a listed one passing.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

import pytest

RELEASES_REASON = "a further real release: run `make test-releases`"


@dataclass(frozen=True)
class Expected:
    """A skip that may happen: tests whose node id matches ``where`` (a glob), skipped with a
    reason that matches ``reason`` (a glob), and why the skip is right."""

    where: str
    reason: str
    why: str


EXPECTED = (
    Expected(
        "tests/*",
        RELEASES_REASON,
        "tests marked `releases` walk further real vLLM releases, each in a test environment "
        "of its own (minutes each): `make test-releases` runs them (--releases), not CI",
    ),
    Expected(
        "tests/engine/*",
        "tensor_parallel_size=* on CUDA needs * GPUs",
        "the GPU job's runner may have one GPU (engine-cuda.yml); the CPU sessions run "
        "tensor parallelism on two cores in every run",
    ),
)


def expected(nodeid: str, reason: str) -> Expected | None:
    """The entry that allows ``nodeid``'s skip with ``reason``, or None."""
    for e in EXPECTED:
        if fnmatch.fnmatchcase(nodeid, e.where) and fnmatch.fnmatchcase(reason, e.reason):
            return e
    return None


def skip_reason(longrepr: object) -> str:
    """The reason of a skip report (pytest's ``(path, line, "Skipped: reason")``)."""
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return str(text).removeprefix("Skipped: ")


def _gate(report) -> None:
    if not report.skipped or hasattr(report, "wasxfail") or os.environ.get("CI") != "true":
        return
    reason = skip_reason(report.longrepr)
    if expected(report.nodeid, reason) is None:
        report.outcome = "failed"
        report.longrepr = (
            f"unexpected skip under CI=true: {report.nodeid}: {reason}\n"
            "Every skip CI allows is listed in tests/expected_skips.py with its reason: make "
            "the test run here (install what it needs), or list the skip there and say why."
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _gate(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _gate(outcome.get_result())
