"""The tracking run: prepare the move to the newest release for review, in a copy.

1. The target: the newest usable final release on the index (or ``--to``); if the pin is
   already there, nothing to do.
2. A copy of the project (``track/worktrees.py``): a git worktree of the project's repository
   on branch ``track/vllm-<version>`` at ``.work/track/vllm-<version>`` (made from HEAD; never
   the person's checkout or branch). A leftover of an interrupted run is removed first, so
   every run starts clean.
3. ``rebase`` in the copy (the walk, release by release, with proofs for dropped changes
   and the previous branch's resolution records). When it completes, every carried change's
   own tests on the rebased tree (``track/changes.py``: the walk proves what it drops and
   resolves, not what merged cleanly), optionally vLLM's suite on it, and the rebased
   upstream.lock and overlay/ are committed on the branch; when it stops, the walk up to
   the stop is (``_walk_up_to_the_stop``).
4. Where the rebased lock pins vllm-cpu as built from source (the target has no official
   CPU wheel), the engine proof (``track/engine.py``): the wheel compiled in the copy (timed),
   then the copy's engine tests at the target; "ready" then means proven in the engine.
5. ``track-report.md`` (a pull-request body) and ``track-report.json``.

One tracking run per project at a time (a lock under ``.work/``); a second one is refused
with a message saying so.
"""

from __future__ import annotations

from pathlib import Path

from packaging.version import Version

from vllm_overlay import rebase
from vllm_overlay.errors import OverlayError
from vllm_overlay.gitrepo import git, rev_parse, show_bytes
from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.overlay.project import Project
from vllm_overlay.rebase import records
from vllm_overlay.rebase.releases import newer_releases, newest_release
from vllm_overlay.rebase.reportdata import Failed, RebaseReport
from vllm_overlay.track import changes as track_changes
from vllm_overlay.track import engine as track_engine
from vllm_overlay.track import report as track_report
from vllm_overlay.track import worktrees
from vllm_overlay.track.trackdata import (
    NEEDS_PERSON,
    READY,
    UP_TO_DATE,
    ChangesProof,
    SuiteProof,
    TrackReport,
)
from vllm_overlay.util import atomic_write_bytes, exclusive_lock, info

EXIT = {UP_TO_DATE: 0, READY: 0, NEEDS_PERSON: 1}


def track(
    project: Project,
    *,
    to: str | None = None,
    settings: Settings = DEFAULTS,
    suite: bool = False,
    report_dir: Path | None = None,
    engine: str = "auto",
    max_jobs: int | None = None,
    build_python: str | None = None,
) -> TrackReport:
    """Run the tracking job; returns the report (also written as md + json)."""
    report_dir = report_dir or project.work_dir / "track"
    # A second tracking run does not queue behind the first (minutes of rebase and tests):
    # it fails at once, and the scheduler's next run starts clean.
    with exclusive_lock(
        project.work_dir / "track.lock", f"the tracking run of {project.root}", timeout=0
    ):
        lock = project.lock()
        name, pinned = lock.upstream.name, lock.upstream.version
        if to:
            rel = newer_releases(name, pinned, settings, only=[to])[0][0]
            notes: list[str] = []
        else:
            rel, notes = newest_release(name, settings)
        rep = TrackReport(name, pinned, rel.version, notes)
        if rel.version == pinned:
            rep.status, rep.message = UP_TO_DATE, f"upstream.lock already pins {name} {pinned}."
            track_report.write(rep, report_dir)
            return rep
        copy = _copy(project, rel.version, rep)
        checkout = copy.project.default_checkout
        try:
            result = rebase.start(copy.project, rel.version, settings=settings, checkout=checkout)
        except OverlayError as e:
            rep.status, rep.rebase = NEEDS_PERSON, Failed(str(e))
            track_report.write(rep, report_dir)
            return rep
        assert isinstance(result, RebaseReport)  # the target is not the pin
        rep.rebase = result
        if result.stopped_at is not None:
            rep.status = NEEDS_PERSON
            rep.walked_to = _walk_up_to_the_stop(copy, result, settings)
            git("commit", "-q", "--no-verify", "--allow-empty", "-m", _stop_message(rep),
                cwd=copy.worktree)  # fmt: skip
            rep.commit = rev_parse(copy.worktree, "HEAD")
            track_report.write(rep, report_dir)
            return rep
        try:
            rep.changes = track_changes.prove(copy.project, checkout, settings=settings)
        except OverlayError as e:
            rep.changes = ChangesProof(ok=False, error=str(e))
        if suite:
            rep.suite = _suite(copy.project, settings)
        git("add", "-A", "--", str(copy.project.lock_path), str(copy.project.overlay_dir),
            cwd=copy.worktree)  # fmt: skip
        git("commit", "-q", "--no-verify", "-m", _message(result), cwd=copy.worktree)
        rep.commit = rev_parse(copy.worktree, "HEAD")
        if engine == "always" or (
            engine == "auto" and track_engine.pins_a_source_build(copy.project)
        ):
            rep.engine = track_engine.prove(copy.project, settings=settings,
                                            max_jobs=max_jobs, build_python=build_python)  # fmt: skip
        rep.status = READY if rep.proofs_ok() else NEEDS_PERSON
        track_report.write(rep, report_dir)
        return rep


