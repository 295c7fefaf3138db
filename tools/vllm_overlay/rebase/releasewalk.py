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

The release loop is ``Walker.run``; the parts it calls are their own modules: the resolution
records (``rebase/replay.py``), the look-ahead (``rebase/lookahead.py``) and the person's
settlement (``rebase/settle.py``). The walk is plain data (``Walk``, ``rebase/walkdata.py``)
saved after every step: its files are blobs kept by content (``Blobs``), so a walk killed at
any step goes on from the last one saved. What the walk needs from outside is a ``Host``
(declared there too): the files of a release, and the proofs.
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from vllm_overlay.overlay.model import Change
from vllm_overlay.rebase import decide, lookahead, records, replay, settle
from vllm_overlay.rebase.walkdata import (
    TESTS_FAILED,
    WAITING,
    Blobs,
    Cell,
    Fact,
    Form,
    Host,
    Proof,
    State,
    Walk,
)
from vllm_overlay.util import info, sha256_bytes


@dataclass
class Walker:
    """One walk in motion: its data, the blobs, the host, the resolution records."""

    walk: Walk
    blobs: Blobs
    host: Host
    changes: dict[str, Change]
    records: dict[str, records.Record]
    stop_at_conflicts: bool = True  # False: the outlook (a stop is noted, the walk goes on)
    on_step: Callable[[], None] | None = None  # after every step (the rebase saves its state)
    # Each release and each verdict as the walk decides it (a line each); None: quiet.
    report: Callable[[str], None] | None = info
    made: list[records.Record] = field(default_factory=list)  # the person's, by ``settle``
    memo: dict | None = None  # decisions shared by several walks of one series (the outlook)
    _batched: str = ""  # the release whose drops were proven in one batch
    _shown: str = ""  # the release last reported

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> Walk:
        w = self.walk
        while not w.done and w.stop is None:
            if w.next == 0:
                w.tree = self.blobs.keys(self.host.files(w.release, self.paths()))
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
            if self.on_step is not None:
                self.on_step()
        return w

    def _step(self, cid: str) -> None:
        w, rel = self.walk, self.walk.release
        if cid in w.gone:
            return
        if cid in w.waiting and w.waiting[cid] != rel:
            self._cell(cid, WAITING, f"waits for {w.name} {w.waiting[cid]}")
            return
        w.waiting.pop(cid, None)
        o = self.decision(cid, rel, self.tree(w.forms[cid].files))
        if o.state == decide.DROPPED and o.runners_gone:
            runners = " and ".join(r.upper() for r in self.changes[cid].runners)
            self.drop(cid, o, Fact(True, (
                f"{w.name} {rel} has no Model Runner {runners} ({o.reason.rpartition(': ')[2]}); "
                f"the change served {runners} only: the engine tests at {rel} run the series "
                "without it on the runner that remains")))  # fmt: skip
        elif o.state == decide.DROPPED:
            self.drop(cid, o)
        elif o.state in (decide.KEPT, decide.REFRESHED):
            self.carry(cid, o.merged, o.state, o.reason, notes=o.notes)
        else:
            self._conflict(cid, o)

    def _conflict(self, cid: str, o: decide.Outcome) -> None:
        w = self.walk
        if replay.by_record(self, cid, o) or replay.by_drop_record(self, cid, o):
            return
        ahead = lookahead.ahead(self, cid, o)
        if ahead:
            rel, why = ahead
            w.waiting[cid] = rel
            self._cell(cid, WAITING, f"{o.reason}; {why}, so nobody is asked here",
                       met=o.state)  # fmt: skip
            return
        self._stop(cid, o.state, o.reason, outcome=o)

    # -- verdicts ------------------------------------------------------------------------

    def _say(self, line: str) -> None:
        if self.report is not None:
            self.report(line)

    def _cell(self, cid: str, state: State, reason: str, **more: object) -> Cell:
        c = Cell(self.walk.release, cid, state, reason, **more)
        self.walk.cells.append(c)
        first = reason.strip().splitlines()[0] if reason.strip() else ""
        self._say(f"  {cid}: {state}" + (" (stop)" if c.stop else "")
                  + (f": {first}" if first else ""))  # fmt: skip
        return c

    def carry(self, cid: str, files: dict[str, bytes | None], state: State, reason: str,
              **more: object) -> None:  # fmt: skip
        """The change goes on with ``files`` as its form at this release."""
        w = self.walk
        form = w.forms[cid]
        tree = self.tree(list(files))
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
        self._cell(cid, state, reason, **more)

    def _batch_drops(self, cid: str) -> None:
        """Before the first proof at a release: the other changes that drop here too (as
        the release stands now) are proven with it, in one run."""
        w = self.walk
        if self._batched == w.release:
            return
        self._batched = w.release
        items = [self.as_carried(cid)]
        tree = self.tree(self.paths())
        for other in w.order[w.next + 1 :]:
            if other in w.gone or w.waiting.get(other, w.release) != w.release:
                continue
            if self.decision(other, w.release, tree).state == decide.DROPPED:
                items.append(self.as_carried(other))
        if len(items) > 1:
            self.host.prove_drops(w.release, items)

    def prove_drop(self, cid: str) -> Proof | None:
        """The change's tests (and upstream's of a backport) on this release without it."""
        self._batch_drops(cid)
        change, ours = self.as_carried(cid)
        return self.host.prove_drop(self.walk.release, change, ours)

    def drop(self, cid: str, o: decide.Outcome, proof: Proof | None = None,
             **more: object) -> None:  # fmt: skip
        """``proof``: the drop's, already run (a person's resolution to upstream's code, or
        their drop record's); ``more``: what the cell also says (the records)."""
        w = self.walk
        if proof is None:
            proof = self.prove_drop(cid)
        if proof is not None and not proof.ok:
            self._stop(cid, TESTS_FAILED, o.reason, test_run=proof.to_json())
            return
        text = proof.text if proof is not None else "not proven here (the outlook runs no tests)"
        w.gone[cid] = {"release": w.release, "reason": o.reason, "proof": text}
        self._cell(cid, decide.DROPPED, o.reason, proof=text, **more)

    def _stop(self, cid: str, state: State, reason: str, *,
              outcome: decide.Outcome | None = None, test_run: dict | None = None,
              ) -> None:  # fmt: skip
        more: dict = {}
        if outcome is not None:
            more.update(files=list(outcome.files), problems=dict(outcome.problems),
                        hunks=dict(outcome.hunks), candidates=dict(outcome.candidates),
                        conflicted=self.blobs.keys(dict(outcome.conflicted)),
                        merged=self.blobs.keys(dict(outcome.merged)),
                        notes=list(outcome.notes))  # fmt: skip
        cell = self._cell(cid, state, reason, stop=True, test_run=test_run, **more)
        if self.stop_at_conflicts:
            self.walk.stop = cell

    # -- a settled stop: the person's files, or the failed proof run again ------------------

    def settle(self, files: dict[str, bytes | None], renames: dict[str, str],
               unproven: dict | None = None) -> Proof | None:  # fmt: skip
        """The person's resolution of the stop (``rebase/settle.py``)."""
        return settle.settle(self, files, renames, unproven)

    def retry_proof(self) -> None:
        """Run the stopped drop's proof again (the person fixed what made it fail)."""
        settle.retry_proof(self)

    # -- what the parts share: the release's files, the decision -----------------------------

    def paths(self) -> list[str]:
        """Every file the changes still carried touch."""
        w = self.walk
        return sorted({p for cid, f in w.forms.items() if cid not in w.gone for p in f.files})

    def tree(self, paths: list[str]) -> dict[str, bytes | None]:
        """The release's files as the changes so far leave them, ``paths`` among them."""
        w = self.walk
        missing = [p for p in paths if p not in w.tree]
        if missing:
            w.tree.update(self.blobs.keys(self.host.files(w.release, missing)))
        return self.blobs.files(w.tree)

    def decision(self, cid: str, rel: str, tree: dict[str, bytes | None]) -> decide.Outcome:
        """The one decision for the change in its current form at ``rel`` on ``tree``."""
        form = self.walk.forms[cid]
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

    def as_carried(self, cid: str) -> tuple[Change, dict[str, bytes]]:
        """The change in its current form, and its own test files (what a proof stages)."""
        form = self.walk.forms[cid]
        change = replace(self.changes[cid], files=tuple(form.files), tests=tuple(form.tests))
        own = {t.partition("::")[0] for t in form.tests}
        return change, {p: d for p, d in self.blobs.files(form.after).items() if p in own and d}

    def sides(self, cid: str) -> tuple[dict, dict, dict]:
        """The change's files in the release as the walk meets them, at its base, and ours:
        what a drop record is keyed by."""
        form = self.walk.forms[cid]
        tree = self.tree(form.files)
        return ({p: tree.get(p) for p in form.files}, self.blobs.files(form.before),
                self.blobs.files(form.after))  # fmt: skip
