"""Start, continue and abort a rebase: the loop over the changes, and the final write.

Only when every change is settled are ``upstream.lock`` (the new pin and base hashes),
``overlay/`` (exported from the checkout) and ``overlay/overlay.toml`` (dropped changes moved to
``[[dropped]]``, moved paths, revision) written; until then a stop leaves them as they were.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from vllm_overlay.errors import RebaseError
from vllm_overlay.gitrepo import config_set, run_git, set_ref, switch, uncommitted
from vllm_overlay.overlay import history
from vllm_overlay.overlay.checkout import (
    APPLIED_REF,
    BRANCH,
    DIGEST_KEY,
    apply_overlay,
    check_consistency,
)
from vllm_overlay.overlay.checkout import plan as plan_overlay
from vllm_overlay.overlay.export import export_overlay
from vllm_overlay.overlay.model import CONFIG_NAME, load_overlay, overlay_digest, parse_overlay
from vllm_overlay.overlay.project import Project
from vllm_overlay.pin.lockfile import base_hash, render_lock, write_lock
from vllm_overlay.pin.trees import BASE_REF, upstream_repo
from vllm_overlay.rebase.report import report
from vllm_overlay.rebase.state import (
    DROPPED,
    KEPT,
    NEW_BASE_REF,
    OLD_BASE_REF,
    STOP_COMMIT,
    STOP_TESTS,
    Ctx,
    Paths,
    RebaseInProgressError,
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
from vllm_overlay.rebase.steps import drop, settle_resolution, step
from vllm_overlay.rebase.target import pin, resolve_target, with_commit
from vllm_overlay.util import atomic_write_text, info


def start(
    project: Project,
    to: str,
    *,
    commit: str | None = None,
    source: str = "sdist",
    index_url: str | None = None,
    git_url: str | None = None,
    checkout: Path | None = None,
    test_python: str | None = None,
) -> dict:
    """Begin a rebase onto ``to``; returns the report (complete, or stopped)."""
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
        remote = git_url or old_lock.upstream.git
        version, commit = resolve_target(
            to, name=name, git_url=remote, index_url=index_url, commit=commit
        )
        if version == old_lock.upstream.version and commit in (None, old_lock.upstream.commit):
            return {"status": "noop", "message": f"upstream.lock already pins {name} {version}."}
        info(f"pinning {name} {version}")
        lock_plan = pin(overlay, name=name, version=version, commit=commit, remote=remote,
                        index_url=index_url)  # fmt: skip
        dest = (checkout or project.default_checkout).absolute()
        state = State(
            from_version=old_lock.upstream.version,
            from_commit=old_lock.upstream.commit,
            new_lock=render_lock(lock_plan.lock),
            source=source,
            index_url=index_url,
            git_url=git_url,
            test_python=test_python,
            checkout=record_checkout(dest, old_lock, overlay),
            order=[c.id for c in overlay.changes],
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
            _prepare(ctx)
        except BaseException:
            ctx.close()
            undo(paths, state)
            raise
        with ctx:
            return _advance(ctx)


def _prepare(ctx: Ctx) -> None:
    """The checkout at the old pin plus the overlay (one commit per change), then moved to
    the new base with both bases at fixed refs."""
    st = ctx.state
    opts = {"source": st.source, "index_url": st.index_url, "git_url": st.git_url}
    res = apply_overlay(ctx.old_lock, ctx.overlay, ctx.checkout, **opts)
    st.commits = dict(res.commits)
    st.old_base = res.base
    new_repo, new_base = upstream_repo(ctx.new_lock, **opts)
    repo = ctx.repo
    if ctx.commit(new_base) is None:
        run_git(repo.git, "fetch", "-q", "--no-tags", str(new_repo), f"+{BASE_REF}:{NEW_BASE_REF}")
    set_ref(repo, NEW_BASE_REF, new_base)
    set_ref(repo, OLD_BASE_REF, res.base)
    set_ref(repo, BASE_REF, new_base)
    switch(repo, new_base, BRANCH)
    st.new_base = new_base
    st.status = "running"
    ctx.save()


def continue_(project: Project, *, commit: str | None = None) -> dict:
    """Settle the stopped change with the person's resolution, then go on.

    ``commit``: the new pin's full commit id, when the rebase could not resolve it.
    """
    paths = Paths(project)
    with guard(paths):
        state = load(paths)
        if commit is not None:
            with_commit(state, commit)
            if state.pending and state.pending["kind"] == STOP_COMMIT:
                state.pending = None
            save(paths, state)
        if state.status == "starting":
            raise RebaseError(
                "the rebase was interrupted while it started; run `vllm-overlay rebase --abort`, "
                "then start it again."
            )
        with context(paths, state) as ctx:
            return _continue(ctx)


def _continue(ctx: Ctx) -> dict:
    state = ctx.state
    if state.status == "finalizing":  # interrupted while writing: write it all again
        return _finish(ctx)
    refuse_edits(ctx.paths)
    if state.pending is None:
        if state.next < len(state.order):
            _reset_step(ctx)  # interrupted mid-step: redo that step
        return _advance(ctx)
    if state.pending["kind"] == STOP_COMMIT:
        return report(ctx)  # still unknown: the report says how to give it
    change = ctx.overlay.change(state.pending["id"])
    if state.pending["kind"] == STOP_TESTS:
        result, pending = drop(ctx, change, state.pending["reason"])
    else:
        result, pending = settle_resolution(ctx, change)
    if pending is not None:
        state.pending = pending
        ctx.save()
        return report(ctx)
    _record(ctx, result)
    return _advance(ctx)


def abort(project: Project) -> dict:
    """Put upstream.lock, overlay/ and the checkout back as they were before the rebase."""
    paths = Paths(project)
    with guard(paths):
        state = load(paths)
        undo(paths, state)
    return {
        "status": "aborted",
        "from": {"version": state.from_version, "commit": state.from_commit},
        "checkout": state.checkout.path,
    }


# Steps


def _advance(ctx: Ctx) -> dict:
    st = ctx.state
    while st.next < len(st.order):
        change = ctx.overlay.change(st.order[st.next])
        st.step_head = ctx.head()
        st.pending = None
        st.status = "running"
        ctx.save()
        result, pending = step(ctx, change)
        if pending is not None:
            st.pending = pending
            st.status = "stopped"
            ctx.save()
            return report(ctx)
        _record(ctx, result)
    if not st.commit_known:
        st.pending = {"id": "", "kind": STOP_COMMIT, "problems": []}
        st.status = "stopped"
        ctx.save()
        return report(ctx)
    st.status = "finalizing"
    ctx.save()
    return _finish(ctx)


def _record(ctx: Ctx, result: dict) -> None:
    st = ctx.state
    st.results.append(result)
    st.pending = None
    st.next += 1
    st.status = "running"
    ctx.save()


def _reset_step(ctx: Ctx) -> None:
    switch(ctx.repo, ctx.state.step_head, BRANCH, clean=True)


# Finishing: the lock, overlay.toml and overlay/ are written only here


def _finish(ctx: Ctx) -> dict:
    st, project, co = ctx.state, ctx.paths.project, ctx.checkout
    dirty = uncommitted(ctx.repo)
    if dirty:
        raise RebaseError(
            f"{co} has uncommitted changes after every change was settled:\n"
            + "\n".join("    " + d for d in dirty[:20])
            + "\nDiscard them (`git -C CHECKOUT checkout -- .`) or `--abort`; then --continue."
        )
    dropped = [r for r in st.results if r["status"] == DROPPED]
    kept = [r for r in st.results if r["status"] != DROPPED]
    old_text = (ctx.paths.backup_overlay / CONFIG_NAME).read_text()
    bump = any(r["status"] != KEPT for r in st.results)
    new_text = history.rewrite(
        old_text,
        dropped=[
            history.DroppedRecord(
                id=r["id"],
                title=r["title"],
                origin=r["origin"],
                dropped_in=ctx.new_version,
                reason=r["reason"],
                proof=r["proof"],
            )  # fmt: skip
            for r in dropped
        ],
        files={r["id"]: r["files"] for r in kept},
        tests={r["id"]: r["tests"] for r in kept},
        bump_revision=bump,
    )
    new_overlay = parse_overlay(new_text, project.overlay_dir)  # validate before writing
    new_lock = ctx.new_lock.with_base(
        {p: base_hash(ctx.new_file(p)) for p in new_overlay.all_files()}
    )
    atomic_write_text(project.overlay_dir / CONFIG_NAME, new_text)
    exported = export_overlay(new_lock, new_overlay, ctx.repo)
    repo, base = upstream_repo(
        new_lock, source=st.source, index_url=st.index_url, git_url=st.git_url
    )
    plan_overlay(new_lock, load_overlay(project.overlay_dir), repo, base)  # strict re-apply
    write_lock(project.lock_path, new_lock)
    set_ref(ctx.repo, APPLIED_REF, ctx.head())
    config_set(ctx.repo, DIGEST_KEY, overlay_digest(project.overlay_dir))
    for ref in (NEW_BASE_REF, OLD_BASE_REF):
        set_ref(ctx.repo, ref, None)
    result = report(ctx)
    result.update(
        status="complete",
        written=["upstream.lock", f"overlay/{CONFIG_NAME}"]
        + [f"overlay/{p}" for p in exported.written],
        removed=[f"overlay/{p}" for p in exported.removed],
        revision={"from": ctx.overlay.revision, "to": new_overlay.revision},
    )
    shutil.rmtree(ctx.paths.dir)
    return result
