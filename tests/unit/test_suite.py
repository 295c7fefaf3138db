"""vllm-overlay suite: JUnit parsing, failure causes, the comparison and its report, the
baseline cache, and end-to-end runs on the synthetic upstream (real pytest subprocesses in
the tool's own Python, standing in for vLLM's test environment)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from vllm_overlay.envs import childenv
from vllm_overlay.errors import CorruptBaseline, JunitError, SuiteError, UsageError
from vllm_overlay.testing import baseline, causes, proving, runner, suite
from vllm_overlay.testing import plugin as suite_plugin
from vllm_overlay.testing import side as sides
from vllm_overlay.testing.junit import TestResult, parse_junit
from vllm_overlay.testing.report import RunInfo, RunView, compare, render_text, to_json

UNIT = "tests/v1/kv_connector/unit"

# --- JUnit -------------------------------------------------------------------------------

JUNIT_XUNIT1 = """\
<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="1" failures="2" skipped="2" tests="7">
<testcase classname="tests.v1.unit.test_a" name="test_ok" file="tests/v1/unit/test_a.py" line="3" time="0.5">
  <properties><property name="vllm_overlay.markers" value="cpu_test" /></properties>
</testcase>
<testcase classname="tests.v1.unit.test_a.TestK" name="test_p[x-1.5]" file="tests/v1/unit/test_a.py" time="1">
  <failure message="AssertionError: boom">def test_p():
&gt;       assert False
E       AssertionError: boom</failure>
  <system-err>Batch write error: Torch not compiled with CUDA enabled</system-err>
</testcase>
<testcase classname="tests.v1.unit.test_a" name="test_skip" file="tests/v1/unit/test_a.py" time="0">
  <skipped type="pytest.skip" message="needs nixl">tests/v1/unit/test_a.py:9: needs nixl</skipped>
</testcase>
<testcase classname="tests.v1.unit.test_a" name="test_xfail" file="tests/v1/unit/test_a.py" time="0">
  <skipped type="pytest.xfail" message="known" />
</testcase>
<testcase classname="tests.v1.unit.test_a" name="test_twice" file="tests/v1/unit/test_a.py" time="1">
  <failure message="call failed">E   call failed</failure>
</testcase>
<testcase classname="tests.v1.unit.test_a" name="test_twice" file="tests/v1/unit/test_a.py" time="2">
  <error message="failed on teardown with &quot;RuntimeError: td&quot;">E   RuntimeError: td</error>
</testcase>
<testcase classname="" name="tests.v1.unit.test_broken" file="tests/v1/unit/test_broken.py" time="0">
  <error message="collection failure">E   ModuleNotFoundError: No module named 'nixl'</error>
