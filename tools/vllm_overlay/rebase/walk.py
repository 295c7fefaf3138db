"""The walk: the series carried from the pin to a target, one release at a time.

This is the one state machine behind ``rebase``, ``track`` and ``outlook``. It reads top to
bottom as what it does:

    for each release on the path (every final release after the pin, up to the target;
    ``--direct``: the target alone):
        the release's files, as the earlier changes leave them (``tree``)
        for each change still carried, in overlay.toml order:
            waiting for a later release?          -> leave upstream's files; next change
            decide(change in its current form, tree)        (rebase/decide.py, one decision)
            dropped   -> prove it on this release's pristine tree (its tests, and upstream's
                         own tests of the backport); proven: gone from the series;
                         not proven: STOP (tests-failed)
            kept, refreshed -> its new form is its files here; the tree takes them
            conflict, moved, collision:
                every hunk has a resolution record  -> apply; its tests pass here: carried
                a person dropped it in this state   -> drop it again, proven here
                a later release up to the target clears it (drops it, or merges it)
                                                     -> wait for that release: not asked
                upstream touches these lines again before the target
                                                     -> wait for the last release that
                                                        does: asked there, once
                otherwise                            -> STOP here, where upstream touches
                                                        our lines

A stop is settled by the person (``settle``: their files become the change's form at that
release) or by the proof passing again; then the walk goes on from that change. Every verdict
is kept (``cells``), so the report says at which release each change dropped, with which
proof, and the outlook shows the same walk as a matrix.

The walk is plain data (``Walk``) saved after every step: its files are blobs kept by
content (``Blobs``), so a walk killed at any step goes on from the last one saved. What the
walk needs from outside is a ``Host``: the files of a release, and the proofs.
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

from vllm_overlay.overlay.model import Change
from vllm_overlay.rebase import decide, records
from vllm_overlay.util import atomic_write_bytes, info, sha256_bytes

# The verdicts of a cell, beyond decide's: a resolution record applied; waiting for a later
# release that clears the conflict; a stop (the person's); settled by the person.
RECORD, WAITING, STOPPED, RESOLVED, UNRESOLVED = (
    "record",
    "waiting",
    "stopped",
    "resolved",
    "unresolved",
)
TESTS_FAILED = "tests-failed"
CARRIED = (decide.KEPT, decide.REFRESHED, RECORD, RESOLVED)


# ---------------------------------------------------------------------------------------------
# Blobs: file contents by sha256


class Blobs:
    """File contents by their sha256: in a directory (a rebase) or in memory (the outlook)."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root
        self.mem: dict[str, bytes] = {}

    def put(self, data: bytes | None) -> str | None:
        if data is None:
            return None
        key = sha256_bytes(data)
        if self.root is None:
            self.mem[key] = data
        elif not (self.root / key).is_file():
            atomic_write_bytes(self.root / key, data)
        return key

    def get(self, key: str | None) -> bytes | None:
        if key is None:
            return None
        if self.root is None:
            return self.mem[key]
        return (self.root / key).read_bytes()

    def files(self, keys: dict[str, str | None]) -> dict[str, bytes | None]:
        return {p: self.get(k) for p, k in keys.items()}

    def keys(self, files: dict[str, bytes | None]) -> dict[str, str | None]:
        return {p: self.put(d) for p, d in files.items()}


# ---------------------------------------------------------------------------------------------
# The walk's data


@dataclass
class Form:
    """A change as the walk carries it: its files, its tests, and those files before and after
    it at the release it was last carried to (``at``; blob keys, None: absent)."""

    files: list[str]
    tests: list[str]
    at: str
    before: dict[str, str | None]
    after: dict[str, str | None]


