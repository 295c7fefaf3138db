"""The walk's resolution records: a conflict a person resolved once is not asked again.

At a conflict (``Walker._conflict``), before looking ahead: a change whose every conflicting
hunk has a resolution record is carried with them, when its tests pass on the release with
the result (``by_record``); a change a person dropped in exactly this state is dropped again,
when the drop's proof passes here (``by_drop_record``). The records themselves (derive, key,
apply, store) are ``rebase/records.py``'s.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path

from vllm_overlay.rebase import decide, records
from vllm_overlay.rebase.walkdata import RECORD, Walking


def by_record(walker: Walking, cid: str, o: decide.Outcome) -> bool:
    """Carry the change by resolution records when every conflicting hunk has one and its
    tests pass on this release with the result."""
    if o.state != decide.CONFLICT or not walker.records:
        return False
    w = walker.walk
    form, tree = w.forms[cid], walker.tree(w.forms[cid].files)
    before, after = walker.blobs.files(form.before), walker.blobs.files(form.after)
    files: dict[str, bytes | None] = {}
    used: list[records.Record] = []
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-record-") as tmp:
        scratch = decide.Scratch(Path(tmp))
        for p in form.files:
            new, old, ours = tree.get(p), before.get(p), after.get(p)
            if p in o.conflicted:
                got = records.resolve(cid, o.conflicted[p], (new, old, ours), walker.records)  # type: ignore[arg-type]
                if got is None:
                    return False
                files[p], recs = got
                used += recs
            elif (edit := _file_record(cid, (new, old, ours), walker.records)) is not None:
                files[p] = edit.resolution.encode(errors="surrogateescape")
                used.append(edit)  # the person also edited this file, which merged
            elif old is None or new is None or ours is None:
                files[p] = ours
            else:
                files[p], n = scratch.merge(new, old, ours, ("new", "old", "ours"))
                if n:
                    return False
    change = replace(walker.changes[cid], files=tuple(form.files), tests=tuple(form.tests))
    proof = walker.host.prove_carried(w.release, change, {**tree, **files})
    keys = sorted({r.key for r in used})
    if proof is not None and not proof.ok:
        o.notes.append(f"resolution records {', '.join(k[:12] for k in keys)} apply, but "
                       f"the change's tests fail with them: {proof.text}")  # fmt: skip
        return False
    text = proof.text if proof is not None else "its tests not run here (the outlook)"
    # A record a person made unproven (--unproven) applies like any other only where the
    # change's tests pass with it (the rebase always runs them); the cell says so.
    unproven = sorted(r.key for r in used if r.unproven is not None)
    if unproven:
        text += f"; record {', '.join(k[:12] for k in unproven)} was recorded unproven"
    walker.carry(cid, files, RECORD, f"{o.reason}; resolved by record "
                 f"{', '.join(k[:12] for k in keys)}; {text}", records=keys,
                 unproven_records=unproven)  # fmt: skip
    return True


def by_drop_record(walker: Walking, cid: str, o: decide.Outcome) -> bool:
    """Drop the change as a person did in exactly this state, when the drop's proof
    passes here (it is run again: the release is not the one the record was made at)."""
    found = walker.records
    rec = records.find_drop(cid, walker.sides(cid), found) if found else None
    if rec is None:
        return False
    w = walker.walk
    proof = walker.prove_drop(cid)
    if proof is not None and not proof.ok:
        o.notes.append(f"a person dropped it in this state at {w.name} {rec.release} "
                       f"(record {rec.key[:12]}), but its drop's proof fails here: "
                       f"{proof.text}")  # fmt: skip
        return False
    why = (f"{o.reason}; dropped by record {rec.key[:12]}: a person resolved it to "
           f"upstream's code at {w.name} {rec.release}")  # fmt: skip
    walker.drop(cid, decide.Outcome(cid, decide.DROPPED, why), proof=proof, records=[rec.key])
    return True


def _file_record(cid: str, sides: tuple, found: dict[str, records.Record]) -> records.Record | None:
    """The record of a person's edit of a whole file with exactly these three sides."""
    new, old, ours = (x.decode(errors="surrogateescape") if x else "" for x in sides)
    rec = found.get(records.key_of(new, old, ours))
    return rec if rec is not None and rec.change == cid and rec.scope == records.FILE else None
