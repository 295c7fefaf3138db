"""Start, continue and abort a rebase: the walk (``rebase/releasewalk.py``) in a project.

``start`` pins the target, reads the series at the pin, and walks every release up to the
target (``direct``: the target alone). A stop writes the checkout at the stop's release
(``workspace``) and returns the report; ``--continue`` reads the person's resolution from the
checkout (and records it, ``rebase/records.py``) or runs a failed proof again, then walks on.
Only when the walk is done are ``upstream.lock`` (the new pin and base hashes), ``overlay/``
(exported from the checkout, now the target plus one commit per change) and
``overlay/overlay.toml`` (dropped changes moved to ``[[dropped]]`` with the release where each
dropped, moved paths, revision) written; until then a stop leaves them as they were.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
from dataclasses import replace
from pathlib import Path

from packaging.version import Version

from vllm_overlay.errors import (
    RebaseError,
    RebaseInProgressError,
    ResolutionNotProvenError,
    UsageError,
)
from vllm_overlay.gitrepo import config_get, config_set, set_ref, show_bytes, uncommitted
from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.overlay import history
from vllm_overlay.overlay.checkout import APPLIED_REF, DIGEST_KEY, check_consistency
from vllm_overlay.overlay.checkout import plan as plan_overlay
from vllm_overlay.overlay.export import export_overlay
from vllm_overlay.overlay.model import CONFIG_NAME, load_overlay, overlay_digest, parse_overlay
from vllm_overlay.overlay.project import Project
from vllm_overlay.pin.lockfile import base_hash, render_lock, write_lock
from vllm_overlay.pin.trees import upstream_repo
from vllm_overlay.rebase import records, workspace
from vllm_overlay.rebase.host import SdistHost, load_series
from vllm_overlay.rebase.releases import newer_releases
from vllm_overlay.rebase.releasewalk import Walker
from vllm_overlay.rebase.report import report, settled
from vllm_overlay.rebase.reportdata import Aborted, ChangeOutcome, Noop, RebaseReport
from vllm_overlay.rebase.state import (
    NEW_BASE_REF,
    OLD_BASE_REF,
    Ctx,
    Paths,
    State,
    backup,
    context,
    guard,
    load,
    record_checkout,
    refuse_edits,
    save,
    undo,
    where,
)
from vllm_overlay.rebase.target import pin, resolve_target, with_commit
from vllm_overlay.rebase.walkdata import TESTS_FAILED, Blobs, Cell, Proof, Walk
from vllm_overlay.rebase.walkdata import start as start_walk
from vllm_overlay.util import atomic_write_text, info


def start(
    project: Project,
    to: str,
    *,
    settings: Settings = DEFAULTS,
    commit: str | None = None,
    checkout: Path | None = None,
    direct: bool = False,
) -> RebaseReport | Noop:
    """Begin a rebase onto ``to``; returns the report (complete, or stopped). ``settings``
    are kept in the state: --continue works with them again."""
    paths = Paths(project)
    with guard(paths):
        if paths.state.is_file():
            st = load(paths)
            raise RebaseInProgressError(
                f"a rebase from {st.from_version} is in progress ({where(st)}). Finish it with "
                "`vllm-overlay rebase --continue`, or undo it with `vllm-overlay rebase --abort`."
            )
        old_lock, overlay = project.lock(), project.overlay()
        check_consistency(old_lock, overlay)
        name = old_lock.upstream.name
        remote = settings.git_url or old_lock.upstream.git
        version, commit = resolve_target(
            to, name=name, git_url=remote, settings=settings, commit=commit
        )
        if version == old_lock.upstream.version and commit in (None, old_lock.upstream.commit):
            return Noop(f"upstream.lock already pins {name} {version}.")
        if Version(version) < Version(old_lock.upstream.version):
            direct = True  # backwards: no releases in between to walk
        info(f"pinning {name} {version}")
        lock_plan = pin(overlay, name=name, version=version, commit=commit, remote=remote,
                        settings=settings, project_root=project.root)  # fmt: skip
        dest = (checkout or project.default_checkout).absolute()
        state = State(
            from_version=old_lock.upstream.version,
            from_commit=old_lock.upstream.commit,
            new_lock=render_lock(lock_plan.lock),
            source=settings.source,
            index_url=settings.index_url,
            git_url=settings.git_url,
            test_python=settings.test_python,
            checkout=record_checkout(dest, old_lock, overlay),
            direct=direct,
            commit_known=lock_plan.commit_resolved,
            sdist_commit=lock_plan.sdist_commit,
            pin_notes=lock_plan.variant_notes,
        )
        if paths.dir.exists():
            shutil.rmtree(paths.dir)  # a leftover without state.json: nothing to resume
        backup(paths)
        save(paths, state)
        ctx = context(paths, state)
        try:
            walker = _walker(ctx, new=True)
        except BaseException:
            ctx.close()
            undo(paths, state)
            raise
        with ctx:
            return _advance(ctx, walker)


def _path(ctx: Ctx) -> tuple[list[str], dict]:
    """The releases to walk, oldest first (the target last), and the index's releases."""
    st = ctx.state
    found, notes = newer_releases(ctx.name, ctx.old_version, st.settings, to=ctx.new_version)
    for note in notes:
        info(note)
    releases = {r.version: r for r in found}
    if st.direct or ctx.new_version not in releases:
        return [ctx.new_version], releases
    return [r.version for r in found], releases