def _copy(project: Project, version: str, rep: TrackReport) -> worktrees.Copy:
    """The copy to rebase (``track/worktrees.py``), with the resolution records of the previous
    run's branch (read before the copy moves that branch); ``rep`` says where it is."""
    earlier = _records_of_branch(project, f"track/vllm-{version}")
    copy = worktrees.make_copy(project, version)
    _add_records(copy.project, earlier)
    rep.branch, rep.worktree = copy.branch, str(copy.worktree)
    rep.base_commit = rev_parse(copy.worktree, "HEAD")
    rep.uncommitted = worktrees.uncommitted(project, copy.repo_root)
    info(f"tracking {rep.name} {rep.from_} -> {version} in {copy.worktree} ({copy.branch})")
    return copy


def _walk_up_to_the_stop(copy: worktrees.Copy, result: RebaseReport,
                         settings: Settings) -> str | None:  # fmt: skip
    """Move the copy to the newest release before the stop that the walk reaches without a
    person (the outlook's count of stops for that target is 0), and stage it: the branch
    then starts the person from there. Returns that release (None: there is none, or the
    walk there stopped after all, e.g. on a proof)."""
    from vllm_overlay.track.outlook import outlook

    stop = result.stopped_at
    rebase.abort(copy.project)
    if stop is None or not stop.release:
        return None
    look = outlook(copy.project, settings=settings, to=stop.release, progress=False)
    clear = [t["version"] for t in look.targets
             if not t["walk"] and Version(t["version"]) < Version(stop.release)]  # fmt: skip
    if not clear:
        return None
    before = clear[-1]
    info(f"moving the branch to {before}, the newest release before the stop that the walk "
         "reaches without a person")  # fmt: skip
    try:
        got = rebase.start(copy.project, before, settings=settings,
                           checkout=copy.project.default_checkout)  # fmt: skip
    except OverlayError as e:
        info(f"the walk to {before} did not complete ({e}); the branch stays at the pin")
        return None
    if got.status != "complete":
        rebase.abort(copy.project)
        return None
    git("add", "-A", "--", str(copy.project.lock_path), str(copy.project.overlay_dir),
        cwd=copy.worktree)  # fmt: skip
    return before


def _stop_message(rep: TrackReport) -> str:
    stop = rep.stopped.stopped_at if rep.stopped else None
    where = rep.walked_to or rep.from_
    lines = [f"Track {rep.name} {rep.to}: the walk up to the stop ({where})", ""]
    if stop:
        lines.append(f"Stopped at change {stop.id} on {stop.release} "
                     f"({stop.state}); see the pull request for what to do.")  # fmt: skip
    return "\n".join(lines) + "\n"


def _records_of_branch(project: Project, branch: str) -> dict[str, bytes]:
    """The resolution records on an earlier run's branch (local, or fetched from origin)."""
    root = worktrees.repo_root(project)
    rel = project.overlay_dir.resolve().relative_to(root.resolve()) / records.DIR
    for ref in (f"refs/heads/{branch}", f"refs/remotes/origin/{branch}"):
        if rev_parse(root, ref) is None:
            continue
        out = git("ls-tree", "-r", "--name-only", ref, "--", rel.as_posix(), cwd=root, check=False)
        found = {}
        for name in out.stdout.splitlines():
            data = show_bytes(root, ref, name)
            if data is not None:
                found[Path(name).relative_to(rel).as_posix()] = data
        return found
    return {}


def _add_records(project: Project, found: dict[str, bytes]) -> None:
    """Put an earlier run's records into the copy's overlay (a resolution a person made on
    the branch is not asked again)."""
    for rel, data in found.items():
        target = project.overlay_dir / records.DIR / rel
        if not target.exists():
            atomic_write_bytes(target, data)
    if found:
        info(f"read {len(found)} resolution record(s) from the previous tracking branch")


def _suite(project: Project, settings: Settings) -> SuiteProof:
    from vllm_overlay.testing import suite

    info("running vLLM's kv_connector suite on the rebased tree (patched vs pristine)")
    try:
        req = suite.SuiteRequest(settings=settings)
        outcome = suite.run_suite(project, req)
    except OverlayError as e:
        return SuiteProof(ok=False, error=str(e))
    return SuiteProof(outcome.comparison.ok, outcome.text(), outcome.json())


def _message(r: RebaseReport) -> str:
    lines = [f"Track {r.to.name} {r.to.version}: rebase the overlay from {r.from_version}", ""]
    lines += [f"- {c.id}: {c.state}" + (f" ({c.reason})" if c.reason else "") for c in r.changes]
    return "\n".join(lines) + "\n"


def exit_code(rep: TrackReport) -> int:
    return EXIT[rep.status]
