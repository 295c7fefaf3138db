"""Write a zip archive whose members are mostly copied, compressed, from another archive.

``zipfile`` can only copy a member by decompressing and recompressing it (seconds per
hundred megabytes). Here a member of the source is located by its local header, and its
compressed bytes, unchanged, are copied into the new archive; only the members that change
are deflated. Runs of consecutive source members are copied in one ``copy_file_range``
call, so repacking a 280 MB wheel costs about what copying the file costs.

The writer emits its own central directory (zip64 records only when a size, offset or the
member count needs them), never data descriptors, no extra fields of its own beyond zip64,
and only what it is given, in the order it is given: the same calls give the same bytes.
The source's members are located and read by ``zipread.py``.
"""

from __future__ import annotations

import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from typing import BinaryIO

from vllm_overlay.errors import ZipFormatError
from vllm_overlay.wheel.zipread import (
    FLAG_DATA_DESCRIPTOR,
    FLAG_UTF8,
    LOCAL,
    LOCAL_SIG,
    SourceMember,
)

_CENTRAL_SIG = 0x02014B50
_EOCD_SIG = 0x06054B50
_ZIP64_EOCD_SIG = 0x06064B50
_ZIP64_LOCATOR_SIG = 0x07064B50
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # 46 bytes
_EOCD = struct.Struct("<IHHHHIIH")  # 22 bytes
_ZIP64_EOCD = struct.Struct("<IQHHIIQQQQ")  # 56 bytes
_ZIP64_LOCATOR = struct.Struct("<IIQI")  # 20 bytes
_U32 = 0xFFFFFFFF
_U16 = 0xFFFF
_ZIP64_EXTRA_ID = 0x0001
_VERSION_DEFAULT = 20
_VERSION_ZIP64 = 45
_MADE_BY_UNIX = 3 << 8
REGULAR_FILE_MODE = 0o100644


def _name_bytes(name: str) -> tuple[bytes, int]:
    """The name as stored, and the flag bit it needs (UTF-8 for non-ASCII names)."""
    try:
        return name.encode("ascii"), 0
    except UnicodeEncodeError:
        return name.encode("utf-8"), FLAG_UTF8


def _encode_name(name: str, flags: int) -> bytes:
    if name.isascii():
        return name.encode("ascii")
    return name.encode("utf-8" if flags & FLAG_UTF8 else "cp437")


def dos_datetime(date_time: tuple[int, int, int, int, int, int]) -> tuple[int, int]:
    """(dos time, dos date) for a ZipInfo-style date_time tuple (years 1980-2107)."""
    y, mo, d, h, mi, s = date_time
    y = min(max(y, 1980), 2107)
    return (h << 11) | (mi << 5) | (s // 2), ((y - 1980) << 9) | (mo << 5) | d


def deflate(data: bytes) -> bytes:
    """Raw deflate at zlib's default level: the same bytes for the same input and zlib."""
    co = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, -15)
    return co.compress(data) + co.flush()


@dataclass
class _Entry:
    name: bytes
    flags: int
    method: int
    dostime: int
    dosdate: int
    crc: int
    csize: int
    usize: int
    offset: int
    external_attr: int
    internal_attr: int
    made_by: int
    version_needed: int


@dataclass
class _Pending:
    """A run of bytes of one source file still to copy (adjacent copies merge)."""

    src: BinaryIO
    start: int
    end: int


