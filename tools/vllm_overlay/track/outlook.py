"""The outlook: the walk (``rebase/releasewalk.py``) of the series over every newer release,
without a checkout, as a matrix.

The same walk as ``rebase`` makes, on the releases' sdists (cached, checked against the
index's sha256; only the touched files are read), with two differences: it writes nothing
(not upstream.lock, not overlay/, not the checkout), and a stop is noted and passed by (the
change is tried again at the next release, in the form it had). Each cell is the walk's
verdict for a change at a release. Resolution records in overlay/ and in ``.work/`` apply as
in the rebase ("record"); a conflict a later release clears is "waiting".

It also walks to each release as a target, and straight to it (``--direct``), and counts the
stops a person would be asked about in each: the table ``targets``. The walks are cached per
(series, path, records) under ``<cache>/outlook/results/`` (content-keyed, written by rename).

``tests=True`` runs the proofs as the rebase runs them: at each release where a change drops,
its tests (and upstream's own tests of a backport) on the pristine tree; for a record, the
change's tests with it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import Version

from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.overlay.model import Change
from vllm_overlay.overlay.project import Project
from vllm_overlay.overlay.standing import NOT_YET
from vllm_overlay.rebase import decide, lookahead, records, releasewalk, replay, settle, walkdata
from vllm_overlay.rebase.host import SdistHost, Series, load_series
from vllm_overlay.rebase.releases import list_releases, newer_releases
from vllm_overlay.util import atomic_write_text, cache_dir, info, sha256_bytes

FORMAT = 2  # 2: the walk
GONE = "gone"  # dropped at an earlier release
CLEAN = (*decide.CLEAN, walkdata.RECORD, walkdata.WAITING, GONE)


@dataclass
class Column:
    """One release of the outlook."""

    version: str
    sdist: dict
    outcomes: list[dict]
    tests: dict[str, dict] | None = None
    from_cache: bool = False

    @property
    def clean(self) -> bool:
        if any(o["state"] not in CLEAN for o in self.outcomes):
            return False
        return self.tests is None or all(t.get("ok", True) for t in self.tests.values())

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "sdist": self.sdist,
            "clean": self.clean,
            "outcomes": self.outcomes,
            "tests": self.tests,
        }


@dataclass
class Outlook:
    name: str
    pin: str
    changes: list[dict]
    columns: list[Column]
    skipped: list[str] = field(default_factory=list)
    targets: list[dict] = field(default_factory=list)  # per target: the walk's and jump's stops

    @property
    def safe_target(self) -> str | None:
        """The newest release the walk reaches without asking a person (None: none)."""
        clean = [t["version"] for t in self.targets if not t["walk"]]
        if self.columns and any(c.tests is not None for c in self.columns):
            ok = {c.version for c in self.columns if c.clean}
            clean = [v for v in clean if v in ok]
        return clean[-1] if clean else None

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "name": self.name,
            "pin": self.pin,
            "changes": self.changes,
            "releases": [c.to_json() for c in self.columns],
            "skipped": self.skipped,
            "targets": self.targets,
            "safe_target": self.safe_target,
        }


def _code_digest() -> str:
    """The walk's own code: a cached walk is reused only by the code that made it."""
    h = hashlib.sha256()
    for mod in (decide, records, walkdata, releasewalk, replay, lookahead, settle):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()


def _results_dir() -> Path:
    return cache_dir() / "outlook" / "results"


def _walk(series: Series, host: SdistHost, path: list[str], found: dict, key_base: str,
          *, prove: bool, memo: dict | None = None, report: bool = False) -> dict:  # fmt: skip
    """The walk along ``path`` (cached): its cells, drops and stops. ``report``: say each
    release and verdict on stderr as the walk decides it (a cached walk says nothing)."""
    shas = [(v, host.releases[v].artifact(host.name).sha256) for v in path]
    key = sha256_bytes(json.dumps([key_base, shas, prove]).encode())
    cached = _results_dir() / f"{key}.json"
    if cached.is_file():
        data = json.loads(cached.read_text())
        data["from_cache"] = True
        return data
    blobs = walkdata.Blobs()
    w = walkdata.start(host.name, series.lock.upstream.version, path, series.steps, blobs)
    changes = {s.change.id: s.change for s in series.steps}
    releasewalk.Walker(w, blobs, host, changes, found, stop_at_conflicts=False,
                       memo=None if prove else memo, report=info if report else None).run()  # fmt: skip
    data = {"path": path, "cells": [c.to_json() for c in w.cells], "gone": w.gone,
            "stops": walkdata.person_stops(w)}  # fmt: skip
    atomic_write_text(cached, json.dumps(data, indent=1, sort_keys=True) + "\n")
    return data


