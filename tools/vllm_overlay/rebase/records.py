"""Resolution records: a conflict a person resolved once is never asked again.

As git rerere keys its records, a record is keyed by the exact three sides of one conflicting
hunk of ``git merge-file --diff3`` (the release's lines, the lines our change was written
against, our lines), and holds the lines the person put there. When a file's hunks do not
line up with the person's result (edits outside the markers), the record covers the whole
file: its key is the three whole files.

Records live in two places, read together:

- ``overlay/resolutions/<change-id>/<key>.json``: reviewed in the diff like any change. A
  rebase that completes writes the records its walk made or used there (for review), and
  prunes the others whose release is at or before the new pin: their conflict can no longer
  occur, since every walk starts after the pin.
- ``.work/resolutions/`` (the same layout): the records of a walk still in progress, so that
  a rebase after ``--abort`` (which restores overlay/ byte for byte) reuses them.

A record applies only to an identical conflict (every hunk of the file has one, or the whole
file does), and the walk then runs the change's tests on the release with the result before it
counts: a record never silently applies a wrong merge.

A person who resolves a stop to upstream's code drops the change there; that too is recorded
(scope ``drop``), keyed by the change's files on the three sides taken together (the
release's, the base's, ours: each file's sha256, or absent). A walk that meets the
change in exactly that state drops it again, with the drop's proof (the change's tests on
the pristine release), and asks nobody; a deleted file (a ``moved`` stop) is such a state too.

A person's resolution is proven before it is recorded: ``rebase --continue`` runs the change's
tests at the stop's release with it, and records it only when they pass (``proof``: what
passed). ``--continue --unproven REASON`` records it anyway, marked ``unproven`` (who, why,
which tests failed); ``status`` and the outlook show the mark, and a walk applies such a
record only where the change's tests pass with it, like any other.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from vllm_overlay.overlay.export import RECORDS_DIR
from vllm_overlay.overlay.project import Project
from vllm_overlay.rebase.state import Paths
from vllm_overlay.util import atomic_write_text, info, sha256_bytes

DIR = RECORDS_DIR  # overlay/resolutions/
FORMAT = 1
HUNK, FILE, DROP = "hunk", "file", "drop"  # a record's scope


@dataclass(frozen=True)
class Record:
    change: str
    key: str
    path: str  # where the conflict was (for people: the key does not include it)
    release: str  # the release the conflict was met at
    scope: str  # HUNK, FILE or DROP (then ``path`` names the change's files, space-separated)
    release_side: str
    base_side: str
    ours_side: str
    resolution: str
    proof: str = ""  # the tests that passed with it where it was made ("" before proofs)
    unproven: dict | None = None  # recorded though its tests failed: who, why, failing

    def to_json(self) -> str:
        data = {
            "format": FORMAT,
            "change": self.change,
            "path": self.path,
            "release": self.release,
            "scope": self.scope,
            "key": self.key,
            "release_side": self.release_side.splitlines(keepends=True),
            "base_side": self.base_side.splitlines(keepends=True),
            "ours_side": self.ours_side.splitlines(keepends=True),
            "resolution": self.resolution.splitlines(keepends=True),
        }
        if self.proof:
            data["proof"] = self.proof
        if self.unproven is not None:
            data["unproven"] = self.unproven
        return json.dumps(data, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Record:
        d = json.loads(text)
        return cls(
            change=d["change"], key=d["key"], path=d["path"], release=d["release"],
            scope=d["scope"], release_side="".join(d["release_side"]),
            base_side="".join(d["base_side"]), ours_side="".join(d["ours_side"]),
            resolution="".join(d["resolution"]), proof=d.get("proof", ""),
            unproven=d.get("unproven"),
        )  # fmt: skip

    @property
    def relpath(self) -> str:
        return f"{self.change}/{self.key[:16]}.json"


def key_of(release_side: str, base_side: str, ours_side: str) -> str:
    return sha256_bytes(
        json.dumps([release_side, base_side, ours_side], ensure_ascii=False).encode()
    )


# ---------------------------------------------------------------------------------------------
# diff3 results: the regions between markers


@dataclass(frozen=True)
class Hunk:
    release_side: str
    base_side: str
    ours_side: str

    @property
    def key(self) -> str:
        return key_of(self.release_side, self.base_side, self.ours_side)


def split_diff3(merged: str) -> tuple[list[str], list[Hunk]] | None:
    """(the common texts around the hunks, the hunks): len(common) == len(hunks) + 1.
    None when the markers are not the plain diff3 shape git merge-file writes."""
    lines = merged.splitlines(keepends=True)
    common, hunks = [""], []
    i = 0
    while i < len(lines):
        if not lines[i].startswith("<<<<<<< "):
            common[-1] += lines[i]
            i += 1
            continue
        sides = ["", "", ""]
        which = 0
        i += 1
        while i < len(lines):
            ln = lines[i]
            if which == 0 and ln.startswith("||||||| "):
                which = 1
            elif which == 1 and ln.rstrip("\n") == "=======":
                which = 2
            elif which == 2 and ln.startswith(">>>>>>> "):
                break
            elif ln.startswith(("<<<<<<< ", ">>>>>>> ")):
                return None
            else:
                sides[which] += ln
            i += 1
        else:
            return None
        if which != 2:
            return None
        hunks.append(Hunk(*sides))
        common.append("")
        i += 1
    return common, hunks


def derive(
    change: str, path: str, release: str, merged: bytes, resolved: bytes, sides: tuple[bytes, bytes, bytes]
) -> list[Record]:  # fmt: skip
    """The records a person's ``resolved`` file makes of the diff3 ``merged`` one: one per
    hunk when the text around the hunks is kept as it was, else one for the whole file
    (``sides``: the release's, the base's and our whole file)."""
    m, r = merged.decode(errors="surrogateescape"), resolved.decode(errors="surrogateescape")
    split = split_diff3(m)
    if split is not None:
        common, hunks = split
        pieces = _between(common, r)
        if pieces is not None:
            recs = [
                Record(
                    change,
                    h.key,
                    path,
                    release,
                    HUNK,
                    h.release_side,
                    h.base_side,
                    h.ours_side,
                    piece,
                )  # fmt: skip
                for h, piece in zip(hunks, pieces, strict=True)
            ]
            if apply(m, {x.key: x for x in recs}) == r:
                return recs
    return [whole_file(change, path, release, sides, resolved)]


def whole_file(change: str, path: str, release: str, sides: tuple[bytes, bytes, bytes],
               resolved: bytes) -> Record:  # fmt: skip
    """A record of the whole file: keyed by its three sides (the release's file, the base's,
    ours; empty when absent). Also what a person's edit of a file that merged cleanly (a test
    moved to the release's new API, say) becomes, so that it too is not asked again."""
    new, old, ours = (s.decode(errors="surrogateescape") for s in sides)
    r = resolved.decode(errors="surrogateescape")
    return Record(change, key_of(new, old, ours), path, release, FILE, new, old, ours, r)


