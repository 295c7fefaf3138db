"""Write overlay/ back from a checkout, deterministically (same tree, same bytes).

For each file a change lists: a file absent upstream is copied whole; an upstream file
becomes ``overlay/<path>.patch``, the ``git diff`` of the base against the work tree with
pinned diff options and without the ``index`` line (no dates, no tool versions, no blob ids).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay.errors import CheckoutError, OverlayError
from vllm_overlay.gitrepo import (
    Repo,
    changed_since,
    opened,
    rev_parse,
    run_git,
    untracked,
)
from vllm_overlay.overlay.model import CONFIG_NAME, PATCH_SUFFIX, Overlay, overlay_files, safe_join
from vllm_overlay.overlay.patches import canonical_diff
from vllm_overlay.pin.lockfile import ABSENT, Lock
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


def changed_paths(repo: Repo, base: str) -> set[str]:
    """Paths that differ from base in the work tree, untracked (not ignored) files included."""
    return set(changed_since(repo, base)) | set(untracked(repo))


def expected_overlay(lock: Lock, overlay: Overlay, checkout: Path | Repo) -> dict[str, bytes]:
    """overlay-relative path -> bytes, as export would write them."""
    with opened(checkout) as repo:
        return _expected(lock, overlay, repo)


def _expected(lock: Lock, overlay: Overlay, repo: Repo) -> dict[str, bytes]:
    checkout = Path(repo.working_tree_dir or "")
    base = rev_parse(repo, BASE_REF)
    if base is None:
        raise CheckoutError(
            f"{checkout} is not a vllm-overlay checkout (no {BASE_REF}). Create one with "
            "`vllm-overlay apply --checkout DIR` or `vllm-overlay edit`."
        )
    owned = set(overlay.all_files())
    stray = sorted(changed_paths(repo, base) - owned)
    if stray:
        listed = "\n".join("    " + p for p in stray[:30])
        raise OverlayError(
            f"{checkout} changes files that belong to no change in overlay/{CONFIG_NAME}:\n"
            f"{listed}\nAdd each to the `files` of the change it belongs to (or a new "
            "[[change]]), or revert it in the checkout; nothing was exported."
        )
    out: dict[str, bytes] = {}
    for change in overlay.changes:
        for path in change.files:
            target = safe_join(checkout, path)
            if lock.base.get(path) == ABSENT:
                if not target.is_file():
                    raise OverlayError(
                        f"change {change.id!r}: {path} is missing from {checkout}. Restore it, "
                        f"or remove it from the change's files in overlay/{CONFIG_NAME}."
                    )
                out[path] = target.read_bytes()
            else:
                diff = file_diff(repo, base, path)
                if not diff.strip():
                    raise OverlayError(
                        f"change {change.id!r}: {path} no longer differs from upstream in "
                        f"{checkout}. Remove it from the change's files in overlay/{CONFIG_NAME} "
                        "(and from upstream.lock with `vllm-overlay lock`), or redo the edit."
                    )
                out[path + PATCH_SUFFIX] = diff.encode()
    return out


def export_overlay(
    lock: Lock, overlay: Overlay, checkout: Path | Repo, *, check: bool = False
) -> ExportResult:
    """Write (or with ``check``, only compare) overlay/ from ``checkout``."""
    with opened(checkout) as repo:
        want = _expected(lock, overlay, repo)
    have = {
        f.relative_to(overlay.dir).as_posix(): f
        for f in overlay_files(overlay.dir)
        if f.relative_to(overlay.dir).as_posix() != CONFIG_NAME
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
