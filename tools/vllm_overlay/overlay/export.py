"""Write overlay/ back from a checkout, deterministically (same tree, same bytes).

Export walks the checkout's commits, one segment per change (overlay/commitwalk.py). For each
file a change lists: a file absent before the change is copied whole to
``overlay/<change-id>/<path>``; any other becomes ``overlay/<change-id>/<path>.patch``, the
``git diff`` from the tree before the change to the tree after it, with pinned diff options
and without the ``index`` line (no dates, no tool versions, no blob ids).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay.errors import OverlayError
from vllm_overlay.gitrepo import Repo, changed_since, opened, run_git, show_bytes, untracked
from vllm_overlay.overlay.commitwalk import Segment, walk_series
from vllm_overlay.overlay.model import CONFIG_NAME, Overlay, overlay_files, safe_join
from vllm_overlay.overlay.patches import canonical_diff
from vllm_overlay.overlay.series import change_rel
from vllm_overlay.pin.lockfile import Lock
from vllm_overlay.pin.trees import BASE_REF
from vllm_overlay.util import atomic_write_bytes

DIFF_OPTS = (
    "--no-color",
    "--no-ext-diff",
    "--no-textconv",
    "--no-renames",
    "--src-prefix=a/",
    "--dst-prefix=b/",
    "--unified=3",
    "--diff-algorithm=myers",
    "--indent-heuristic",
)


@dataclass
class ExportResult:
    written: list[str] = field(default_factory=list)  # overlay-relative paths added or changed
    removed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)

    @property
    def differs(self) -> bool:
        return bool(self.written or self.removed)


def file_diff(repo: Repo, base: str, path: str, rev: str | None = None) -> str:
    """The canonical patch of ``path``: ``base`` vs ``rev`` (None: the work tree).

    The text is the product (it is what overlay/ holds), so it comes from ``git diff`` with
    the options above, not from GitPython's parsed hunks.
    """
    revs = (base, rev) if rev else (base,)
    return canonical_diff(run_git(repo.git, "diff", *DIFF_OPTS, *revs, "--", path).stdout)


def changed_paths(repo: Repo, before: str, after: str | None = None) -> set[str]:
    """Paths that differ between two commits, or from ``before`` to the work tree (untracked,
    not ignored files included)."""
    paths = set(changed_since(repo, before, after))
    if after is None:
        paths |= set(untracked(repo))
    return paths


def expected_overlay(lock: Lock, overlay: Overlay, checkout: Path | Repo) -> dict[str, bytes]:
    """overlay-relative path -> bytes, as export would write them: each change's segment of
    the checkout's history (see overlay/commitwalk.py) against the tree before it."""
    with opened(checkout) as repo:
        root = Path(repo.working_tree_dir or "")
        _base, segments = walk_series(root, overlay)
        out: dict[str, bytes] = {}
        for seg in segments:
            out.update(_segment_files(repo, root, seg))
        return out


def _segment_files(repo: Repo, checkout: Path, seg: Segment) -> dict[str, bytes]:
    change = seg.change
    where = "uncommitted work and commits on top" if seg.top else f"commit(s) of {change.id!r}"
    stray = sorted(changed_paths(repo, seg.before, seg.after) - set(change.files))
    if stray:
        listed = "\n".join("    " + p for p in stray[:30])
        hint = (
            "Uncommitted edits and commits on top belong to the last change in overlay.toml; "
            "put an edit of another change into that change's commit (`git commit "
            f"--fixup=COMMIT`, then `git rebase -i --autosquash {BASE_REF}`), "
            if seg.top
            else "Move the edit into the commit of the change it belongs to "
            f"(`git rebase -i {BASE_REF}`), "
        )
        raise OverlayError(
            f"change {change.id!r} ({where} in {checkout}) changes files it does not list in "
            f"overlay/{CONFIG_NAME}:\n{listed}\n{hint}add them to the change's `files`, or "
            "revert them; nothing was exported."
        )
    out: dict[str, bytes] = {}
    for path in change.files:
        if show_bytes(repo, seg.before, path) is None:  # absent before: stored whole
            if seg.top:
                target = safe_join(checkout, path)
                data = target.read_bytes() if target.is_file() else None
            else:
                data = show_bytes(repo, seg.after or "", path)
            if data is None:
                raise OverlayError(
                    f"change {change.id!r}: {path} is missing from {checkout} ({where}). "
                    f"Restore it, or remove it from the change's files in overlay/{CONFIG_NAME}."
                )
            out[change_rel(change.id, path, added=True)] = data
            continue
        diff = file_diff(repo, seg.before, path, seg.after)
        if not diff.strip():
            raise OverlayError(
                f"change {change.id!r} ({where}) does not change {path} in {checkout}. Remove "
                f"it from the change's files in overlay/{CONFIG_NAME} (and from upstream.lock "
                "with `vllm-overlay lock --refresh-base` when no change touches it), or redo "
                "the edit."
            )
        out[change_rel(change.id, path, added=False)] = diff.encode(errors="surrogateescape")
    return out


RECORDS_DIR = "resolutions"  # the rebase's resolution records (rebase/records.py)


def export_overlay(
    lock: Lock, overlay: Overlay, checkout: Path | Repo, *, check: bool = False
) -> ExportResult:
    """Write (or with ``check``, only compare) overlay/ from ``checkout``."""
    want = expected_overlay(lock, overlay, checkout)
    have = {
        f.relative_to(overlay.dir).as_posix(): f
        for f in overlay_files(overlay.dir)
        if f.relative_to(overlay.dir).as_posix() != CONFIG_NAME
        and not f.relative_to(overlay.dir).as_posix().startswith(RECORDS_DIR + "/")
    }
    result = ExportResult()
    for rel in sorted(want):
        cur = have.get(rel)
        if cur is not None and cur.read_bytes() == want[rel]:
            result.unchanged.append(rel)
            continue
        result.written.append(rel)
        if not check:
            atomic_write_bytes(safe_join(overlay.dir, rel), want[rel])
    for rel in sorted(set(have) - set(want)):
        result.removed.append(rel)
        if not check:
            os.unlink(have[rel])
            _prune_empty_dirs(have[rel].parent, overlay.dir)
    return result


def _prune_empty_dirs(d: Path, stop: Path) -> None:
    while d != stop and d.is_dir() and not any(d.iterdir()):
        d.rmdir()
        d = d.parent
