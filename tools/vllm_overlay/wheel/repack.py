"""The repack strategy: the official wheel with the overlay's files put in.

Every member the overlay does not touch is copied with its compressed bytes as they are
(see ``zipcopy``); the changed files, ``vllm/_version.py``, METADATA, the provenance record
and RECORD are written anew. Order: the official wheel's members in its order (changed ones
in place), then files the overlay adds (sorted), then the ``.dist-info`` members in the
official order with the provenance record and, last, RECORD. Members written anew keep the
date and mode of the member they replace; new members get the official wheel's newest
member date. Nothing depends on the clock, so the same inputs give the same bytes.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from vllm_overlay.errors import BuildError
from vllm_overlay.wheel.metadata import (
    VERSION_PY,
    RecordRow,
    WheelName,
    dist_info_dirs,
    metadata_version,
    parse_name,
    parse_record,
    record_hash,
    render_record,
    set_metadata_version,
    set_version_py,
)
from vllm_overlay.wheel.provenance import PROVENANCE_NAME
from vllm_overlay.wheel.zipcopy import REGULAR_FILE_MODE, ZipWriter
from vllm_overlay.wheel.zipread import SourceMember, locate_members, read_member


@dataclass(frozen=True)
class RepackInput:
    official: Path
    version: str  # the new version (METADATA, file name, .dist-info)
    replace: Mapping[str, bytes]  # member -> new content; the official wheel has each
    add: Mapping[str, bytes] = field(default_factory=dict)  # new members
    version_py: str | None = None  # what vllm/_version.py reports; None: leave it as is
    provenance: bytes = b""
    tags: str | None = None  # the output file name's tags; None: the input's


@dataclass(frozen=True)
class OfficialWheel:
    """The official wheel, read: its name, members, .dist-info and RECORD."""

    path: Path
    name: WheelName
    members: list[SourceMember]
    dist_info: str
    record: dict[str, RecordRow]

    @functools.cached_property
    def by_name(self) -> dict[str, SourceMember]:
        return {m.name: m for m in self.members}

    def member(self, name: str) -> SourceMember | None:
        return self.by_name.get(name)

    def read(self, name: str) -> bytes:
        m = self.by_name.get(name)
        if m is None:
            raise BuildError(f"{self.path.name} has no member {name}.")
        with open(self.path, "rb") as f:
            return read_member(f, m)

    @property
    def date_time(self) -> tuple[int, int, int, int, int, int]:
        return max(m.info.date_time for m in self.members)


def read_official(path: Path) -> OfficialWheel:
    name = parse_name(path.name)
    members = locate_members(path)
    names = [m.name for m in members]
    dirs = dist_info_dirs(names)
    if dirs != [name.dist_info]:
        raise BuildError(
            f"{path.name}: expected one .dist-info directory {name.dist_info}, found {dirs}."
        )
    wheel = OfficialWheel(path, name, members, name.dist_info, {})
    record_name = f"{name.dist_info}/RECORD"
    if wheel.member(record_name) is None:
        raise BuildError(f"{path.name} has no {record_name}.")
    record = parse_record(wheel.read(record_name), f"{path.name}:{record_name}")
    meta_name = f"{name.dist_info}/METADATA"
    got = metadata_version(wheel.read(meta_name), f"{path.name}:{meta_name}")
    if got != name.version:
        raise BuildError(f"{path.name}: METADATA says version {got}, the file name {name.version}.")
    return OfficialWheel(path, name, members, name.dist_info, record)


def repack(inp: RepackInput, out_dir: Path, official: OfficialWheel | None = None) -> Path:
    """Write the repacked wheel into ``out_dir`` (a new file there); return its path.

    ``official``: ``inp.official`` already read (saves reading its directory again). On
    failure no file is left behind."""
    if official is None or official.path != inp.official:
        official = read_official(inp.official)
    new = official.name.with_version(inp.version)
    if inp.tags:
        new = new.with_tags(inp.tags)
    _check_paths(official, inp)
    replace = dict(inp.replace)
    if inp.version_py is not None and official.member(VERSION_PY) is not None:
        replace[VERSION_PY] = set_version_py(official.read(VERSION_PY), inp.version_py)
    out = out_dir / new.filename
    try:
        with open(inp.official, "rb") as src, open(out, "xb") as f, ZipWriter(f) as zw:
            rows = _write_body(zw, src, official, replace, inp.add)
            _write_dist_info(zw, src, official, new.dist_info, inp, rows)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            out.unlink()
        raise
    return out


def _write_body(
    zw: ZipWriter,
    src: BinaryIO,
    official: OfficialWheel,
    replace: Mapping[str, bytes],
    add: Mapping[str, bytes],
) -> list[RecordRow]:
    """The package members (official order, changed ones in place), then added files."""
    rows = []
    for m in official.members:
        if m.name.startswith(official.dist_info + "/"):
            continue
        if m.name.endswith("/"):  # a directory entry (auditwheel writes them): no content,
            continue  # never in RECORD; installers make directories from the files' paths
        if m.name in replace:
            data = replace[m.name]
            zw.add(m.name, data, date_time=m.info.date_time, mode=_mode(m))
            rows.append(RecordRow(m.name, record_hash(data), len(data)))
        else:
            zw.copy(src, m)
            rows.append(_official_row(official, m.name, m.name))
    for name in sorted(add):
        zw.add(name, add[name], date_time=official.date_time, mode=REGULAR_FILE_MODE)
        rows.append(RecordRow(name, record_hash(add[name]), len(add[name])))
    return rows


def _write_dist_info(
    zw: ZipWriter,
    src: BinaryIO,
    official: OfficialWheel,
    new_di: str,
    inp: RepackInput,
    rows: list[RecordRow],
) -> None:
    """The renamed .dist-info: METADATA with the new version, the other files copied, the
    provenance record, and RECORD last."""
    old_di = official.dist_info
    meta_name, record_name = f"{old_di}/METADATA", f"{old_di}/RECORD"
    for m in official.members:
        if not m.name.startswith(old_di + "/") or m.name == record_name or m.name.endswith("/"):
            continue
        renamed = new_di + m.name[len(old_di) :]
        if m.name == meta_name:
            data = set_metadata_version(official.read(meta_name), inp.version, meta_name)
            zw.add(renamed, data, date_time=m.info.date_time, mode=_mode(m))
            rows.append(RecordRow(renamed, record_hash(data), len(data)))
        else:
            zw.copy(src, m, rename=renamed)
            rows.append(_official_row(official, m.name, renamed))
    prov = f"{new_di}/{PROVENANCE_NAME}"
    zw.add(prov, inp.provenance, date_time=official.date_time)
    rows.append(RecordRow(prov, record_hash(inp.provenance), len(inp.provenance)))
    rows.append(RecordRow(f"{new_di}/RECORD", "", None))
    old_record = official.by_name[record_name]
    zw.add(
        f"{new_di}/RECORD",
        render_record(rows),
        date_time=old_record.info.date_time,
        mode=_mode(old_record),
    )


def _mode(m: SourceMember) -> int:
    return (m.info.external_attr >> 16) or REGULAR_FILE_MODE


def _official_row(official: OfficialWheel, old: str, new: str) -> RecordRow:
    row = official.record.get(old)
    if row is None or not row.hash or row.size is None:
        raise BuildError(
            f"{official.path.name}: RECORD has no hash and size for {old}, so its copy cannot "
            "be recorded. The official wheel is malformed; use --strategy precompiled."
        )
    return RecordRow(new, row.hash, row.size)


def _check_paths(official: OfficialWheel, inp: RepackInput) -> None:
    names = {m.name for m in official.members}
    missing = sorted(set(inp.replace) - names)
    if missing:
        raise BuildError(
            f"{official.path.name} does not contain {', '.join(missing)}, which the overlay "
            "changes; repack can only replace members the official wheel has."
        )
    clash = sorted(set(inp.add) & names)
    if clash:
        raise BuildError(
            f"{official.path.name} already contains {', '.join(clash)}, which the overlay adds "
            "as a new file. Record it as a patch of the upstream file instead (`vllm-overlay "
            "lock --refresh-base`, then export)."
        )
