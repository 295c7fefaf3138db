"""Resolution records: derived from a person's resolution, applied only to an identical
conflict, pruned when their conflict can no longer occur."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from vllm_overlay.rebase import records
from vllm_overlay.rebase.decide import Scratch

BASE = "".join(f"line {i}\n" for i in range(20))
OURS = BASE.replace("line 3\n", "line 3 ours\n").replace("line 15\n", "line 15 ours\n")
NEW = BASE.replace("line 3\n", "line 3 new\n").replace("line 15\n", "line 15 new\n")


def merged(tmp_path: Path, new: str = NEW) -> bytes:
    out, n = Scratch(tmp_path).merge(new.encode(), BASE.encode(), OURS.encode(),
                                     ("vllm 2", "vllm 1", "our change"))  # fmt: skip
    assert n == 2
    return out


def sides(new: str = NEW) -> tuple[bytes, bytes, bytes]:
    return new.encode(), BASE.encode(), OURS.encode()


RESOLVED = NEW.replace("line 3 new\n", "line 3 both\n").replace("line 15 new\n", "line 15 both\n")


def test_one_record_per_hunk_and_it_resolves_the_same_conflict(tmp_path):
    m = merged(tmp_path)
    recs = records.derive("c", "f.py", "2.0", m, RESOLVED.encode(), sides())
    assert [r.scope for r in recs] == ["hunk", "hunk"]
    assert [r.resolution for r in recs] == ["line 3 both\n", "line 15 both\n"]
    got = records.resolve("c", m, sides(), {r.key: r for r in recs})
    assert got is not None and got[0] == RESOLVED.encode()
    # another change's conflict with the same sides is not this record's
    assert records.resolve("other", m, sides(), {r.key: r for r in recs}) is None


def test_a_hunk_without_an_identical_record_is_not_applied(tmp_path):
    recs = records.derive("c", "f.py", "2.0", merged(tmp_path), RESOLVED.encode(), sides())
    changed = NEW.replace("line 15 new\n", "line 15 newer\n")  # one hunk differs now
    (tmp_path / "x").mkdir()
    m2 = merged(tmp_path / "x", changed)
    assert records.resolve("c", m2, sides(changed), {r.key: r for r in recs}) is None


def test_edits_outside_the_markers_make_a_whole_file_record(tmp_path):
    m = merged(tmp_path)
    resolved = "header\n" + RESOLVED
    [rec] = records.derive("c", "f.py", "2.0", m, resolved.encode(), sides())
    assert rec.scope == "file" and rec.resolution == resolved
    got = records.resolve("c", m, sides(), {rec.key: rec})
    assert got is not None and got[0] == resolved.encode()


def test_stored_records_are_checked_and_pruned(tmp_path):
    recs = records.derive("c", "f.py", "2.0", merged(tmp_path), RESOLVED.encode(), sides())
    store = tmp_path / "store"
    for r in recs:
        records.save(store, r)
    assert set(records.load(store)) == {r.key for r in recs}
    # a record edited by hand (its key no longer the hash of its sides) never loads
    p = store / recs[0].relpath
    p.write_text(p.read_text().replace("line 3 new", "line 3 forged"))
    assert set(records.load(store)) == {recs[1].key}
    # written into overlay/: kept while its conflict can occur, pruned once the pin passed it
    overlay = tmp_path / "overlay"
    old = records.Record("c", records.key_of("a", "b", "c"), "f.py", "1.5", "hunk", "a", "b",
                         "c", "r")  # fmt: skip
    records.save(overlay / records.DIR, old)
    removed = records.write_overlay(overlay, [recs[1]], "1.9")
    assert removed == [f"{records.DIR}/{old.relpath}"]
    assert sorted(p.name for p in (overlay / records.DIR / "c").iterdir()) == [
        recs[1].relpath.split("/")[1]
    ]
    later = records.Record("c", records.key_of("x", "y", "z"), "f.py", "3.0", "hunk", "x", "y",
                           "z", "r")  # fmt: skip
    records.save(overlay / records.DIR, later)
    assert records.write_overlay(overlay, [], "2.0") == [f"{records.DIR}/{recs[1].relpath}"]
    assert [p.name for p in (overlay / records.DIR / "c").iterdir()] == [
        later.relpath.split("/")[1]
    ]


def test_proof_and_unproven_marks_round_trip_and_leave_old_records_byte_identical(tmp_path):
    [rec] = records.derive("c", "f.py", "2.0", merged(tmp_path), RESOLVED.encode(), sides())[:1]
    old = rec.to_json()
    assert "proof" not in json.loads(old) and "unproven" not in json.loads(old)
    assert records.Record.from_json(old).to_json() == old  # records made before proofs
    un = {"why": "needs a GPU", "by": "Ada", "failed": ["t.py::test_x"], "tests": "1 failed"}
    marked = replace(rec, unproven=un)
    back = records.Record.from_json(marked.to_json())
    assert back == marked and back.unproven == un and back.key == rec.key
    records.save(tmp_path / "store", marked)
    assert records.load(tmp_path / "store")[rec.key].unproven == un  # the key still holds
    proven = replace(rec, proof="t.py: 1 passed on vllm 2.0 with it")
    assert records.Record.from_json(proven.to_json()).proof == proven.proof