def _walker(ctx: Ctx, *, new: bool = False) -> Walker:
    """The walk of this rebase: made at the start, loaded from the state after."""
    st, paths = ctx.state, ctx.paths
    path, releases = _path(ctx)
    if ctx.new_version not in releases:
        from vllm_overlay.rebase.releases import list_releases

        everything = list_releases(ctx.name, st.settings)
        if ctx.new_version in everything:
            releases[ctx.new_version] = everything[ctx.new_version]
    host = SdistHost(ctx.old_lock, releases, settings=st.settings, work=paths.dir)
    blobs = Blobs(paths.blobs)
    if new:
        series = load_series(ctx.old_lock, ctx.overlay, st.settings)
        w = start_walk(ctx.name, ctx.old_version, path, series.steps, blobs)
        info(f"walking {ctx.name} {ctx.old_version} -> " + " -> ".join(path))
        st.walk = w.to_json()
        st.status = "running"
        ctx.save()
    else:
        w = Walk.from_json(st.walk)
    found = records.load(*records.stores(ctx.paths.project).values())
    changes = {c.id: c for c in ctx.overlay.changes}

    def saved() -> None:
        st.walk = w.to_json()
        ctx.save()
        _fault_point(len(w.cells))

    return Walker(w, blobs, host, changes, found, on_step=saved)


def _fault_point(step: int) -> None:
    """Tests kill the rebase at a chosen step (VLLM_OVERLAY_KILL_AT_STEP=N: SIGKILL right
    after the walk's N-th verdict is saved), to prove every step resumes."""
    if os.environ.get("VLLM_OVERLAY_KILL_AT_STEP") == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def continue_(project: Project, *, commit: str | None = None, unproven: str | None = None
              ) -> RebaseReport:  # fmt: skip
    """Settle the stop with the person's resolution (or run its proof again), then go on.

    The resolution is proven first: the change's tests at the stop's release with it. If they
    fail, ``ResolutionNotProvenError`` (nothing recorded, the stop and the checkout as they
    were), unless ``unproven`` (the person's reason) says to record it anyway, marked so.
    ``commit``: the new pin's full commit id, when the rebase could not resolve it.
    """
    paths = Paths(project)
    with guard(paths):
        state = load(paths)
        if commit is not None:
            with_commit(state, commit)
            state.commit_pending = False
            save(paths, state)
        if state.status == "starting":
            raise RebaseError(
                "the rebase was interrupted while it started; run `vllm-overlay rebase --abort`, "
                "then start it again."
            )
        with context(paths, state) as ctx:
            return _continue(ctx, unproven)


def _continue(ctx: Ctx, unproven: str | None = None) -> RebaseReport:
    st = ctx.state
    if st.status == "finalizing":  # interrupted while writing: write it all again
        return _finish(ctx, _walker(ctx))
    refuse_edits(ctx.paths)
    walker = _walker(ctx)
    w = walker.walk
    if st.commit_pending:
        return report(ctx, w)  # still unknown: the report says how to give it
    if w.stop is not None:
        if w.stop.state == TESTS_FAILED:
            if unproven is not None:
                raise UsageError(
                    "--unproven records a person's resolution of a conflict; this stop is a "
                    "drop whose tests failed, and a drop is always proven. Run `vllm-overlay "
                    "rebase --continue` after fixing the test, or `--abort`."
                )
            walker.retry_proof()
        else:
            _settle(ctx, walker, unproven)
    elif unproven is not None:
        raise UsageError("--unproven goes with a stop a person resolved; there is none now.")
    return _advance(ctx, walker)


