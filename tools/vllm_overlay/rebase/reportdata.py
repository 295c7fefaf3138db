"""The rebase report as typed data: what ``rebase/report.py`` builds, what the CLI and the
tracking run render, and its JSON (``to_json``; ``from_json`` reads it back, tolerant of a
report saved by an older version: a key it lacks takes its default).

The JSON is the report's public form (``rebase --json``, ``track-report.json``): its keys
and their presence are as before the report was typed. The lists by outcome (``kept``,
``dropped``, ``conflicted``, ...) are derived from ``changes``, so they are written, never
stored."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_overlay.rebase.decide import DROPPED, KEPT, REFRESHED
from vllm_overlay.rebase.state import STOP_COMMIT
from vllm_overlay.rebase.walkdata import RECORD, RESOLVED, Cell

CONFLICTED = ("conflict", "moved", "collision", RESOLVED, RECORD)


@dataclass(frozen=True)
class Run:
    """One pytest run of a proof, as its report says it (the saved JSON keeps every key)."""

    failed: int = 0
    errors: int = 0
    first_error: str = ""
    log: str = ""

    @classmethod
    def from_json(cls, d: dict) -> Run:
        return cls(d.get("failed") or 0, d.get("errors") or 0, d.get("first_error") or "",
                   d.get("log") or "")  # fmt: skip


@dataclass(frozen=True)
class TestRun:
    """A proof's outcome (``walkdata.Proof.to_json``), kept whole for the JSON; read typed."""

    raw: dict

    @property
    def text(self) -> str:
        return self.raw.get("text", "")

    @property
    def seconds(self) -> float | None:
        return self.raw.get("seconds")

    @property
    def runs(self) -> dict[str, Run]:
        return {k: Run.from_json(v) for k, v in (self.raw.get("runs") or {}).items()}

    @classmethod
    def from_json(cls, d: dict | None) -> TestRun | None:
        return None if d is None else cls(dict(d))


def _run_json(t: TestRun | None) -> dict | None:
    return None if t is None else t.raw


@dataclass(frozen=True)
class Artifact:
    kind: str
    project: str
    filename: str
    sha256: str
    size: int

    def to_json(self) -> dict:
        return {"kind": self.kind, "project": self.project, "filename": self.filename,
                "sha256": self.sha256, "size": self.size}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> Artifact:
        return cls(d["kind"], d.get("project", ""), d["filename"], d["sha256"], d.get("size", 0))


@dataclass(frozen=True)
class Pin:
    """The new pin: the release, its commit (None while unknown) and its artifacts."""

    name: str
    version: str
    tag: str
    commit: str | None
    sdist_commit: str | None = None
    artifacts: tuple[Artifact, ...] = ()
    variants: dict[str, list[str]] = field(default_factory=dict)
    built_from_source: str = "none"

    def to_json(self) -> dict:
        return {"name": self.name, "version": self.version, "tag": self.tag,
                "commit": self.commit, "sdist_commit": self.sdist_commit,
                "artifacts": [a.to_json() for a in self.artifacts],
                "variants": {k: list(v) for k, v in self.variants.items()},
                "built_from_source": self.built_from_source}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> Pin:
        return cls(d["name"], d["version"], d.get("tag", ""), d.get("commit"),
                   d.get("sdist_commit"), tuple(Artifact.from_json(a) for a in d.get("artifacts", [])),
                   {k: list(v) for k, v in d.get("variants", {}).items()},
                   d.get("built_from_source", "none"))  # fmt: skip


@dataclass(frozen=True)
class Problem:
    """One file of a stop: its kind (content, renamed, deleted, collision), what upstream did,
    and git's rename candidates (path, similarity)."""

    path: str
    kind: str
    detail: str
    candidates: tuple[tuple[str, int], ...] = ()

    def to_json(self) -> dict:
        return {"path": self.path, "kind": self.kind, "detail": self.detail,
                "candidates": [{"path": p, "similarity": s} for p, s in self.candidates]}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> Problem:
        cands = tuple((c["path"], c["similarity"]) for c in d.get("candidates", []))
        return cls(d["path"], d.get("kind", ""), d.get("detail", ""), cands)


