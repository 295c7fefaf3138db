"""The suite and the proofs running real pytest children: both sides of `vllm-overlay suite` on
the synthetic upstream (patched vs pristine, the cached and the targeted baseline, crashes
and hangs, wheel mode), and the one runner as a rebase's proofs use it. The comparison,
report and JUnit parsing on their own are tests/unit/test_suite.py."""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import FIXED_CONNECTOR_SNIPPET
from synthetic import ADDED_TEST, CONNECTOR, release_files
from vllm_overlay import util
from vllm_overlay.envs import childenv
from vllm_overlay.testing import proving
from vllm_overlay.testing import side as sides
from vllm_overlay.testing.report import TOTAL_KEYS

UNIT = "tests/v1/kv_connector/unit"

# --- end to end on the synthetic upstream ------------------------------------------------


def suite_cli(cli, project, *args):
    return cli(
        "suite", "--python", sys.executable, "--index-url", project.index.url, "--timeout", "30",
        *args, cwd=project.root,
    )  # fmt: skip


def test_suite_compares_patched_with_pristine_and_caches_the_baseline(project, cli, tmp_path):
    junit = tmp_path / "junit"
    res = suite_cli(cli, project, "--junit", junit)
    assert res.rc == 0, res.err + res.out
    out = res.out
    assert "vllm 1.0.0 suite: tests/v1/kv_connector/unit (+1 overlay test path)" not in out
    assert "vllm 1.0.0 suite: tests/v1/kv_connector/unit" in out
    rows = [line.split()[:7] for line in out.splitlines()[4:6]]
    assert rows == ["baseline 1 0 0 0 0 1".split(), "patched 2 0 0 0 0 2".split()]
    assert "new failures (pass on baseline, fail on patched): none" in out
    assert f"only on patched: 1\n    {ADDED_TEST}: 1 passed" in out
    assert "verdict: OK" in out
    assert "running the baseline on pristine upstream" in res.err
    assert "suite: patched: running the tests" in res.err
    base = (junit / "baseline.xml").read_text()
    assert "test_layout" in base and "test_group_block_size" not in base
    assert "test_group_block_size" in (junit / "patched.xml").read_text()
    assert 'name="vllm_overlay.markers"' in base

    # Warm: the baseline comes from the cache; the JUnit reports are written all the same.
    (junit / "baseline.xml").unlink()
    res = suite_cli(cli, project, "--junit", junit, "--json")
    assert res.rc == 0, res.err
    assert "baseline from the cache" in res.err
    assert "running the baseline" not in res.err
    doc = json.loads(res.out)
    assert doc["ok"] is True
    assert doc["runs"]["baseline"]["cached"] is True
    assert doc["runs"]["patched"]["totals"]["passed"] == 2
    assert doc["only_patched"] == [
        {
            "nodeid": f"{ADDED_TEST}::test_group_block_size",
            "baseline": "absent",
            "patched": "passed",
        }
    ]
    assert doc["baseline_selection"] == [UNIT]
    assert (junit / "baseline.xml").read_text() == base

    # A corrupt cached baseline is rebuilt, and the run says so.
    entries = list((util.cache_dir() / "suite-baselines").glob("*.json"))
    assert len(entries) == 1
    entries[0].write_text('{"format": 1, "junit": "<testsu')
    res = suite_cli(cli, project, "--junit", junit)
    assert res.rc == 0, res.err
    assert "the cached baseline is unusable" in res.err and "is corrupt" in res.err
    assert "running the baseline on pristine upstream" in res.err
    assert json.loads(entries[0].read_text())["key"] == entries[0].stem