@dataclass
class Walk:
    name: str
    pin: str
    path: list[str]  # the releases walked, oldest first; the last is the target
    order: list[str]  # the series' change ids
    forms: dict[str, Form]
    pos: int = 0  # index into path
    next: int = 0  # index into order, within the release
    tree: dict[str, str | None] = field(default_factory=dict)  # the release + changes < next
    gone: dict[str, dict] = field(default_factory=dict)  # dropped: id -> record
    waiting: dict[str, str] = field(default_factory=dict)  # id -> the release that clears it
    unresolved: list[str] = field(default_factory=list)  # outlook: stops nobody settled
    cells: list[dict] = field(default_factory=list)  # every verdict, in walk order
    records_used: list[str] = field(default_factory=list)  # keys of resolution records
    stop: dict | None = None
    done: bool = False

    @property
    def target(self) -> str:
        return self.path[-1]

    @property
    def release(self) -> str:
        return self.path[self.pos]

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Walk:
        data = dict(data)
        data["forms"] = {k: Form(**v) for k, v in data["forms"].items()}
        return cls(**data)

    def stops(self) -> list[dict]:
        """Every stop a person met or would meet (settled ones included)."""
        return [c for c in self.cells if c.get("stop")]


class Proof(Protocol):
    ok: bool
    text: str

    def to_json(self) -> dict: ...


@dataclass(frozen=True)
class Fact:
    """A drop proven by the release's tree, not by tests: the model runners the change
    serves are gone (``decide.runners_gone``). What the runner that remains does without the
    change is the engine tests' to prove at that release (tests/engine; track's engine proof
    runs them on the rebased series, which no longer carries it)."""

    ok: bool
    text: str

    def to_json(self) -> dict:
        return {"ok": self.ok, "text": self.text, "runs": {}, "seconds": 0.0}


class Host(Protocol):
    """What the walk needs from outside."""

    def files(self, version: str, paths: list[str]) -> dict[str, bytes | None]:
        """The release's files at ``paths`` (None: absent), pristine."""

    def names(self, version: str) -> frozenset[str]:
        """Every file name of the release's tree."""

    def prove_drop(self, version: str, change: Change, ours: dict[str, bytes]) -> Proof | None:
        """The change's tests (``ours``: its own test files) and its upstream tests on the
        release's pristine tree; None: not run (the outlook)."""

    def prove_carried(self, version: str, change: Change, tree: dict[str, bytes | None],
                      what: str = "record") -> Proof | None:  # fmt: skip
        """The change's tests on the release with ``tree`` (the series' files) written over
        it (``what``: a "record" applied, or a person's "resolution"); None: not run (the
        outlook)."""


# ---------------------------------------------------------------------------------------------
# Running


