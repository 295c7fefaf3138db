"""Member hashes of a wheel for verify: every member decompressed from its raw bytes (CRC
and size checked on the way), in parallel; and, for a wheel repacked from the official
one, the official member's hash for every member whose compressed bytes are identical.

The official wheel's hashes are computed here (never taken from its RECORD) once per
official wheel and kept in ``<cache>/member-hashes/<its sha256>.json``, so the repeated
verify of a repack decompresses only what the overlay changed.
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, BinaryIO

from vllm_overlay.errors import ZipFormatError
from vllm_overlay.util import atomic_write_text, cache_dir, sha256_file
from vllm_overlay.wheel.zipread import SourceMember, locate_members, read_raw

Hashes = dict[str, tuple[str, int, str]]  # name -> (sha256 hex, size, error)


def digest(f: BinaryIO, m: SourceMember) -> tuple[str, int, str]:
    """(sha256 hex, size, error) of a member's content, decompressed from its raw bytes.

    The CRC and size in the central directory are checked along the way."""
    info = m.info
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        return "", 0, f"compression method {info.compress_type} is not stored or deflate"
    d = zlib.decompressobj(-15) if info.compress_type == zipfile.ZIP_DEFLATED else None
    h, crc, size = hashlib.sha256(), 0, 0
    try:
        for chunk in read_raw(f, m, 1 << 24):
            data = d.decompress(chunk) if d else chunk
            h.update(data)
            crc = zlib.crc32(data, crc)
            size += len(data)
        if d is not None:
            tail = d.flush()
            h.update(tail)
            crc = zlib.crc32(tail, crc)
            size += len(tail)
            if not d.eof:
                return "", size, "the deflate stream is truncated"
    except (zlib.error, ZipFormatError) as e:
        return "", size, str(e)
    if crc != info.CRC:
        return "", size, f"CRC-32 {crc:08x}, the central directory says {info.CRC:08x}"
    if size != info.file_size:
        return "", size, f"{size} bytes, the central directory says {info.file_size}"
    return h.hexdigest(), size, ""


def digest_slice(path: Path, members: Sequence[SourceMember]) -> Hashes:
    with open(path, "rb") as f:
        return {m.name: digest(f, m) for m in members}


def member_hashes(path: Path, workers: int = 0) -> Hashes:
    """name -> (sha256 hex, size, error) for every member, read in parallel slices (one per
    core, at most 8, unless ``workers`` says; zlib and hashlib release the GIL)."""
    return hash_members(
        path, [m for m in locate_members(path) if not m.name.endswith("/")], workers
    )


def hash_members(path: Path, members: Sequence[SourceMember], workers: int) -> Hashes:
    workers = workers or max(2, min(8, os.cpu_count() or 2))
    total = sum(m.info.compress_size for m in members) or 1
    slices: list[list[SourceMember]] = [[] for _ in range(workers)]
    acc = 0
    for m in members:
        slices[min(workers - 1, acc * workers // total)].append(m)
        acc += m.info.compress_size
    out: Hashes = {}
    with ThreadPoolExecutor(max_workers=workers) as ex:
        for part in ex.map(lambda s: digest_slice(path, s), [s for s in slices if s]):
            out.update(part)
    return out


def hashes_reusing_official(path: Path, official: Path) -> tuple[Hashes, set[str]]:
    """``member_hashes(path)``, without decompressing the members that are byte-identical
    to the official wheel's member of the same name (same method, CRC, sizes and raw
    bytes, compared here): those take the official member's hash, computed by us once per
    official wheel (by its sha256) and kept in the cache. Also gives the identical names."""
    mine = [m for m in locate_members(path) if not m.name.endswith("/")]
    theirs = {m.name: m for m in locate_members(official)}
    known = official_hashes(official)
    same: set[str] = set()
    with open(path, "rb") as fm, open(official, "rb") as fo:
        for m in mine:
            o = theirs.get(m.name)
            if o is not None and m.name in known and raw_equal(fm, m, fo, o):
                same.add(m.name)
    out = {n: known[n] for n in same}
    rest = [m for m in mine if m.name not in same]
    out.update(hash_members(path, rest, 0))
    return out, same


def official_hashes(official: Path) -> Hashes:
    """Member hashes of an official wheel, cached by its sha256 (computed, not trusted)."""
    store = cache_dir() / "member-hashes" / f"{sha256_file(official)}.json"
    try:
        doc = json.loads(store.read_text())
        return {n: (h, int(size), "") for n, (h, size) in doc["members"].items()}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    hashes = member_hashes(official)
    good = {n: v for n, v in hashes.items() if not v[2]}
    doc = {"format": 1, "members": {n: [h, size] for n, (h, size, _) in sorted(good.items())}}
    atomic_write_text(store, json.dumps(doc, separators=(",", ":")) + "\n")
    return good


def raw_equal(fa: Any, a: SourceMember, fb: Any, b: SourceMember) -> bool:
    ia, ib = a.info, b.info
    if (ia.compress_type, ia.CRC, ia.compress_size, ia.file_size) != (
        ib.compress_type,
        ib.CRC,
        ib.compress_size,
        ib.file_size,
    ):
        return False
    return all(x == y for x, y in zip(read_raw(fa, a), read_raw(fb, b), strict=True))