def _settle(ctx: Ctx, walker: Walker, unproven: str | None = None) -> None:
    w = walker.walk
    files = workspace.read_resolution(ctx)
    left = [p for p, d in files.items() if d is not None and _has_markers(d)]
    if left:
        shown = "\n".join("    " + p for p in left)
        raise RebaseError(
            f"conflict markers (<<<<<<< or >>>>>>>) are still in:\n{shown}\nEdit them away, "
            "then run `vllm-overlay rebase --continue` again."
        )
    stop = w.stop
    assert stop is not None
    renames = {p: c[0][0] for p, c in stop.candidates.items() if c}
    why = {"why": unproven, "by": _who(ctx)} if unproven is not None else None
    proof = walker.settle(files, renames, why)
    if w.stop is stop:  # not proven: nothing recorded, the stop and the checkout as they were
        tree = walker.blobs.files(w.tree)
        dropped = all(d == tree.get(p) for p, d in files.items())
        raise ResolutionNotProvenError(_not_proven(ctx, stop, proof, dropped=dropped))
    workspace.fold_commits(ctx)
    for rec in walker.made:
        records.save(ctx.paths.records, rec)  # kept even if the rebase is aborted
        walker.records[rec.key] = rec
    if walker.made and all(r.scope == records.DROP for r in walker.made):
        info(f"recorded the drop of change {stop.id}: a later walk that meets the change "
             "in the same state drops it there (proven again) without asking")  # fmt: skip
    elif walker.made:
        unproven_ = any(r.unproven is not None for r in walker.made)
        mark = " UNPROVEN (--unproven: its tests fail with it)" if unproven_ else ""
        info(f"recorded {len(walker.made)} resolution(s) of change {stop.id}{mark}: a "
             "later walk that meets the same conflict applies them where its tests pass")  # fmt: skip


def _who(ctx: Ctx) -> str:
    """Who goes on unproven: git's user of the checkout, else the login name."""
    name, email = config_get(ctx.repo, "user.name"), config_get(ctx.repo, "user.email")
    if name:
        return f"{name} <{email}>" if email else name
    return getpass.getuser()


def _not_proven(ctx: Ctx, stop: Cell, proof: Proof | None, *, dropped: bool) -> str:
    """Why the resolution was refused: the failing tests by id, the log and JUnit report."""
    cid, at = stop.id, f"{ctx.name} {stop.release}"
    data = proof.to_json() if proof is not None else {}
    runs = list((data.get("runs") or {}).values())
    lines = [
        f"your resolution of change {cid} at {at} is not recorded: "
        + ("it leaves the change's files as upstream's, so the change would drop there, and "
           if dropped else "")
        + f"its tests do not pass with it ({data.get('text', '')})."
    ]  # fmt: skip
    failing = [t for r in runs for t in r.get("failing", [])]
    if failing:
        lines.append("failed:")
        lines += ["    " + t for t in failing]
    for r in runs:
        if r.get("first_error"):
            lines.append(f"first error: {r['first_error']}")
        if r.get("log"):
            lines.append(f"log: {r['log']}")
        if r.get("junit"):
            lines.append(f"JUnit report: {r['junit']}")
    lines.append(
        f"The stop is still there and {ctx.checkout} is as you left it: fix the resolution "
        "(or the change's test) and run `vllm-overlay rebase --continue` again"
        + ("; or keep the change (raise its drop_when) after `--abort`."
           if dropped else "; or `vllm-overlay rebase --continue --unproven REASON` to record "
           "it anyway, marked unproven; or `--abort`.")
    )  # fmt: skip
    return "\n".join(lines)


def _has_markers(data: bytes) -> bool:
    import re

    return re.search(rb"^(<<<<<<<|>>>>>>>)( |$)", data, re.MULTILINE) is not None


def abort(project: Project) -> Aborted:
    """Put upstream.lock, overlay/ and the checkout back as they were before the rebase."""
    paths = Paths(project)
    with guard(paths):
        state = load(paths)
        undo(paths, state)
    return Aborted(state.from_version, state.from_commit, state.checkout.path)


def _advance(ctx: Ctx, walker: Walker) -> RebaseReport:
    st = ctx.state
    w = walker.run()
    if w.stop is not None:
        repo, base = walker.host.tree(w.release)
        workspace.show_stop(ctx, w, walker.blobs, walker.changes, repo, base)
        st.status = "stopped"
        st.walk = w.to_json()
        ctx.save()
        return report(ctx, w, timings=walker.host.timings)
    if not st.commit_known:
        st.commit_pending = True
        st.status = "stopped"
        ctx.save()
        return report(ctx, w)
    st.status = "finalizing"
    ctx.save()
    return _finish(ctx, walker)


