"""The walk as plain data: its files as blobs, each change's form, every verdict (a ``Cell``);
and what the walk needs from outside (a ``Host``) and its parts use of the walker (``Walking``).

The walk (``rebase/releasewalk.py``) saves a ``Walk`` after every step, so a walk killed at
any step goes on from the last one saved; its files are blobs kept by content (``Blobs``).

A cell's ``state`` is its verdict, one of ``STATES``: decide's (kept, refreshed, dropped,
conflict, moved, collision) and the walk's own (``RECORD``: a resolution record applied;
``WAITING``: a later release clears the conflict; ``RESOLVED``: settled by a person;
``TESTS_FAILED``: a drop whose proof failed). A stop is a cell with ``stop`` set: the person
is asked there (the rebase stops; the outlook notes it and goes on), and its state is what
the walk met (conflict, moved, collision, tests-failed). The report calls it ``state`` too.

Saved walks written before cells were typed (a stop's ``kind`` beside the state "stopped"
or "unresolved"; ``unresolved`` and ``records_used`` in the walk) still load.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Literal, Protocol, get_args

from vllm_overlay.overlay.model import Change
from vllm_overlay.rebase import decide, records
from vllm_overlay.util import atomic_write_bytes, sha256_bytes

State = Literal[
    "kept", "refreshed", "dropped", "conflict", "moved", "collision",
    "record", "waiting", "resolved", "tests-failed",
]  # fmt: skip
STATES: tuple[str, ...] = get_args(State)
RECORD, WAITING, RESOLVED, TESTS_FAILED = "record", "waiting", "resolved", "tests-failed"


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
# What the walk needs from outside, and what its parts use of it


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
    """What the walk, and the rebase around it, need from outside."""

    timings: dict[str, float]  # seconds spent on proofs, per release (the report shows them)

    def files(self, version: str, paths: list[str]) -> dict[str, bytes | None]:
        """The release's files at ``paths`` (None: absent), pristine."""

    def names(self, version: str) -> frozenset[str]:
        """Every file name of the release's tree."""

    def tree(self, version: str) -> tuple[Path, str]:
        """(a git repository of the release's whole tree, its commit): what a stop's checkout
        is written from."""

    def prove_drops(self, version: str, items: list[tuple[Change, dict[str, bytes]]]) -> None:
        """Prove several drops at one release ahead, in one run (``items``: each change and
        its own test files); ``prove_drop`` then answers from these. May do nothing."""

    def prove_drop(self, version: str, change: Change, ours: dict[str, bytes]) -> Proof | None:
        """The change's tests (``ours``: its own test files) and its upstream tests on the
        release's pristine tree; None: not run (the outlook)."""

    def prove_carried(self, version: str, change: Change, tree: dict[str, bytes | None],
                      what: str = "record") -> Proof | None:  # fmt: skip
        """The change's tests on the release with ``tree`` (the series' files) written over
        it (``what``: a "record" applied, or a person's "resolution"); None: not run (the
        outlook)."""


class Walking(Protocol):
    """What the walk's parts (``replay``, ``lookahead``, ``settle``) use of the walker
    (``rebase/releasewalk.py`` ``Walker``), which calls them."""

    walk: Walk
    blobs: Blobs
    host: Host
    changes: dict[str, Change]
    records: dict[str, records.Record]
    made: list[records.Record]

    def paths(self) -> list[str]: ...

    def tree(self, paths: list[str]) -> dict[str, bytes | None]: ...

    def decision(self, cid: str, rel: str, tree: dict[str, bytes | None]) -> decide.Outcome: ...

    def sides(self, cid: str) -> tuple[dict, dict, dict]: ...

    def prove_drop(self, cid: str) -> Proof | None: ...

    def carry(self, cid: str, files: dict[str, bytes | None], state: State, reason: str,
              **more: object) -> None: ...  # fmt: skip

    def drop(self, cid: str, o: decide.Outcome, proof: Proof | None = None,
             **more: object) -> None: ...  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Forms, cells, the walk


@dataclass
class Form:
    """A change as the walk carries it: its files, its tests, and those files before and after
    it at the release it was last carried to (``at``; blob keys, None: absent)."""

    files: list[str]
    tests: list[str]
    at: str
    before: dict[str, str | None]
    after: dict[str, str | None]


