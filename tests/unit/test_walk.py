"""The walk: a rebase through every release between the pin and the target, on synthetic
upstream histories (real git, real sdists on a real index on loopback, real pytest proofs).

Each history below is a run of releases one after another, as upstream makes them; the
overlay is conftest's (change ``group-block-size``: a patch of the connector plus an added test
file), pinned to 1.0.0.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import FIXED_CONNECTOR_SNIPPET, Proj, pinned_project, run_cli, tree_snapshot, unified
from synthetic import ADDED_TEST, CONNECTOR, EXTRACT, make_upstream, release_files

CID = "group-block-size"
SECOND = "extract-comment"
BASE = release_files("1.0.0")
CONN = BASE[CONNECTOR]
OLD_LINE = "        self._block_size = cache_config.block_size\n"
REWRITTEN = "        self._block_size = int(cache_config.block_size)\n"
ELSEWHERE = "\n    def name(self):\n        return 'upstream'\n"
EXTRACT_LINE = "    block_size = len(kv_cache[0])\n"
UPSTREAM_TEST = "tests/test_upstream_group.py"
UPSTREAM_TEST_BODY = """\
def test_upstream_group():
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        {cls} as C,
    )

    class Cfg:
        block_size = 8
        group_block_size = 2

    assert C(Cfg()).slots([1])[0] == 2