# Finishing: the lock, overlay.toml and overlay/ are written only here


def _finish(ctx: Ctx, walker: Walker) -> RebaseReport:
    st, project, w = ctx.state, ctx.paths.project, walker.walk
    repo, base = upstream_repo(ctx.new_lock, settings=st.settings)
    carried = [c for c in w.order if c not in w.gone]
    touched = sorted({p for c in carried for p in w.forms[c].files})
    walked = walker.host.files(w.target, touched)
    differ = [p for p in touched if show_bytes(repo, base, p) != walked[p]]
    if differ:
        raise RebaseError(
            f"the {st.source} tree of {ctx.name} {ctx.new_version} differs from its sdist, which "
            "the walk read, in: " + ", ".join(differ) + ". Rebase with --source sdist, or check "
            "the pinned commit."
        )
    workspace.show_release(ctx, repo, base)
    workspace.commit_carried(ctx, w, walker.blobs, walker.changes, carried)
    dirty = uncommitted(ctx.repo)
    if dirty:
        raise RebaseError(
            f"{ctx.checkout} has uncommitted changes after every change was settled:\n"
            + "\n".join("    " + d for d in dirty[:20])
            + "\nDiscard them (`git -C CHECKOUT checkout -- .`) or `--abort`; then --continue."
        )
    new_text = _new_config(ctx, settled(w, ctx.overlay))
    new_overlay = parse_overlay(new_text, project.overlay_dir)  # validate before writing
    new_lock = ctx.new_lock.with_base(
        {p: base_hash(show_bytes(repo, base, p)) for p in new_overlay.all_files()}
    )
    atomic_write_text(project.overlay_dir / CONFIG_NAME, new_text)
    exported = export_overlay(new_lock, new_overlay, ctx.repo)
    keys = {k for c in w.cells for k in c.records}
    stored = records.load(*records.stores(project).values())
    pruned = records.write_overlay(
        project.overlay_dir, [stored[k] for k in sorted(keys) if k in stored], ctx.new_version
    )
    for k in keys:  # now in overlay/, for review: the walk's own copies go
        if k in stored:
            (ctx.paths.records / stored[k].relpath).unlink(missing_ok=True)
    plan_overlay(new_lock, load_overlay(project.overlay_dir), repo, base)  # strict re-apply
    write_lock(project.lock_path, new_lock)
    set_ref(ctx.repo, APPLIED_REF, ctx.head())
    config_set(ctx.repo, DIGEST_KEY, overlay_digest(project.overlay_dir))
    for ref in (NEW_BASE_REF, OLD_BASE_REF):
        set_ref(ctx.repo, ref, None)
    written = [f"overlay/{records.DIR}/{stored[k].relpath}" for k in sorted(keys) if k in stored]
    result = replace(
        report(ctx, w),
        status="complete",
        written=(
            "upstream.lock", f"overlay/{CONFIG_NAME}", *[f"overlay/{p}" for p in exported.written],
            *written,
        ),
        removed=tuple(f"overlay/{p}" for p in exported.removed + pruned),
        revision=(ctx.overlay.revision, new_overlay.revision),
    )  # fmt: skip
    shutil.rmtree(ctx.paths.dir)
    return result


def _new_config(ctx: Ctx, results: list[ChangeOutcome]) -> str:
    """overlay.toml after the walk: dropped changes moved to [[dropped]] with their proof,
    carried changes' files and tests as they are now, the revision bumped if any moved."""
    old_text = (ctx.paths.backup_overlay / CONFIG_NAME).read_text()
    bump = any(r.state != "kept" for r in results)
    carried = [r for r in results if r.state != "dropped"]
    return history.rewrite(
        old_text,
        dropped=[
            history.DroppedRecord(
                id=r.id,
                title=r.title,
                origin=r.origin,
                dropped_in=r.release or "",
                reason=r.reason,
                proof=r.proof,
                upstream_tests=ctx.overlay.change(r.id).upstream_tests,
                pull_request=r.pull_request,
            )  # fmt: skip
            for r in results
            if r.state == "dropped"
        ],
        files={r.id: list(r.files) for r in carried},
        tests={r.id: list(r.tests) for r in carried},
        bump_revision=bump,
    )