def side(files: Mapping[str, bytes | None]) -> str:
    """The change's files on one side of a drop record: a line per path, in order, with its
    content's sha256 or "absent". Hashes, not texts: the record matches the same state all
    the same, and the overlay carries no copy of vLLM's files."""
    return "".join(
        f"{path} {'absent' if files[path] is None else 'sha256:' + sha256_bytes(files[path])}\n"
        for path in sorted(files)
    )


def drop(change: str, release: str, sides: tuple[Mapping, Mapping, Mapping]) -> Record:
    """The record of a person's drop of ``change`` at ``release``: ``sides`` are the change's
    files (path -> bytes, None: absent) in the release as the walk met them, at the change's
    base, and ours."""
    new, old, ours = (side(s) for s in sides)
    return Record(change, key_of(new, old, ours), " ".join(sorted(sides[2])), release, DROP,
                  new, old, ours, "")  # fmt: skip


def find_drop(change: str, sides: tuple[Mapping, Mapping, Mapping],
              found: dict[str, Record]) -> Record | None:  # fmt: skip
    """The record of a person's drop of ``change`` in exactly this state (None: there is none)."""
    rec = found.get(key_of(*(side(s) for s in sides)))
    return rec if rec is not None and rec.change == change and rec.scope == DROP else None


def _between(common: list[str], resolved: str) -> list[str] | None:
    """The texts of ``resolved`` between the common texts, in order (None: they are not there)."""
    if not resolved.startswith(common[0]):
        return None
    pos, out = len(common[0]), []
    for k, text in enumerate(common[1:], start=1):
        if k == len(common) - 1:
            end = len(resolved) - len(text)
            if end < pos or not resolved.endswith(text):
                return None
        else:
            end = resolved.find(text, pos) if text else pos
            if end < 0:
                return None
        out.append(resolved[pos:end])
        pos = end + len(text)
    return out