@dataclass(frozen=True)
class Stop:
    """Where the rebase stopped and what the person does next. The stop before the new pin
    is written (``STOP_COMMIT``: its commit is unknown) is at no change and no release."""

    id: str
    state: str
    next_steps: tuple[str, ...]
    problems: tuple[Problem, ...] = ()
    release: str | None = None
    reason: str = ""
    hunks: dict[str, str] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    test_run: TestRun | None = None

    def to_json(self) -> dict:
        out = {"id": self.id, "state": self.state, "problems": [p.to_json() for p in self.problems],
               "next_steps": list(self.next_steps)}  # fmt: skip
        if self.state != STOP_COMMIT:
            out |= {"release": self.release, "reason": self.reason, "hunks": dict(self.hunks),
                    "notes": list(self.notes), "test_run": _run_json(self.test_run)}  # fmt: skip
        return out

    @classmethod
    def from_json(cls, d: dict) -> Stop:
        return cls(d.get("id", ""), d["state"], tuple(d.get("next_steps", [])),
                   tuple(Problem.from_json(p) for p in d.get("problems", [])), d.get("release"),
                   d.get("reason") or "", dict(d.get("hunks") or {}), tuple(d.get("notes", [])),
                   TestRun.from_json(d.get("test_run")))  # fmt: skip


@dataclass(frozen=True)
class ChangeOutcome:
    """One change over the walk so far: dropped (at which release, why, with which proof),
    or carried (kept, refreshed, resolved, by a record; pending: not judged at the walk's
    release yet) with its files and tests now; the stopped change also carries the stop's
    problems, reason, proof and notes (``stopped``)."""

    id: str
    title: str
    origin: str
    state: str
    release: str | None = None  # dropped, or the stop: where
    reason: str = ""  # dropped, or the stop: why
    proof: str = ""  # dropped
    pull_request: str | None = None  # dropped
    files: tuple[str, ...] = ()
    tests: tuple[str, ...] = ()
    renamed: dict[str, str] = field(default_factory=dict)
    releases: dict[str, str] = field(default_factory=dict)  # release -> the cell's state
    unproven: tuple[str, ...] = ()  # releases where it was recorded unproven
    stopped: bool = False
    problems: tuple[Problem, ...] = ()
    test_run: TestRun | None = None
    notes: tuple[str, ...] = ()

    def to_json(self) -> dict:
        out: dict = {"id": self.id, "title": self.title, "origin": self.origin,
                     "state": self.state}  # fmt: skip
        if self.state == DROPPED:
            return out | {"release": self.release, "reason": self.reason, "proof": self.proof,
                          "pull_request": self.pull_request}  # fmt: skip
        out |= {"files": list(self.files), "tests": list(self.tests),
                "renamed": dict(self.renamed), "releases": dict(self.releases),
                "unproven": list(self.unproven)}  # fmt: skip
        if self.stopped:
            out |= {"release": self.release, "reason": self.reason,
                    "problems": [p.to_json() for p in self.problems],
                    "test_run": _run_json(self.test_run), "notes": list(self.notes)}  # fmt: skip
        return out

    @classmethod
    def from_json(cls, d: dict) -> ChangeOutcome:
        return cls(
            d["id"], d.get("title", ""), d.get("origin", ""), d["state"], d.get("release"),
            d.get("reason") or "", d.get("proof") or "", d.get("pull_request"),
            tuple(d.get("files", [])), tuple(d.get("tests", [])), dict(d.get("renamed", {})),
            dict(d.get("releases", {})), tuple(d.get("unproven", [])), "problems" in d,
            tuple(Problem.from_json(p) for p in d.get("problems", [])),
            TestRun.from_json(d.get("test_run")), tuple(d.get("notes", [])),
        )  # fmt: skip


@dataclass(frozen=True)
class Brief:
    """A cell as the report lists it: where, which change, its state, whether a stop."""

    release: str
    id: str
    state: str
    stop: bool = False

    def to_json(self) -> dict:
        out = {"release": self.release, "id": self.id, "state": self.state}
        return out | ({"stop": True} if self.stop else {})

    @classmethod
    def from_json(cls, d: dict) -> Brief:
        return cls(d["release"], d["id"], d["state"], bool(d.get("stop")))


