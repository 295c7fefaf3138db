"""`vllm-overlay suite --shard K/N` and `--merge` on a synthetic suite (real pytest children):
the merged verdict, lists and totals are those of one unsplit run; a missing or failed shard
fails the merge. The split itself is tests/unit/test_suite_shards.py; the same comparison on
the pinned release's own CI files is the `releases`-marked test at the end."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from conftest import pinned_project
from synthetic import CONNECTOR, make_upstream, release_files

UNIT = "tests/v1/kv_connector/unit"

# Passes, a skip, failures on both sides (one "no accelerator", one "other"), a test the
# overlay fixes (it reads the group's block size) and, in a nested directory, one more pass.
SYNTHETIC = {
    f"{UNIT}/test_pass_a.py": "def test_a1():\n    pass\n\n\ndef test_a2():\n    pass\n\n\n"
    "def test_a3():\n    pass\n",
    f"{UNIT}/test_pass_b.py": "import pytest\n\n\ndef test_b1():\n    pass\n\n\n"
    "@pytest.mark.skip(reason='synthetic')\ndef test_b2():\n    pass\n",
    f"{UNIT}/test_upstream_fails.py": "def test_cuda():\n"
    "    raise AssertionError('Torch not compiled with CUDA enabled')\n\n\n"
    "def test_other():\n    assert 1 == 2\n",
    f"{UNIT}/test_fixed.py": "def test_group_size():\n"
    f"    from {CONNECTOR[:-3].replace('/', '.')} import Connector\n\n"
    "    class C:\n        block_size = 4\n        group_block_size = 2\n\n"
    "    assert Connector(C()).slots([1]) == [2, 3]\n",
    f"{UNIT}/nested/__init__.py": "",
    f"{UNIT}/nested/test_nested.py": "def test_n():\n    pass\n",
}


@pytest.fixture
def sharded(tmp_path, cli):
    up = make_upstream(
        tmp_path / "up", trees={"1.0.0": {**release_files("1.0.0"), **SYNTHETIC}}, cpu={}
    )
    with pinned_project(up, tmp_path / "project") as project:
        co = tmp_path / "co"
        res = cli("apply", "--checkout", co, "--index-url", project.index.url, cwd=project.root)
        assert res.rc == 0, res.err
        connector = co / CONNECTOR  # a new failure: test_layout passes upstream only
        connector.write_text(connector.read_text().replace('return "NHD"', 'return "HND"'))
        yield project, co


def _suite(cli, project, *args):
    return cli(
        "suite", "--python", sys.executable, "--index-url", project.index.url, "--timeout", "30",
        "--workers", "1", *args, cwd=project.root,
    )  # fmt: skip


def _lists(doc: dict) -> dict:
    """The verdict and its lists, and both sides' totals: what must not depend on the split."""
    keys = ("ok", "verdict", "new_failures", "lost", "fixed", "only_patched", "only_baseline")
    out = {k: doc[k] for k in keys}
    out |= {k: doc[k] for k in ("unchanged_failures", "overlay_failing", "selection")}
    out["totals"] = {s: doc["runs"][s].get("totals") for s in ("baseline", "patched")}
    return out