"""


def walk_lines(err: str) -> list[str]:
    """What the walk said on stderr as it went: each release, then each verdict there."""
    return [ln for ln in err.splitlines()
            if re.fullmatch(r"vllm \S+ \(\d+/\d+\)", ln) or ln.startswith(f"  {CID}: ")]  # fmt: skip


def tree(connector: str = CONN, **more: str) -> dict[str, str]:
    files = dict(BASE)
    files[CONNECTOR] = connector
    files.update({k.replace("__", "/"): v for k, v in more.items()})
    return files


FIXED = CONN.replace(*FIXED_CONNECTOR_SNIPPET)
# Upstream's own fix, on our line but not ours: a conflict that the change's test passes on.
OWN_FIX = ("        self._block_size = getattr(cache_config, 'group_block_size', None) "
           "or cache_config.block_size\n")  # fmt: skip
RENAMED_CLASS = FIXED.replace("class Connector:", "class HiddenStatesConnector:")

HISTORIES = {
    # Upstream merges our fix in 1.0.1 (with its own test), then renames the class in 1.1.0,
    # so our test of it no longer imports: the walk drops the change at 1.0.1, proven there.
    "drop": {
        "1.0.0": tree(),
        "1.0.1": {**tree(FIXED), UPSTREAM_TEST: UPSTREAM_TEST_BODY.format(cls="Connector")},
        "1.1.0": {
            **tree(RENAMED_CLASS),
            UPSTREAM_TEST: UPSTREAM_TEST_BODY.format(cls="HiddenStatesConnector"),
        },
    },
    # Upstream edits elsewhere in 1.0.1, rewrites our line in 1.1.0 (the first conflict), and
    # in 1.2.0 rewrites the line the second change touches.
    "stop": {
        "1.0.0": tree(),
        "1.0.1": tree(CONN + ELSEWHERE),
        "1.1.0": tree(CONN.replace(OLD_LINE, REWRITTEN) + ELSEWHERE),
        "1.2.0": {
            **tree(CONN.replace(OLD_LINE, REWRITTEN) + ELSEWHERE),
            EXTRACT: BASE[EXTRACT].replace(EXTRACT_LINE, "    block_size = kv_cache.shape[1]\n"),
        },
    },
    # 1.1.0 fixes it upstream's own way on our line (a conflict a person settles by taking
    # upstream's code: a drop); 1.2.0 rewrites the line the second change touches.
    "own_fix": {
        "1.0.0": tree(),
        "1.1.0": tree(CONN.replace(OLD_LINE, OWN_FIX)),
        "1.2.0": {
            **tree(CONN.replace(OLD_LINE, OWN_FIX)),
            EXTRACT: BASE[EXTRACT].replace(EXTRACT_LINE, "    block_size = kv_cache.shape[1]\n"),
        },
    },
    # As "own_fix" up to 1.1.0; 1.2.0 keeps that connector, and a conftest of upstream's
    # breaks every test (the change's files are as at 1.1.0; its drop's proof fails there).
    "own_fix_broken": {
        "1.0.0": tree(),
        "1.1.0": tree(CONN.replace(OLD_LINE, OWN_FIX)),
        "1.2.0": {
            **tree(CONN.replace(OLD_LINE, OWN_FIX)),
            "tests/conftest.py": "raise RuntimeError('upstream broke the tests')\n",
        },
    },
    # 1.1.0 rewrites our line and adds its own file where we add our test: one stop, two
    # kinds (a conflict and a collision).
    "mixed": {
        "1.0.0": tree(),
        "1.1.0": {
            **tree(CONN.replace(OLD_LINE, REWRITTEN)),
            ADDED_TEST: "def test_theirs():\n    pass\n",
        },
    },
    # 1.1.0 rewrites our line, 1.2.0 puts it back: a conflict a later release undoes.
    "undone": {
        "1.0.0": tree(),
        "1.1.0": tree(CONN.replace(OLD_LINE, REWRITTEN)),
        "1.2.0": tree(CONN + ELSEWHERE),
    },
    # 1.1.0 rewrites our line, and 1.2.0 rewrites it again: a resolution at 1.1.0 would be
    # asked again at 1.2.0, so a walk to 1.2.0 asks once, at 1.2.0.
    "twice": {
        "1.0.0": tree(),
        "1.1.0": tree(CONN.replace(OLD_LINE, REWRITTEN)),
        "1.2.0": tree(CONN.replace(OLD_LINE, REWRITTEN.replace("int(", "abs("))),
    },
    # 1.1.0 rewrites our line, 1.2.0 has the fix: the change drops at 1.2.0, not asked at 1.1.0.
    "fixed_later": {
        "1.0.0": tree(),
        "1.1.0": tree(CONN.replace(OLD_LINE, REWRITTEN)),
        "1.2.0": tree(FIXED),
    },
}


@pytest.fixture(scope="module")
def histories(tmp_path_factory):
    return {
        name: make_upstream(tmp_path_factory.mktemp(f"walk-{name}"), trees=trees)
        for name, trees in HISTORIES.items()
    }


@pytest.fixture
def make_proj(tmp_path: Path, histories):
    made = []

    def make(history: str) -> Proj:
        cm = pinned_project(histories[history], tmp_path / f"project-{len(made)}")
        made.append(cm)
        return cm.__enter__()

    yield make
    for cm in made:
        cm.__exit__(None, None, None)


def rebase(p: Proj, *args: str, env: dict | None = None):
    if env:
        return _subprocess(p, "rebase", *args, env=env)
    return run_cli("rebase", *args, cwd=p.root)


def to(p: Proj, version: str, *extra: str):
    commit = p.upstream.releases[version].commit
    return rebase(p, "--to", version, "--commit", commit, "--index-url", p.index.url, "--json",
                  *extra)  # fmt: skip


def _subprocess(p: Proj, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_overlay", *args], cwd=p.root, capture_output=True,
        text=True, env={**os.environ, **(env or {})},
    )  # fmt: skip


def set_toml(p: Proj, old: str, new: str) -> None:
    toml = p.overlay / "overlay.toml"
    text = toml.read_text()
    assert old in text
    toml.write_text(text.replace(old, new))


def add_second_change(p: Proj) -> None:
    old = BASE[EXTRACT]
    new = old.replace(EXTRACT_LINE, EXTRACT_LINE.rstrip("\n") + "  # ours\n")
    patch = p.change_file(EXTRACT + ".patch", SECOND)
    patch.parent.mkdir(parents=True, exist_ok=True)
    patch.write_text(unified(EXTRACT, old, new))
    with open(p.overlay / "overlay.toml", "a") as f:
        f.write(
            "\n[[change]]\n"
            f'id = "{SECOND}"\n'
            'title = "A second change"\n'
            'why = "ordering"\n'
            'origin = "https://github.com/vllm-project/vllm/pull/1"\n'
            'upstream_status = "open"\n'
            'drop_when = "vllm>=9"\n'
            f'files = ["{EXTRACT}"]\n'
            "tests = []\n"
        )
    assert p.pin("1.0.0").rc == 0


def snapshot(p: Proj) -> dict[str, bytes]:
    snap = {"upstream.lock": p.lock.read_bytes()}
    snap.update({f"overlay/{k}": v for k, v in tree_snapshot(p.overlay).items()})
    return snap


def overlay_toml(p: Proj) -> dict:
    return tomllib.loads((p.overlay / "overlay.toml").read_text())


def checkout(p: Proj) -> Path:
    return p.root / ".work" / "vllm"


def settle_conflict(f: Path, lines: str) -> None:
    """The person's edit of a file with one conflict: ``lines`` in place of the markers."""
    text = f.read_text()
    end = ">>>>>>> our change\n"
    start, stop = text.index("<<<<<<<"), text.index(end) + len(end)
    f.write_text(text[:start] + lines + text[stop:])


