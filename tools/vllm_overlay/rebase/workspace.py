"""The checkout a person works in: written only when the walk stops, and at the end.

The walk itself runs on blobs. At a stop, the checkout shows the stop's release: its tree,
one commit per change carried so far at that release, and the stopped change's files left
uncommitted (diff3 markers where the merge conflicts; for a renamed file, our edit merged into
git's first candidate; for a collision, upstream's file and ours as an add/add conflict). When
the walk completes, the checkout is the target's tree plus one commit per change, which
``export`` turns into overlay/.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from vllm_overlay.errors import RebaseError
from vllm_overlay.gitrepo import (
    changed_since,
    commit,
    git,
    is_ancestor,
    rev_parse,
    run_git,
    set_ref,
    switch,
    untracked,
)
from vllm_overlay.overlay.checkout import BRANCH, change_message
from vllm_overlay.overlay.model import Change
from vllm_overlay.pin.trees import BASE_REF
from vllm_overlay.rebase import decide
from vllm_overlay.rebase.state import NEW_BASE_REF, Ctx
from vllm_overlay.rebase.walkdata import TESTS_FAILED, Blobs, Walk
from vllm_overlay.testing import proving


def show_release(ctx: Ctx, repo: Path, base: str) -> None:
    """The checkout at ``base`` (a release's tree from ``repo``), clean, on the overlay's
    branch; a checkout that does not exist yet is made."""
    co = ctx.checkout
    if not (co / ".git").exists():
        co.mkdir(parents=True, exist_ok=True)
        git("init", "-q", str(co))
        ctx.close()
    if rev_parse(ctx.repo, base) is None:
        run_git(ctx.repo.git, "fetch", "-q", "--no-tags", str(repo), f"+{BASE_REF}:{NEW_BASE_REF}")
    set_ref(ctx.repo, NEW_BASE_REF, base)
    set_ref(ctx.repo, BASE_REF, base)
    switch(ctx.repo, base, BRANCH, clean=True)


def commit_carried(ctx: Ctx, w: Walk, blobs: Blobs, changes: dict[str, Change],
                   ids: list[str]) -> None:  # fmt: skip
    """One commit per change of ``ids``, its files as the walk carries it."""
    for cid in ids:
        form = w.forms[cid]
        proving.write_files(ctx.checkout, blobs.files(form.after))
        run_git(ctx.repo.git, "add", "-A", "--", *form.files)
        commit(ctx.repo, change_message(changes[cid]))


def show_stop(ctx: Ctx, w: Walk, blobs: Blobs, changes: dict[str, Change], repo: Path,
              base: str) -> None:  # fmt: skip
    """The checkout at the stop: the release, the changes carried so far, the stopped one's
    files to resolve."""
    stop = w.stop
    assert stop is not None
    show_release(ctx, repo, base)
    done = [c for c in w.order[: w.next] if c not in w.gone and c not in w.waiting]
    commit_carried(ctx, w, blobs, changes, done)
    ctx.state.step_head = ctx.head()
    if stop.state == TESTS_FAILED:
        return
    form = w.forms[stop.id]
    before, after = blobs.files(form.before), blobs.files(form.after)
    out: dict[str, bytes | None] = {}
    conflicted, merged = blobs.files(stop.conflicted), blobs.files(stop.merged)
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-stop-") as tmp:
        scratch = decide.Scratch(Path(tmp))
        labels = (f"{w.name} {w.release}", f"{w.name} {form.at}", "our change")
        for p in form.files:
            if p in conflicted:
                out[p] = conflicted[p]
            elif p in merged:
                out[p] = merged[p]
            elif stop.state == decide.MOVED and stop.candidates.get(p):
                cand = stop.candidates[p][0][0]
                theirs = (ctx.checkout / cand).read_bytes()
                out[cand], _ = scratch.merge(theirs, before[p] or b"", after[p] or b"", labels)
            elif stop.state == decide.MOVED and before.get(p) is not None:
                out[p] = after[p]  # deleted upstream: ours, for the person to move
            elif stop.state == decide.COLLISION and before.get(p) is None:
                theirs = (ctx.checkout / p).read_bytes()
                out[p], _ = scratch.merge(theirs, b"", after[p] or b"", labels)
    proving.write_files(ctx.checkout, out)


def read_resolution(ctx: Ctx) -> dict[str, bytes | None]:
    """Every file the person changed in the checkout since the stop (None: deleted), commits
    they made on top included; the checkout is left as it is (``fold_commits`` after)."""
    head, pre = ctx.head(), ctx.state.step_head
    if head != pre and not is_ancestor(ctx.repo, pre, head):
        raise RebaseError(
            f"HEAD of {ctx.checkout} moved off the rebase (it is {head[:12]}, expected "
            f"{pre[:12]} or a commit on top of it). Check out the rebase's work again, or "
            "`--abort`."
        )
    paths = sorted(set(changed_since(ctx.repo, pre) + untracked(ctx.repo)))
    out: dict[str, bytes | None] = {}
    for rel in paths:
        p = ctx.checkout / rel
        out[rel] = p.read_bytes() if p.is_file() else None
    return out


def fold_commits(ctx: Ctx) -> None:
    """Fold the commits the person made on top of the stop into its uncommitted files (once
    their resolution is settled)."""
    if ctx.head() != ctx.state.step_head:
        run_git(ctx.repo.git, "reset", "-q", "--soft", ctx.state.step_head)
