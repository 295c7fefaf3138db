"""What the cache holds: its entries, each with its kind, lock, size, last use and whether it
is unused (``inventory``); ``cache.py`` removes and prunes them.

The cache (``util.cache_dir()``, ``~/.cache/vllm-overlay``) is a set of entries of a few
kinds, each a directory or file that is complete where it stands (every writer builds aside
and renames into place):

=============  ==============================================  ======================================
kind           entry                                           the lock a user or writer holds
=============  ==============================================  ======================================
artifacts      ``artifacts/sha256/<sha256>/`` (a release file)  ``locks/<sha256>.lock``
trees          ``trees/sdist-<sha256>.git``, ``git-<sha>.git``  ``locks/tree-<sha256|sha>.lock``
test-env,      ``testenv/<recipe hash>/`` (told apart by its    ``testenv/locks/<hash>.lock``: shared
engine-env,    recipe)                                          by every process using it
client-env,                                                     (``envbuild.hold``)
build-env
models         ``engine-models/<key>/``                         ``engine-models/<key>.lock``
outlook        ``outlook/{results,runs,members}/*``            none: written atomically, read whole
member-hashes  ``member-hashes/<sha256>.json``                  none: likewise
baselines      ``suite-baselines/<key>.json``                   none: likewise
uv             ``uv/`` (uv's own cache, one entry)              ``uv/.lock``, uv's own
ccache         ``ccache/<machine>-<compiler>/`` (the CPU        none: ccache's own files, each written
               source build's compiler cache)                   atomically
=============  ==============================================  ======================================

An entry's last use is its modification time; the tool touches an entry when it uses it
(``util.touch``), and holds it in use until the process exits (``util.hold``: a shared lock
on the entry's lock). An entry is *unused* when no current recipe or lock uses it: an artifact or a
tree the project's ``upstream.lock`` does not pin, an environment superseded in its slot
(``envbuild``) or built by an older format. Other kinds are never called unused (their keys
are content hashes; only age and size prune them).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay import util
from vllm_overlay.envs import layout
from vllm_overlay.errors import OverlayError
from vllm_overlay.pin.artifacts import lock_path as artifact_lock
from vllm_overlay.pin.lockfile import read_lock
from vllm_overlay.pin.trees import lock_path as tree_lock
from vllm_overlay.pin.trees import tree_key

KINDS = (
    "artifacts",
    "trees",
    "test-env",
    "engine-env",
    "client-env",
    "models",
    "outlook",
    "member-hashes",
    "baselines",
    "uv",
    "build-env",
    "ccache",
)
ENV_KINDS = ("test-env", "engine-env", "client-env", "build-env")


@dataclass(eq=False)  # compared by identity
class Entry:
    kind: str
    path: Path
    lock: Path | None  # taken exclusively, without waiting, to remove the entry
    size: int = 0  # freed by removing it
    shared: int = 0  # hard-linked from elsewhere too (not freed)
    last_use: float = 0.0
    unused: bool = False  # no current recipe or lock uses it
    why: str = ""  # what it is, or why it is unused
    slot: str = ""  # an environment's slot
    inodes: dict[tuple[int, int], int] = field(default_factory=dict, repr=False)  # -> bytes

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "path": os.fspath(self.path),
            "size": self.size,
            "shared": self.shared,
            "last_use": round(self.last_use, 3),
            "unused": self.unused,
            "why": self.why,
        }


def _walk(path: Path) -> dict[tuple[int, int], list[int]]:
    """Every inode under ``path``: (device, inode) -> [bytes on disk, links it has, links
    found here]."""
    found: dict[tuple[int, int], list[int]] = {}
    stack = [path]
    while stack:
        p = stack.pop()
        try:
            st = p.lstat()
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        if key in found:
            found[key][2] += 1
            continue
        is_dir = stat.S_ISDIR(st.st_mode)
        found[key] = [st.st_blocks * 512, 1 if is_dir else st.st_nlink, 1]  # dirs: no links
        if is_dir:
            try:
                stack.extend(p.iterdir())
            except OSError:
                pass
    return found


def _sizes(entries: list[Entry]) -> int:
    """Each entry's ``size`` (what removing it alone frees: files no other path links to),
    ``shared`` (files hard-linked from elsewhere too: uv links its cache into the
    environments) and ``inodes``; returns the bytes on disk of them all, each file once."""
    for e in entries:
        found = _walk(e.path)
        e.size = sum(b for b, nlink, here in found.values() if here >= nlink or nlink <= 1)
        e.shared = sum(b for b, nlink, here in found.values() if 1 < nlink and here < nlink)
        e.inodes = {key: b for key, (b, _, _) in found.items()}
    return on_disk_of(entries)


def on_disk_of(entries: Iterable[Entry]) -> int:
    """The bytes on disk of ``entries`` together, a file linked from several counted once:
    what the cache would hold with only these (exact, where the links are the cache's own)."""
    union: dict[tuple[int, int], int] = {}
    for e in entries:
        union.update(e.inodes)
    return sum(union.values())


def _project_pins() -> tuple[set[str], set[str]] | None:
    """(sha256s, commits) the project's upstream.lock pins; None outside a project."""
    try:
        lock = read_lock(util.project_root() / "upstream.lock")
    except (OverlayError, OSError):
        return None
    return {a.sha256 for a in lock.artifacts}, {lock.upstream.commit}


def _env_entry(path: Path) -> Entry:
    lock = layout.lock_path(path.name.split(".", 1)[0])
    if "." in path.name:  # <hash>.build-*, <hash>.old: a build in progress or killed
        return Entry("test-env", path, lock, unused=True, why="an unfinished build")
    marker = layout.read_marker(path)
    try:
        recipe = json.loads((path / layout.RECIPE).read_text())
    except (OSError, ValueError):
        recipe = None
    if marker is None or not isinstance(recipe, dict):
        return Entry("test-env", path, lock, unused=True, why="incomplete (no marker)")
    if "wheel" in recipe:
        kind, what = "engine-env", recipe["wheel"]
    elif "requirement" in recipe:
        kind, what = "client-env", recipe["requirement"]
    elif recipe.get("kind") == layout.BUILD_KIND:
        kind, what = "build-env", recipe.get("constraints_file", "?")
    else:
        kind = "test-env"
        what = recipe.get("upstream") or "a tree without a release"
    # The slot is the builder's (envbuild.ensure writes it); an environment built before
    # slots gets its own on its next use, and until then only age and size prune it.
    slot = marker.get("slot", "")
    entry = Entry(kind, path, lock, slot=slot, why=what)
    if recipe.get("format") != layout.FORMATS[kind]:
        entry.unused, entry.why = True, f"{what}: built by an older format"
    return entry


def _glob_entries(kind: str, pattern: str, lock: Callable[[Path], Path | None]) -> Iterator[Entry]:
    root = util.cache_dir()
    for p in sorted(root.glob(pattern)):
        if p.name.endswith(".lock"):
            continue
        yield Entry(kind, p, lock(p))


class Entries(list):
    """Entries, and ``on_disk``: their bytes on disk, a file linked from several counted
    once (0 where sizes were not taken)."""

    on_disk: int = 0


def inventory(kinds: Iterable[str] = KINDS, *, sizes: bool = True) -> Entries:
    """Every entry of the cache of ``kinds``, with its size (``sizes``: a walk of every
    file), last use and whether it is unused (see the module docstring)."""
    kinds = set(kinds)
    root = util.cache_dir()
    entries = Entries()
    if "artifacts" in kinds:
        entries += _glob_entries("artifacts", "artifacts/sha256/*", lambda p: artifact_lock(p.name))
    if "trees" in kinds:
        entries += _glob_entries("trees", "trees/*.git", lambda p: tree_lock(tree_key(p)))
    if kinds & set(ENV_KINDS):
        envs = root / "testenv"
        for p in sorted(envs.iterdir()) if envs.is_dir() else ():
            if p.name == "locks":
                continue
            e = _env_entry(p)
            if e.kind in kinds:
                entries.append(e)
    if "models" in kinds:
        entries += _glob_entries(
            "models", "engine-models/*", lambda p: p.with_name(f"{p.name.split('.')[0]}.lock")
        )
    if "outlook" in kinds:
        for part in ("results", "runs", "members"):
            entries += _glob_entries("outlook", f"outlook/{part}/*", lambda p: None)
    if "member-hashes" in kinds:
        entries += _glob_entries("member-hashes", "member-hashes/*", lambda p: None)
    if "baselines" in kinds:
        entries += _glob_entries("baselines", "suite-baselines/*", lambda p: None)
    if "ccache" in kinds:
        entries += _glob_entries("ccache", "ccache/*", lambda p: None)
    if "uv" in kinds and (root / "uv").is_dir():
        entries.append(Entry("uv", root / "uv", root / "uv" / ".lock", why="uv's own cache"))
    for e in entries:
        e.last_use = e.path.lstat().st_mtime if os.path.lexists(e.path) else 0.0
    if sizes:
        entries.on_disk = _sizes(entries)
    _mark_unused(entries)
    return entries


def _mark_unused(entries: list[Entry]) -> None:
    pins = _project_pins()
    if pins is not None:
        shas, commits = pins
        for e in entries:
            if e.kind == "artifacts" and e.path.name not in shas:
                e.unused, e.why = True, "not pinned by upstream.lock"
            elif e.kind == "trees":
                key = tree_key(e.path)
                if key not in shas and key not in commits:
                    e.unused, e.why = True, "not pinned by upstream.lock"
    newest: dict[str, tuple[float, Entry]] = {}  # slot -> the newest build of it
    for e in entries:
        if e.kind in ENV_KINDS and e.slot and not e.unused:
            built = (e.path / layout.MARKER).stat().st_mtime
            if e.slot not in newest or built > newest[e.slot][0]:
                newest[e.slot] = (built, e)
    for e in entries:
        if e.kind in ENV_KINDS and e.slot and not e.unused and newest[e.slot][1] is not e:
            e.unused, e.why = True, f"superseded in its slot ({e.slot})"
