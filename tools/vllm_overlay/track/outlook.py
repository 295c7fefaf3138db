"""The outlook: every change of the series against every newer release, without a checkout.

For each release: its sdist (cached, checked against the index's sha256), the touched files
read straight from the tarball (``track/sdist.py``), and the classifier (``track/classify.py``)
in series order. The series at the pin comes from the overlay's own ``plan`` run over a tiny
git repository holding only the touched files, so the outlook follows the overlay's storage
whatever it is. Results are cached per (series digest, release) under
``<cache>/outlook/results/`` (content-keyed, written by rename). Nothing in the project is
written: not upstream.lock, not overlay/, not the checkout.

``tests=True`` also runs each change's tests on the release: on the patched tree (the release
plus every change that merges), or, for a change that would be dropped, on the pristine tree
with our test files placed beside upstream's (the proof a rebase asks for).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay.gitrepo import git, show_bytes
from vllm_overlay.overlay.checkout import check_consistency, plan
from vllm_overlay.overlay.model import Overlay, overlay_digest
from vllm_overlay.overlay.project import Project
from vllm_overlay.pin.artifacts import ensure_artifact
from vllm_overlay.pin.lockfile import Lock, Upstream
from vllm_overlay.pin.trees import commit_tree, sdist_repo
from vllm_overlay.rebase.releases import Release, ensure_sdist, newer_releases
from vllm_overlay.testing import proving
from vllm_overlay.track import classify
from vllm_overlay.track.sdist import MemberCache
from vllm_overlay.util import atomic_write_text, cache_dir, sha256_bytes

FORMAT = 1
WORKERS = 4


@dataclass
class Series:
    """The series at the pin, as the outlook needs it."""

    lock: Lock
    overlay: Overlay
    steps: list[classify.Step]
    paths: list[str]
    old_names: frozenset[str]
    digest: str


def load_series(project: Project, index_url: str | None = None) -> Series:
    lock, overlay = project.lock(), project.overlay()
    check_consistency(lock, overlay)
    paths = overlay.all_files()
    art = lock.sdist()
    sdist = ensure_artifact(art, index_url=index_url)
    pin = MemberCache().get(sdist, art.sha256, paths)
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-series-") as tmp:
        # A tiny repository of the touched files at the pin: the overlay's own plan reads them.
        work, repo = Path(tmp) / "w", Path(tmp) / "r.git"
        work.mkdir()
        git("init", "-q", "--bare", str(repo))
        for p, data in pin.files.items():
            if data is not None:
                (work / p).parent.mkdir(parents=True, exist_ok=True)
                (work / p).write_bytes(data)
        base = commit_tree(work, repo, "touched files at the pin")
        planned = plan(lock, overlay, repo, base)
        state = {p: show_bytes(repo, base, p) for p in paths}
    steps = []
    for pc in planned:
        before = {p: state[p] for p in pc.change.files}
        after = {p: pc.files.get(p, state[p]) for p in pc.change.files}
        state.update(after)
        steps.append(classify.Step(pc.change, before, after))
    digest = sha256_bytes(
        json.dumps(
            {
                "format": FORMAT,
                "overlay": overlay_digest(overlay.dir),
                "pin": art.sha256,
                "base": lock.base,
                "name": lock.upstream.name,
                "version": lock.upstream.version,
            },
            sort_keys=True,
        ).encode()
    )
    return Series(lock, overlay, steps, paths, pin.names, digest)


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
        if any(o["state"] not in classify.CLEAN for o in self.outcomes):
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

    @property
    def safe_target(self) -> str | None:
        """The newest release every change reaches cleanly (None: none does)."""
        clean = [c.version for c in self.columns if c.clean]
        return clean[-1] if clean else None

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "name": self.name,
            "pin": self.pin,
            "changes": self.changes,
            "releases": [c.to_json() for c in self.columns],
            "skipped": self.skipped,
            "safe_target": self.safe_target,
        }


def _results_dir() -> Path:
    return cache_dir() / "outlook" / "results"


def outlook(
    project: Project,
    *,
    index_url: str | None = None,
    to: str | None = None,
    releases: list[str] | None = None,
    tests: bool = False,
    test_python: str | None = None,
) -> Outlook:
    """The outlook of the project's series over the releases asked for."""
    series = load_series(project, index_url)
    name, pin = series.lock.upstream.name, series.lock.upstream.version
    chosen, skipped = newer_releases(name, pin, index_url, to=to, only=releases)
    members = MemberCache()

    def one(rel: Release) -> Column:
        art = rel.artifact(name)
        key = sha256_bytes(f"{series.digest}\0{art.sha256}\0{rel.version}".encode())
        cached = _results_dir() / f"{key}.json"
        col = None
        if cached.is_file():
            data = json.loads(cached.read_text())
            col = Column(rel.version, data["sdist"], data["outcomes"], data.get("tests"), True)
        if col is None:
            sdist = ensure_sdist(rel, name)
            found = members.get(sdist, art.sha256, series.paths)
            outcomes = classify.classify_release(
                series.steps,
                name=name,
                old_version=pin,
                version=rel.version,
                new_files=found.files,
                old_names=series.old_names,
                new_names=found.names,
                read_new=lambda paths: members.get(sdist, art.sha256, paths).files,
            )
            col = Column(
                rel.version,
                {"filename": art.filename, "sha256": art.sha256},
                [o.to_json() for o in outcomes],
            )
            atomic_write_text(cached, json.dumps(col.to_json(), indent=1, sort_keys=True) + "\n")
        return col

    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        columns = list(pool.map(one, chosen))
    if tests:
        for rel, col in zip(chosen, columns, strict=True):
            col.tests = _tests_for(series, rel, col, name, test_python)
    changes = [
        {"id": s.change.id, "title": s.change.title, "drop_when": s.change.drop_when,
         "drop_condition": s.change.drop_condition,
         "tests": list(s.change.tests)}
        for s in series.steps
    ]  # fmt: skip
    return Outlook(name, pin, changes, columns, skipped)


