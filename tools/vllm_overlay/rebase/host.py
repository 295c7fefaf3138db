"""What the walk reads from outside: releases from their sdists, and the proofs.

Every release on a walk's path is read from its sdist (cached, checked against the index's
sha256): the touched files straight from the tarball (``rebase/sdist.py``), so a walk over
nine releases reads a few files of each. Only a proof needs a release's whole tree (a git
repository of the sdist, cached) and a test environment for it, so a walk builds one only at
the releases where something drops or a resolution record applies; ``timings`` says how long
each took.

A drop's proof runs, on the release's pristine tree, the change's own tests (our test files
placed beside upstream's) and, for a backport, ``upstream_tests``: the tests its origin pull
request added upstream. Upstream may move the API so that our copy of a test can no longer be
collected there; if upstream's own tests pass, the drop is proven, and the proof says so.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay.errors import OverlayError
from vllm_overlay.gitrepo import git, show_bytes
from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.overlay.checkout import check_consistency, plan
from vllm_overlay.overlay.model import Change, Overlay, overlay_digest
from vllm_overlay.pin.artifacts import ensure_artifact
from vllm_overlay.pin.lockfile import Lock, Upstream
from vllm_overlay.pin.trees import commit_tree, sdist_repo
from vllm_overlay.rebase import decide
from vllm_overlay.rebase.releases import Release, ensure_sdist
from vllm_overlay.rebase.sdist import MemberCache
from vllm_overlay.testing import proving
from vllm_overlay.util import info, sha256_bytes

SERIES_FORMAT = 1


@dataclass
class Series:
    """The series at the pin: where every walk starts."""

    lock: Lock
    overlay: Overlay
    steps: list[decide.Step]
    paths: list[str]
    old_names: frozenset[str]
    digest: str


def load_series(lock: Lock, overlay: Overlay, settings: Settings = DEFAULTS) -> Series:
    """Each change's files before and after it at the pin (the overlay's own ``plan`` over a
    tiny repository of the touched files, read from the pin's sdist)."""
    check_consistency(lock, overlay)
    paths = overlay.all_files()
    art = lock.sdist()
    sdist = ensure_artifact(art, settings=settings)
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
        steps.append(decide.Step(pc.change, before, after))
    digest = sha256_bytes(
        json.dumps(
            {
                "format": SERIES_FORMAT,
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
class Proof:
    """The tests that prove (or fail to prove) a step, as the report shows them."""

    ok: bool
    text: str
    runs: dict[str, dict] = field(default_factory=dict)  # "ours" / "upstream" -> TestRun json
    seconds: float = 0.0

    def to_json(self) -> dict:
        return {"ok": self.ok, "text": self.text, "runs": self.runs, "seconds": self.seconds}


class SdistHost:
    """Releases read from their sdists; proofs run on their trees (``prove=False``: none)
    with ``settings.test_python``."""

    def __init__(
        self, lock: Lock, releases: dict[str, Release], *, settings: Settings = DEFAULTS,
        prove: bool = True, work: Path | None = None,
    ) -> None:  # fmt: skip
        self.lock = lock
        self.name = lock.upstream.name
        self.releases = releases
        self.settings = settings
        self.prove = prove
        self.work = work
        self.members = MemberCache()
        self.timings: dict[str, float] = {}
        self._proved: dict[tuple[str, str], Proof] = {}  # proofs made ahead, in a batch
        self._sdists: dict[str, tuple[Path, str]] = {}
        self._names: dict[str, frozenset[str]] = {}

    # -- files -------------------------------------------------------------------------------

    def _sdist(self, version: str) -> tuple[Path, str]:
        """The release's sdist, verified once per walk (the walk asks for it at every step)."""
        if version not in self._sdists:
            self._sdists[version] = self._fetch_sdist(version)
        return self._sdists[version]

    def _fetch_sdist(self, version: str) -> tuple[Path, str]:
        if version == self.lock.upstream.version:
            art = self.lock.sdist()
            return ensure_artifact(art, settings=self.settings), art.sha256
        rel = self.releases.get(version)
        if rel is None:
            raise OverlayError(f"{self.name} {version} is not among the releases of this walk.")
        return ensure_sdist(rel, self.name, self.settings), rel.artifact(self.name).sha256

    def files(self, version: str, paths: list[str]) -> dict[str, bytes | None]:
        sdist, sha = self._sdist(version)
        return dict(self.members.get(sdist, sha, paths).files)

    def names(self, version: str) -> frozenset[str]:
        if version not in self._names:
            sdist, sha = self._sdist(version)
            self._names[version] = self.members.get(sdist, sha, []).names
        return self._names[version]

    def lock_for(self, version: str) -> Lock:
        """A lock of the release's sdist alone (what its tree is built from)."""
        if version == self.lock.upstream.version:
            return self.lock
        art = self.releases[version].artifact(self.name)
        up = Upstream(self.name, version, self.lock.upstream.git, f"v{version}", "0" * 40)
        return Lock(up, (art,))

    def tree(self, version: str) -> tuple[Path, str]:
        """(the git repository of the release's sdist, its commit)."""
        return sdist_repo(self.lock_for(version), settings=self.settings)

    # -- proofs ------------------------------------------------------------------------------

    def _scratch(self, version: str, change: Change, what: str) -> Path:
        assert self.work is not None
        d = self.work / "tests" / version / change.id / what
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        return d

    def _run(self, version: str, change: Change, what: str, tests: list[str],
             ours: dict[str, bytes], files: dict[str, bytes | None] | None = None,
             ) -> proving.TestRun:  # fmt: skip
        scratch = self._scratch(version, change, what)
        repo, base = self.tree(version)
        tree = proving.export_tree(repo, base, scratch / "tree")
        proving.write_files(tree, files or {})
        targets, notes = proving.stage_tests(tree, tests, ours)
        runner = proving.runner_for(tree, self.settings.test_python)
        res = proving.run_tests(runner, tree, targets, scratch / "work", scratch / "pytest.log")
        res.notes = notes
        if res.ok:
            shutil.rmtree(tree, ignore_errors=True)
        return res

    def prove_drops(self, version: str, items: list[tuple[Change, dict[str, bytes]]]) -> None:
        """Prove the drops of several changes at one release in one pytest run (one
        interpreter start and collection: vLLM's imports cost tens of seconds), each change's
        tests and upstream's told apart by file; ``prove_drop`` then answers from these."""
        if not self.prove:
            return
        todo = [(c, o) for c, o in items if (version, c.id) not in self._proved
                and (c.tests or c.upstream_tests)]  # fmt: skip
        if not todo:
            return
        started = time.monotonic()
        info(f"proving the drop of {', '.join(c.id for c, _ in todo)} on {self.name} {version} "
             "without them")  # fmt: skip
        scratch = self.work / "tests" / version / "drops"  # type: ignore[operator]
        shutil.rmtree(scratch, ignore_errors=True)
        repo, base = self.tree(version)
        tree = proving.export_tree(repo, base, scratch / "tree")
        groups: dict[str, list[str]] = {}
        notes: dict[str, list[str]] = {}
        names = self.names(version)
        for change, ours in todo:
            groups[f"ours {change.id}"], notes[change.id] = proving.stage_tests(
                tree, list(change.tests), ours)  # fmt: skip
            present = [t for t in change.upstream_tests if t.partition("::")[0] in names]
            groups[f"upstream {change.id}"], _ = proving.stage_tests(tree, present, {})
        groups = {k: v for k, v in groups.items() if v}
        runner = proving.runner_for(tree, self.settings.test_python)
        runs = proving.run_groups(runner, tree, groups, scratch / "work", scratch / "pytest.log")
        seconds = round(time.monotonic() - started, 1)
        self.timings[version] = self.timings.get(version, 0.0) + seconds
        where = f"{self.name} {version} without the change"
        for change, _ in todo:
            mine = {k.split(" ", 1)[0]: r for k, r in runs.items() if k.endswith(f" {change.id}")}
            if "ours" in mine:
                mine["ours"].notes = notes[change.id]
            proof = _judge(mine, list(change.tests), list(change.upstream_tests), where)
            proof.seconds = seconds
            self._proved[(version, change.id)] = proof
        if all(r.ok for r in runs.values()):
            shutil.rmtree(tree, ignore_errors=True)

    def prove_drop(self, version: str, change: Change, ours: dict[str, bytes]) -> Proof | None:
        if not self.prove:
            return None
        if change.build_only and not change.tests:
            return Proof(True, f"a build-only change, proven by {change.proof}: not compiled "
                         "here (the engine proof of `track` compiles the test build)")  # fmt: skip
        if not change.tests and not change.upstream_tests:
            return Proof(True, "not proven: the change lists no tests")
        self.prove_drops(version, [(change, ours)])
        return self._proved.pop((version, change.id))

    def prove_carried(self, version: str, change: Change, files: dict[str, bytes | None],
                      what: str = "record") -> Proof | None:  # fmt: skip
        """``what``: "record" (a resolution record applied) or "resolution" (a person's)."""
        if not self.prove:
            return None
        if change.build_only and not change.tests:
            return Proof(True, f"a build-only change, proven by {change.proof}: not compiled "
                         "here (the engine proof of `track` compiles the test build)")  # fmt: skip
        if not change.tests:
            return Proof(True, "the change lists no tests")
        started = time.monotonic()
        info(f"change {change.id}: running its tests on {self.name} {version} with the {what}")
        res = self._run(version, change, what, list(change.tests), {}, files)
        text = f"{', '.join(change.tests)}: {res.counts()} on {self.name} {version} with it"
        proof = Proof(res.ok, text, {"ours": res.to_json()})
        proof.seconds = round(time.monotonic() - started, 1)
        self.timings[version] = self.timings.get(version, 0.0) + proof.seconds
        return proof


def _judge(runs: dict[str, proving.TestRun], mine: list[str], theirs: list[str],
           where: str) -> Proof:  # fmt: skip
    """Whether the runs prove the drop, and the proof's words."""
    ours, up = runs.get("ours"), runs.get("upstream")
    parts = []
    if ours is not None:
        parts.append(f"{', '.join(mine)} passed against {where} ({ours.counts()})"
                     if ours.ok else f"{', '.join(mine)}: {ours.counts()} against {where}")  # fmt: skip
        parts += ours.notes
    if theirs and up is None:
        parts.append(f"upstream's tests {', '.join(theirs)} are not in that release")
    if up is not None:
        parts.append(f"upstream's own {', '.join(theirs)} "
                     + ("passed" if up.ok else "did not pass") + f" ({up.counts()})")  # fmt: skip
    uncollectable = ours is not None and not ours.ok and _unreachable(ours)
    if ours is not None and ours.ok:
        ok = up is None or up.ok
    elif uncollectable and up is not None and up.ok:
        ok = True
        parts.append("our copy of the test can no longer be collected there, or reach the "
                     "code (upstream moved the API it imports); upstream's own tests prove the "
                     "drop")  # fmt: skip
    else:
        ok = ours is None and up is not None and up.ok
    runs_json = {k: v.to_json() for k, v in runs.items()}
    return Proof(bool(ok), "; ".join(parts), runs_json)


def _unreachable(run: proving.TestRun) -> bool:
    """Our tests cannot reach the code there: they error at collection, or fail only on an
    import (upstream moved or renamed what they import)."""
    if run.passed:
        return False
    if run.errors and not run.failed:
        return True
    return any(e in run.first_error for e in ("ImportError", "ModuleNotFoundError"))
