"""The overlay's own tests, run with vLLM's pytest on the patched and on the pristine tree.

On the tree `vllm-overlay apply` makes, every test of every change must pass. On pristine
the pinned vLLM (with our test files added), the tests that need a fix are marked
``xfail(strict=True)`` by ``VLLM_OVERLAY_TREE=pristine``: pytest must report each as
xfailed (a strict xfail that passes is a failure), so the behavioural tests are proven to
fail without the fix. Both runs print a one-screen summary.

The one skip allowed is a test's own word that this machine cannot show its fix: a skip
reason that starts with ``MACHINE_SKIP`` (the AMX permission needs a CPU with AMX tiles). It
is reported as "unproven here" in the summary; any other skip fails, as before.
"""

from __future__ import annotations

import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from vllm_overlay.envs.testenv import recipe
from vllm_overlay.overlay.checkout import apply_overlay, plan
from vllm_overlay.overlay.model import load_overlay
from vllm_overlay.overlay.series import final_tree
from vllm_overlay.pin.lockfile import read_lock
from vllm_overlay.pin.trees import upstream_repo

ROOT = Path(__file__).resolve().parents[2]
END_TO_END = "test_hidden_states_saved_from_a_cache_in_host_memory"
MACHINE_SKIP = "this machine has no "  # the start of a skip reason: hardware the test needs

pytestmark = [pytest.mark.network, pytest.mark.slow]


def overlay_tests() -> list[str]:
    return [t for change in load_overlay(ROOT / "overlay").changes for t in change.tests]


@pytest.fixture
def patched_tree(tmp_path) -> Path:
    """The pinned vLLM tree with the overlay applied, as `vllm-overlay apply` makes it."""
    lock, overlay = read_lock(ROOT / "upstream.lock"), load_overlay(ROOT / "overlay")
    return apply_overlay(lock, overlay, tmp_path / "patched").checkout


@pytest.fixture
def pristine_tree(tmp_path) -> Path:
    """Pristine vLLM at the pin, plus the test files the overlay adds or extends (its tests
    and the helpers they import) as the whole series leaves them (and nothing else)."""
    lock, overlay = read_lock(ROOT / "upstream.lock"), load_overlay(ROOT / "overlay")
    tree = apply_overlay(lock, None, tmp_path / "pristine").checkout
    final = final_tree(plan(lock, overlay, *upstream_repo(lock)))
    added = {p for change in overlay.changes for p in change.files if p.startswith("tests/")}
    for path in added | {t.split("::")[0] for t in overlay_tests()}:
        dest = tree / path
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(final[path])
    return tree


def outcomes(junit_xml: Path) -> dict[str, str]:
    """test name -> passed | failed | error | skipped | xfailed | unproven here (skipped for
    hardware this machine lacks: ``MACHINE_SKIP``), from pytest's JUnit XML."""
    result = {}
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed" if child.tag == "failure" else "error"
            elif child.tag == "skipped" and outcome == "passed":
                if child.get("type") == "pytest.xfail":
                    outcome = "xfailed"
                elif MACHINE_SKIP in (child.get("message") or ""):
                    outcome = "unproven here"
                else:
                    outcome = "skipped"
        result[case.get("name")] = outcome
    return result


def run_overlay_tests(env, tree: Path, kind: str, tmp_path: Path, capsys) -> dict[str, str]:
    work = tmp_path / f"work-{kind}"
    environ = env.environ(work, tree)
    environ["VLLM_OVERLAY_TREE"] = kind
    run_dir = work / "run"  # some vLLM tests write into the current directory
    run_dir.mkdir()
    junit = work / "junit.xml"
    cmd = [
        str(env.python),
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "-rA",
        f"--junitxml={junit}",
        *(str(tree / t) for t in overlay_tests()),
    ]
    proc = subprocess.run(
        cmd, cwd=run_dir, env=environ, capture_output=True, text=True, timeout=600
    )
    results = outcomes(junit) if junit.is_file() else {}
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    tally = lines[-1] if lines else "(no output)"
    with capsys.disabled():
        print(f"\n--- the overlay's tests on the {kind} tree: {tally}")
        for name, outcome in results.items():
            print(f"    {outcome:8} {name}")
    assert results, f"no test ran on the {kind} tree:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return results


def test_overlay_tests_pass_on_the_patched_tree(
    real_testenv, patched_tree, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("VLLM_OVERLAY_PROJECT", str(ROOT))  # the project whose constraints/ pin
    assert recipe(patched_tree).hash == real_testenv.recipe_hash  # the same environment
    results = run_overlay_tests(real_testenv, patched_tree, "patched", tmp_path, capsys)
    assert END_TO_END in results
    not_passed = {name: o for name, o in results.items() if o not in ("passed", "unproven here")}
    assert not not_passed


def test_fix_dependent_tests_fail_on_the_pristine_tree(
    real_testenv, pristine_tree, tmp_path, capsys
):
    results = run_overlay_tests(real_testenv, pristine_tree, "pristine", tmp_path, capsys)
    # Strict xfail: a fix-dependent test that passed on pristine is reported as failed.
    failed = {name: o for name, o in results.items() if o in ("failed", "error", "skipped")}
    assert not failed
    assert results[END_TO_END] == "xfailed"
    xfailed = sorted(name for name, o in results.items() if o == "xfailed")
    assert len(xfailed) > len(results) // 2, xfailed
