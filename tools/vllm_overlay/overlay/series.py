"""The overlay as a series: changes in overlay.toml order, each applied to the tree the
previous ones left, several of them possibly touching one file.

Storage, per change, at vLLM's paths below the change's own directory:

- ``overlay/<change-id>/<path>.patch``: the change's patch of a file that exists before it
  (upstream's file, or one an earlier change added), against the file as the earlier changes
  left it;
- ``overlay/<change-id>/<path>``: a file that is absent before the change, whole.

``plan_series`` computes every step in memory (base hashes checked, every patch applied with
the strict applier) and raises before anything is written. ``migrate`` converts the older
one-change-per-file layout (``overlay/<path>.patch``, ``overlay/<path>``) into this one.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from vllm_overlay.errors import BaseMismatchError, OverlayConfigError, PatchError
from vllm_overlay.overlay.model import (
    CONFIG_NAME,
    PATCH_SUFFIX,
    Change,
    Overlay,
    safe_join,
)
from vllm_overlay.overlay.patches import apply_patch, parse_patch
from vllm_overlay.pin.lockfile import ABSENT, Lock, base_hash

ReadBase = Callable[[str], "bytes | None"]  # upstream file at the pin (None: absent)
ReadOverlay = Callable[[str], "bytes | None"]  # overlay-relative path -> bytes (None: missing)


@dataclass(frozen=True)
class PlannedChange:
    change: Change
    files: dict[str, bytes]  # path -> content after this change (the series up to here)
    added: frozenset[str] = field(default_factory=frozenset)  # paths absent before the change

    def overlay_path(self, path: str) -> str:
        """The overlay-relative file this change stores for ``path``."""
        return change_rel(self.change.id, path, added=path in self.added)


def change_rel(change_id: str, path: str, *, added: bool) -> str:
    return f"{change_id}/{path}" if added else f"{change_id}/{path}{PATCH_SUFFIX}"


def disk_reader(overlay: Overlay) -> ReadOverlay:
    def read(rel: str) -> bytes | None:
        p = safe_join(overlay.dir, rel)
        return p.read_bytes() if p.is_file() else None

    return read


def check_consistency(lock: Lock, overlay: Overlay) -> None:
    """Every path of the series has a [base] entry, every [base] entry belongs to a change."""
    from vllm_overlay.errors import LockFileError

    files = overlay.all_files()
    missing = [f for f in files if f not in lock.base]
    extra = [f for f in lock.base if f not in overlay.series_files()]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"lacks [base] entries for {missing}")
        if extra:
            parts.append(f"has [base] entries for files no change touches: {extra}")
        raise LockFileError(
            f"upstream.lock {' and '.join(parts)}. Record the overlay's files with "
            "`vllm-overlay lock --version " + lock.upstream.version + "` (it keeps the pin and "
            "rewrites [base])."
        )


def legacy_files(overlay: Overlay) -> list[str]:
    """Files of the one-change-per-file layout: a path of the series stored at
    ``overlay/<path>`` or ``overlay/<path>.patch``, outside any change's directory."""
    out = []
    for path in overlay.all_files():
        for rel in (path, path + PATCH_SUFFIX):
            if safe_join(overlay.dir, rel).is_file():
                out.append(rel)
    return out


def refuse_legacy(overlay: Overlay) -> None:
    legacy = legacy_files(overlay)
    if legacy:
        shown = "\n".join("    overlay/" + p for p in legacy[:20])
        raise OverlayConfigError(
            f"overlay/ holds files of the older one-change-per-file layout:\n{shown}\n"
            "The overlay keeps each change's files under overlay/<change-id>/. Convert it with "
            "`vllm-overlay export --migrate` (the applied tree stays the same)."
        )