def resolve_stop(p: Proj) -> None:
    """The person's resolution of group-block-size at 1.1.0: upstream's int() and our group."""
    assert "<<<<<<< vllm 1.1.0\n" in (checkout(p) / CONNECTOR).read_text()
    settle_conflict(checkout(p) / CONNECTOR, "        self._block_size = int(getattr("
                    "cache_config, 'group_block_size', cache_config.block_size))\n")  # fmt: skip


# --------------------------------------------------------------------------------------------
# Drops: at the first release that has the change, proven there


def test_drop_at_the_first_release_that_has_it_proven_there(make_proj):
    p = make_proj("drop")
    res = to(p, "1.1.0")
    assert res.rc == 0, res.err
    rep = json.loads(res.out)
    assert rep["path"] == ["1.0.1", "1.1.0"]
    # Each release and each verdict is said as the walk decides it (stderr).
    said = walk_lines(res.err)
    assert said[0] == "vllm 1.0.1 (1/2)" and said[2:] == ["vllm 1.1.0 (2/2)"]
    assert said[1].startswith(f"  {CID}: dropped: ") and "applies in reverse" in said[1]
    [d] = rep["dropped"]
    assert d["id"] == CID and d["release"] == "1.0.1"
    assert "applies in reverse" in d["reason"] and "passed against vllm 1.0.1" in d["proof"]
    assert rep["stops"] == [] and rep["proof_releases"].keys() == {"1.0.1"}
    [rec] = overlay_toml(p)["dropped"]
    assert rec["id"] == CID and rec["dropped_in"] == "1.0.1"
    assert "passed against vllm 1.0.1" in rec["proof"]
    assert tomllib.loads(p.lock.read_text())["upstream"]["version"] == "1.1.0"


def test_the_direct_jump_stops_where_the_walk_does_not(make_proj):
    """At 1.1.0 our test no longer imports (upstream renamed the class): the direct jump
    cannot prove the drop and stops; the walk proved it at 1.0.1."""
    p = make_proj("drop")
    before = snapshot(p)
    res = to(p, "1.1.0", "--direct")
    assert res.rc == 1
    rep = json.loads(res.out)
    stop = rep["stopped_at"]
    assert stop["state"] == "tests-failed" and stop["release"] == "1.1.0"
    assert rep["stops"] == [{"release": "1.1.0", "id": CID, "state": "tests-failed"}]
    assert rebase(p, "--abort").rc == 0
    assert snapshot(p) == before


def test_upstream_tests_prove_a_drop_our_test_can_no_longer_reach(make_proj):
    p = make_proj("drop")
    set_toml(p, f'tests = ["{ADDED_TEST}"]',
             f'tests = ["{ADDED_TEST}"]\nupstream_tests = ["{UPSTREAM_TEST}"]')  # fmt: skip
    assert p.pin("1.0.0").rc == 0
    res = to(p, "1.1.0", "--direct")
    assert res.rc == 0, res.err
    [d] = json.loads(res.out)["dropped"]
    assert d["release"] == "1.1.0"
    assert f"upstream's own {UPSTREAM_TEST} passed" in d["proof"]
    assert "can no longer be collected" in d["proof"]


def test_the_walk_proof_names_upstream_tests_too(make_proj):
    p = make_proj("drop")
    set_toml(p, f'tests = ["{ADDED_TEST}"]',
             f'tests = ["{ADDED_TEST}"]\nupstream_tests = ["{UPSTREAM_TEST}"]')  # fmt: skip
    assert p.pin("1.0.0").rc == 0
    res = to(p, "1.1.0")
    assert res.rc == 0, res.err
    [d] = json.loads(res.out)["dropped"]
    assert d["release"] == "1.0.1"
    assert "passed against vllm 1.0.1" in d["proof"]
    assert f"upstream's own {UPSTREAM_TEST} passed" in d["proof"]


# --------------------------------------------------------------------------------------------
# Stops: at the first conflicting release; never more than the direct jump


