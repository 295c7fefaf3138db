"""The checkout: a git work tree of the pinned upstream with the overlay applied.

Layout of a checkout made by this tool:
- ``refs/vllm-overlay/base``: the pristine upstream commit (the recorded base ref);
- branch ``overlay``: the base plus one commit per change, in overlay.toml order, each
  with an ``Overlay-Change: <id>`` trailer, fixed identity and dates;
- ``refs/vllm-overlay/applied``: what apply last produced.

``apply`` computes every patched file in memory first (base hashes checked, patches applied
strictly) and touches the checkout only when all of it succeeded.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_overlay.errors import CheckoutError, OverlayError, StaleCheckoutError
from vllm_overlay.gitrepo import (
    Repo,
    commit,
    commit_message,
    config_get,
    config_set,
    git,
    head_state,
    open_repo,
    opened,
    restore_head,
    rev_parse,
    run_git,
    set_ref,
    show_bytes,
    switch,
    uncommitted,
)
from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.overlay.commitwalk import TRAILER
from vllm_overlay.overlay.model import Change, Overlay, overlay_digest, safe_join
from vllm_overlay.overlay.series import (  # check_consistency: re-exported for rebase
    PlannedChange,
    check_consistency,  # noqa: F401
    plan_series,
)
from vllm_overlay.pin.lockfile import Lock
from vllm_overlay.pin.trees import BASE_REF, upstream_repo
from vllm_overlay.util import cache_dir, exclusive_lock

BRANCH = "overlay"
APPLIED_REF = "refs/vllm-overlay/applied"
DIGEST_KEY = "vllm-overlay.overlay-digest"

if TYPE_CHECKING:
    from vllm_overlay.overlay.export import ExportResult


@dataclass
class ApplyResult:
    checkout: Path
    base: str
    head: str
    commits: list[tuple[str, str]] = field(default_factory=list)  # (change id, commit)
    stash: str | None = None
    created: bool = False


def plan(lock: Lock, overlay: Overlay, repo: Repo | Path, base: str) -> list[PlannedChange]:
    """Check base hashes and compute every change's files in order (the series, see
    overlay/series.py); raises before anything is written."""
    with opened(repo) as r:
        return plan_series(lock, overlay, lambda path: show_bytes(r, base, path))


def _lock_for(dest: Path):
    key = hashlib.sha256(str(dest.resolve()).encode()).hexdigest()[:16]
    return exclusive_lock(cache_dir() / "locks" / f"checkout-{key}.lock", f"the checkout {dest}")


def is_checkout(path: Path) -> bool:
    return (path / ".git").exists() and rev_parse(path, BASE_REF) is not None


def change_message(change: Change) -> str:
    """The message of a change's commit (apply writes it, rebase recommits it)."""
    return commit_message(f"{change.id}: {change.title}", change.origin, {TRAILER: change.id})