def plan_series(
    lock: Lock, overlay: Overlay, read_base: ReadBase, read_overlay: ReadOverlay | None = None
) -> list[PlannedChange]:
    """Every change's result, in order; raises (naming change, file, hunk, line) first."""
    check_consistency(lock, overlay)
    if read_overlay is None:
        refuse_legacy(overlay)
        read_overlay = disk_reader(overlay)
    tree: dict[str, bytes | None] = {}
    touched: dict[str, list[str]] = {}  # path -> ids of the changes that touched it so far
    planned = []
    for n, change in enumerate(overlay.changes):
        later = {p: [c.id for c in overlay.changes[n + 1 :] if p in c.files] for p in change.files}
        out: dict[str, bytes] = {}
        added: set[str] = set()
        for path in change.files:
            if path not in tree:
                tree[path] = _checked_base(lock, path, read_base(path))
            before = tree[path]
            out[path] = _step(
                change, path, before, touched.get(path, []), later[path], read_overlay
            )
            if before is None:
                added.add(path)
            tree[path] = out[path]
            touched.setdefault(path, []).append(change.id)
        planned.append(PlannedChange(change, out, frozenset(added)))
    return planned


def _checked_base(lock: Lock, path: str, original: bytes | None) -> bytes | None:
    got, want = base_hash(original), lock.base[path]
    if got != want:
        found = "absent" if original is None else got
        raise BaseMismatchError(
            f"upstream file {path} differs from upstream.lock: expected {want}, found "
            f"{found} in the {lock.upstream.name} {lock.upstream.version} tree. The "
            "overlay was written against other code; nothing was applied. Check the pin "
            "(`vllm-overlay lock --check`) or rebase the overlay."
        )
    return original


def _step(
    change: Change,
    path: str,
    before: bytes | None,
    earlier: list[str],
    later: list[str],
    read: ReadOverlay,
) -> bytes:
    where = f"change {change.id!r}, file {path}"
    whole_rel = change_rel(change.id, path, added=True)
    patch_rel = change_rel(change.id, path, added=False)
    whole, patch = read(whole_rel), read(patch_rel)
    if before is None:
        if whole is None:
            raise OverlayConfigError(
                f"{where}: the file does not exist before this change (upstream lacks it"
                + (f" and {', '.join(earlier)} did not add it" if earlier else "")
                + f"), so overlay/{whole_rel} must hold it whole, but it does not exist. "
                "Run `vllm-overlay export`."
            )
        if patch is not None:
            raise OverlayConfigError(
                f"{where}: both overlay/{whole_rel} and overlay/{patch_rel} exist; a file "
                "absent before the change is stored whole. Remove the .patch (or re-export)."
            )
        return whole
    if patch is None:
        had = "upstream has it" if not earlier else f"change(s) {', '.join(earlier)} leave it"
        extra = f" (overlay/{whole_rel} holds a whole file instead)" if whole is not None else ""
        raise OverlayConfigError(
            f"{where}: overlay/{patch_rel} does not exist{extra}. The file exists before "
            f"this change ({had}), so the change stores a patch of it. Run `vllm-overlay export`."
        )
    fp = parse_patch(patch.decode("utf-8", errors="surrogateescape"), f"overlay/{patch_rel}")
    for side in (fp.old_path, fp.new_path):
        if side is not None and side != path:
            raise OverlayConfigError(
                f"{where}: overlay/{patch_rel} patches {side!r}, not {path!r}."
            )
    if not fp.hunks:
        raise OverlayConfigError(f"{where}: overlay/{patch_rel} has no hunks.")
    try:
        return apply_patch(before, fp, where)
    except PatchError as e:
        if not earlier and later:
            raise PatchError(
                f"{e.args[0]} Later change(s) {', '.join(later)} in overlay/{CONFIG_NAME} also "
                f"patch {path}: if {change.id!r} was written on top of them, the order of the "
                "[[change]] tables is wrong (a patch applies to the tree the changes before it "
                "leave). Nothing was applied."
            ) from e
        if not earlier:
            raise
        raise PatchError(
            f"{e.args[0].split(' The upstream file changed')[0]} The patch applies to {path} as "
            f"the earlier change(s) {', '.join(earlier)} leave it (overlay.toml order), and it "
            "was written against another version of it: the changes conflict in this order, or "
            f"an earlier change was edited without {change.id!r} being re-exported on top of "
            "it. Nothing was applied. Put the changes in the order they were written in "
            f"overlay/{CONFIG_NAME}, or redo {change.id!r} on top of the edited change "
            "(see docs/overlay.md, 'A patch that no longer applies')."
        ) from e