def test_stop_at_the_first_conflicting_release_then_continue(make_proj):
    p = make_proj("stop")
    before = snapshot(p)
    res = to(p, "1.2.0")
    assert res.rc == 1
    rep = json.loads(res.out)
    assert rep["path"] == ["1.0.1", "1.1.0", "1.2.0"]
    stop = rep["stopped_at"]
    assert (stop["id"], stop["release"], stop["state"]) == (CID, "1.1.0", "conflict")
    assert [ln.split(": merges")[0] for ln in walk_lines(res.err)] == [
        "vllm 1.0.1 (1/3)", f"  {CID}: kept", "vllm 1.1.0 (2/3)",
                        f"  {CID}: conflict (stop): " + stop["reason"].splitlines()[0]]  # fmt: skip
    assert snapshot(p) == before
    # the checkout shows 1.1.0 (upstream's method from 1.0.1 is there), not the target
    text = (checkout(p) / CONNECTOR).read_text()
    assert "def name(self)" in text and "|||||||" in text
    resolve_stop(p)
    res = rebase(p, "--continue", "--json")
    assert res.rc == 0, res.err
    rep = json.loads(res.out)
    assert rep["status"] == "complete" and rep["resolved"] == [CID]
    # The walk goes on from the stop, saying each release and verdict from there.
    assert [ln.split(": merges")[0] for ln in walk_lines(res.err)] == [
        f"  {CID}: resolved: resolved by a person at this release; "
        "tests/v1/kv_connector/unit/test_hidden_states_connector.py: 1 passed on vllm 1.1.0 "
        "with it", "vllm 1.2.0 (3/3)", f"  {CID}: kept"]  # fmt: skip
    [change] = [c for c in rep["changes"] if c["id"] == CID]
    assert change["releases"] == {"1.0.1": "kept", "1.1.0": "resolved", "1.2.0": "kept"}
    patch = p.change_file(CONNECTOR + ".patch").read_text()
    assert "+        self._block_size = int(getattr(" in patch
    # the person's resolution is recorded in the overlay, for review
    recs = list((p.overlay / "resolutions" / CID).glob("*.json"))
    assert len(recs) == 1
    rec = json.loads(recs[0].read_text())
    assert rec["release"] == "1.1.0" and rec["scope"] == "hunk"
    assert "1 passed on vllm 1.1.0" in rec["proof"] and "unproven" not in rec  # proven first
    assert "".join(rec["release_side"]) == REWRITTEN
    [listed] = json.loads(run_cli("status", "--json", cwd=p.root).out)["resolutions"]
    assert (listed["change"], listed["release"], listed["in"]) == (CID, "1.1.0", "overlay")
    assert run_cli("export", "--check", cwd=p.root).rc == 0
    assert run_cli("apply", "--checkout", p.root / "fresh", "--index-url", p.index.url,
                   cwd=p.root).rc == 0  # fmt: skip


def test_a_rebase_stopped_before_cells_were_typed_goes_on(make_proj):
    """A rebase stopped by the version that saved a stop's state as "stopped" beside its
    "kind" (and kept "unresolved" and "records_used" in the walk) is named and goes on."""
    p = make_proj("stop")
    assert to(p, "1.2.0").rc == 1
    saved = p.root / ".work" / "rebase" / "state.json"
    state = json.loads(saved.read_text())
    walk = state["walk"]
    old_stop = {**walk["stop"], "state": "stopped", "kind": walk["stop"]["state"]}
    assert walk["cells"][-1] == walk["stop"]
    walk.update(stop=old_stop, unresolved=[], records_used=[])
    walk["cells"][-1] = old_stop
    saved.write_text(json.dumps(state, indent=1))
    res = to(p, "1.2.0")
    assert res.rc == 1 and f"(stopped at change {CID} on 1.1.0 (conflict))" in res.err
    resolve_stop(p)
    res = rebase(p, "--continue", "--json")
    assert res.rc == 0, res.err
    rep = json.loads(res.out)
    assert rep["status"] == "complete" and rep["resolved"] == [CID]
    assert [(c["release"], c["state"], c.get("stop", False)) for c in rep["cells"]] == [
        ("1.0.1", "kept", False), ("1.1.0", "conflict", True), ("1.1.0", "resolved", False),
        ("1.2.0", "kept", False)]  # fmt: skip


def test_the_same_conflict_is_asked_once(make_proj):
    """Resolved at 1.1.0, then the walk stops again at 1.2.0 (the second change) and is
    aborted: the next rebase applies the record (its tests pass) and asks only about 1.2.0."""
    p = make_proj("stop")
    add_second_change(p)
    before = snapshot(p)
    assert to(p, "1.2.0").rc == 1
    resolve_stop(p)
    # the person also edits the change's test, which merged cleanly: part of the resolution
    test = checkout(p) / ADDED_TEST
    test.write_text(test.read_text() + "\n\n# checked against 1.1.0\n")
    res = rebase(p, "--continue", "--json")
    assert res.rc == 1
    stop = json.loads(res.out)["stopped_at"]
    assert (stop["id"], stop["release"]) == (SECOND, "1.2.0")
    assert rebase(p, "--abort").rc == 0
    assert snapshot(p) == before  # byte for byte; the record survives in .work/
    res = to(p, "1.2.0")
    assert res.rc == 1
    rep = json.loads(res.out)
    assert rep["stopped_at"]["id"] == SECOND
    assert rep["stops"] == [{"release": "1.2.0", "id": SECOND, "state": "conflict"}]
    [change] = [c for c in rep["changes"] if c["id"] == CID]
    assert change["releases"]["1.1.0"] == "record"
    assert rep["proof_releases"].keys() == {"1.1.0"}  # its tests ran there, with the record
    # settle the second change, then the overlay has the whole resolution of the first
    _settle_second(p)
    res = rebase(p, "--continue", "--json")
    assert res.rc == 0, res.err
    assert "# checked against 1.1.0" in p.change_file(ADDED_TEST).read_text()
    assert "int(getattr(" in p.change_file(CONNECTOR + ".patch").read_text()