@dataclass
class Walker:
    """One walk in motion: its data, the blobs, the host, the resolution records."""

    walk: Walk
    blobs: Blobs
    host: Host
    changes: dict[str, Change]
    records: dict[str, records.Record]
    stop_at_conflicts: bool = True  # False: the outlook (a stop is noted, the walk goes on)
    on_step: object = None  # called after every step (the rebase saves its state)
    # Each release and each verdict as the walk decides it (a line each); None: quiet.
    report: Callable[[str], None] | None = info
    made: list[records.Record] = field(default_factory=list)
    memo: dict | None = None  # decisions shared by several walks of one series (the outlook)
    _batched: str = ""  # the release whose drops were proven in one batch
    _shown: str = ""  # the release last reported

    def _say(self, line: str) -> None:
        if self.report is not None:
            self.report(line)

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> Walk:
        w = self.walk
        while not w.done and w.stop is None:
            if w.next == 0:
                w.tree = self.blobs.keys(self.host.files(w.release, self._paths()))
            if w.next < len(w.order):
                if self._shown != w.release:
                    self._shown = w.release
                    self._say(f"{w.name} {w.release} ({w.pos + 1}/{len(w.path)})")
                self._step(w.order[w.next])
                if w.stop is None:
                    w.next += 1
            else:
                w.pos, w.next = w.pos + 1, 0
                w.done = w.pos == len(w.path)
                if w.done:
                    w.pos -= 1
            self._saved()
        return w

    def _saved(self) -> None:
        if callable(self.on_step):
            self.on_step()

    def _paths(self) -> list[str]:
        w = self.walk
        return sorted({p for cid, f in w.forms.items() if cid not in w.gone for p in f.files})

    def _step(self, cid: str) -> None:
        w, rel = self.walk, self.walk.release
        if cid in w.gone:
            return
        if cid in w.waiting and w.waiting[cid] != rel:
            self._cell(cid, WAITING, f"waits for {w.name} {w.waiting[cid]}")
            return
        w.waiting.pop(cid, None)
        o = self._decide(cid, rel, self._tree(w.forms[cid].files))
        if o.state == decide.DROPPED and o.runners_gone:
            runners = " and ".join(r.upper() for r in self.changes[cid].runners)
            self._drop(cid, o, Fact(True, (
                f"{w.name} {rel} has no Model Runner {runners} ({o.reason.rpartition(': ')[2]}); "
                f"the change served {runners} only: the engine tests at {rel} run the series "
                "without it on the runner that remains")))  # fmt: skip
        elif o.state == decide.DROPPED:
            self._drop(cid, o)
        elif o.state in (decide.KEPT, decide.REFRESHED):
            self._carry(cid, o.merged, o.state, o.reason, notes=o.notes)
        else:
            self._conflict(cid, o)

    def _tree(self, paths: list[str]) -> dict[str, bytes | None]:
        """The release's files as the changes so far leave them, ``paths`` among them."""
        w = self.walk
        missing = [p for p in paths if p not in w.tree]
        if missing:
            w.tree.update(self.blobs.keys(self.host.files(w.release, missing)))
        return self.blobs.files(w.tree)

    def _decide(self, cid: str, rel: str, tree: dict[str, bytes | None]) -> decide.Outcome:
        w = self.walk
        form = w.forms[cid]
        if self.memo is not None:  # a pure function of the form and the release's files
            key = (cid, rel, form.at, json.dumps([form.files, form.tests, form.before,
                   form.after], sort_keys=True),
                   tuple((p, sha256_bytes(d) if d is not None else None)
                         for p in form.files for d in [tree.get(p)]))  # fmt: skip
            if key not in self.memo:
                self.memo[key] = self._decide_now(cid, rel, tree)
            return copy.deepcopy(self.memo[key])
        return self._decide_now(cid, rel, tree)

    def _decide_now(self, cid: str, rel: str, tree: dict[str, bytes | None]) -> decide.Outcome:
        w = self.walk
        form = w.forms[cid]
        change = replace(self.changes[cid], files=tuple(form.files), tests=tuple(form.tests))
        step = decide.Step(change, self.blobs.files(form.before), self.blobs.files(form.after))
        labels = (f"{w.name} {rel}", f"{w.name} {form.at}", "our change")
        r = decide.Release(w.name, rel, self.host.names(rel), lambda ps: self.host.files(rel, ps))
        with tempfile.TemporaryDirectory(prefix="vllm-overlay-walk-") as tmp:
            return decide.decide(step, decide.Scratch(Path(tmp)), tree, r,
                                 self.host.names(form.at), labels)  # fmt: skip

    # -- verdicts ------------------------------------------------------------------------

    def _cell(self, cid: str, state: str, reason: str, **more: object) -> dict:
        c = {"release": self.walk.release, "id": cid, "state": state, "reason": reason, **more}
        self.walk.cells.append(c)
        first = reason.strip().splitlines()[0] if reason.strip() else ""
        self._say(f"  {cid}: {state}" + (" (stop)" if more.get("stop") else "")
                  + (f": {first}" if first else ""))  # fmt: skip
        return c

    def _carry(self, cid: str, files: dict[str, bytes | None], state: str, reason: str,
               **more: object) -> None:  # fmt: skip
        w = self.walk
        form = w.forms[cid]
        tree = self._tree(list(files))
        before = {p: tree.get(p) for p in files}
        kept = [p for p in files if files[p] != before[p]] or list(files)
        w.forms[cid] = Form(
            files=kept,
            tests=list(form.tests),
            at=w.release,
            before=self.blobs.keys({p: before[p] for p in kept}),
            after=self.blobs.keys({p: files[p] for p in kept}),
        )
        w.tree.update(self.blobs.keys(files))
        if cid in w.unresolved:
            w.unresolved.remove(cid)
        self._cell(cid, state, reason, **more)

    def _as_carried(self, cid: str) -> tuple[Change, dict[str, bytes]]:
        """The change in its current form, and its own test files (what a proof stages)."""
        form = self.walk.forms[cid]
        change = replace(self.changes[cid], files=tuple(form.files), tests=tuple(form.tests))
        own = {t.partition("::")[0] for t in form.tests}
        return change, {p: d for p, d in self.blobs.files(form.after).items() if p in own and d}

    def _batch_drops(self, cid: str) -> None:
        """Before the first proof at a release: the other changes that drop here too (as
        the release stands now) are proven with it, in one run."""
        w = self.walk
        if self._batched == w.release or not hasattr(self.host, "prove_drops"):
            return
        self._batched = w.release
        items = [self._as_carried(cid)]
        tree = self._tree(self._paths())
        for other in w.order[w.next + 1 :]:
            if other in w.gone or w.waiting.get(other, w.release) != w.release:
                continue
            if self._decide(other, w.release, tree).state == decide.DROPPED:
                items.append(self._as_carried(other))
        if len(items) > 1:
            self.host.prove_drops(w.release, items)

    def _prove_drop(self, cid: str) -> Proof | None:
        """The change's tests (and upstream's of a backport) on this release without it."""
        self._batch_drops(cid)
        change, ours = self._as_carried(cid)
        return self.host.prove_drop(self.walk.release, change, ours)

    def _drop(self, cid: str, o: decide.Outcome, proof: Proof | None = None,
              **more: object) -> None:  # fmt: skip
        """``proof``: the drop's, already run (a person's resolution to upstream's code, or
        their drop record's); ``more``: what the cell also says (the records)."""
        w = self.walk
        if proof is None:
            proof = self._prove_drop(cid)
        if proof is not None and not proof.ok:
            self._stop(cid, TESTS_FAILED, o.reason, proof=proof.to_json())
            return
        text = proof.text if proof is not None else "not proven here (the outlook runs no tests)"
        w.gone[cid] = {"release": w.release, "reason": o.reason, "proof": text}
        if cid in w.unresolved:
            w.unresolved.remove(cid)
        self._cell(cid, decide.DROPPED, o.reason, proof=text, **more)

    def _conflict(self, cid: str, o: decide.Outcome) -> None:
        w = self.walk
        if self._by_record(cid, o) or self._by_drop_record(cid, o):
            return
        ahead = self._ahead(cid, o)
        if ahead:
            rel, why = ahead
            w.waiting[cid] = rel
            self._cell(cid, WAITING, f"{o.reason}; {why}, so nobody is asked here",
                       met=o.state)  # fmt: skip
            return
        self._stop(cid, o.state, o.reason, outcome=o)

    def _stop(self, cid: str, kind: str, reason: str, *, outcome: decide.Outcome | None = None,
              proof: dict | None = None) -> None:  # fmt: skip
        w = self.walk
        more: dict = {"stop": True, "kind": kind}
        if outcome is not None:
            more.update(files=outcome.files, problems=dict(outcome.problems),
                        hunks=outcome.hunks, candidates=outcome.candidates,
                        conflicted=self.blobs.keys(dict(outcome.conflicted)),
                        merged=self.blobs.keys(dict(outcome.merged)),
                        notes=list(outcome.notes))  # fmt: skip
        if proof is not None:
            more["test_run"] = proof
        cell = self._cell(cid, STOPPED if self.stop_at_conflicts else UNRESOLVED, reason, **more)
        if self.stop_at_conflicts:
            w.stop = dict(cell)
        elif cid not in w.unresolved:
            w.unresolved.append(cid)

    # -- resolution records ----------------------------------------------------------------

    def _by_record(self, cid: str, o: decide.Outcome) -> bool:
        """Carry the change by resolution records when every conflicting hunk has one and its
        tests pass on this release with the result."""
        if o.state != decide.CONFLICT or not self.records:
            return False
        w = self.walk
        form, tree = w.forms[cid], self._tree(w.forms[cid].files)
        before, after = self.blobs.files(form.before), self.blobs.files(form.after)
        files: dict[str, bytes | None] = {}
        used: list[records.Record] = []
        with tempfile.TemporaryDirectory(prefix="vllm-overlay-record-") as tmp:
            scratch = decide.Scratch(Path(tmp))
            for p in form.files:
                new, old, ours = tree.get(p), before.get(p), after.get(p)
                if p in o.conflicted:
                    got = records.resolve(cid, o.conflicted[p], (new, old, ours), self.records)  # type: ignore[arg-type]
                    if got is None:
                        return False
                    files[p], recs = got
                    used += recs
                elif (edit := _file_record(cid, (new, old, ours), self.records)) is not None:
                    files[p] = edit.resolution.encode(errors="surrogateescape")
                    used.append(edit)  # the person also edited this file, which merged
                elif old is None or new is None or ours is None:
                    files[p] = ours
                else:
                    files[p], n = scratch.merge(new, old, ours, ("new", "old", "ours"))
                    if n:
                        return False
        change = replace(self.changes[cid], files=tuple(form.files), tests=tuple(form.tests))
        proof = self.host.prove_carried(w.release, change, {**tree, **files})
        keys = sorted({r.key for r in used})
        if proof is not None and not proof.ok:
            o.notes.append(f"resolution records {', '.join(k[:12] for k in keys)} apply, but "
                           f"the change's tests fail with them: {proof.text}")  # fmt: skip
            return False
        for k in keys:
            if k not in w.records_used:
                w.records_used.append(k)
        text = proof.text if proof is not None else "its tests not run here (the outlook)"
        # A record a person made unproven (--unproven) applies like any other only where the
        # change's tests pass with it (the rebase always runs them); the cell says so.
        unproven = sorted(r.key for r in used if r.unproven is not None)
        more = {"unproven_records": unproven} if unproven else {}
        if unproven:
            text += f"; record {', '.join(k[:12] for k in unproven)} was recorded unproven"
        self._carry(cid, files, RECORD, f"{o.reason}; resolved by record "
                    f"{', '.join(k[:12] for k in keys)}; {text}", records=keys, **more)  # fmt: skip
        return True

    def _sides(self, cid: str) -> tuple[dict, dict, dict]:
        """The change's files in the release as the walk meets them, at its base, and ours:
        what a drop record is keyed by."""
        form = self.walk.forms[cid]
        tree = self._tree(form.files)
        return ({p: tree.get(p) for p in form.files}, self.blobs.files(form.before),
                self.blobs.files(form.after))  # fmt: skip

    def _by_drop_record(self, cid: str, o: decide.Outcome) -> bool:
        """Drop the change as a person did in exactly this state, when the drop's proof
        passes here (it is run again: the release is not the one the record was made at)."""
        rec = records.find_drop(cid, self._sides(cid), self.records) if self.records else None
        if rec is None:
            return False
        w = self.walk
        proof = self._prove_drop(cid)
        if proof is not None and not proof.ok:
            o.notes.append(f"a person dropped it in this state at {w.name} {rec.release} "
                           f"(record {rec.key[:12]}), but its drop's proof fails here: "
                           f"{proof.text}")  # fmt: skip
            return False
        if rec.key not in w.records_used:
            w.records_used.append(rec.key)
        why = (f"{o.reason}; dropped by record {rec.key[:12]}: a person resolved it to "
               f"upstream's code at {w.name} {rec.release}")  # fmt: skip
        self._drop(cid, decide.Outcome(cid, decide.DROPPED, why), proof=proof, records=[rec.key])
        return True

    # -- looking ahead ---------------------------------------------------------------------

    def _ahead(self, cid: str, here: decide.Outcome) -> tuple[str, str] | None:
        """Where to take up a change that does not go through here, looking ahead to the
        target, in its current form, on each release as the changes before it leave it:

        - the first later release that clears it (it drops there, or merges cleanly):
          nobody is asked at all;
        - else the last release where upstream touches the conflicting lines again (the
          conflict's hunks differ from the release before): a resolution made earlier would
          be asked again there, so the person is asked once, there.

        None: stop here (the conflict stays as it is up to the target)."""
        w = self.walk
        earlier = w.order[: w.order.index(cid)]
        last, at = _hunks_of(here), None
        for rel in w.path[w.pos + 1 :]:
            tree = self.host.files(rel, self._paths())
            for other in earlier:
                if other in w.gone or w.waiting.get(other, rel) != rel:
                    continue
                o = self._decide(other, rel, tree)
                if o.state in (decide.KEPT, decide.REFRESHED):
                    tree.update(o.merged)
            o = self._decide(cid, rel, tree)
            if o.state in decide.CLEAN:
                how = "it drops there" if o.state == decide.DROPPED else "it merges there"
                return rel, f"{w.name} {rel} clears it ({how})"
            hunks = _hunks_of(o)
            if hunks != last:
                last, at = hunks, rel
        if at is None:
            return None
        return at, (f"upstream touches these lines again up to {w.name} {at}: the person is "
                    "asked there, once")  # fmt: skip

    # -- a person's settlement -------------------------------------------------------------

    def settle(self, files: dict[str, bytes | None], renames: dict[str, str],
               unproven: dict | None = None) -> Proof | None:  # fmt: skip
        """The person's resolution of the stop: the change's files as they left them at the
        stop's release (``files``: every path they touched; None: deleted).

        Proven before it counts: the change's tests run on the release with it (a resolution
        to upstream's code: the drop's proof). Not proven: nothing changes (the stop stays, no
        record is made) and the failed proof is returned, unless ``unproven`` (who and why)
        says to go on anyway: then the records are marked unproven."""
        w = self.walk
        stop = w.stop
        assert stop is not None and stop["kind"] != TESTS_FAILED
        cid = stop["id"]
        form = w.forms[cid]
        tree = self._tree(list(files))
        changed = {p: d for p, d in files.items() if d != tree.get(p)}
        order = [renames.get(p, p) for p in form.files]  # the change's order, then new files
        changed = dict(sorted(changed.items(), key=lambda kv: (
            order.index(kv[0]) if kv[0] in order else len(order), kv[0])))  # fmt: skip
        tests = [_renamed(t, renames) for t in form.tests]
        proof = self._prove_resolution(cid, changed, tests, tree, renames)
        failed = proof is not None and not proof.ok
        if failed and (unproven is None or not changed):
            return proof  # a drop is always proven: --unproven carries a resolution only
        marks = _marks(proof, unproven)
        if changed:
            made = self._resolution_records(cid, files, tree)
        else:  # a drop: recorded by the change's whole state, so never asked again
            made = [records.drop(cid, w.release, self._sides(cid))]
        self.made += [replace(r, **marks) for r in made]
        form.tests = tests
        w.stop = None
        if not changed:
            self._drop(cid, decide.Outcome(cid, decide.DROPPED, "the person resolved the stop "
                       f"to upstream's code: {w.name} {w.release} replaces the change"),
                       proof=proof, records=[r.key for r in made])  # fmt: skip
        else:
            more = {"unproven": marks["unproven"]} if failed else {}
            proven = "its tests not run" if proof is None else proof.text
            self._carry(cid, changed, RESOLVED, "resolved by a person at this release; "
                        + ("UNPROVEN: " if failed else "") + proven,
                        renamed=renames, records=[r.key for r in self.made], **more)  # fmt: skip
        if w.stop is None:
            w.next += 1
        return proof

    def _resolution_records(self, cid: str, files: dict[str, bytes | None],
                            tree: dict[str, bytes | None]) -> list[records.Record]:  # fmt: skip
        """The records of a person's resolution of the stop: per conflicting hunk (or whole
        file), and a whole-file record of each file that merged but that they edited."""
        w, form, stop = self.walk, self.walk.forms[cid], self.walk.stop or {}
        shown = {**stop.get("merged", {}), **stop.get("conflicted", {})}
        made: list[records.Record] = []
        for p, data in files.items():
            if data is None or p not in form.files:
                continue
            sides = (tree.get(p) or b"", self.blobs.get(form.before.get(p)) or b"",
                     self.blobs.get(form.after.get(p)) or b"")  # fmt: skip
            cf = stop.get("conflicted", {}).get(p)
            if cf is not None:
                made += records.derive(cid, p, w.release, self.blobs.get(cf), data, sides)  # type: ignore[arg-type]
            elif data != self.blobs.get(shown.get(p)):  # the person edited a file that merged
                made.append(records.whole_file(cid, p, w.release, sides, data))
        return made

    def _prove_resolution(self, cid: str, changed: dict[str, bytes | None], tests: list[str],
                          tree: dict[str, bytes | None], renames: dict[str, str]
                          ) -> Proof | None:  # fmt: skip
        """The change's tests on the release with the person's files (``changed``); when
        nothing of the change is left (upstream's code), the drop's proof."""
        w, form = self.walk, self.walk.forms[cid]
        change = replace(self.changes[cid], files=tuple(changed or form.files), tests=tuple(tests))
        if changed:
            return self.host.prove_carried(w.release, change, {**tree, **changed}, "resolution")
        own = {t.partition("::")[0] for t in form.tests}
        ours = {renames.get(p, p): d for p, d in self.blobs.files(form.after).items()
                if p in own and d}  # fmt: skip
        return self.host.prove_drop(w.release, change, ours)

    def retry_proof(self) -> None:
        """Run the stopped drop's proof again (the person fixed what made it fail)."""
        w = self.walk
        assert w.stop is not None and w.stop["kind"] == TESTS_FAILED
        cid, reason = w.stop["id"], w.stop["reason"]
        w.stop = None
        self._drop(cid, decide.Outcome(cid, decide.DROPPED, reason))
        if w.stop is None:
            w.next += 1


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