class ZipWriter:
    """Write an archive member by member; ``close`` writes the central directory.

    Use as a context manager over an open binary file positioned at 0.
    """

    def __init__(self, out: BinaryIO, *, force_zip64: bool = False) -> None:
        self._out = out
        self._pos = 0
        self._entries: list[_Entry] = []
        self._names: set[str] = set()
        self._pending: _Pending | None = None
        self._force_zip64 = force_zip64

    def __enter__(self) -> ZipWriter:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            self.close()

    def _claim(self, name: str) -> None:
        if name in self._names:
            raise ZipFormatError(f"member {name} would be written twice.")
        self._names.add(name)

    # -- copying -------------------------------------------------------------------------

    def copy(self, src: BinaryIO, member: SourceMember, *, rename: str | None = None) -> None:
        """Copy ``member`` of the open source archive ``src`` without recompressing it."""
        info = member.info
        name = rename or info.filename
        self._claim(name)
        flags = info.flag_bits & ~FLAG_DATA_DESCRIPTOR
        if rename is not None or not member.raw_header_ok:
            raw_name, utf8 = _name_bytes(name)
            flags = (flags & ~FLAG_UTF8) | utf8
            offset = self._write_local_header(raw_name, flags, info)
            self._queue(src, member.data_offset, member.data_end)
        else:
            raw_name = _encode_name(name, flags)
            offset = self._pos
            self._queue(src, member.header_offset, member.data_end)
        dostime, dosdate = dos_datetime(info.date_time)
        self._entries.append(
            _Entry(
                name=raw_name,
                flags=flags,
                method=info.compress_type,
                dostime=dostime,
                dosdate=dosdate,
                crc=info.CRC,
                csize=info.compress_size,
                usize=info.file_size,
                offset=offset,
                external_attr=info.external_attr,
                internal_attr=info.internal_attr,
                made_by=(info.create_system << 8) | (info.create_version & 0xFF),
                version_needed=max(info.extract_version, _VERSION_DEFAULT),
            )
        )

    def _queue(self, src: BinaryIO, start: int, end: int) -> None:
        p = self._pending
        if p is not None and p.src is src and p.end == start:
            p.end = end
        else:
            self._flush()
            self._pending = _Pending(src, start, end)
        self._pos += end - start

    def _flush(self) -> None:
        p, self._pending = self._pending, None
        if p is None or p.end == p.start:
            return
        self._out.flush()
        _copy_range(p.src, self._out, p.start, p.end - p.start)

    def _write_local_header(self, raw_name: bytes, flags: int, info: zipfile.ZipInfo) -> int:
        self._flush()
        offset = self._pos
        self._write(
            _local_header(
                raw_name,
                flags,
                info.compress_type,
                info.date_time,
                info.CRC,
                info.compress_size,
                info.file_size,
            )
        )
        return offset

    # -- new members ---------------------------------------------------------------------

    def add(
        self,
        name: str,
        data: bytes,
        *,
        date_time: tuple[int, int, int, int, int, int],
        mode: int = REGULAR_FILE_MODE,
    ) -> None:
        """Write ``data`` as a new deflated member."""
        self._claim(name)
        self._flush()
        raw_name, flags = _name_bytes(name)
        comp = deflate(data)
        crc = zlib.crc32(data)
        offset = self._pos
        self._write(
            _local_header(
                raw_name, flags, zipfile.ZIP_DEFLATED, date_time, crc, len(comp), len(data)
            )
        )
        self._write(comp)
        dostime, dosdate = dos_datetime(date_time)
        self._entries.append(
            _Entry(
                name=raw_name,
                flags=flags,
                method=zipfile.ZIP_DEFLATED,
                dostime=dostime,
                dosdate=dosdate,
                crc=crc,
                csize=len(comp),
                usize=len(data),
                offset=offset,
                external_attr=(mode & 0xFFFF) << 16,
                internal_attr=0,
                made_by=_MADE_BY_UNIX | _VERSION_DEFAULT,
                version_needed=_VERSION_DEFAULT,
            )
        )

    def _write(self, data: bytes) -> None:
        self._out.write(data)
        self._pos += len(data)

    # -- central directory ---------------------------------------------------------------

    def close(self) -> None:
        self._flush()
        cd_offset = self._pos
        for e in self._entries:
            self._write(_central_entry(e))
        cd_size = self._pos - cd_offset
        count = len(self._entries)
        zip64 = self._force_zip64 or count >= _U16 or cd_size >= _U32 or cd_offset >= _U32
        if zip64:
            eocd64_offset = self._pos
            self._write(
                _ZIP64_EOCD.pack(
                    _ZIP64_EOCD_SIG,
                    _ZIP64_EOCD.size - 12,
                    _MADE_BY_UNIX | _VERSION_ZIP64,
                    _VERSION_ZIP64,
                    0,
                    0,
                    count,
                    count,
                    cd_size,
                    cd_offset,
                )
            )
            self._write(_ZIP64_LOCATOR.pack(_ZIP64_LOCATOR_SIG, 0, eocd64_offset, 1))
        self._write(
            _EOCD.pack(
                _EOCD_SIG,
                0,
                0,
                min(count, _U16),
                min(count, _U16),
                min(cd_size, _U32),
                min(cd_offset, _U32),
                0,
            )
        )
        self._out.flush()


def _local_header(
    raw_name: bytes,
    flags: int,
    method: int,
    date_time: tuple[int, int, int, int, int, int],
    crc: int,
    csize: int,
    usize: int,
) -> bytes:
    dostime, dosdate = dos_datetime(date_time)
    extra = b""
    version = _VERSION_DEFAULT
    if csize >= _U32 or usize >= _U32:
        extra = struct.pack("<HHQQ", _ZIP64_EXTRA_ID, 16, usize, csize)
        csize = usize = _U32
        version = _VERSION_ZIP64
    return (
        LOCAL.pack(
            LOCAL_SIG,
            version,
            flags,
            method,
            dostime,
            dosdate,
            crc,
            csize,
            usize,
            len(raw_name),
            len(extra),
        )
        + raw_name
        + extra
    )


def _central_entry(e: _Entry) -> bytes:
    fields: list[int] = []
    usize, csize, offset = e.usize, e.csize, e.offset
    if usize >= _U32:
        fields.append(usize)
        usize = _U32
    if csize >= _U32:
        fields.append(csize)
        csize = _U32
    if offset >= _U32:
        fields.append(offset)
        offset = _U32
    extra = b""
    version_needed = e.version_needed
    if fields:
        extra = struct.pack(f"<HH{len(fields)}Q", _ZIP64_EXTRA_ID, 8 * len(fields), *fields)
        version_needed = max(version_needed, _VERSION_ZIP64)
    return (
        _CENTRAL.pack(
            _CENTRAL_SIG,
            e.made_by,
            version_needed,
            e.flags,
            e.method,
            e.dostime,
            e.dosdate,
            e.crc,
            csize,
            usize,
            len(e.name),
            len(extra),
            0,
            0,
            e.internal_attr,
            e.external_attr,
            offset,
        )
        + e.name
        + extra
    )


def _copy_range(src: BinaryIO, dst: BinaryIO, start: int, length: int) -> None:
    """Copy ``length`` bytes of ``src`` from ``start`` to ``dst``'s current position."""
    in_fd, out_fd = src.fileno(), dst.fileno()
    out_off = dst.tell()
    done = 0
    try:
        while done < length:
            n = os.copy_file_range(in_fd, out_fd, length - done, start + done, out_off + done)
            if n == 0:
                break
            done += n
    except (AttributeError, OSError):
        pass  # no copy_file_range here (or across these files): fall back to read/write
    if done < length:
        src.seek(start + done)
        dst.seek(out_off + done)
        remaining = length - done
        while remaining:
            chunk = src.read(min(remaining, 1 << 22))
            if not chunk:
                raise ZipFormatError("the source archive ended while copying a member.")
            dst.write(chunk)
            remaining -= len(chunk)
    dst.seek(out_off + length)