def _settle_second(p: Proj) -> None:
    settle_conflict(checkout(p) / EXTRACT, "    block_size = kv_cache.shape[1]  # ours\n")


def _take_upstreams_fix(p: Proj) -> None:
    """The person drops group-block-size at the stop: upstream's own fix, our test removed."""
    settle_conflict(checkout(p) / CONNECTOR, OWN_FIX)
    (checkout(p) / ADDED_TEST).unlink()


def _given_the_drop_record_of(make_proj, history: str, version: str, into: str = "") -> Proj:
    """A new project pinned at 1.0.0 of ``into`` (default: ``history``), holding the record of
    the drop a person made at ``version`` in a project of ``history``."""
    p = make_proj(history)
    assert to(p, version).rc == 1
    _take_upstreams_fix(p)
    assert rebase(p, "--continue").rc == 0
    [rec] = (p.overlay / "resolutions" / CID).glob("*.json")
    q = make_proj(into or history)
    (q.overlay / "resolutions" / CID).mkdir(parents=True)
    (q.overlay / "resolutions" / CID / rec.name).write_bytes(rec.read_bytes())
    return q


def test_a_drop_a_person_made_is_not_asked_again(make_proj):
    """At 1.1.0 upstream fixes it its own way on our line; the person leaves upstream's code,
    so the change drops there, proven. The walk then stops at 1.2.0 (the second change) and
    is aborted: the next rebase drops the change at 1.1.0 by the record, proving the drop
    again, and asks only about 1.2.0. Once the rebase completes, the record is in overlay/."""
    p = make_proj("own_fix")
    add_second_change(p)
    before = snapshot(p)
    res = to(p, "1.2.0")
    assert res.rc == 1
    stop = json.loads(res.out)["stopped_at"]
    assert (stop["id"], stop["release"], stop["state"]) == (CID, "1.1.0", "conflict")
    _take_upstreams_fix(p)  # upstream's code: the change drops
    res = rebase(p, "--continue", "--json")
    assert res.rc == 1
    assert f"recorded the drop of change {CID}" in res.err
    assert json.loads(res.out)["stopped_at"]["id"] == SECOND
    [stored] = (p.root / ".work" / "resolutions" / CID).glob("*.json")
    assert rebase(p, "--abort").rc == 0
    assert snapshot(p) == before  # byte for byte; the record survives in .work/
    res = to(p, "1.2.0")
    assert res.rc == 1
    rep = json.loads(res.out)
    assert rep["stops"] == [{"release": "1.2.0", "id": SECOND, "state": "conflict"}]
    [d] = rep["dropped"]
    assert (d["id"], d["release"]) == (CID, "1.1.0")
    key = json.loads(stored.read_text())["key"]
    assert f"dropped by record {key[:12]}" in d["reason"]
    assert "passed against vllm 1.1.0" in d["proof"]  # the drop was proven again
    assert rep["proof_releases"].keys() == {"1.1.0"}
    _settle_second(p)
    res = rebase(p, "--continue", "--json")
    assert res.rc == 0, res.err
    [rec] = (p.overlay / "resolutions" / CID).glob("*.json")
    data = json.loads(rec.read_text())
    assert (data["scope"], data["release"], data["key"]) == ("drop", "1.1.0", key)
    assert "passed against vllm 1.1.0" in data["proof"]
    conn = (p.root / ".work" / "vllm" / CONNECTOR).read_bytes()  # 1.2.0's: 1.1.0's too
    assert f"{CONNECTOR} sha256:{hashlib.sha256(conn).hexdigest()}\n" in data["release_side"]
    assert f"{ADDED_TEST} absent\n" in data["release_side"]  # only hashes: no upstream text
    assert [x["id"] for x in overlay_toml(p)["dropped"]] == [CID]
    listed = json.loads(run_cli("status", "--json", cwd=p.root).out)["resolutions"]
    assert [(r["scope"], r["in"]) for r in listed if r["change"] == CID] == [("drop", "overlay")]
    assert f"{CID} at vllm 1.1.0, a drop of {ADDED_TEST} {CONNECTOR}" in run_cli(
        "status", cwd=p.root).out  # fmt: skip