def _report_body(text: str) -> list[str]:
    """The text report less its title, times and JUnit paths."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("baseline"))
    return [
        line.rsplit("   ", 1)[0] if i < 3 else line
        for i, line in enumerate(lines[start:])
        if not line.startswith("JUnit: ")
    ]


def test_three_shards_merge_to_the_unsplit_verdict(sharded, cli, tmp_path):
    project, co = sharded
    whole = _suite(cli, project, "--checkout", co, "--junit", tmp_path / "whole", "--json")
    assert whole.rc == 1, whole.err
    unsplit = json.loads(whole.out)
    # The scenario has every kind of entry the verdict knows.
    assert [e["nodeid"] for e in unsplit["new_failures"]] == [f"{UNIT}/test_layout.py::test_layout"]
    assert [e["nodeid"] for e in unsplit["fixed"]] == [f"{UNIT}/test_fixed.py::test_group_size"]
    assert sorted(unsplit["unchanged_failures"]) == ["no-accelerator", "other"]
    assert (
        len(unsplit["only_patched"]) == 1 and unsplit["runs"]["patched"]["totals"]["skipped"] == 1
    )

    # A durations file that knows three of the files: the rest count as their median (1 s).
    known = {"test_pass_a.py": 100, "test_fixed.py": 1, "nested/test_nested.py": 1}
    durations = tmp_path / "durations.json"
    durations.write_text(json.dumps({"files": {f"{UNIT}/{f}": s for f, s in known.items()}}))
    dirs, files = [], []
    for k in (1, 2, 3):
        d = tmp_path / f"shard{k}"
        res = _suite(
            cli, project, "--checkout", co, "--shard", f"{k}/3", "--durations", durations,
            "--junit", d, "--json",
        )  # fmt: skip
        assert res.rc in (0, 1), res.err
        doc = json.loads(res.out)
        assert doc["shard"] == k and doc["of"] == 3
        files.append(doc["files"])
        dirs.append(d)
        assert json.loads((d / "shard.json").read_text())["status"] == "done"
    # Whole files, each in one shard; the longest known file alone in the first.
    assert files[0] == [f"{UNIT}/test_pass_a.py"]
    every = sorted(f for part in files for f in part)
    assert len(every) == len(set(every)) == 7
    assert f"{UNIT}/nested/test_nested.py" in every

    res = _suite(cli, project, "--merge", *dirs, "--junit", tmp_path / "merged", "--json")
    assert res.rc == 1, res.err
    merged = json.loads(res.out)
    assert _lists(merged) == _lists(unsplit)
    assert [s["shard"] for s in merged["shards"]] == [1, 2, 3]
    text_whole = _suite(cli, project, "--checkout", co, "--junit", tmp_path / "whole")
    text_merged = _suite(cli, project, "--merge", *dirs, "--junit", tmp_path / "merged")
    assert _report_body(text_merged.out) == _report_body(text_whole.out)
    assert "merged from 3 shards" in text_merged.out
    assert "verdict: FAIL: 1 new failure(s)." in text_merged.out
    # The merged JUnit reports hold every test; durations.json has every file.
    patched_xml = (tmp_path / "merged" / "patched.xml").read_text()
    assert patched_xml.count("<testcase") == (tmp_path / "whole" / "patched.xml").read_text().count(
        "<testcase"
    )
    measured = json.loads((tmp_path / "merged" / "durations.json").read_text())["files"]
    assert sorted(measured) == every

    # A missing shard, or one that failed to run, is no verdict: the merge says which.
    res = _suite(cli, project, "--merge", dirs[0], dirs[2])
    assert res.rc == 1 and "verdict" not in res.out
    assert "shard 2/3: missing" in res.err
    bad = tmp_path / "shard2-failed"
    res = cli("suite", "--python", tmp_path / "no-python", "--checkout", co, "--shard", "2/3",
              "--junit", bad, "--index-url", project.index.url, cwd=project.root)  # fmt: skip
    assert res.rc == 2, res.err
    assert json.loads((bad / "shard.json").read_text())["status"] == "failed"
    res = _suite(cli, project, "--merge", dirs[0], bad, dirs[2])
    assert res.rc == 1 and "verdict" not in res.out
    assert f"shard 2/3: failed to run ({bad}): --python {tmp_path / 'no-python'}" in res.err


# --- the real suite: the pinned release's CI files, split in three ---------------------------


def ci_files() -> list[str]:
    """CI's files of the suite, as the Makefile names them (CI_SUITE_FILES): one list, so
    a release that deletes a file is followed in one place."""
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    m = re.search(r"^CI_SUITE_FILES :=((?:.*\\\n)*.*)$", makefile, re.M)
    assert m, "the Makefile names no CI_SUITE_FILES"
    return m.group(1).replace("\\\n", " ").split()


@pytest.mark.releases
@pytest.mark.network
@pytest.mark.timeout(3600)
def test_real_ci_files_in_three_shards_merge_to_the_unsplit_verdict(cli, tmp_path):
    """CI's files of vLLM's kv_connector suite (14 at 0.34.0), unsplit and in three shards (each with a
    targeted baseline, as CI runs them), in this project: the same verdict and lists. Prints
    the times (make test-releases; the test environment comes from the shared cache)."""
    repo = Path(__file__).resolve().parents[2]
    tests = [f"{UNIT}/{f}" for f in ci_files()]
    common = ("--baseline-for-failures", "--tests", *tests)

    def run(*args: object) -> tuple[dict, float]:
        t = time.monotonic()
        res = cli("suite", *common, *args, "--json", cwd=repo)
        assert res.rc in (0, 1), res.err[-3000:]
        return json.loads(res.out), time.monotonic() - t

    unsplit, t_whole = run("--junit", tmp_path / "whole")
    times = []
    for k in (1, 2, 3):
        _, t = run("--shard", f"{k}/3", "--junit", tmp_path / f"shard{k}")
        times.append(t)
    res = cli("suite", "--merge", *(tmp_path / f"shard{k}" for k in (1, 2, 3)), "--json",
              "--junit", tmp_path / "merged", cwd=repo)  # fmt: skip
    merged = json.loads(res.out)
    print(f"unsplit {t_whole:.0f} s; shards " + ", ".join(f"{t:.0f} s" for t in times))
    assert _lists(merged) == _lists(unsplit)
