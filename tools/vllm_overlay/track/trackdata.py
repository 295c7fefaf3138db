"""The tracking run's report as typed data, and its JSON (``track-report.json``).

``to_json`` writes the keys a report has always had, each present where it was before;
``from_json`` reads a saved report back, tolerant of one an older version wrote (a key it
lacks takes its default). The rebase's own report is ``rebase.reportdata``'s."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm_overlay.rebase.reportdata import Failed, RebaseReport, outcome_from_json

UP_TO_DATE, READY, NEEDS_PERSON = "up-to-date", "ready", "needs-person"


@dataclass(frozen=True)
class ChangeRun:
    """One carried change's own tests at the target."""

    ok: bool
    counts: str
    first_error: str = ""
    failing: tuple[str, ...] = ()

    def to_json(self) -> dict:
        return {"ok": self.ok, "counts": self.counts, "first_error": self.first_error,
                "failing": list(self.failing)}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> ChangeRun:
        return cls(d["ok"], d.get("counts", ""), d.get("first_error") or "",
                   tuple(d.get("failing", [])))  # fmt: skip


@dataclass(frozen=True)
class ChangesProof:
    """The carried changes' own tests at the target (``track/changes.py``), or why they
    could not run (``error``)."""

    ok: bool
    seconds: float = 0.0
    changes: dict[str, ChangeRun] = field(default_factory=dict)
    untested: tuple[str, ...] = ()
    log: str | None = None
    error: str | None = None

    def to_json(self) -> dict:
        if self.error is not None:
            return {"ok": self.ok, "error": self.error}
        out = {"ok": self.ok, "seconds": self.seconds, "untested": list(self.untested),
               "changes": {k: v.to_json() for k, v in self.changes.items()}}  # fmt: skip
        return out | ({"log": self.log} if self.log is not None else {})

    @classmethod
    def from_json(cls, d: dict) -> ChangesProof:
        runs = {k: ChangeRun.from_json(v) for k, v in d.get("changes", {}).items()}
        return cls(d["ok"], d.get("seconds", 0.0), runs, tuple(d.get("untested", [])),
                   d.get("log"), d.get("error"))  # fmt: skip


@dataclass(frozen=True)
class SuiteProof:
    """vLLM's kv_connector suite on the rebased tree: its comparison's text and JSON, or why
    it could not run."""

    ok: bool
    text: str = ""
    json: dict | None = None
    error: str | None = None

    def to_json(self) -> dict:
        if self.error is not None:
            return {"ok": self.ok, "error": self.error}
        return {"ok": self.ok, "text": self.text, "json": self.json}

    @classmethod
    def from_json(cls, d: dict) -> SuiteProof:
        return cls(d["ok"], d.get("text", ""), d.get("json"), d.get("error"))


@dataclass(frozen=True)
class Wheel:
    name: str
    up_to_date: bool

    def to_json(self) -> dict:
        return {"name": self.name, "up_to_date": self.up_to_date}


@dataclass(frozen=True)
class EngineBuild:
    """The test build of the source-built variants at the target: its wheels, or its error."""

    ok: bool
    seconds: float
    wheels: tuple[Wheel, ...] = ()
    error: str | None = None

    def to_json(self) -> dict:
        if not self.ok:
            return {"ok": False, "seconds": self.seconds, "error": self.error}
        return {"ok": True, "seconds": self.seconds, "wheels": [w.to_json() for w in self.wheels]}

    @classmethod
    def from_json(cls, d: dict) -> EngineBuild:
        wheels = tuple(Wheel(w["name"], w.get("up_to_date", False)) for w in d.get("wheels", []))
        return cls(bool(d.get("ok")), d.get("seconds", 0.0), wheels, d.get("error"))