def test_a_drop_record_is_not_applied_where_the_change_meets_another_state(make_proj):
    """The record of a drop at 1.1.0 of the "own_fix" history does not drop the change at
    the "stop" history's 1.1.0 (another conflict): there the person is asked."""
    q = _given_the_drop_record_of(make_proj, "own_fix", "1.1.0", into="stop")
    res = to(q, "1.1.0")
    assert res.rc == 1
    stop = json.loads(res.out)["stopped_at"]
    assert (stop["id"], stop["release"], stop["state"]) == (CID, "1.1.0", "conflict")


def test_a_drop_record_whose_proof_fails_asks_the_person(make_proj):
    """A drop recorded at 1.1.0 meets the change in the same state at 1.2.0 (a direct jump),
    where the drop's proof fails: the change is not dropped; the person is asked, and the
    stop says why the record did not apply."""
    q = _given_the_drop_record_of(make_proj, "own_fix_broken", "1.1.0")
    [rec] = (q.overlay / "resolutions" / CID).glob("*.json")
    res = to(q, "1.2.0", "--direct")
    assert res.rc == 1
    stop = json.loads(res.out)["stopped_at"]
    assert (stop["id"], stop["release"], stop["state"]) == (CID, "1.2.0", "conflict")
    [note] = [n for n in stop["notes"] if "a person dropped it in this state" in n]
    assert f"at vllm 1.1.0 (record {rec.stem[:12]}" in note and "proof fails here" in note


def test_a_stop_of_two_kinds_says_each_file_and_each_step(make_proj):
    """A conflict in one file and a collision in another: each file is named with its own
    problem (once), and the steps say how to settle both."""
    p = make_proj("mixed")
    res = to(p, "1.1.0")
    assert res.rc == 1
    stop = json.loads(res.out)["stopped_at"]
    assert stop["state"] == "collision"
    assert [(x["path"], x["kind"], x["detail"]) for x in stop["problems"]] == [
        (ADDED_TEST, "collision", "the change adds it, and vllm 1.1.0 now has its own, "
                                  "different file"),
        (CONNECTOR, "content", "vllm 1.1.0 and our change edit the same lines (1 conflict)"),
    ]  # fmt: skip
    steps = " ".join(stop["next_steps"])
    assert "Resolve the conflict markers" in steps and "A file the change adds now" in steps
    assert rebase(p, "--abort").rc == 0
    out = rebase(p, "--to", "1.1.0", "--commit", p.upstream.releases["1.1.0"].commit,
                 "--index-url", p.index.url).out  # fmt: skip
    assert out.count("edit the same lines") == 1 and out.count("its own, different file") == 1