def _commit_change(dest: Repo, pc: PlannedChange) -> str:
    root = Path(dest.working_tree_dir or "")
    for path, data in pc.files.items():
        target = safe_join(root, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
    return commit(dest, change_message(pc.change), *pc.files)


def _checkout_base(dest: Repo, repo: Path, base: str) -> None:
    if not rev_parse(dest, base):
        run_git(dest.git, "fetch", "-q", "--no-tags", str(repo), f"+{BASE_REF}:{BASE_REF}")
    set_ref(dest, BASE_REF, base)
    switch(dest, base, BRANCH)


def apply_overlay(
    lock: Lock,
    overlay: Overlay | None,
    dest: Path,
    *,
    force: bool = False,
    settings: Settings = DEFAULTS,
) -> ApplyResult:
    """Make ``dest`` the pinned upstream (from where ``settings`` say) plus ``overlay``
    (None: the pristine tree)."""
    repo, base = upstream_repo(lock, settings=settings)
    planned = plan(lock, overlay, repo, base) if overlay is not None else []
    digest = overlay_digest(overlay.dir) if overlay is not None else "pristine"
    dest = dest.absolute()
    with _lock_for(dest):
        if dest.exists() and not (dest.is_dir() and not any(dest.iterdir())):
            return _apply_existing(dest, repo, base, planned, digest, force)
        return _apply_new(dest, repo, base, planned, digest)


def _finish(dest: Repo, planned: list[PlannedChange], digest: str, result: ApplyResult) -> None:
    for pc in planned:
        result.commits.append((pc.change.id, _commit_change(dest, pc)))
    result.head = dest.head.commit.hexsha
    set_ref(dest, APPLIED_REF, result.head)
    config_set(dest, DIGEST_KEY, digest)


def _apply_new(
    dest: Path, repo: Path, base: str, planned: list[PlannedChange], digest: str
) -> ApplyResult:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        git("clone", "-q", "--no-checkout", str(repo), str(tmp / "w"))
        work = tmp / "w"
        with open_repo(work) as w:
            run_git(w.git, "remote", "remove", "origin")
            _checkout_base(w, repo, base)
            result = ApplyResult(checkout=dest, base=base, head=base, created=True)
            _finish(w, planned, digest, result)
        if dest.exists():
            dest.rmdir()  # the empty directory the user named
        work.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _apply_existing(
    dest: Path, repo: Path, base: str, planned: list[PlannedChange], digest: str, force: bool
) -> ApplyResult:
    if not is_checkout(dest):
        raise CheckoutError(
            f"{dest} exists and is not a vllm-overlay checkout (no {BASE_REF}). Nothing was "
            "changed. Pass another --checkout directory, or remove this one."
        )
    with open_repo(dest) as d:
        return _apply_to(d, repo, base, planned, digest, force)


def _apply_to(dest: Repo, repo: Path, base: str, planned: list[PlannedChange], digest: str,
              force: bool) -> ApplyResult:  # fmt: skip
    where = Path(dest.working_tree_dir or "")
    dirty = uncommitted(dest)
    stash = None
    if dirty:
        if not force:
            shown = "\n".join("    " + e for e in dirty[:20])
            more = f"\n    … and {len(dirty) - 20} more" if len(dirty) > 20 else ""
            raise CheckoutError(
                f"{where} has uncommitted changes:\n{shown}{more}\nNothing was changed. Save them "
                "into the overlay with `vllm-overlay export`, commit or discard them, or pass "
                "--force (which stashes them with `git stash` before applying)."
            )
        run_git(dest.git, "stash", "push", "-q", "--include-untracked", "-m",
                "vllm-overlay apply --force")  # fmt: skip
        stash = rev_parse(dest, "refs/stash")
    before = head_state(dest)
    result = ApplyResult(checkout=where, base=base, head=base, stash=stash)
    try:
        _checkout_base(dest, repo, base)
        _finish(dest, planned, digest, result)
    except BaseException:
        with contextlib.suppress(Exception):
            restore_head(dest, before)
            if stash:
                run_git(dest.git, "stash", "pop", "-q")
        raise
    return result


def stale(dest: Path, overlay: Overlay) -> bool:
    """The checkout is what apply made of another overlay/ than today's (a pull or a merge
    came since): no commit above it, no uncommitted edit, and the overlay's digest is not the
    one it was applied from."""
    with open_repo(dest) as repo:
        if not _unedited(rev_parse(repo, "HEAD"), rev_parse(repo, APPLIED_REF), uncommitted(repo)):
            return False
        applied = config_get(repo, DIGEST_KEY)
    return applied is not None and applied != overlay_digest(overlay.dir)


def _unedited(head: str | None, applied: str | None, dirty: list) -> bool:
    return head == applied and not dirty


def export_checked(lock: Lock, overlay: Overlay, dest: Path, *, check: bool) -> ExportResult:
    """``export_overlay`` of a checkout, refused where the checkout is stale: it has no
    commit or edit of the user's, and overlay/ changed since it was applied (a pull, a
    merge), so exporting would only write the older changes back."""
    from vllm_overlay.overlay.export import export_overlay

    if stale(dest, overlay):  # cheap (refs, status, a digest): the export runs once
        res = export_overlay(lock, overlay, dest, check=True)
        if res.differs:
            shown = [f"  overlay/{p}" for p in [*res.written, *res.removed]]
            raise StaleCheckoutError(
                f"{dest} is stale: overlay/ changed since it was applied (a pull or a merge), "
                "and the checkout holds no commit or edit of yours. Exporting it would write "
                "the older changes back over:\n" + "\n".join(shown) + "\nRun `vllm-overlay "
                "apply` to bring the checkout up to date, then edit and export."
            )
        if check:
            return res
    return export_overlay(lock, overlay, dest, check=check)


@dataclass(frozen=True)
class CheckoutState:
    """How a checkout relates to the overlay on disk: ``state`` is missing, foreign (not a
    checkout of ours), edited (uncommitted edits or new commits: run export), stale (the
    overlay changed: run apply) or matches; a checkout of ours also says its base, HEAD and
    how many files are uncommitted."""

    state: str
    base: str | None = None
    head: str | None = None
    dirty_files: int = 0

    @property
    def exists(self) -> bool:
        return self.state != "missing"

    @property
    def ours(self) -> bool:
        return self.state not in ("missing", "foreign")

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {"exists": self.exists, "state": self.state}
        if self.ours:
            out |= {"base": self.base, "head": self.head, "dirty_files": self.dirty_files}
        return out


def checkout_state(dest: Path, lock: Lock, overlay: Overlay) -> CheckoutState:
    """How a checkout relates to the overlay on disk (for status, edit, import, rebase)."""
    from vllm_overlay.overlay.export import export_overlay

    if not dest.exists():
        return CheckoutState("missing")
    if not is_checkout(dest):
        return CheckoutState("foreign")
    with open_repo(dest) as repo:
        applied = rev_parse(repo, APPLIED_REF)
        head = rev_parse(repo, "HEAD")
        base = rev_parse(repo, BASE_REF)
        dirty = uncommitted(repo)
    if not _unedited(head, applied, dirty):
        state = "edited"  # uncommitted edits or new commits: run export
    else:
        try:
            differs = export_overlay(lock, overlay, dest, check=True).differs
        except OverlayError:
            differs = True
        state = "stale" if differs else "matches"  # stale: the overlay changed; run apply
    return CheckoutState(state, base, head, len(dirty))