def apply(merged: str, by_key: dict[str, Record]) -> str | None:
    """``merged`` with every hunk replaced by its record's resolution (None: a hunk has none)."""
    split = split_diff3(merged)
    if split is None:
        return None
    common, hunks = split
    out = common[0]
    for h, text in zip(hunks, common[1:], strict=True):
        rec = by_key.get(h.key)
        if rec is None or rec.scope != HUNK:
            return None
        out += rec.resolution + text
    return out


def resolve(change: str, merged: bytes, sides: tuple[bytes, bytes, bytes],
            records: dict[str, Record]) -> tuple[bytes, list[Record]] | None:  # fmt: skip
    """The file as the records resolve it, and the records used (None: not every hunk has
    an identical record)."""
    new, old, ours = (s.decode(errors="surrogateescape") for s in sides)
    whole = records.get(key_of(new, old, ours))
    if whole is not None and whole.change == change and whole.scope == FILE:
        return whole.resolution.encode(errors="surrogateescape"), [whole]
    mine = {k: r for k, r in records.items() if r.change == change}
    text = apply(merged.decode(errors="surrogateescape"), mine)
    if text is None:
        return None
    used = [mine[h.key] for h in split_diff3(merged.decode(errors="surrogateescape"))[1]]  # type: ignore[index]
    return text.encode(errors="surrogateescape"), list({r.key: r for r in used}.values())


# ---------------------------------------------------------------------------------------------
# Stores


def load(*dirs: Path) -> dict[str, Record]:
    """Every record under the given stores, by key (the first store wins)."""
    out: dict[str, Record] = {}
    for d in reversed(dirs):
        if not d.is_dir():
            continue
        for p in sorted(d.glob("*/*.json")):
            rec = Record.from_json(p.read_text())
            if rec.key != key_of(rec.release_side, rec.base_side, rec.ours_side):
                info(f"ignoring the resolution record {p}: its key is not the hash of its three "
                     "sides (edited by hand?); it never applies")  # fmt: skip
                continue
            out[rec.key] = rec
    return out


def stores(project: Project) -> dict[str, Path]:
    """Where a project's records live: "overlay" (reviewed, overlay/resolutions/) and "work"
    (walks not finished yet, ``Paths.records``), in the order ``load`` reads them."""
    return {"overlay": project.overlay_dir / DIR, "work": Paths(project).records}


def listing(project: Project) -> list[dict]:
    """Every record a rebase of the project reuses, as ``status`` shows them: by store, then
    by change and key."""
    out = []
    for where, d in stores(project).items():
        for key, r in sorted(load(d).items(), key=lambda kv: kv[1].relpath):
            out.append({"change": r.change, "release": r.release, "path": r.path,
                        "scope": r.scope, "key": key, "in": where, "proof": r.proof,
                        "unproven": r.unproven})  # fmt: skip
    return out


def save(store: Path, rec: Record) -> None:
    atomic_write_text(store / rec.relpath, rec.to_json())


def write_overlay(overlay_dir: Path, records: list[Record], pin: str) -> list[str]:
    """Write ``records`` (those this walk made or used) into overlay/resolutions/, and remove
    every other record there whose release is at or before ``pin`` (the new pin: its conflict
    can no longer occur); returns the paths removed (relative to overlay/)."""
    store = overlay_dir / DIR
    keep = {r.relpath: r for r in records}
    removed = []
    if store.is_dir():
        for p in sorted(store.glob("*/*.json")):
            rel = p.relative_to(store).as_posix()
            rec = Record.from_json(p.read_text())
            if rel not in keep and Version(rec.release) <= Version(pin):
                p.unlink()
                removed.append(f"{DIR}/{rel}")
            else:
                keep.setdefault(rel, rec)
    for rec in keep.values():
        save(store, rec)
    if store.is_dir():
        for d in sorted(store.iterdir()):
            if d.is_dir() and not any(d.iterdir()):
                os.rmdir(d)
        if not any(store.iterdir()):
            os.rmdir(store)
    return removed
