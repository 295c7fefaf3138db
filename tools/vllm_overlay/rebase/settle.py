"""A stop settled: the person's resolution becomes the change's form, or the failed proof
passes when run again; then the walk goes on from that change (``Walker.settle``,
``Walker.retry_proof``, which the rebase's ``--continue`` calls).

A resolution is proven before it counts, and recorded (``rebase/records.py``) so that no
later walk asks it again: per conflicting hunk (or whole file), a whole-file record of each
file that merged but that the person edited, or, for a resolution to upstream's code, a drop
record of the change's whole state.
"""

from __future__ import annotations

from dataclasses import replace

from vllm_overlay.rebase import decide, records
from vllm_overlay.rebase.walkdata import RESOLVED, TESTS_FAILED, Proof, Walking


def settle(walker: Walking, files: dict[str, bytes | None], renames: dict[str, str],
           unproven: dict | None = None) -> Proof | None:  # fmt: skip
    """The person's resolution of the stop: the change's files as they left them at the
    stop's release (``files``: every path they touched; None: deleted).

    Proven before it counts: the change's tests run on the release with it (a resolution
    to upstream's code: the drop's proof). Not proven: nothing changes (the stop stays, no
    record is made) and the failed proof is returned, unless ``unproven`` (who and why)
    says to go on anyway: then the records are marked unproven."""
    w = walker.walk
    stop = w.stop
    assert stop is not None and stop.state != TESTS_FAILED
    cid = stop.id
    form = w.forms[cid]
    tree = walker.tree(list(files))
    changed = {p: d for p, d in files.items() if d != tree.get(p)}
    order = [renames.get(p, p) for p in form.files]  # the change's order, then new files
    changed = dict(sorted(changed.items(), key=lambda kv: (
        order.index(kv[0]) if kv[0] in order else len(order), kv[0])))  # fmt: skip
    tests = [_renamed(t, renames) for t in form.tests]
    proof = _prove(walker, cid, changed, tests, tree, renames)
    failed = proof is not None and not proof.ok
    if failed and (unproven is None or not changed):
        return proof  # a drop is always proven: --unproven carries a resolution only
    marks = _marks(proof, unproven)
    if changed:
        made = _resolution_records(walker, cid, files, tree)
    else:  # a drop: recorded by the change's whole state, so never asked again
        made = [records.drop(cid, w.release, walker.sides(cid))]
    walker.made += [replace(r, **marks) for r in made]
    form.tests = tests
    w.stop = None
    if not changed:
        walker.drop(cid, decide.Outcome(cid, decide.DROPPED, "the person resolved the stop "
                    f"to upstream's code: {w.name} {w.release} replaces the change"),
                    proof=proof, records=[r.key for r in made])  # fmt: skip
    else:
        proven = "its tests not run" if proof is None else proof.text
        walker.carry(cid, changed, RESOLVED, "resolved by a person at this release; "
                     + ("UNPROVEN: " if failed else "") + proven, renamed=renames,
                     records=[r.key for r in walker.made],
                     unproven=marks["unproven"] if failed else None)  # fmt: skip
    if w.stop is None:
        w.next += 1
    return proof


def retry_proof(walker: Walking) -> None:
    """Run the stopped drop's proof again (the person fixed what made it fail)."""
    w = walker.walk
    assert w.stop is not None and w.stop.state == TESTS_FAILED
    cid, reason = w.stop.id, w.stop.reason
    w.stop = None
    walker.drop(cid, decide.Outcome(cid, decide.DROPPED, reason))
    if w.stop is None:
        w.next += 1


def _resolution_records(walker: Walking, cid: str, files: dict[str, bytes | None],
                        tree: dict[str, bytes | None]) -> list[records.Record]:  # fmt: skip
    """The records of a person's resolution of the stop: per conflicting hunk (or whole
    file), and a whole-file record of each file that merged but that they edited."""
    w, form, blobs = walker.walk, walker.walk.forms[cid], walker.blobs
    stop = w.stop
    assert stop is not None
    shown = {**stop.merged, **stop.conflicted}
    made: list[records.Record] = []
    for p, data in files.items():
        if data is None or p not in form.files:
            continue
        sides = (tree.get(p) or b"", blobs.get(form.before.get(p)) or b"",
                 blobs.get(form.after.get(p)) or b"")  # fmt: skip
        cf = stop.conflicted.get(p)
        if cf is not None:
            made += records.derive(cid, p, w.release, blobs.get(cf), data, sides)  # type: ignore[arg-type]
        elif data != blobs.get(shown.get(p)):  # the person edited a file that merged
            made.append(records.whole_file(cid, p, w.release, sides, data))
    return made


def _prove(walker: Walking, cid: str, changed: dict[str, bytes | None], tests: list[str],
           tree: dict[str, bytes | None], renames: dict[str, str]) -> Proof | None:  # fmt: skip
    """The change's tests on the release with the person's files (``changed``); when
    nothing of the change is left (upstream's code), the drop's proof."""
    w, form = walker.walk, walker.walk.forms[cid]
    change = replace(walker.changes[cid], files=tuple(changed or form.files), tests=tuple(tests))
    if changed:
        return walker.host.prove_carried(w.release, change, {**tree, **changed}, "resolution")
    own = {t.partition("::")[0] for t in form.tests}
    ours = {renames.get(p, p): d for p, d in walker.blobs.files(form.after).items()
            if p in own and d}  # fmt: skip
    return walker.host.prove_drop(w.release, change, ours)


def _marks(proof: Proof | None, unproven: dict | None) -> dict:
    """What a person's records say of their proof: the tests that passed with them, or (gone on
    with --unproven) who, why, and the tests that failed."""
    if proof is None:
        return {}
    if proof.ok:
        return {"proof": proof.text}
    runs = proof.to_json().get("runs", {})
    failed = [t for r in runs.values() for t in r.get("failing", [])]
    return {"unproven": {**(unproven or {}), "tests": proof.text, "failed": failed}}


def _renamed(entry: str, renames: dict[str, str]) -> str:
    path, sep, node = entry.partition("::")
    return renames.get(path, path) + sep + node