</testcase>
</testsuite></testsuites>
"""


def test_junit_ids_outcomes_markers_and_output():
    r = parse_junit(JUNIT_XUNIT1)
    a = "tests/v1/unit/test_a.py"
    assert sorted(r) == sorted(
        [
            f"{a}::test_ok",
            f"{a}::TestK::test_p[x-1.5]",
            f"{a}::test_skip",
            f"{a}::test_xfail",
            f"{a}::test_twice",
            "tests/v1/unit/test_broken.py",
        ]
    )
    ok = TestResult(f"{a}::test_ok", "passed", markers=("cpu_test",), seconds=0.5)
    assert r[f"{a}::test_ok"] == ok
    p = r[f"{a}::TestK::test_p[x-1.5]"]
    assert (p.outcome, p.summary) == ("failed", "AssertionError: boom")
    assert "E       AssertionError: boom" in p.detail
    assert "Torch not compiled" in p.output
    assert r[f"{a}::test_skip"].outcome == "skipped"
    assert r[f"{a}::test_xfail"].outcome == "skipped"
    twice = r[f"{a}::test_twice"]
    assert twice.outcome == "failed"  # the worse of a failing call and a failing teardown
    assert "call failed" in twice.message and "RuntimeError: td" in twice.message
    assert twice.seconds == 3.0
    assert r["tests/v1/unit/test_broken.py"].outcome == "error"


def test_junit_without_file_attributes_uses_classname():
    xml = (
        '<testsuite><testcase classname="tests.v1.test_a.TestK" name="test_b[1]"/>'
        '<testcase classname="" name="tests.v1.test_c"><error message="collection failure"/>'
        "</testcase></testsuite>"
    )
    r = parse_junit(xml)
    assert r["tests.v1.test_a.TestK::test_b[1]"].outcome == "passed"
    assert r["tests.v1.test_c"].outcome == "error"


@pytest.mark.parametrize(
    "text, message",
    [
        ("<testsuites><testcase", "not valid XML"),
        ("<html><body/></html>", "expected <testsuites> or <testsuite>, found <html>"),
    ],
)
def test_junit_that_is_not_a_report(text, message):
    with pytest.raises(JunitError, match=message):
        parse_junit(text, "r.xml")


def test_the_plugin_and_the_parser_agree_on_the_markers_property():
    assert suite_plugin.MARKERS_PROPERTY == "vllm_overlay.markers"
    from vllm_overlay.testing import junit

    assert junit.MARKERS_PROPERTY == suite_plugin.MARKERS_PROPERTY


# --- causes ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, cause",
    [
        # The messages of vLLM 0.24.0's kv_connector unit tests on a machine without a GPU.
        (
            "RuntimeError: Cannot access accelerator device when none is available.",
            causes.NO_ACCELERATOR,
        ),
        ("AssertionError: Torch not compiled with CUDA enabled", causes.NO_ACCELERATOR),
        (
            "ImportError: vllm.vllm_flash_attn requires the CUDA flash attention extensions "
            "(_vllm_fa2_C or _vllm_fa3_C).",
            causes.NO_ACCELERATOR,
        ),
        (
            "AssertionError: All kv cache tensors must have the same number of blocks; "
            "layer=layer0, layer_spec=FullAttentionSpec, backend=CPU_ATTN, kv_cache_layout=HND",
            causes.NO_ACCELERATOR,
        ),
        ("RuntimeError: NIXL is not available", causes.OPTIONAL_PACKAGE),
        ("ModuleNotFoundError: No module named 'lmcache'", causes.OPTIONAL_PACKAGE),
        (
            "huggingface_hub.errors.LocalEntryNotFoundError: Cannot find an appropriate cached "
            "snapshot folder for the specified revision on the local disk and outgoing traffic "
            "has been disabled.",
            causes.MODEL_HUB,
        ),
        (
            "Value error, Invalid repository ID or local directory specified: 'Qwen/Qwen3-0.6B'.",
            causes.MODEL_HUB,
        ),
        ("Failed: Timeout (>120.0s) from pytest-timeout.", causes.TIMEOUT_CRASH),
        ("WorkerCrash: worker 'gw0' crashed while running 't.py::x'", causes.TIMEOUT_CRASH),
        # Our own breakage is never explained away.
        ("ModuleNotFoundError: No module named 'vllm.distributed.foo'", causes.OTHER),
        ("ModuleNotFoundError: No module named 'tests.v1.utils'", causes.OTHER),
        ("AssertionError: assert 22 == 528", causes.OTHER),
        (
            "All kv cache tensors must have the same number of blocks; backend=FLASH_ATTN",
            causes.OTHER,
        ),
    ],
)
def test_causes(text, cause):
    assert causes.classify(text) == cause


def test_captured_output_is_read_only_when_the_traceback_says_nothing():
    # hf3fs's mock client logs the real error and returns -1.
    log = "ERROR hf3fs_mock_client.py:110 Batch write error: Torch not compiled with CUDA enabled"
    assert (
        causes.classify("AssertionError: Write should succeed, got [-1]", log)
        == causes.NO_ACCELERATOR
    )
    assert causes.classify("RuntimeError: NIXL is not available", log) == causes.OPTIONAL_PACKAGE


def test_every_cause_has_a_title():
    assert {r.cause for r in causes.RULES} | {causes.OTHER} == set(causes.TITLES)


# --- the comparison ----------------------------------------------------------------------


def _view(ran: bool = True, collected: tuple[str, ...] = (), **outcomes: str) -> RunView:
    results = {}
    for key, outcome in outcomes.items():
        nodeid = f"t.py::{key}"
        message = {
            "failed": "RuntimeError: Cannot access accelerator device when none is available.",
            "error": "E boom",
        }
        results[nodeid] = TestResult(nodeid, outcome, message.get(outcome, ""))
    return RunView(results, tuple(f"t.py::{c}" for c in collected), ran=ran)


def test_comparison_sorts_every_test_into_one_verdict():
    base = _view(
        same_pass="passed",
        broke="passed",
        broke_from_skip="skipped",
        fixed="failed",
        still="failed",
        gone="passed",
        gone_failing="failed",
        now_skipped="passed",
        gone_not_run="passed",
    )
    patched = _view(
        collected=("gone_not_run",),
        same_pass="passed",
        broke="failed",
        broke_from_skip="error",
        fixed="passed",
        still="failed",
        new_ok="passed",
        new_bad="failed",
        now_skipped="skipped",
    )
    cmp = compare(base, patched)
    ids = lambda es: [e.nodeid.split("::")[1] for e in es]  # noqa: E731
    assert ids(cmp.new_failures) == ["broke", "broke_from_skip"]
    assert ids(cmp.fixed) == ["fixed"]
    assert ids(cmp.lost) == ["gone", "gone_not_run", "now_skipped"]
    assert ids(cmp.only_patched) == ["new_bad", "new_ok"]
    assert ids(cmp.only_baseline) == ["gone", "gone_failing"]
    assert list(cmp.unchanged) == [causes.NO_ACCELERATOR]
    assert ids(cmp.unchanged[causes.NO_ACCELERATOR]) == ["still"]
    assert not cmp.ok


def test_comparison_without_differences_is_ok():
    cmp = compare(_view(a="passed", b="failed"), _view(a="passed", b="failed", c="passed"))
    assert cmp.ok
    assert [e.nodeid for e in cmp.only_patched] == ["t.py::c"]


def test_overlay_tests_must_pass_on_patched():
    base = _view(a="passed")
    patched = RunView(
        {
            "t.py::a": TestResult("t.py::a", "passed"),
            "ours/test_x.py::t1": TestResult("ours/test_x.py::t1", "passed"),
            "ours/test_x.py::t2": TestResult("ours/test_x.py::t2", "skipped"),
        }
    )
    cmp = compare(base, patched, overlay_tests=("ours/test_x.py",))
    assert [e.nodeid for e in cmp.overlay_failing] == ["ours/test_x.py::t2"]
    assert not cmp.ok


def test_no_baseline_groups_patched_failures_and_checks_only_overlay_tests():
    cmp = compare(_view(ran=False), _view(a="failed", b="passed"))
    assert cmp.ok
    assert [e.nodeid for e in cmp.patched_failures[causes.NO_ACCELERATOR]] == ["t.py::a"]
    text = render_text(cmp, "title", {"patched": RunInfo(3.0)})
    assert "not run: --no-baseline" in text
    assert "verdict: no comparison" in text


def test_report_fits_on_a_screen_and_names_what_matters():
    n = 300
    base = {f"t.py::f{i}": TestResult(f"t.py::f{i}", "failed", f"weird {i}") for i in range(n)}
    base["t.py::ok"] = TestResult("t.py::ok", "passed")
    patched = dict(base)
    patched["t.py::ok"] = TestResult("t.py::ok", "failed", "AssertionError: 22 != 528")
    patched["ours.py::t"] = TestResult("ours.py::t", "passed")
    cmp = compare(RunView(base, ("t.py::notrun",)), RunView(patched, ("t.py::notrun",)))
    runs = {"baseline": RunInfo(444.0, cached=True, junit="b.xml"), "patched": RunInfo(30.0)}
    text = render_text(cmp, "vllm 0.24.0 suite", runs)
    lines = text.splitlines()
    assert len(lines) < 50
    assert lines[2].split() == "passed failed skipped errors not run total time".split()
    assert lines[3].split() == f"baseline 1 {n} 0 0 1 {n + 2} 7.4 min (cached)".split()
    assert lines[4].split() == f"patched 1 {n + 1} 0 0 1 {n + 3} 30 s".split()
    assert "new failures (pass on baseline, fail on patched): 1" in text
    assert "    t.py::ok (failed): AssertionError: 22 != 528" in text
    assert "only on patched: 1" in text and "ours.py: 1 passed" in text
    assert re.search(rf"^    other \.+ +{n}$", text, re.MULTILINE)
    assert "more (--json lists all)" in text
    assert text.rstrip().endswith("verdict: FAIL: 1 new failure(s).")
    doc = to_json(cmp, {"format": 1}, runs)
    assert doc["ok"] is False
    assert doc["runs"]["baseline"]["totals"] == {
        "passed": 1, "failed": n, "skipped": 0, "errors": 0, "not run": 1,
    }  # fmt: skip
    assert len(doc["unchanged_failures"]["other"]) == n
    assert doc["new_failures"][0]["nodeid"] == "t.py::ok"
    json.dumps(doc)


# --- selection, the baseline cache, progress ---------------------------------------------


def test_default_selection_adds_only_overlay_tests_outside_it():
    assert suite.default_selection((f"{UNIT}/test_x.py", "tests/other/test_y.py")) == (
        UNIT,
        "tests/other/test_y.py",
    )


def test_selection_paths_must_exist_in_the_tree(tmp_path):
    (tmp_path / UNIT).mkdir(parents=True)
    (tmp_path / UNIT / "test_a.py").write_text("")
    ok = suite.check_selection(tmp_path, (UNIT + "/", f"{UNIT}/test_a.py::test_b[1]", UNIT))
    assert ok == (UNIT, f"{UNIT}/test_a.py::test_b[1]")
    for bad, message in [
        ("tests/nope", "does not exist in the tree under test"),
        ("/etc", "relative to its root"),
        ("tests/../..", "relative to its root"),
    ]:
        with pytest.raises(UsageError, match=message):
            suite.check_selection(tmp_path, (bad,))


def _key(**over) -> baseline.BaselineKey:
    env = sides.RunEnv(Path(sys.executable), "recipe-1", "env", lambda s, c: {})
    args = {"upstream": {"commit": "c" * 40}, "code": "tree", "env": env, "selection": (UNIT,)}
    args.update(over)
    return baseline.baseline_key(
        args["upstream"], args["code"], args["env"], args["selection"], sides.RunOptions()
    )


def test_baseline_key_changes_with_each_input():
    other_env = sides.RunEnv(Path(sys.executable), "recipe-2", "env", lambda s, c: {})
    digests = {
        _key().digest,
        _key(upstream={"commit": "d" * 40}).digest,
        _key(code="wheel:abc").digest,
        _key(env=other_env).digest,
        _key(selection=(UNIT, "tests/x.py")).digest,
    }
    assert len(digests) == 5
    assert _key().digest == _key().digest


def test_baseline_cache_round_trip_and_corruption():
    key = _key()
    assert baseline.load_baseline(key) is None
    run = sides.SideRun(
        "baseline",
        parse_junit(JUNIT_XUNIT1),
        ("tests/v1/unit/test_a.py::test_ok", "tests/v1/unit/test_a.py::test_never"),
        JUNIT_XUNIT1,
        seconds=12.3,
        returncode=1,
    )
    path = baseline.store_baseline(key, run)
    loaded = baseline.load_baseline(key)
    assert loaded is not None and loaded.cached
    assert loaded.results == run.results and loaded.collected == run.collected
    assert loaded.not_run == ("tests/v1/unit/test_a.py::test_never",)
    good = path.read_text()
    doc = json.loads(good)
    corruptions = {
        "truncated": good[: len(good) // 2],
        "not an object": "[]",
        "other key": json.dumps({**doc, "key": "x"}),
        "edited report": json.dumps({**doc, "junit": doc["junit"].replace("passed", "x") + " "}),
        "no collected": json.dumps({k: v for k, v in doc.items() if k != "collected"}),
    }
    for what, text in corruptions.items():
        path.write_text(text)
        with pytest.raises(CorruptBaseline, match="is corrupt"):
            baseline.load_baseline(key)
        assert what


def test_progress_line(tmp_path):
    f = tmp_path / "progress.json"
    label = "suite: patched"
    assert runner.progress_line(label, f, 5) == "suite: patched: collecting tests (5 s)"
    f.write_text(json.dumps({"total": 674, "done": 300, "counts": {"passed": 290, "failed": 10}}))
    line = runner.progress_line(label, f, 150)
    assert line == "suite: patched: 300/674 tests (290 passed, 10 failed), 2.5 min"


def test_copy_tests_uses_the_tree_pytest_config_or_an_empty_one(tmp_path):
    tree = tmp_path / "tree"
    (tree / "tests").mkdir(parents=True)
    (tree / "tests" / "test_a.py").write_text("")
    (tree / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    assert sides.copy_tests(tree, tmp_path / "r1") == tmp_path / "r1" / "pytest.ini"
    (tree / "pyproject.toml").write_text("[tool.pytest.ini_options]\nmarkers = ['cpu_test']\n")
    assert sides.copy_tests(tree, tmp_path / "r2") == tmp_path / "r2" / "pyproject.toml"
    assert (tmp_path / "r2" / "tests" / "test_a.py").is_file()
    assert not (tmp_path / "r2" / "examples").exists()  # a tree without it
    # what the tests read by path from the tree's root (0.34.0's proxy tests: examples/)
    (tree / "examples" / "proxy").mkdir(parents=True)
    (tree / "examples" / "proxy" / "server.py").write_text("PORT = 1\n")
    sides.copy_tests(tree, tmp_path / "r4")
    assert (tmp_path / "r4" / "examples" / "proxy" / "server.py").read_text() == "PORT = 1\n"
    with pytest.raises(UsageError, match="no tests/ directory"):
        sides.copy_tests(tmp_path / "r2" / "tests", tmp_path / "r3")


# --- a side's environment: what the preflight says ---------------------------------------


def _env() -> sides.RunEnv:
    return sides.python_provider(Path(sys.executable))(Path("."))


def _side(tree: Path, tmp_path: Path, selection=(UNIT,)) -> tuple[sides.Side, sides.Scratch]:
    return sides.Side("patched", tree, selection), sides.Scratch(tmp_path / "run")


def _tree(tmp_path: Path, vllm_init: str | None) -> Path:
    tree = tmp_path / "tree"
    (tree / UNIT).mkdir(parents=True)
    (tree / UNIT / "test_a.py").write_text("def test_a():\n    import vllm  # noqa: F401\n")
    if vllm_init is not None:
        (tree / "vllm").mkdir()
        (tree / "vllm" / "__init__.py").write_text(vllm_init)
    return tree


def test_environment_without_vllm_is_named(tmp_path):
    side, scratch = _side(_tree(tmp_path, None), tmp_path)
    with pytest.raises(SuiteError, match="cannot import vllm: ModuleNotFoundError.*Missing: vllm"):
        sides.run_side(side, _env(), scratch, sides.RunOptions(workers=0))


def test_environment_missing_a_vllm_dependency_names_it(tmp_path):
    side, scratch = _side(_tree(tmp_path, "import torch_not_installed_here\n"), tmp_path)
    with pytest.raises(SuiteError, match="Missing: torch_not_installed_here"):
        sides.run_side(side, _env(), scratch, sides.RunOptions(workers=0))


def test_environment_without_xdist_says_what_to_do(tmp_path, monkeypatch):
    side, scratch = _side(_tree(tmp_path, ""), tmp_path)
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "xdist.py").write_text("raise ImportError('blocked', name='xdist')\n")
    plain = _env()
    env = sides.RunEnv(
        plain.python,
        plain.recipe,
        plain.description,
        lambda s, c: {**plain.environ(s, c), "PYTHONPATH": f"{blocker}:{c}"},
    )
    with pytest.raises(SuiteError, match="cannot import xdist.*pass --workers 0"):
        sides.run_side(side, env, scratch, sides.RunOptions(workers=2))


def test_the_suite_and_proofs_give_ray_a_short_directory(tmp_path):
    deep = tmp_path / ("x" * 80) / ("y" * 80)
    for environ in (
        childenv.scratch_environ(deep),
        proving.PythonRunner().command(tmp_path, deep)[1],
        sides._plain_environ(deep, tmp_path),
    ):
        ray = environ["RAY_TMPDIR"]
        assert len(ray) + len(childenv.RAY_SOCKET_SUFFIX) <= childenv.SOCKET_PATH_MAX, ray
        assert Path(environ["TMPDIR"]).is_relative_to(deep.resolve())