def outlook(
    project: Project,
    *,
    settings: Settings = DEFAULTS,
    to: str | None = None,
    releases: list[str] | None = None,
    tests: bool = False,
    progress: bool = True,
) -> Outlook:
    """The outlook of the project's series over the releases asked for. ``progress``: the
    walk over every release says each release and verdict on stderr as it decides it (the
    walks to each target and the direct jumps, which repeat its decisions, stay quiet)."""
    lock, overlay = project.lock(), project.overlay()
    series = load_series(lock, overlay, settings)
    name, pin = lock.upstream.name, lock.upstream.version
    chosen, skipped = newer_releases(name, pin, settings, to=to, only=releases)
    found = records.load(*records.stores(project).values())
    digest = hashlib.sha256()
    for k in sorted(found):
        digest.update(found[k].to_json().encode())
    key_base = json.dumps([FORMAT, _code_digest(), series.digest, digest.hexdigest(),
                           (tests and settings.test_python) or ""])  # fmt: skip
    host = SdistHost(lock, {r.version: r for r in chosen}, settings=settings, prove=tests,
                     work=cache_dir() / "outlook" / "runs")  # fmt: skip
    path = [r.version for r in chosen]
    columns: list[Column] = []
    targets: list[dict] = []
    memo0: dict = {}
    if path:
        main = _walk(series, host, path, found, key_base, prove=tests, memo=memo0,
                     report=progress)  # fmt: skip
        columns = _columns(series, host, main)
        cheap = SdistHost(lock, host.releases, settings=settings, prove=False)
        memo = memo0  # the walks to each target share most of their decisions
        for i, v in enumerate(path):
            walked = main if i == len(path) - 1 and not tests else _walk(
                series, cheap, path[: i + 1], found, key_base, prove=False, memo=memo)  # fmt: skip
            direct = _walk(series, cheap, [v], found, key_base, prove=False, memo=memo)
            targets.append({"version": v, "walk": walked["stops"], "direct": direct["stops"]})
    known = sorted(list_releases(name, settings), key=Version)
    changes = [
        {"id": s.change.id, "title": s.change.title, "drop_when": s.change.drop_when,
         "drop_condition": s.change.drop_condition,
         "tests": list(s.change.tests),
         "upstream_tests": list(s.change.upstream_tests),
         **standing(s.change, columns, known)}
        for s in series.steps
    ]  # fmt: skip
    return Outlook(name, pin, changes, columns, skipped, targets)


def standing(change: Change, columns: list[Column], known: list[str]) -> dict:
    """Where ``change`` stands upstream, and the releases it is carried on: from its
    ``since`` to the newest release known, up to (not including) where the walk drops it.
    A change of ours not yet sent is flagged."""
    dropped_at = next((c.version for c in columns for o in c.outcomes
                       if o["id"] == change.id and o["state"] == decide.DROPPED), None)  # fmt: skip
    carried: list[str] = []
    if change.since:
        carried = [v for v in known if Version(v) >= Version(change.since)
                   and (dropped_at is None or Version(v) < Version(dropped_at))]  # fmt: skip
    return {
        "origin_kind": change.origin_kind,
        "forwarded": change.forwarded.to_json(),
        "security": change.security,
        "since": change.since,
        "carried": carried,
        "flag": change.ours and change.forwarded.state == NOT_YET,
    }


def _columns(series: Series, host: SdistHost, main: dict) -> list[Column]:
    cols = []
    gone_at: dict[str, str] = {}
    for v in main["path"]:
        outcomes, tests = [], {}
        for s in series.steps:
            cid = s.change.id
            cells = [c for c in main["cells"] if c["id"] == cid and c["release"] == v]
            if not cells:
                outcomes.append({"id": cid, "state": GONE, "reason": f"dropped at {gone_at[cid]}",
                                 "files": [], "hunks": {}, "candidates": {}, "notes": []})  # fmt: skip
                continue
            c = cells[-1]
            state = c["state"]  # a stop's: what the walk met there
            if state == decide.DROPPED:
                gone_at[cid] = v
            outcomes.append({"id": cid, "state": state, "reason": c["reason"],
                             "files": c.get("files", []), "hunks": c.get("hunks", {}),
                             "candidates": c.get("candidates", {}), "notes": [],
                             "proof": c.get("proof", ""),
                             "unproven": c.get("unproven_records", [])})  # fmt: skip
            proof = c.get("test_run")
            if c.get("proof") and "not proven here" not in c["proof"]:
                tests[cid] = {"ran": True, "ok": True, "on": "the pristine tree",
                              "summary": c["proof"], "counts": c["proof"]}  # fmt: skip
            elif proof:
                tests[cid] = {"ran": True, "ok": False, "on": "the pristine tree",
                              "summary": proof.get("text", ""), "counts": proof.get("text", "")}  # fmt: skip
        rel = host.releases[v].artifact(host.name)
        cols.append(Column(v, {"filename": rel.filename, "sha256": rel.sha256}, outcomes,
                           tests or None, bool(main.get("from_cache"))))  # fmt: skip
    return cols
