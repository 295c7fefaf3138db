"""The cache's size cap, and removing and pruning its entries: ``vllm-overlay cache``'s
library. What the cache holds, its kinds of entry and which are unused, is
``cacheentries.py``.

Removal takes the entry's lock without waiting (``util.lock_if_free``); an entry that
another process holds is passed by and said so. A removed entry is first renamed into
``trash/`` (one atomic step: the entry is there whole or gone), then deleted: a prune
killed at any point leaves no half-removed entry where a later run would look, and the next
prune (or build) empties ``trash/``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay import util
from vllm_overlay.envs.cacheentries import ENV_KINDS, KINDS, Entry, inventory, on_disk_of
from vllm_overlay.errors import UsageError

MAX_SIZE_ENV = "VLLM_OVERLAY_CACHE_MAX_SIZE"
TRASH = "trash"
_max_size: int | None = None  # --cache-max-size of this invocation; None: env or no cap


# -- sizes ----------------------------------------------------------------------------------

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """``20G``, ``500M``, ``1.5T``, ``12345`` (bytes; K/M/G/T are powers of 1024, an
    optional ``B`` or ``iB`` after them)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if m is None:
        raise UsageError(f"{text!r} is not a size: give bytes or a number with K, M, G or T")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: int) -> str:
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit]:
            return f"{n / _UNITS[unit]:.1f} {unit}iB"
    return f"{n} B"


def set_max_size(size: int | None) -> None:
    """The cap of this process (``--cache-max-size``); None: $VLLM_OVERLAY_CACHE_MAX_SIZE."""
    global _max_size
    _max_size = size


def max_size() -> int | None:
    """The cache's size cap in bytes: --cache-max-size, else $VLLM_OVERLAY_CACHE_MAX_SIZE,
    else None (no cap)."""
    if _max_size is not None:
        return _max_size
    env = os.environ.get(MAX_SIZE_ENV, "").strip()
    return parse_size(env) if env else None


# -- removal --------------------------------------------------------------------------------


def empty_trash() -> None:
    """Delete what a killed prune left in ``trash/`` (never an entry a run would use)."""
    trash = util.cache_dir() / TRASH
    for p in trash.iterdir() if trash.is_dir() else ():
        _delete(p)


def _delete(p: Path) -> None:
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


def remove(entry: Entry) -> bool:
    """Remove ``entry`` if nobody uses it now: renamed into trash/ under its lock (atomic),
    then deleted. False where its lock is held (in use) or it is already gone."""
    trash = util.cache_dir() / TRASH
    trash.mkdir(parents=True, exist_ok=True)
    with _locked(entry.lock) as free:
        if not free or not os.path.lexists(entry.path):
            return False
        dest = trash / f"{entry.path.name}.{uuid.uuid4().hex[:8]}"
        os.replace(entry.path, dest)
    _delete(dest)
    return True


def _locked(lock: Path | None):
    return util.lock_if_free(lock) if lock is not None else contextlib.nullcontext(True)


# -- prune ----------------------------------------------------------------------------------


@dataclass
class PruneResult:
    chosen: list[Entry] = field(default_factory=list)  # what the rules picked
    removed: list[Entry] = field(default_factory=list)
    in_use: list[Entry] = field(default_factory=list)  # picked, but another process holds it
    total_before: int = 0
    total_after: int = 0


def choose(
    entries: list[Entry],
    *,
    older_than: float | None = None,
    max_total: int | None = None,
    unused: bool = False,
    keep: Iterable[Path] = (),
    now: float | None = None,
) -> list[Entry]:
    """The entries the rules pick, oldest use first: unused ones (``unused``), those last
    used more than ``older_than`` seconds ago, then the least recently used until the rest
    fit in ``max_total`` bytes (counted with ``on_disk_of``: a file linked from several
    entries is freed with the last of them). ``keep`` is never picked."""
    now = time.time() if now is None else now
    kept = {Path(k) for k in keep}
    pool = sorted((e for e in entries if e.path not in kept), key=lambda e: e.last_use)
    picked: list[Entry] = []
    for e in pool:
        if (unused and e.unused) or (older_than is not None and now - e.last_use > older_than):
            picked.append(e)
    if max_total is not None:
        rest = [e for e in entries if e not in picked]
        for e in pool:
            if on_disk_of(rest) <= max_total:
                break
            if e not in picked:
                picked.append(e)
                rest.remove(e)
    return picked


def prune(
    *,
    older_than: float | None = None,
    max_total: int | None = None,
    unused: bool = False,
    kinds: Iterable[str] = KINDS,
    dry_run: bool = False,
    keep: Iterable[Path] = (),
    progress: Callable[[str], None] | None = None,
) -> PruneResult:
    """Remove what the rules pick (``choose``); with ``dry_run`` only say what. An entry in
    use is passed by; ``max_total`` then takes the next least recently used. The cache is
    walked once: what each removal frees is known from the entries' inodes."""
    keep = [Path(k) for k in keep]
    if not dry_run:
        empty_trash()
    entries = inventory(kinds)
    res = PruneResult(total_before=entries.on_disk)
    if dry_run:
        res.chosen = choose(entries, older_than=older_than, max_total=max_total, unused=unused,
                            keep=keep)  # fmt: skip
        res.total_after = on_disk_of(e for e in entries if e not in res.chosen)
        return res
    rest = list(entries)  # what stays on disk

    def take(e: Entry) -> None:
        res.chosen.append(e)
        if remove(e):
            res.removed.append(e)
            rest.remove(e)
            if progress:
                progress(f"removed {e.kind} {e.path.name} ({format_size(e.size)}, {e.why})")
        else:
            res.in_use.append(e)
            if progress:
                progress(f"kept {e.kind} {e.path}: in use by another process")

    for e in choose(entries, older_than=older_than, unused=unused, keep=keep):
        take(e)
    while max_total is not None and on_disk_of(rest) > max_total:
        tried = keep + [e.path for e in res.chosen]
        pick = choose(rest, max_total=max_total, keep=tried)
        if not pick:
            break  # what is left is kept, in use, or already tried
        take(pick[0])
    res.total_after = on_disk_of(rest)
    return res


def enforce_cap(keep: Iterable[Path] = ()) -> PruneResult | None:
    """Keep the cache under its size cap (``max_size``) after a build added to it: the
    least recently used entries go, never ``keep`` or one in use. None without a cap."""
    cap = max_size()
    if cap is None:
        return None
    res = prune(max_total=cap, keep=keep)
    for e in res.removed:
        util.info(f"cache: over its cap of {format_size(cap)}: removed {e.kind} {e.path}")
    if res.total_after > cap:
        util.info(
            f"cache: {format_size(res.total_after)} is over its cap of {format_size(cap)}; "
            "what is left is in use or was just built"
        )
    return res


def retire(slot: str, keep: Path) -> list[Entry]:
    """Remove the environments of ``slot`` other than ``keep`` (superseded by it), each if
    nobody uses it now; the ones in use stay for a later prune. Returns those removed."""
    removed = []
    for e in inventory(ENV_KINDS, sizes=False):
        if e.slot == slot and e.path != keep:
            if remove(e):
                removed.append(e)
                util.info(f"cache: retired {e.kind} {e.path.name} ({e.why}), superseded")
            else:
                util.info(f"cache: {e.path} is superseded but in use; a later prune removes it")
    return removed
