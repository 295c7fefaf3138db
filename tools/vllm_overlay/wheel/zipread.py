"""Locate and read the members of a zip archive on disk (a wheel): each member's local header
and compressed data found (``locate_members``), its compressed bytes read as they are
(``read_raw``, what ``zipcopy.ZipWriter.copy`` copies) or its content, CRC checked
(``read_member``).
"""

from __future__ import annotations

import mmap
import os
import struct
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from vllm_overlay.errors import ZipFormatError

LOCAL_SIG = 0x04034B50
LOCAL = struct.Struct("<IHHHHHIIIHH")  # the local header: 30 bytes
FLAG_ENCRYPTED = 0x1
FLAG_DATA_DESCRIPTOR = 0x8
FLAG_UTF8 = 0x800


@dataclass(frozen=True)
class SourceMember:
    """A member of a source archive, located on disk."""

    info: zipfile.ZipInfo
    header_offset: int
    data_offset: int  # first byte of the compressed data
    raw_header_ok: bool  # the local header can be copied as it is
    name: str

    @property
    def data_end(self) -> int:
        return self.data_offset + self.info.compress_size


def _decode_name(raw: bytes, flags: int) -> str:
    return raw.decode("utf-8" if flags & FLAG_UTF8 else "cp437")


def locate_members(path: Path) -> list[SourceMember]:
    """Every member of the archive at ``path``, in central-directory order, located."""
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError) as e:
        raise ZipFormatError(f"{path.name} is not a readable zip archive: {e}") from e
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return []
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            return [_locate(view, size, info, path.name) for info in infos]


def _locate(view: mmap.mmap, size: int, info: zipfile.ZipInfo, archive: str) -> SourceMember:
    if info.flag_bits & FLAG_ENCRYPTED:
        raise ZipFormatError(f"{archive}: member {info.filename} is encrypted; cannot copy it.")
    start = info.header_offset
    if start + LOCAL.size > size:
        raise ZipFormatError(f"{archive}: member {info.filename}: local header is truncated.")
    sig, _ver, flags, method, _t, _d, _crc, _cs, _us, nlen, xlen = LOCAL.unpack_from(view, start)
    if sig != LOCAL_SIG:
        raise ZipFormatError(
            f"{archive}: member {info.filename}: no local header at offset {start}."
        )
    name_start = start + LOCAL.size
    local_name = _decode_name(view[name_start : name_start + nlen], flags)
    data_offset = name_start + nlen + xlen
    if data_offset + info.compress_size > size:
        raise ZipFormatError(
            f"{archive}: member {info.filename}: its data runs past the end of the file."
        )
    raw_ok = (
        not flags & FLAG_DATA_DESCRIPTOR
        and local_name == info.filename
        and flags == info.flag_bits
        and method == info.compress_type
    )
    return SourceMember(info, start, data_offset, raw_ok, info.filename)


def read_member(f: BinaryIO, member: SourceMember) -> bytes:
    """A member's content (stored or deflated), its CRC checked."""
    raw = b"".join(read_raw(f, member))
    method = member.info.compress_type
    if method == zipfile.ZIP_DEFLATED:
        data = zlib.decompress(raw, -15)
    elif method == zipfile.ZIP_STORED:
        data = raw
    else:
        raise ZipFormatError(f"member {member.name}: compression method {method} is not supported.")
    if zlib.crc32(data) != member.info.CRC or len(data) != member.info.file_size:
        raise ZipFormatError(f"member {member.name}: its CRC or size does not match its content.")
    return data


def read_raw(f: BinaryIO, member: SourceMember, chunk: int = 1 << 22) -> Iterator[bytes]:
    """The member's compressed bytes, in chunks."""
    f.seek(member.data_offset)
    remaining = member.info.compress_size
    while remaining:
        data = f.read(min(remaining, chunk))
        if not data:
            raise ZipFormatError(f"member {member.name}: the archive ended inside its data.")
        remaining -= len(data)
        yield data