def test_a_resolution_is_proven_before_it_is_recorded(make_proj):
    """A wrong resolution (upstream's line kept, ours lost) fails the change's test at the
    stop's release: refused, nothing recorded, the stop and the checkout as the person left
    them. --unproven records it marked so; status and the outlook show the mark, and a later
    rebase applies it only where the change's tests pass with it (here they do not)."""
    p = make_proj("stop")
    add_second_change(p)
    assert to(p, "1.2.0").rc == 1
    settle_conflict(checkout(p) / CONNECTOR, REWRITTEN.replace("\n", "  # group: see below\n"))
    co = checkout(p)
    git = ["git", "-C", str(co)]
    subprocess.run([*git, "config", "user.name", "Ada Person"], check=True)
    subprocess.run([*git, "config", "user.email", "ada@example.org"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "my resolution"], check=True)  # folded when settled
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True).stdout
    files, state = tree_snapshot(co), (p.root / ".work" / "rebase" / "state.json").read_bytes()

    res = rebase(p, "--continue")
    assert res.rc == 1
    test_id = f"{ADDED_TEST}::test_group_block_size"
    assert "is not recorded" in res.err and f"    {test_id}\n" in res.err
    log = p.root / ".work/rebase/tests/1.1.0" / CID / "resolution/pytest.log"
    assert f"log: {log}" in res.err and "assert 528 == 22" in log.read_text()
    junit = res.err.split("JUnit report: ")[1].splitlines()[0]
    assert test_id.rpartition("::")[2] in Path(junit).read_text()
    assert tree_snapshot(co) == files  # the checkout as the person left it, HEAD too
    assert subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True).stdout == head
    assert (p.root / ".work" / "rebase" / "state.json").read_bytes() == state  # still stopped
    assert not (p.root / ".work" / "resolutions").exists()  # nothing recorded
    assert json.loads(run_cli("status", "--json", cwd=p.root).out)["resolutions"] == []

    res = rebase(p, "--continue", "--unproven", "the test needs the GPU build", "--json")
    assert res.rc == 1, res.err  # on to the next stop: the second change at 1.2.0
    rep = json.loads(res.out)
    assert rep["stopped_at"]["id"] == SECOND and rep["unproven"] == [CID]
    [change] = [c for c in rep["changes"] if c["id"] == CID]
    assert change["unproven"] == ["1.1.0"] and change["releases"]["1.1.0"] == "resolved"
    [rec] = (p.root / ".work" / "resolutions" / CID).glob("*.json")
    un = json.loads(rec.read_text())["unproven"]
    assert un["why"] == "the test needs the GPU build" and un["failed"] == [test_id]
    assert un["by"] == "Ada Person <ada@example.org>"  # git's user of the checkout
    status = run_cli("status", cwd=p.root).out
    assert "UNPROVEN: recorded with --unproven by" in status and test_id in status
    assert rebase(p, "--abort").rc == 0

    res = run_cli("outlook", "--index-url", p.index.url, "--to", "1.2.0", "--json", cwd=p.root)
    [cell] = [o for col in json.loads(res.out)["releases"] if col["version"] == "1.1.0"
              for o in col["outcomes"] if o["id"] == CID]  # fmt: skip
    assert cell["state"] == "record" and cell["unproven"] == [json.loads(rec.read_text())["key"]]
    text = run_cli("outlook", "--index-url", p.index.url, "--to", "1.2.0", cwd=p.root).out
    assert "record! " in text and "record!   a record made unproven" in text

    res = to(p, "1.2.0")  # the record is proven where it applies: its tests fail, so it stops
    assert res.rc == 1
    stop = json.loads(res.out)["stopped_at"]
    assert (stop["id"], stop["release"]) == (CID, "1.1.0")
    assert any("the change's tests fail with them" in n for n in stop["notes"])


def test_a_record_that_does_not_match_is_not_applied(make_proj, tmp_path):
    from vllm_overlay.rebase import records

    p = make_proj("stop")
    other = "        self._block_size = cache_config.block_size * 2\n"
    made = records.derive(
        CID, CONNECTOR, "1.1.0",
        f"<<<<<<< a\n{other}||||||| b\n{OLD_LINE}=======\nours\n>>>>>>> c\n".encode(),
        b"resolved\n", (other.encode(), OLD_LINE.encode(), b"ours\n"),
    )  # fmt: skip
    for rec in made:
        records.save(p.root / ".work" / "resolutions", rec)
    # and a record edited by hand: the right key, other sides
    right = records.key_of(REWRITTEN, OLD_LINE, FIXED_CONNECTOR_SNIPPET[1])
    forged = records.Record(CID, right, CONNECTOR, "1.1.0", "hunk", REWRITTEN, OLD_LINE,
                            "something else\n", "forged\n")  # fmt: skip
    records.save(p.root / ".work" / "resolutions", forged)
    res = to(p, "1.2.0")
    assert res.rc == 1
    stop = json.loads(res.out)["stopped_at"]
    assert (stop["id"], stop["release"]) == (CID, "1.1.0")
    assert "forged" not in (checkout(p) / CONNECTOR).read_text()


def test_a_conflict_a_later_release_undoes_is_not_asked(make_proj):
    p = make_proj("undone")
    res = to(p, "1.2.0")
    assert res.rc == 0, res.err
    rep = json.loads(res.out)
    assert rep["stops"] == []
    [w] = rep["waited"]
    assert (w["id"], w["release"], w["met"]) == (CID, "1.1.0", "conflict")
    [change] = [c for c in rep["changes"] if c["id"] == CID]
    assert change["releases"] == {"1.1.0": "waiting", "1.2.0": "kept"}


def test_a_change_that_drops_by_the_target_is_not_resolved_on_the_way(make_proj):
    p = make_proj("fixed_later")
    res = to(p, "1.2.0")
    assert res.rc == 0, res.err
    rep = json.loads(res.out)
    assert rep["stops"] == []
    [d] = rep["dropped"]
    assert d["release"] == "1.2.0" and "applies in reverse" in d["reason"]
    assert "passed against vllm 1.2.0" in d["proof"]
    [w] = rep["waited"]
    assert (w["id"], w["release"]) == (CID, "1.1.0") and "it drops there" in w["reason"]


