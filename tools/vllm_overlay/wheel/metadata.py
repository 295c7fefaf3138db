"""Names, versions and the metadata files of a wheel: METADATA, RECORD, vllm/_version.py.

Edits are exact and checked: METADATA changes by its one ``Version:`` header (the result
is re-parsed with the email parser and every other header must be unchanged), RECORD is
written with the csv module the way pypa/wheel writes it, and ``_version.py`` changes by
its two version assignments.
"""

from __future__ import annotations

import base64
import csv
import email.parser
import email.policy
import hashlib
import io
import re
from dataclasses import dataclass
from email.message import Message

from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from vllm_overlay.errors import BuildError

LABEL_PREFIX = "ovl"
VERSION_PY = "vllm/_version.py"


# -- versions ------------------------------------------------------------------------------


def local_label(revision: int, digest: str) -> str:
    """The local version label for an overlay: ``ovl.<revision>.g<8 hex of its digest>``.

    Dot-separated so that PEP 440 compares the revision as a number (``ovl.10`` sorts after
    ``ovl.9``); the digest segment starts with a letter so it is compared and written as
    text, never shortened like a number with leading zeros.
    """
    if revision < 1:
        raise BuildError(f"overlay revision must be a positive integer, got {revision}.")
    if not re.fullmatch(r"[0-9a-f]{8,}", digest):
        raise BuildError(f"overlay digest must be hex, got {digest!r}.")
    return f"{LABEL_PREFIX}.{revision}.g{digest[:8]}"


def overlay_version(release: str, label: str) -> str:
    """``release`` with ``label`` as (or appended to) its local version, PEP 440 canonical."""
    try:
        v = Version(release)
    except InvalidVersion as e:
        raise BuildError(f"upstream version {release!r} is not a PEP 440 version.") from e
    out = f"{release}.{label}" if v.local else f"{release}+{label}"
    if str(Version(out)) != out:
        raise BuildError(
            f"the version {out!r} is not in PEP 440 canonical form (it would be written "
            f"{Version(out)}); re-pin upstream with its canonical version."
        )
    return out


def version_tuple(version: str) -> tuple[int | str, ...]:
    """What setuptools-scm writes as ``__version_tuple__`` for ``version``."""
    v = Version(version)
    out: tuple[int | str, ...] = tuple(v.release)
    if v.dev is not None:
        out += (f"dev{v.dev}",)
    if v.local is not None:
        out += (v.local,)
    return out


# -- file names ----------------------------------------------------------------------------


@dataclass(frozen=True)
class WheelName:
    distribution: str  # as the file name spells it, e.g. "vllm"
    version: str
    tags: str  # "cp38-abi3-manylinux_2_28_x86_64"

    @property
    def filename(self) -> str:
        return f"{self.distribution}-{self.version}-{self.tags}.whl"

    @property
    def dist_info(self) -> str:
        return f"{self.distribution}-{self.version}.dist-info"

    def with_version(self, version: str) -> WheelName:
        return WheelName(self.distribution, version, self.tags)

    def with_tags(self, tags: str) -> WheelName:
        return WheelName(self.distribution, self.version, tags)


def parse_name(filename: str) -> WheelName:
    """Split a wheel file name (no build tag) into distribution, version and tags."""
    try:
        _name, _version, build, _tags = parse_wheel_filename(filename)
    except (InvalidWheelFilename, InvalidVersion) as e:
        raise BuildError(f"{filename} is not a valid wheel file name: {e}") from e
    if build:
        raise BuildError(f"{filename}: wheels with a build tag are not supported.")
    # packaging validated it and normalises the name; keep the file name's own spelling
    distribution, version, tags = filename[: -len(".whl")].split("-", 2)
    return WheelName(distribution, version, tags)


def dist_info_dirs(names: list[str]) -> list[str]:
    """The top-level ``*.dist-info`` directories among archive member names."""
    return sorted({n.split("/", 1)[0] for n in names if n.split("/", 1)[0].endswith(".dist-info")})


# -- METADATA ------------------------------------------------------------------------------


def parse_metadata(data: bytes, where: str) -> Message:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BuildError(f"{where} is not UTF-8: {e}") from e
    return email.parser.Parser(policy=email.policy.compat32).parsestr(text)


def _headers(msg: Message) -> list[tuple[str, str]]:
    return [(k, str(v)) for k, v in msg.items()]