def final_tree(planned: list[PlannedChange]) -> dict[str, bytes]:
    """path -> content after the whole series."""
    out: dict[str, bytes] = {}
    for pc in planned:
        out.update(pc.files)
    return out


# ---------------------------------------------------------------------------------------------
# Migration from the one-change-per-file layout


@dataclass
class Migration:
    moves: list[tuple[str, str]] = field(default_factory=list)  # (old rel, new rel)


def plan_migration(lock: Lock, overlay: Overlay, read_base: ReadBase) -> Migration:
    """The moves that turn the old layout into the series layout, checked to give the same
    tree: both layouts are planned in memory and their results compared."""
    legacy = set(legacy_files(overlay))
    if not legacy:
        raise OverlayConfigError(
            "overlay/ is already in the series layout (no file of a change sits at "
            "overlay/<path>); nothing to migrate."
        )
    owners: dict[str, str] = {}
    for c in overlay.changes:
        for p in c.files:
            if p in owners:
                raise OverlayConfigError(
                    f"{p} is listed by changes {owners[p]!r} and {c.id!r}; the one-change layout "
                    "had one owner per file, so this overlay.toml is not that layout."
                )
            owners[p] = c.id
    mig = Migration()
    old_files: dict[str, bytes] = {}
    for path, cid in owners.items():
        added = lock.base.get(path) == ABSENT
        old_rel = path if added else path + PATCH_SUFFIX
        if old_rel not in legacy:
            raise OverlayConfigError(
                f"change {cid!r}: overlay/{old_rel} does not exist, so this is not a complete "
                "one-change layout; restore it from git before migrating."
            )
        new_rel = change_rel(cid, path, added=added)
        mig.moves.append((old_rel, new_rel))
        old_files[new_rel] = safe_join(overlay.dir, old_rel).read_bytes()
    old_tree = final_tree(_plan_legacy(lock, overlay, read_base))
    new_tree = final_tree(plan_series(lock, overlay, read_base, old_files.get))
    if old_tree != new_tree:  # cannot happen with one owner per file; checked all the same
        differ = sorted(p for p in old_tree if old_tree.get(p) != new_tree.get(p))
        raise OverlayConfigError(f"migration would change the applied tree at {differ}; stopped.")
    return mig


def _plan_legacy(lock: Lock, overlay: Overlay, read_base: ReadBase) -> list[PlannedChange]:
    def read_old(rel: str) -> bytes | None:
        cid, _, path = rel.partition("/")
        p = safe_join(overlay.dir, path)
        return p.read_bytes() if p.is_file() else None

    return plan_series(lock, overlay, read_base, read_old)


def migrate(overlay: Overlay, mig: Migration) -> None:
    """Move every file (copy, then remove the old ones: killed half-way, nothing is lost)."""
    from vllm_overlay.util import atomic_write_bytes

    for old_rel, new_rel in mig.moves:
        data = safe_join(overlay.dir, old_rel).read_bytes()
        atomic_write_bytes(safe_join(overlay.dir, new_rel), data)
    for old_rel, _ in mig.moves:
        old = safe_join(overlay.dir, old_rel)
        os.unlink(old)
        d = old.parent
        while d != overlay.dir and d.is_dir() and not any(d.iterdir()):
            d.rmdir()
            d = d.parent
