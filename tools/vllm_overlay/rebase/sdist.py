"""Read a few members of a cached release sdist without unpacking it.

A vLLM sdist is a ~40 MB gzip of ~150 MB of tar. ``tarfile`` walks it member by member in
Python and costs seconds per release; this reader inflates the stream with zlib in large
chunks and parses the 512-byte headers itself (ustar, pax ``x`` records, GNU ``L`` long
names), keeping only the members asked for and the list of every file name.

What a scan found is cached per sdist under ``<cache>/outlook/members/<sdist sha256>/``
(the names, and each member asked for, content-addressed), so a release is read from its
tarball once, whatever series asks about it later.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay.errors import IntegrityError
from vllm_overlay.util import atomic_write_bytes, atomic_write_text, cache_dir, sha256_bytes

CHUNK = 4 << 20
BLOCK = 512


@dataclass
class Members:
    """What a scan of one sdist found: every file name, and the bytes of the paths asked for
    (None: the path is not in the sdist)."""

    names: frozenset[str]
    files: dict[str, bytes | None]


def _octal(field: bytes) -> int:
    field = field.rstrip(b"\0 ").strip()
    if field and field[0] & 0x80:  # base-256 (GNU) for large sizes
        return int.from_bytes(field[1:], "big")
    return int(field or b"0", 8)


def _pax_path(data: bytes) -> str | None:
    pos = 0
    while pos < len(data):
        sp = data.index(b" ", pos)
        length = int(data[pos:sp])
        key, _, value = data[sp + 1 : pos + length - 1].partition(b"=")
        if key == b"path":
            return value.decode("utf-8", "surrogateescape")
        pos += length
    return None


def _strip_top(name: str) -> str | None:
    """``vllm-0.25.0/vllm/x.py`` -> ``vllm/x.py`` (the sdist's single top directory)."""
    name = name.lstrip("./")
    top, sep, rest = name.partition("/")
    return rest if sep and rest else None


class _Inflated:
    """The sdist's tar stream, inflated with zlib in large chunks: a buffer and a position
    in it."""

    def __init__(self, sdist: Path) -> None:
        self._source = self._chunks(sdist)
        self.buf = bytearray()
        self.pos = 0

    @staticmethod
    def _chunks(sdist: Path) -> Iterator[bytes]:
        inflate = zlib.decompressobj(31)
        with open(sdist, "rb") as f:
            while not inflate.eof:
                raw = f.read(CHUNK)
                if not raw:
                    break
                yield inflate.decompress(raw)
            tail = inflate.flush()
            if tail:
                yield tail

    def need(self, n: int) -> bool:
        """Whether ``n`` bytes from the position are in the buffer (inflating more for
        them); False at the end of the stream."""
        while len(self.buf) - self.pos < n:
            try:
                more = next(self._source)
            except StopIteration:
                return False
            if self.pos:
                del self.buf[: self.pos]
                self.pos = 0
            self.buf += more
        return True

    def take(self, n: int, advance: int) -> bytes:
        """The ``n`` bytes from the position, which moves ``advance`` bytes on."""
        data = bytes(self.buf[self.pos : self.pos + n])
        self.pos += advance
        return data

    def skip(self, n: int) -> None:
        """Move ``n`` bytes on (possibly across chunks; to the end where fewer are left)."""
        while n:
            have = len(self.buf) - self.pos
            if have >= n:
                self.pos += n
                return
            n -= have
            self.pos = len(self.buf)
            if not self.need(1):
                return


def _members(stream: _Inflated) -> Iterator[tuple[str, bytes, int]]:
    """(name, type flag, size) of each member, the stream left at the start of its data (the
    reader reads or skips it, padded to the block); pax ``x`` and GNU ``L`` long names are
    read here, global ``g`` records passed over."""
    pending_name: str | None = None
    while stream.need(BLOCK):
        header = stream.take(BLOCK, BLOCK)
        if header == b"\0" * BLOCK:
            continue
        size = _octal(header[124:136])
        kind = header[156:157]
        if kind in (b"x", b"L", b"g"):
            if not stream.need(_padded(size)):
                return
            data = stream.take(size, _padded(size))
            if kind == b"x":
                pending_name = _pax_path(data) or pending_name
            elif kind == b"L":
                pending_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            continue
        name = pending_name
        pending_name = None
        if name is None:
            raw_name = header[0:100].split(b"\0", 1)[0]
            prefix = header[345:500].split(b"\0", 1)[0] if header[257:262] == b"ustar" else b""
            name = (prefix + b"/" + raw_name if prefix else raw_name).decode(
                "utf-8", "surrogateescape"
            )
        yield name, kind, size


def _padded(size: int) -> int:
    return (size + BLOCK - 1) // BLOCK * BLOCK


def scan(sdist: Path, wanted: Iterable[str]) -> Members:
    """One pass over ``sdist``: every regular file's name, and the bytes of the ``wanted``
    paths (tree-relative: the sdist's top directory stripped)."""
    want = set(wanted)
    names: set[str] = set()
    files: dict[str, bytes | None] = dict.fromkeys(want)
    stream = _Inflated(sdist)
    try:
        for name, kind, size in _members(stream):
            rel = _strip_top(name) if kind in (b"0", b"\0", b"7") else None
            if rel is not None:
                names.add(rel)
                if rel in want:
                    if not stream.need(size):
                        raise IntegrityError(f"{sdist.name} ends inside member {name}.")
                    files[rel] = stream.take(size, 0)
            stream.skip(_padded(size))
    except (zlib.error, ValueError) as e:
        raise IntegrityError(
            f"cannot read {sdist.name} as a gzipped tar ({e}). Delete it from the cache "
            f"({sdist}) and run again."
        ) from e
    return Members(frozenset(names), files)


class MemberCache:
    """Members of sdists, cached per sdist sha256: names once, each asked-for path once."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or cache_dir()) / "outlook" / "members"

    def _dir(self, sha256: str) -> Path:
        return self.root / sha256

    def get(self, sdist: Path, sha256: str, paths: Iterable[str]) -> Members:
        paths = sorted(set(paths))
        d = self._dir(sha256)
        index_file = d / "index.json"
        index: dict[str, str | None] = {}
        names: frozenset[str] | None = None
        if index_file.is_file() and (d / "names.txt").is_file():
            index = json.loads(index_file.read_text())
            names = frozenset((d / "names.txt").read_text().splitlines())
        missing = [p for p in paths if p not in index]
        if names is None or missing:
            found = scan(sdist, paths)
            names = found.names
            for p, data in found.files.items():
                if data is None:
                    index[p] = None
                else:
                    blob = sha256_bytes(data)
                    atomic_write_bytes(d / "blobs" / blob, data)
                    index[p] = blob
            atomic_write_text(d / "names.txt", "\n".join(sorted(names)) + "\n")
            atomic_write_text(index_file, json.dumps(index, indent=0, sort_keys=True) + "\n")
        files: dict[str, bytes | None] = {}
        for p in paths:
            blob = index[p]
            files[p] = None if blob is None else (d / "blobs" / blob).read_bytes()
        return Members(names, files)
