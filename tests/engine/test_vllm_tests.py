"""vLLM's own tests of our changes that start the engine (`engine_tests` in overlay.toml).

A regression test through `LLM` needs vLLM's compiled extension, which the source tree's test
environment lacks; so these run from the built wheels, in their engine environments, with
the release's ``tests/`` as our series leaves it (and nothing of its ``vllm/``): each must pass
on our wheel, and each of a change the wheel without our changes lacks must fail there
(``harness.HIDDEN_STATE_CHANGES``), as it fails on the release upstream would start from.
"""

from __future__ import annotations

import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from engine import harness


def engine_tests() -> dict[str, tuple[str, ...]]:
    """change id -> its engine tests (path::test), in series order."""
    from vllm_overlay.overlay.model import load_overlay

    overlay = load_overlay(harness.REPO / "overlay")
    return {c.id: c.engine_tests for c in overlay.changes if c.engine_tests}


@pytest.fixture(scope="module")
def series_tests(tmp_path_factory) -> Path:
    """The release's tests/ as our series leaves it, alone in a directory of its own."""
    from vllm_overlay.overlay.checkout import apply_overlay
    from vllm_overlay.overlay.model import load_overlay
    from vllm_overlay.pin.lockfile import read_lock

    work = tmp_path_factory.mktemp("series")
    lock = read_lock(harness.REPO / "upstream.lock")
    tree = apply_overlay(lock, load_overlay(harness.REPO / "overlay"), work / "tree").checkout
    root = work / "root"
    shutil.copytree(tree / "tests", root / "tests")
    for name in ("pyproject.toml",):  # vLLM's pytest configuration (markers)
        shutil.copy(tree / name, root / name)
    shutil.rmtree(work / "tree")
    return root


def _outcomes(junit: Path) -> dict[str, str]:
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = "failed" if kinds & {"failure", "error"} else "passed"
        outcome = "skipped" if "skipped" in kinds else outcome
        out[case.get("name")] = outcome
    return out


def _run(wheel: harness.Wheel, root: Path, nodes: list[str], where: Path) -> dict[str, str]:
    where.mkdir(parents=True, exist_ok=True)
    env = wheel.env.environ(where / "work")
    env["PYTHONPATH"] = str(root)  # vLLM's tests package; vllm itself from the wheel
    junit = where / "junit.xml"
    with open(where / "pytest.log", "w") as log:
        proc = subprocess.run(
            [wheel.env.python, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "--junitxml", junit, *nodes],
            cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
            timeout=harness.SESSION_TIMEOUT, check=False,
        )  # fmt: skip
    shutil.rmtree(env["VLLM_RPC_BASE_PATH"], ignore_errors=True)
    if not junit.is_file():
        tail = (where / "pytest.log").read_text()[-4000:]
        raise AssertionError(f"pytest wrote no report (rc {proc.returncode}):\n{tail}")
    return _outcomes(junit)


@pytest.mark.parametrize("kind", ["ours", "without"])
def test_vllm_engine_tests_of_our_changes(kind, engine_wheels, series_tests, tmp_path):
    tests = engine_tests()
    assert tests, "no change lists engine_tests"
    runner = harness.runners_at(harness.pinned_version(harness.REPO))[0]
    wheel = harness.runner_wheel(engine_wheels, kind, runner)
    nodes = [t for ts in tests.values() for t in ts]
    got = _run(wheel, series_tests, nodes, tmp_path / kind)
    expected = {
        t.split("::")[1]: "failed"
        if kind == "without" and cid in harness.HIDDEN_STATE_CHANGES
        else "passed"
        for cid, ts in tests.items()
        for t in ts
    }
    log = (tmp_path / kind / "pytest.log").read_text()
    assert got == expected, log[-4000:]