@dataclass(frozen=True)
class Cell:
    """One verdict: a change at a release. Fields past ``stop`` say what the verdict needs
    said, and are left at their defaults (and out of the saved walk) otherwise."""

    release: str
    id: str
    state: State
    reason: str
    stop: bool = False  # the person is asked here; ``state``: what the walk met
    proof: str | None = None  # dropped: the proof's words
    records: list[str] = field(default_factory=list)  # the resolution records used or made
    unproven_records: list[str] = field(default_factory=list)  # record: made unproven
    unproven: dict | None = None  # resolved with --unproven: who, why, the tests that failed
    renamed: dict[str, str] = field(default_factory=dict)  # resolved: the person's renames
    met: str | None = None  # waiting: the state it met here (conflict, moved, collision)
    test_run: dict | None = None  # tests-failed: the proof that failed
    # A stop at a conflict, moved or collision: what the checkout shows the person.
    files: list[str] = field(default_factory=list)
    problems: dict[str, str] = field(default_factory=dict)  # path -> "kind: detail"
    hunks: dict[str, str] = field(default_factory=dict)
    candidates: dict[str, list] = field(default_factory=dict)  # path -> [(path, similarity)]
    conflicted: dict[str, str | None] = field(default_factory=dict)  # blob keys
    merged: dict[str, str | None] = field(default_factory=dict)  # blob keys
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ValueError(f"a cell's state is one of {', '.join(STATES)}, not {self.state!r}")

    def to_json(self) -> dict:
        out: dict = {}
        for f in fields(self):
            value = getattr(self, f.name)
            default = f.default_factory() if callable(f.default_factory) else f.default
            if f.name in _ALWAYS or value != default:
                out[f.name] = value
        return out

    @classmethod
    def from_json(cls, data: dict) -> Cell:
        data = dict(data)
        if data.get("state") in _OLD_STOPS:  # saved before cells were typed
            data["state"], data["stop"] = data.pop("kind"), True
        data.pop("kind", None)
        return cls(**data)


_ALWAYS = ("release", "id", "state", "reason")
_OLD_STOPS = ("stopped", "unresolved")  # the rebase's and the outlook's, beside a "kind"


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
    gone: dict[str, dict] = field(default_factory=dict)  # dropped: id -> release, reason, proof
    waiting: dict[str, str] = field(default_factory=dict)  # id -> the release that clears it
    cells: list[Cell] = field(default_factory=list)  # every verdict, in walk order
    stop: Cell | None = None  # the stop the walk stands at (the last cell)
    done: bool = False

    @property
    def target(self) -> str:
        return self.path[-1]

    @property
    def release(self) -> str:
        return self.path[self.pos]

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "pin": self.pin,
            "path": list(self.path),
            "order": list(self.order),
            "forms": {k: vars(f).copy() for k, f in self.forms.items()},
            "pos": self.pos,
            "next": self.next,
            "tree": dict(self.tree),
            "gone": {k: dict(v) for k, v in self.gone.items()},
            "waiting": dict(self.waiting),
            "cells": [c.to_json() for c in self.cells],
            "stop": self.stop.to_json() if self.stop is not None else None,
            "done": self.done,
        }

    @classmethod
    def from_json(cls, data: dict) -> Walk:
        data = dict(data)
        for old in ("unresolved", "records_used"):  # written, never read: no longer kept
            data.pop(old, None)
        data["forms"] = {k: Form(**v) for k, v in data["forms"].items()}
        data["cells"] = [Cell.from_json(c) for c in data.get("cells", [])]
        if data.get("stop") is not None:
            data["stop"] = Cell.from_json(data["stop"])
        return cls(**data)

    def stops(self) -> list[Cell]:
        """Every stop a person met or would meet (settled ones included)."""
        return [c for c in self.cells if c.stop]


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
    """The first stop of each change a person is asked about: its release, change and state
    (the outlook's walk goes on past a stop nobody settles; a later one of the same change
    depends on how the person resolves the first)."""
    first: dict[str, dict] = {}
    for c in w.stops():
        first.setdefault(c.id, {"release": c.release, "id": c.id, "state": c.state})
    return list(first.values())