def _broken_checkout(cli, project, tmp_path: Path) -> Path:
    co = tmp_path / "co"
    res = cli("apply", "--checkout", co, "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0, res.err
    connector = co / CONNECTOR
    connector.write_text(connector.read_text().replace('return "NHD"', 'return "HND"'))
    return co


def test_a_new_failure_fails_the_run(project, cli, tmp_path):
    co = _broken_checkout(cli, project, tmp_path)
    res = suite_cli(cli, project, "--checkout", co, "--workers", "1")
    assert res.rc == 1, res.err + res.out
    assert "new failures (pass on baseline, fail on patched): 1" in res.out
    assert f"    {UNIT}/test_layout.py::test_layout (failed): AssertionError" in res.out
    assert "verdict: FAIL: 1 new failure(s)." in res.out


def test_a_targeted_baseline_runs_only_what_did_not_pass_on_patched(project, cli, tmp_path):
    # Everything passes on patched: pristine upstream collects test_layout and runs nothing.
    res = suite_cli(cli, project, "--baseline-for-failures", "--workers", "1", "--json")
    assert res.rc == 0, res.err
    assert "leaving out the 2 tests that passed on the patched tree" in res.err
    doc = json.loads(res.out)
    assert doc["runs"]["baseline"]["not_rerun"] == 1
    assert doc["runs"]["baseline"]["totals"] == dict.fromkeys(TOTAL_KEYS, 0)
    assert doc["fixed"] is None and doc["ok"] is True and doc["only_baseline"] == []
    assert not (util.cache_dir() / "suite-baselines").exists()  # a part is never cached
    res = suite_cli(cli, project, "--baseline-for-failures", "--workers", "1")
    assert "(+1 collected that passed on patched, not re-run here)" in res.out
    assert "fixed (fail on baseline, pass on patched): not known" in res.out

    # test_layout fails on patched: it runs on pristine upstream, passes: a new failure.
    co = _broken_checkout(cli, project, tmp_path)
    res = suite_cli(cli, project, "--checkout", co, "--baseline-for-failures", "--workers", "1")
    assert res.rc == 1, res.err + res.out
    assert f"    {UNIT}/test_layout.py::test_layout (failed): AssertionError" in res.out
    assert "verdict: FAIL: 1 new failure(s)." in res.out

    # test_layout is gone from patched: it runs on pristine upstream, passes: lost.
    (co / UNIT / "test_layout.py").unlink()
    res = suite_cli(cli, project, "--checkout", co, "--baseline-for-failures", "--workers", "1")
    assert res.rc == 1, res.err + res.out
    assert "lost (pass on baseline; skipped, absent or not run on patched): 1" in res.out

    # A cached whole baseline is used as it is.
    assert suite_cli(cli, project, "--workers", "1").rc == 0
    res = suite_cli(cli, project, "--baseline-for-failures", "--workers", "1", "--json")
    assert res.rc == 0 and "baseline from the cache" in res.err
    assert json.loads(res.out)["runs"]["baseline"]["totals"]["passed"] == 1


CRASHING_TESTS = """\
import os, signal, time


def test_fine():
    pass


def test_segfault():
    os.kill(os.getpid(), signal.SIGSEGV)


def test_exits():
    os._exit(3)


def test_hangs():
    time.sleep(600)


def test_hangs_where_no_signal_reaches():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
    time.sleep(600)


def test_after():
    pass
"""


def test_crashing_and_hanging_tests_fail_alone(project, cli, tmp_path, monkeypatch):
    # A limit no passing test comes near on a loaded machine (they take milliseconds); the
    # hanging tests are stopped at 10 s (pytest-timeout) and 11 s (the watchdog).
    monkeypatch.setattr(sides, "HARD_TIMEOUT_GRACE", 1)
    co = tmp_path / "co"
    assert (
        cli("apply", "--checkout", co, "--index-url", project.index.url, cwd=project.root).rc == 0
    )
    (co / UNIT / "test_crashes.py").write_text(CRASHING_TESTS)
    res = cli(
        "suite", "--python", sys.executable, "--index-url", project.index.url, "--checkout", co,
        "--no-baseline", "--timeout", "10", "--json", cwd=project.root,
    )  # fmt: skip
    assert res.rc == 0, res.err  # no baseline: only the overlay's own tests decide
    doc = json.loads(res.out)
    assert doc["runs"]["patched"]["totals"] == {
        "passed": 4, "failed": 4, "skipped": 0, "errors": 0, "not run": 0,
    }  # fmt: skip
    failures = {e["nodeid"].split("::")[1]: e for e in doc["patched_failures"]["timeout-or-crash"]}
    assert sorted(failures) == ["test_exits", "test_hangs", "test_hangs_where_no_signal_reaches",
                                "test_segfault"]  # fmt: skip
    assert failures["test_segfault"]["message"].startswith("WorkerCrash: worker 'gw")
    assert failures["test_exits"]["message"].startswith("WorkerCrash: worker 'gw")
    assert failures["test_hangs"]["message"] == "Failed: Timeout (>10.0s) from pytest-timeout."
    assert failures["test_hangs_where_no_signal_reaches"]["message"].startswith(
        "HardTimeout: the test was still running after 11 s"
    )


def _patched_wheel(project, tmp_path: Path) -> Path:
    """The official synthetic wheel with the patched connector: what build would make."""
    official = project.upstream.releases["1.0.0"].wheel
    out = tmp_path / "dist" / official.name
    out.parent.mkdir()
    fixed = release_files("1.0.0")[CONNECTOR].replace(*FIXED_CONNECTOR_SNIPPET)
    with zipfile.ZipFile(official) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            dst.writestr(info, fixed.encode() if info.filename == CONNECTOR else data)
    return out


def test_wheel_mode_runs_the_tests_against_the_wheels_code(project, cli, tmp_path):
    wheel = _patched_wheel(project, tmp_path)
    res = suite_cli(cli, project, "--wheel", wheel, "--workers", "1", "--json")
    assert res.rc == 0, res.err + res.out
    doc = json.loads(res.out)
    assert doc["mode"] == "wheel"
    assert doc["runs"]["patched"]["totals"]["passed"] == 2
    assert "installing vllm-1.0.0-cp38-abi3-manylinux_2_28_x86_64.whl" in res.err
    # The official (unpatched) wheel as the "built" one: the overlay's test fails, although
    # the tree it runs from is patched. The code under test is the wheel's.
    official = project.upstream.releases["1.0.0"].wheel
    res = suite_cli(cli, project, "--wheel", official, "--workers", "1", "--json")
    assert res.rc == 1, res.err
    doc = json.loads(res.out)
    assert [e["nodeid"] for e in doc["overlay_failing"]] == [f"{ADDED_TEST}::test_group_block_size"]
    assert "baseline from the cache" in res.err


@pytest.mark.parametrize(
    "args, message",
    [
        (("--tests", "tests/nope"), "does not exist in the tree under test"),
        (("--wheel", "missing.whl"), "not a wheel file"),
        (("--timeout", "0"), "--timeout 0"),
        (("--workers", "-1"), "--workers -1"),
        (("--checkout", "nowhere"), "--checkout nowhere: not a directory"),
    ],
)
def test_bad_input_is_a_usage_error(project, cli, args, message):
    res = suite_cli(cli, project, *args)
    assert res.rc == 2, res.err
    assert message in res.err


# ---- the one runner, as proofs use it -----------------------------------------------------

SOCKET_TEST = '''\
import os, socket


def test_binds_a_socket_where_ray_would():
    """Ray's raylet socket: $RAY_TMPDIR/ray/session_<date>_<time>_<usec>_<pid>/sockets/."""
    d = os.path.join(os.environ["RAY_TMPDIR"], "ray", "session_2026-01-01_00-00-00_000000_4194304", "sockets")
    os.makedirs(d)
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(os.path.join(d, "raylet.12345"))


def test_fails():
    assert 1 + 1 == 3, "arithmetic is broken"


def test_skipped():
    import pytest

    pytest.skip("not here")
'''


def test_a_proof_reads_outcomes_from_junit_and_ray_gets_a_short_socket_path(tmp_path):
    tree = tmp_path / "tree"
    (tree / "tests").mkdir(parents=True)
    (tree / "tests" / "test_sock.py").write_text(SOCKET_TEST)
    deep = tmp_path / ("d" * 60) / ("e" * 60)  # like .work/rebase/tests/<change id>/work
    log = deep / "pytest.log"
    run = proving.run_tests(proving.PythonRunner(), tree, [str(tree / "tests")], deep / "work", log)
    assert (run.passed, run.failed, run.errors, run.skipped) == (1, 1, 0, 1), log.read_text()
    assert not run.ok and run.returncode == 1
    assert run.first_error.startswith("tests/test_sock.py::test_fails: AssertionError")
    assert "arithmetic is broken" in run.first_error
    assert run.summary.startswith("1 passed, 1 failed, 1 skipped in ")
    assert "1 failed, 1 passed, 1 skipped" in log.read_text()  # the whole output
    # Under the work directory, as before, the socket path would be too long to bind.
    too_deep = len(str((deep / "work" / "tmp").resolve()) + childenv.RAY_SOCKET_SUFFIX)
    assert too_deep > childenv.SOCKET_PATH_MAX
    assert not list(Path("/tmp").glob(f"{childenv.RAY_PREFIX}*{_digest(deep / 'work')}"))


def _digest(path: Path) -> str:
    import hashlib

    return hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]


def test_a_proof_that_passes_is_ok_and_one_that_collects_nothing_is_not(tmp_path):
    tree = tmp_path / "tree"
    (tree / "tests").mkdir(parents=True)
    (tree / "tests" / "test_ok.py").write_text("def test_ok():\n    assert True\n")
    (tree / "tests" / "test_none.py").write_text("X = 1\n")

    def prove(name: str):
        return proving.run_tests(
            proving.PythonRunner(), tree, [str(tree / "tests" / f"test_{name}.py")],
            tmp_path / f"work-{name}", tmp_path / f"{name}.log",
        )  # fmt: skip

    ok = prove("ok")
    assert ok.ok and (ok.passed, ok.failed) == (1, 0) and ok.first_error == ""
    none = prove("none")
    assert not none.ok and none.returncode == 5 and none.summary.startswith("no tests ran")