def test_walk_to_the_conflicting_release_stops_like_the_jump(make_proj):
    p = make_proj("undone")
    walked = to(p, "1.1.0")
    assert walked.rc == 1
    assert json.loads(walked.out)["stops"] == [{"release": "1.1.0", "id": CID, "state": "conflict"}]
    assert rebase(p, "--abort").rc == 0
    jumped = to(p, "1.1.0", "--direct")
    assert json.loads(jumped.out)["stops"] == [{"release": "1.1.0", "id": CID, "state": "conflict"}]


def test_lines_upstream_touches_twice_are_asked_once_at_the_last(make_proj):
    p = make_proj("twice")
    res = to(p, "1.2.0")
    assert res.rc == 1
    rep = json.loads(res.out)
    assert rep["stops"] == [{"release": "1.2.0", "id": CID, "state": "conflict"}]
    [w] = rep["waited"]
    assert (w["id"], w["release"]) == (CID, "1.1.0") and "asked there, once" in w["reason"]
    assert "abs(cache_config.block_size)" in (checkout(p) / CONNECTOR).read_text()
    assert rebase(p, "--abort").rc == 0
    # up to 1.1.0, nothing touches it again: asked at 1.1.0
    rep = json.loads(to(p, "1.1.0").out)
    assert rep["stops"] == [{"release": "1.1.0", "id": CID, "state": "conflict"}]


# --------------------------------------------------------------------------------------------
# Abort and kill


def test_abort_in_the_middle_of_a_walk_restores_everything(make_proj):
    p = make_proj("stop")
    assert run_cli("apply", "--index-url", p.index.url, cwd=p.root).rc == 0
    co = checkout(p)
    before = snapshot(p)
    co_before = {k: v for k, v in tree_snapshot(co).items() if not k.startswith(".git/")}
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=co, capture_output=True,
                          text=True).stdout  # fmt: skip
    assert to(p, "1.2.0").rc == 1
    resolve_stop(p)  # the person started resolving; then gave up
    assert rebase(p, "--abort").rc == 0
    assert snapshot(p) == before
    assert {k: v for k, v in tree_snapshot(co).items() if not k.startswith(".git/")} == co_before
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=co, capture_output=True,
                          text=True).stdout == head  # fmt: skip
    assert not (p.root / ".work" / "rebase").exists()


def _final(p: Proj) -> dict[str, bytes]:
    return snapshot(p)


def test_sigkill_at_any_step_resumes_with_continue(make_proj):
    """Killed right after each verdict of the walk in turn, the rebase goes on with --continue
    to the same result as a run never killed."""
    ref = make_proj("drop")
    add_second_change(ref)
    assert to(ref, "1.1.0").rc == 0
    want = _final(ref)
    steps = json.loads(to(ref, "1.1.0").out or "{}")  # noop now
    assert steps.get("status") == "noop"
    n = 4  # verdicts: 1.0.1 (drop, kept), 1.1.0 (kept); and the finish after the last
    for k in range(1, n + 1):
        p = make_proj("drop")
        add_second_change(p)
        commit = p.upstream.releases["1.1.0"].commit
        out = _subprocess(p, "rebase", "--to", "1.1.0", "--commit", commit, "--index-url",
                          p.index.url, env={"VLLM_OVERLAY_KILL_AT_STEP": str(k)})  # fmt: skip
        if out.returncode == 0:  # fewer verdicts than k: it completed
            assert _final(p) == want
            continue
        assert out.returncode == -9, out.stderr
        res = _subprocess(p, "rebase", "--continue", "--json")
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["status"] == "complete"
        assert _final(p) == want, f"killed after verdict {k}"


@pytest.mark.parametrize(
    "history,target",
    [("drop", "1.1.0"), ("stop", "1.2.0"), ("undone", "1.2.0"), ("fixed_later", "1.2.0")],
)
def test_the_outlook_verdict_is_the_rebase_verdict(make_proj, history, target):
    """One walk, one decision: for every change and release the rebase walked (up to its
    first stop), the outlook says the same."""
    p = make_proj(history)
    add_second_change(p)
    res = run_cli("outlook", "--index-url", p.index.url, "--to", target, "--json", cwd=p.root)
    assert res.rc == 0, res.err
    outlook = {(o["id"], col["version"]): o["state"]
               for col in json.loads(res.out)["releases"] for o in col["outcomes"]}  # fmt: skip
    rep = json.loads(to(p, target).out)
    compared = 0
    for c in rep["cells"]:
        if c.get("stop"):  # the stop: the outlook notes the same state, and goes on
            assert outlook[(c["id"], c["release"])] == c["state"], c
            break
        assert outlook[(c["id"], c["release"])] == c["state"], c
        compared += 1
    assert compared >= 2