@dataclass(frozen=True)
class EngineTests:
    """The copy's engine tests at the target, or why they did not run (``error``)."""

    ok: bool
    seconds: float = 0.0
    returncode: int | None = None
    summary: str = ""
    log: str = ""
    tail: str = ""
    error: str | None = None

    def to_json(self) -> dict:
        if self.error is not None:
            return {"ok": self.ok, "error": self.error}
        return {"ok": self.ok, "returncode": self.returncode, "seconds": self.seconds,
                "summary": self.summary, "log": self.log, "tail": self.tail}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict) -> EngineTests:
        return cls(d["ok"], d.get("seconds", 0.0), d.get("returncode"), d.get("summary") or "",
                   d.get("log", ""), d.get("tail") or "", d.get("error"))  # fmt: skip


@dataclass(frozen=True)
class EngineProof:
    """The engine proof (``track/engine.py``): the test build, then the engine tests."""

    ok: bool
    source_builds: str
    build: EngineBuild
    tests: EngineTests | None = None

    def to_json(self) -> dict:
        out = {"ok": self.ok, "source_builds": self.source_builds, "build": self.build.to_json()}
        return out | ({"tests": self.tests.to_json()} if self.tests is not None else {})

    @classmethod
    def from_json(cls, d: dict) -> EngineProof:
        t = d.get("tests")
        return cls(d["ok"], d.get("source_builds", "none"),
                   EngineBuild.from_json(d.get("build") or {}),
                   None if t is None else EngineTests.from_json(t))  # fmt: skip


@dataclass
class TrackReport:
    """A tracking run's report, filled in as the run goes (hence not frozen): the target,
    the copy, the rebase's outcome, the proofs after it, and the verdict (``status``)."""

    name: str
    from_: str
    to: str
    notes: list[str] = field(default_factory=list)
    status: str = ""
    message: str | None = None  # up to date: nothing to do
    branch: str | None = None
    worktree: str | None = None
    base_commit: str | None = None
    uncommitted: list[str] = field(default_factory=list)
    rebase: RebaseReport | Failed | None = None
    walked_to: str | None = None  # a stop: the release the branch carries the walk to
    commit: str | None = None
    changes: ChangesProof | None = None
    suite: SuiteProof | None = None
    engine: EngineProof | None = None
    files: dict[str, str] | None = None  # where it was written (md, json); not in the file

    @property
    def stopped(self) -> RebaseReport | None:
        """The rebase's report when it stopped at a change or before the pin."""
        r = self.rebase
        return r if isinstance(r, RebaseReport) and r.stopped_at is not None else None

    @property
    def hunks(self) -> dict[str, str]:
        """The conflict regions of the stop, per file."""
        r = self.stopped
        return dict(r.stopped_at.hunks) if r is not None and r.stopped_at else {}

    def proofs_ok(self) -> bool:
        return all(p is None or p.ok for p in (self.changes, self.suite, self.engine))

    def to_json(self) -> dict:
        out: dict = {"from": self.from_, "to": self.to, "name": self.name,
                     "notes": list(self.notes), "status": self.status}  # fmt: skip
        if self.message is not None:
            out["message"] = self.message
        if self.branch is not None:
            out |= {"branch": self.branch, "worktree": self.worktree,
                    "base_commit": self.base_commit, "uncommitted": list(self.uncommitted)}  # fmt: skip
        if self.rebase is not None:
            out["rebase"] = self.rebase.to_json()
        if self.stopped is not None:
            out |= {"hunks": self.hunks, "walked_to": self.walked_to}
        for key in ("commit", "changes", "suite", "engine"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value if isinstance(value, str) else value.to_json()
        if self.files is not None:
            out["report"] = dict(self.files)
        return out

    @classmethod
    def from_json(cls, d: dict) -> TrackReport:
        def part(key: str, kind):  # noqa: ANN001, ANN202
            return None if d.get(key) is None else kind.from_json(d[key])

        rebase = d.get("rebase")
        return cls(
            d["name"], d["from"], d["to"], list(d.get("notes", [])), d.get("status", ""),
            d.get("message"), d.get("branch"), d.get("worktree"), d.get("base_commit"),
            list(d.get("uncommitted", [])),
            None if rebase is None else outcome_from_json(rebase),  # type: ignore[arg-type]
            d.get("walked_to"), d.get("commit"), part("changes", ChangesProof),
            part("suite", SuiteProof), part("engine", EngineProof), d.get("report"),
        )  # fmt: skip