@dataclass(frozen=True)
class RebaseReport:
    """Where the rebase stands (running, stopped, complete); ``written``, ``removed`` and
    ``revision`` once complete."""

    status: str
    from_version: str
    from_commit: str | None
    to: Pin
    path: tuple[str, ...]
    at: str
    checkout: str
    changes: tuple[ChangeOutcome, ...]
    notes: tuple[str, ...] = ()
    waited: tuple[Cell, ...] = ()  # conflicts a later release cleared: not asked
    stops: tuple[Brief, ...] = ()
    cells: tuple[Brief, ...] = ()
    proof_releases: dict[str, float] = field(default_factory=dict)
    stopped_at: Stop | None = None
    written: tuple[str, ...] | None = None
    removed: tuple[str, ...] = ()
    revision: tuple[int, int] | None = None  # overlay.toml's, from -> to

    def ids(self, *states: str) -> list[str]:
        return [c.id for c in self.changes if c.state in states]

    @property
    def dropped(self) -> list[ChangeOutcome]:
        return [c for c in self.changes if c.state == DROPPED]

    def to_json(self) -> dict:
        out = {
            "status": self.status,
            "from": {"version": self.from_version, "commit": self.from_commit},
            "to": self.to.to_json(),
            "path": list(self.path),
            "at": self.at,
            "notes": list(self.notes),
            "checkout": self.checkout,
            "changes": [c.to_json() for c in self.changes],
            "kept": self.ids(KEPT),
            "refreshed": self.ids(REFRESHED),
            "resolved": self.ids(RESOLVED),
            "by_record": self.ids(RECORD),
            "unproven": [c.id for c in self.changes if c.unproven],  # recorded unproven
            "dropped": [{k: c.to_json()[k] for k in ("id", "release", "reason", "proof",
                                                     "pull_request")} for c in self.dropped],
            "conflicted": self.ids(*CONFLICTED),
            "waited": [c.to_json() for c in self.waited],
            "stops": [s.to_json() for s in self.stops],
            "proof_releases": dict(self.proof_releases),
            "cells": [c.to_json() for c in self.cells],
            "stopped_at": None if self.stopped_at is None else self.stopped_at.to_json(),
        }  # fmt: skip
        if self.written is not None:
            rev = self.revision or (0, 0)
            out |= {"written": list(self.written), "removed": list(self.removed),
                    "revision": {"from": rev[0], "to": rev[1]}}  # fmt: skip
        return out

    @classmethod
    def from_json(cls, d: dict) -> RebaseReport:
        frm, rev, stop = d.get("from") or {}, d.get("revision"), d.get("stopped_at")
        return cls(
            d["status"], frm.get("version", ""), frm.get("commit"), Pin.from_json(d["to"]),
            tuple(d.get("path", [])), d.get("at", ""), d.get("checkout", ""),
            tuple(ChangeOutcome.from_json(c) for c in d.get("changes", [])),
            tuple(d.get("notes", [])), tuple(Cell.from_json(c) for c in d.get("waited", [])),
            tuple(Brief.from_json(s) for s in d.get("stops", [])),
            tuple(Brief.from_json(c) for c in d.get("cells", [])),
            dict(d.get("proof_releases", {})), None if stop is None else Stop.from_json(stop),
            None if "written" not in d else tuple(d["written"]), tuple(d.get("removed", [])),
            None if rev is None else (rev["from"], rev["to"]),
        )  # fmt: skip


@dataclass(frozen=True)
class Noop:
    """The pin is already the target."""

    message: str
    status: str = "noop"

    def to_json(self) -> dict:
        return {"status": self.status, "message": self.message}


@dataclass(frozen=True)
class Aborted:
    """upstream.lock, overlay/ and the checkout put back at ``from_version``."""

    from_version: str
    from_commit: str | None
    checkout: str
    status: str = "aborted"

    def to_json(self) -> dict:
        return {"status": self.status, "checkout": self.checkout,
                "from": {"version": self.from_version, "commit": self.from_commit}}  # fmt: skip


@dataclass(frozen=True)
class Failed:
    """The rebase stopped on an error, not on a change (the tracking run's report)."""

    error: str
    status: str = "failed"

    def to_json(self) -> dict:
        return {"status": self.status, "error": self.error}


Outcome = RebaseReport | Noop | Aborted | Failed


def outcome_from_json(d: dict) -> Outcome:
    """Any rebase outcome from its JSON (a saved report)."""
    if d["status"] == "noop":
        return Noop(d.get("message", ""))
    if d["status"] == "aborted":
        frm = d.get("from") or {}
        return Aborted(frm.get("version", ""), frm.get("commit"), d.get("checkout", ""))
    if d["status"] == "failed":
        return Failed(d.get("error", ""))
    return RebaseReport.from_json(d)