# ---------------------------------------------------------------------------------------------
# --tests


def _tests_for(
    series: Series, rel: Release, col: Column, name: str, test_python: str | None
) -> dict[str, dict]:
    """Each change's tests on the release (cached with the column, per runner)."""
    art = rel.artifact(name)
    key = sha256_bytes(
        f"{series.digest}\0{art.sha256}\0{rel.version}\0tests\0{test_python or ''}".encode()
    )
    cached = _results_dir() / f"{key}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    lock = Lock(Upstream(name, rel.version, series.lock.upstream.git, f"v{rel.version}",
                         "0" * 40), (art,))  # fmt: skip
    repo, base = sdist_repo(lock)
    runs_dir = cache_dir() / "outlook" / "runs" / key
    shutil.rmtree(runs_dir, ignore_errors=True)
    outcomes = {o["id"]: o for o in col.outcomes}
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-outlook-tests-") as tmp:
        patched = _patched_tree(series, repo, base, outcomes, Path(tmp) / "patched")
        for step in series.steps:
            change, state = step.change, outcomes[step.change.id]["state"]
            if not change.tests:
                out[change.id] = {"ran": False, "ok": True, "why": "the change lists no tests"}
                continue
            if state not in classify.CLEAN:
                out[change.id] = {"ran": False, "ok": True,
                                  "why": f"not run: the change does not apply ({state})"}  # fmt: skip
                continue
            if state == classify.DROPPED:
                tree = proving.export_tree(repo, base, Path(tmp) / f"pristine-{change.id}")
                ours = {
                    p: data
                    for p in (t.partition("::")[0] for t in change.tests)
                    if p in change.files and (data := step.after.get(p)) is not None
                }
                where = "the pristine tree (the change would be dropped)"
            else:
                tree, ours, where = patched, {}, "the patched tree"
            targets, notes = proving.stage_tests(tree, change.tests, ours)
            runner = proving.runner_for(tree, test_python)
            log = runs_dir / f"{change.id}.log"
            res = proving.run_tests(runner, tree, targets, Path(tmp) / f"work-{change.id}", log)
            text = log.read_text(errors="replace").splitlines()
            out[change.id] = {
                "ran": True,
                "ok": res.ok,
                "on": where,
                "summary": res.summary,
                "counts": res.counts(),
                "first_error": res.first_error,
                "notes": notes,
                "log": str(log),
                "log_tail": "\n".join(text[-80:]),
            }
    atomic_write_text(cached, json.dumps(out, indent=1, sort_keys=True) + "\n")
    return out


def _patched_tree(
    series: Series, repo: Path, base: str, outcomes: dict[str, dict], dest: Path
) -> Path:
    """The release plus every change that merges, in series order (recomputed: the cached
    column keeps no file contents)."""
    tree = proving.export_tree(repo, base, dest)
    state = {p: show_bytes(repo, base, p) for p in series.paths}
    for step in series.steps:
        if outcomes[step.change.id]["state"] not in (classify.KEPT, classify.REFRESHED):
            continue
        with tempfile.TemporaryDirectory(prefix="vllm-overlay-merge-") as tmp:
            scratch = classify.Scratch(Path(tmp))
            for p in step.change.files:
                before, after, new = step.before.get(p), step.after.get(p), state.get(p)
                if before is None or after is None or new is None:
                    state[p] = after
                else:
                    state[p], _ = scratch.merge(new, before, after, ("new", "old", "ours"))
    for p, data in state.items():
        target = tree / p
        if data is None:
            target.unlink(missing_ok=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    return tree
