"""Which members of a built wheel differ from the official wheel it started from."""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay.wheel.metadata import RecordRow, dist_info_dirs, parse_record


@dataclass(frozen=True)
class MemberDiff:
    changed: list[str]
    added: list[str]
    removed: list[str]
    renamed: list[tuple[str, str]]  # .dist-info members: (official name, new name)
    identical: int

    def lines(self) -> list[str]:
        out = [f"changed  {n}" for n in self.changed]
        out += [f"added    {n}" for n in self.added]
        out += [f"removed  {n}" for n in self.removed]
        out += [f"renamed  {a} -> {b}" for a, b in self.renamed]
        out.append(f"{self.identical} other members identical (name, sha256 and size per RECORD)")
        return out


def _record(path: Path) -> tuple[str, dict[str, RecordRow]]:
    with zipfile.ZipFile(path) as zf:
        di = dist_info_dirs(zf.namelist())[0]
        return di, parse_record(zf.read(f"{di}/RECORD"), f"{path.name}:{di}/RECORD")


def member_diff(official: Path, built: Path) -> MemberDiff:
    """Compare by RECORD (sha256 and size); .dist-info members are matched across the rename."""
    old_di, old = _record(official)
    new_di, new = _record(built)

    def key(name: str, di: str) -> str:
        return "<dist-info>" + name[len(di) :] if name.startswith(di + "/") else name

    old_by = {key(n, old_di): r for n, r in old.items()}
    new_by = {key(n, new_di): r for n, r in new.items()}
    changed, added, removed, renamed = [], [], [], []
    identical = 0
    for k, r in new_by.items():
        o = old_by.get(k)
        if o is None:
            added.append(r.path)
        elif (o.hash, o.size) != (r.hash, r.size) or k.endswith("/RECORD"):
            changed.append(r.path)
        elif o.path != r.path:
            renamed.append((o.path, r.path))
        else:
            identical += 1
    removed = [r.path for k, r in old_by.items() if k not in new_by]
    return MemberDiff(sorted(changed), sorted(added), sorted(removed), sorted(renamed), identical)