def _file_record(cid: str, sides: tuple, found: dict[str, records.Record]) -> records.Record | None:
    """The record of a person's edit of a whole file with exactly these three sides."""
    new, old, ours = (x.decode(errors="surrogateescape") if x else "" for x in sides)
    rec = found.get(records.key_of(new, old, ours))
    return rec if rec is not None and rec.change == cid and rec.scope == records.FILE else None


def _hunks_of(o: decide.Outcome) -> tuple:
    """What a conflict is, release names aside: its kind, files and the three sides of each
    hunk (a resolution of one applies to the other only when these are equal)."""
    out = []
    for path in sorted(o.files):
        merged = o.conflicted.get(path)
        split = records.split_diff3(merged.decode(errors="surrogateescape")) if merged else None
        out.append((path, tuple(split[1]) if split else None))
    return (o.state, tuple(out))


def _renamed(entry: str, renames: dict[str, str]) -> str:
    path, sep, node = entry.partition("::")
    return renames.get(path, path) + sep + node


def start(name: str, pin: str, path: list[str], steps: list[decide.Step], blobs: Blobs) -> Walk:
    """A walk of ``steps`` (the series at the pin) along ``path``."""
    return Walk(
        name=name,
        pin=pin,
        path=list(path),
        order=[s.change.id for s in steps],
        forms={
            s.change.id: Form(
                files=list(s.change.files),
                tests=list(s.change.tests),
                at=pin,
                before=blobs.keys(dict(s.before)),
                after=blobs.keys(dict(s.after)),
            )
            for s in steps
        },
    )


def person_stops(w: Walk) -> list[dict]:
    """The first stop of each change a person is asked about: its release, change and kind
    (the outlook's walk goes on past a stop nobody settles; a later one of the same change
    depends on how the person resolves the first)."""
    first: dict[str, dict] = {}
    for c in w.stops():
        first.setdefault(c["id"], {"release": c["release"], "id": c["id"], "kind": c["kind"]})
    return list(first.values())