def metadata_version(data: bytes, where: str) -> str:
    msg = parse_metadata(data, where)
    versions = msg.get_all("Version") or []
    if len(versions) != 1:
        raise BuildError(f"{where} has {len(versions)} Version headers; expected exactly one.")
    return str(versions[0]).strip()


def set_metadata_version(data: bytes, version: str, where: str) -> bytes:
    """METADATA with its Version header set to ``version``; nothing else changes."""
    text = data.decode("utf-8")
    head_end = text.find("\n\n")
    head = text if head_end < 0 else text[:head_end]
    new_head, n = re.subn(r"(?m)^Version: [^\n]*$", f"Version: {version}", head)
    if n != 1:
        raise BuildError(f"{where}: expected one 'Version:' header line, found {n}.")
    out = (new_head + ("" if head_end < 0 else text[head_end:])).encode("utf-8")
    before, after = _headers(parse_metadata(data, where)), _headers(parse_metadata(out, where))
    want = [(k, version if k == "Version" else v) for k, v in before]
    if after != want:
        raise BuildError(f"{where}: rewriting the Version header changed other headers.")
    return out


def requires_dist(data: bytes, where: str) -> list[str]:
    return [str(v).strip() for v in parse_metadata(data, where).get_all("Requires-Dist") or []]


# -- RECORD --------------------------------------------------------------------------------


def record_hash(data: bytes) -> str:
    digest = hashlib.sha256(data).digest()
    return "sha256=" + base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def record_hash_from_hex(hexdigest: str) -> str:
    raw = bytes.fromhex(hexdigest)
    return "sha256=" + base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


@dataclass(frozen=True)
class RecordRow:
    path: str
    hash: str  # "sha256=<urlsafe b64>" or "" (RECORD itself)
    size: int | None


def parse_record(data: bytes, where: str) -> dict[str, RecordRow]:
    rows: dict[str, RecordRow] = {}
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BuildError(f"{where} is not UTF-8: {e}") from e
    for lineno, row in enumerate(csv.reader(io.StringIO(text)), start=1):
        if not row:
            continue
        if len(row) != 3:
            raise BuildError(f"{where} line {lineno}: expected path,hash,size; got {row!r}.")
        path, h, size = row
        if path in rows:
            raise BuildError(f"{where} line {lineno}: {path} is listed twice.")
        if h and not h.startswith("sha256="):
            raise BuildError(f"{where} line {lineno}: {path} has no sha256 hash ({h!r}).")
        try:
            n = int(size) if size else None
        except ValueError as e:
            raise BuildError(f"{where} line {lineno}: size {size!r} is not a number.") from e
        rows[path] = RecordRow(path, h, n)
    return rows


def render_record(rows: list[RecordRow]) -> bytes:
    buf = io.StringIO()
    w = csv.writer(buf, delimiter=",", quotechar='"', lineterminator="\n")
    for r in rows:
        w.writerow([r.path, r.hash, "" if r.size is None else str(r.size)])
    return buf.getvalue().encode("utf-8")


# -- vllm/_version.py ----------------------------------------------------------------------

_VERSION_LINE = re.compile(r"(?m)^(__version__ = version = )(['\"])([^'\"]*)\2[ \t]*$")
_TUPLE_LINE = re.compile(r"(?m)^(__version_tuple__ = version_tuple = )\(.*\)[ \t]*$")


def version_py_version(data: bytes, where: str = VERSION_PY) -> str:
    matches = _VERSION_LINE.findall(data.decode("utf-8"))
    if len(matches) != 1:
        raise BuildError(
            f"{where}: expected one `__version__ = version = '...'` line, found {len(matches)}."
        )
    return matches[0][2]


def set_version_py(data: bytes, version: str, where: str = VERSION_PY) -> bytes:
    """``_version.py`` reporting ``version`` (and its tuple); its other lines unchanged."""
    text = data.decode("utf-8")
    version_py_version(data, where)
    text = _VERSION_LINE.sub(lambda m: f"{m.group(1)}{m.group(2)}{version}{m.group(2)}", text)
    if len(_TUPLE_LINE.findall(text)) > 1:
        raise BuildError(f"{where}: more than one `__version_tuple__` line.")
    text = _TUPLE_LINE.sub(lambda m: f"{m.group(1)}{version_tuple(version)!r}", text)
    return text.encode("utf-8")
