"""Verify a built wheel: it is what its RECORD, METADATA, provenance and the overlay say.

Checks, each failure naming the member and what differs:
- zip: the archive reads, no name is stored twice, every member's CRC holds;
- names: every member stays inside the install (no absolute path, ``..`` or backslash);
- record: every member has a RECORD row with its sha256 and size, and every row a member;
- dist-info: exactly one ``.dist-info``, named for the file name's distribution and version,
  holding WHEEL;
- metadata: METADATA's Version is the file name's version;
- provenance: the record is there, its version is METADATA's, and ``vllm/_version.py``
  reports the version the record says;
- changes (with a project): the wheel's copies of the changed files are the patched tree's,
  files that are not wheel content (tests/) are absent, and the record names this overlay;
- official (repack): every other member is the official wheel's, compressed bytes and all;
  (precompiled): the compiled members are the official wheel's, byte for byte;
- install: a real installer (uv, else pip; ``wheel/installcheck.py``) installs the wheel
  with ``--no-deps --target`` into a temporary directory, and ``importlib.metadata`` there
  reports the wheel's version.
"""

from __future__ import annotations

import hashlib
import re
import zipfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_overlay.errors import BuildError, OverlayError, VerifyError, ZipFormatError
from vllm_overlay.wheel.hashes import hashes_reusing_official, member_hashes, raw_equal
from vllm_overlay.wheel.installcheck import check_installed, installing
from vllm_overlay.wheel.metadata import (
    VERSION_PY,
    RecordRow,
    WheelName,
    dist_info_dirs,
    metadata_version,
    parse_name,
    parse_record,
    record_hash_from_hex,
    version_py_version,
)
from vllm_overlay.wheel.provenance import PROVENANCE_NAME, ChangedFile, parse
from vllm_overlay.wheel.zipread import locate_members


@dataclass(frozen=True)
class Expectation:
    """What the project says the wheel must hold (absent: check the wheel on its own)."""

    files: Sequence[ChangedFile] = ()
    overlay_digest: str | None = None
    upstream_commit: str | None = None
    official: Path | None = None  # the official wheel, for repack/precompiled identity
    pinned_wheels: Mapping[str, str] = field(default_factory=dict)  # filename -> sha256


@dataclass
class VerifyResult:
    path: Path
    version: str
    provenance: dict[str, Any] | None
    passed: list[str] = field(default_factory=list)
    # What a user must know to run the wheel that no check can settle (install_notes).
    notes: list[str] = field(default_factory=list)


@dataclass
class _Wheel:
    path: Path
    name: WheelName
    zf: zipfile.ZipFile
    names: list[str]
    dist_info: str | None = None
    hashes: dict[str, tuple[str, int, str]] = field(default_factory=dict)
    official: Path | None = None  # members raw-identical to its members reuse its hashes
    same_as_official: set[str] = field(default_factory=set)  # proven byte-identical

    def read(self, member: str) -> bytes | None:
        try:
            return self.zf.read(member)
        except KeyError:
            return None


def verify_wheel(
    path: Path, expect: Expectation | None = None, *, install: bool = True
) -> VerifyResult:
    """Run every check on ``path``; raise VerifyError listing all problems found."""
    problems: list[str] = []
    name = _check_name(path)
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise VerifyError(path, [f"zip: the archive cannot be read: {e}"]) from e
    # The install runs in its own process while the checks below read the archive; its
    # result counts only when they all pass.
    with zf, installing(path, name, enabled=install) as installed:
        w = _Wheel(path, name, zf, [i.filename for i in zf.infolist()])
        w.official = expect.official if expect is not None else None
        result = VerifyResult(path, name.version, None)
        for label, step in [*_installable_steps(w), ("metadata", lambda: _check_metadata(w))]:
            _run_step(label, step, problems, result)
        doc, prov_problems = _check_provenance(w)
        result.provenance = doc
        _record(problems, result, "provenance", prov_problems)
        if ((doc or {}).get("build_settings") or {}).get("manylinux"):
            _run_step("manylinux", lambda: _check_manylinux(w), problems, result)
        if expect is not None:
            _run_step("changes", lambda: _check_changes(w, doc, expect), problems, result)
            strategy = (doc or {}).get("strategy")
            if expect.official is not None and strategy in ("repack", "precompiled"):
                _run_step(
                    "official", lambda: _check_official(w, strategy, expect), problems, result
                )
        if problems:
            raise VerifyError(path, problems)
        if install:
            target, found = installed()
            if target is not None and not found:
                files = expect.files if expect else ()
                found = check_installed(target, name, doc, files)
            _record(problems, result, "install", found)
    if problems:
        raise VerifyError(path, problems)
    result.notes = install_notes(doc)
    return result


def install_notes(doc: dict[str, Any] | None) -> list[str]:
    """What the wheel needs beside it that its metadata does not name, and what fails
    without it (its provenance's ``build_settings.install_beside``: vllm-cpu built here from
    a tree that names triton-cpu by a URL)."""
    beside = ((doc or {}).get("build_settings") or {}).get("install_beside")
    if not beside:
        return []
    reqs = ", ".join(beside["requirements"])
    return [
        f"install {reqs} beside this wheel on x86 (vLLM names it by a URL on its git host, "
        f"which this wheel's metadata leaves out; take it from where your site mirrors it); "
        f"without it {beside['without_them']}"
    ]


def check_installable(path: Path) -> list[str]:
    """What an installer checks before it writes anything, as "check: problem" lines (empty
    when the wheel would install): the archive reads, member names stay inside the install,
    RECORD lists every member with its hash and size, exactly one .dist-info (named for the
    file name) holding WHEEL. ``publish`` refuses a wheel with any of these."""
    path = Path(path)
    try:
        name = parse_name(path.name)
    except BuildError as e:
        return [f"name: {e}"]
    problems: list[str] = []
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        return [f"zip: the archive cannot be read: {e}"]
    with zf:
        w = _Wheel(path, name, zf, [i.filename for i in zf.infolist()])
        result = VerifyResult(path, name.version, None)
        for label, step in _installable_steps(w):
            _run_step(label, step, problems, result)
    return problems


def _installable_steps(w: _Wheel) -> list[tuple[str, Any]]:
    return [
        ("zip", lambda: _check_zip(w)),
        ("names", lambda: _check_member_names(w)),
        ("record", lambda: _check_record(w)),
        ("dist-info", lambda: _check_dist_info(w)),
    ]


def _run_step(label: str, step: Any, problems: list[str], result: VerifyResult) -> None:
    try:
        found = list(step())
    except (OverlayError, zipfile.BadZipFile, OSError, UnicodeDecodeError) as e:
        found = [str(e)]
    _record(problems, result, label, found)


def _record(problems: list[str], result: VerifyResult, label: str, found: Iterable[str]) -> None:
    found = list(found)
    problems.extend(f"{label}: {p}" for p in found)
    if not found:
        result.passed.append(label)


def _check_name(path: Path) -> WheelName:
    try:
        return parse_name(path.name)
    except BuildError as e:
        raise VerifyError(path, [f"name: {e}"]) from e


# -- zip and RECORD ------------------------------------------------------------------------


def _check_zip(w: _Wheel) -> list[str]:
    """Structure, then every member decompressed from its raw bytes: CRC and size."""
    seen: set[str] = set()
    out = []
    for n in w.names:
        if n in seen:
            out.append(f"{n}: stored twice")
        seen.add(n)
    try:
        if w.official is not None:
            w.hashes, w.same_as_official = hashes_reusing_official(w.path, w.official)
        else:
            w.hashes = member_hashes(w.path)
    except ZipFormatError as e:
        return [*out, str(e)]
    out.extend(f"{n}: cannot be read: {err}" for n, (_, _, err) in w.hashes.items() if err)
    return out


def _check_record(w: _Wheel) -> list[str]:
    dirs = dist_info_dirs(w.names)
    if len(dirs) != 1:
        return []  # reported by dist-info
    record_name = f"{dirs[0]}/RECORD"
    data = w.read(record_name)
    if data is None:
        return [f"{record_name} is missing"]
    rows = parse_record(data, record_name)
    hashes = w.hashes
    if not hashes:
        return []  # the zip check could not read the members and said so
    out = []
    for n, (hexd, size, err) in hashes.items():
        if err or n == record_name:
            continue
        row = rows.get(n)
        if row is None:
            out.append(f"{n}: not listed in RECORD")
            continue
        out.extend(_compare_row(n, row, hexd, size))
    for n in rows:
        if n not in hashes and not n.endswith("/"):
            out.append(f"{n}: listed in RECORD but not in the archive")
    return out


def _compare_row(n: str, row: RecordRow, hexd: str, size: int) -> list[str]:
    got = record_hash_from_hex(hexd)
    if row.hash != got or row.size != size:
        return [
            f"{n}: RECORD says {row.hash or '(no hash)'} size {row.size}, the member has {got} size {size}"
        ]
    return []


# -- names, METADATA, provenance -----------------------------------------------------------


def _check_member_names(w: _Wheel) -> list[str]:
    """Every member lands inside the install: no absolute path, drive, ``..`` or backslash."""
    out = []
    for n in w.names:
        if n.startswith("/") or re.match(r"^[A-Za-z]:", n):
            out.append(f"{n}: an absolute path; an installer would write outside the install")
        elif "\\" in n:
            out.append(f"{n}: contains a backslash; installers refuse such member names")
        elif ".." in n.split("/"):
            out.append(f"{n}: contains '..'; an installer would write outside the install")
    return out


def _check_dist_info(w: _Wheel) -> list[str]:
    dirs = dist_info_dirs(w.names)
    if len(dirs) != 1:
        return [f"expected exactly one .dist-info directory, found {len(dirs)}: {dirs}"]
    w.dist_info = dirs[0]
    out = []
    want = w.name.dist_info
    if dirs[0] != want:
        out.append(f"{dirs[0]}: expected {want} (from the file name)")
    if w.read(f"{dirs[0]}/WHEEL") is None:
        out.append(f"{dirs[0]}/WHEEL is missing")
    return out


def _check_manylinux(w: _Wheel) -> list[str]:
    """A wheel we compiled and gave a manylinux tag: auditwheel finds it consistent with the
    tag its file name claims (``wheel/manylinux.py``)."""
    from vllm_overlay.wheel import manylinux

    claimed = w.name.tags.rsplit("-", 1)[-1]  # manylinux1_x86_64.manylinux_2_5_x86_64: aliases
    found = manylinux.consistent_tag(w.path)
    if found not in claimed.split("."):
        return [
            f"the file name claims {claimed}; auditwheel finds the wheel consistent with {found}"
        ]
    return []


def _check_metadata(w: _Wheel) -> list[str]:
    if w.dist_info is None:
        return []
    meta = f"{w.dist_info}/METADATA"
    data = w.read(meta)
    if data is None:
        return [f"{meta} is missing"]
    version = metadata_version(data, meta)
    if version != w.name.version:
        return [f"{meta}: Version is {version}, the file name says {w.name.version}"]
    return []


def _check_provenance(w: _Wheel) -> tuple[dict[str, Any] | None, list[str]]:
    if w.dist_info is None:
        return None, []
    member = f"{w.dist_info}/{PROVENANCE_NAME}"
    data = w.read(member)
    if data is None:
        return None, [f"{member} is missing: this wheel was not built by vllm-overlay"]
    try:
        doc = parse(data, member)
    except BuildError as e:
        return None, [str(e)]
    out = []
    if doc.get("version") != w.name.version:
        out.append(f"{member}: version {doc.get('version')}, the wheel is {w.name.version}")
    vp = w.read(VERSION_PY)
    if vp is not None:
        try:
            reported = version_py_version(vp)
        except BuildError as e:
            out.append(str(e))
        else:
            if reported != doc.get("version_py"):
                out.append(
                    f"{VERSION_PY}: reports {reported}, the provenance record says "
                    f"{doc.get('version_py')}"
                )
    return doc, out


# -- the overlay's files and the official wheel --------------------------------------------


def _check_changes(w: _Wheel, doc: Mapping[str, Any] | None, expect: Expectation) -> list[str]:
    out = []
    if doc is not None:
        if expect.overlay_digest and doc["overlay"]["digest"] != expect.overlay_digest:
            out.append(
                f"{PROVENANCE_NAME}: built from overlay digest {doc['overlay']['digest']}, the "
                f"project's overlay is now {expect.overlay_digest}: rebuild the wheel"
            )
        if expect.upstream_commit and doc["upstream"]["commit"] != expect.upstream_commit:
            out.append(
                f"{PROVENANCE_NAME}: built on upstream commit {doc['upstream']['commit']}, "
                f"upstream.lock pins {expect.upstream_commit}"
            )
        bw = doc.get("base_wheel")
        if bw and expect.pinned_wheels.get(bw["filename"]) != bw["sha256"]:
            out.append(
                f"{PROVENANCE_NAME}: built from {bw['filename']} sha256 {bw['sha256']}, which "
                "upstream.lock does not pin"
            )
    names = set(w.names)
    for f in expect.files:
        if not f.in_wheel:
            if f.path in names:
                out.append(
                    f"{f.path}: is not wheel content ({f.kind} outside the package) but the wheel has it"
                )
            continue
        data = w.read(f.path)
        if data is None:
            out.append(f"{f.path}: missing; the patched tree has it ({f.change_id})")
        elif data != f.content:
            got = hashlib.sha256(data).hexdigest()
            out.append(
                f"{f.path}: differs from the patched tree's file (member sha256 {got}, "
                f"tree {f.result_sha256})"
            )
    return out


def _check_repack_identity(w: _Wheel, expect: Expectation) -> list[str]:
    assert expect.official is not None and w.dist_info is not None
    official = {m.name: m for m in locate_members(expect.official)}
    mine = {m.name: m for m in locate_members(w.path)}
    old_di = parse_name(expect.official.name).dist_info
    changed = {f.path for f in expect.files if f.in_wheel}
    rewritten = {
        VERSION_PY,
        f"{w.dist_info}/METADATA",
        f"{w.dist_info}/RECORD",
        f"{w.dist_info}/{PROVENANCE_NAME}",
    }
    out = []
    with open(expect.official, "rb") as fo, open(w.path, "rb") as fm:
        for name, om in official.items():
            new_name = w.dist_info + name[len(old_di) :] if name.startswith(old_di + "/") else name
            if new_name in changed or new_name in rewritten:
                continue
            m = mine.get(new_name)
            if m is None:
                out.append(f"{new_name}: the official wheel has it ({name}), this wheel does not")
            elif (m.info.external_attr >> 16) != (om.info.external_attr >> 16):
                out.append(
                    f"{new_name}: mode {oct(m.info.external_attr >> 16)}, official "
                    f"{oct(om.info.external_attr >> 16)}"
                )
            elif new_name not in w.same_as_official and not raw_equal(fm, m, fo, om):
                out.append(f"{new_name}: not byte-identical to the official wheel's member")
    renamed = {
        w.dist_info + n[len(old_di) :] if n.startswith(old_di + "/") else n for n in official
    }
    for name in mine:
        if name not in renamed and name not in changed and name not in rewritten:
            out.append(f"{name}: in this wheel but neither in the official wheel nor the overlay")
    return out


def _check_official(w: _Wheel, strategy: str, expect: Expectation) -> list[str]:
    assert expect.official is not None
    if strategy == "repack":
        return _check_repack_identity(w, expect)
    return _check_compiled_identity(w, expect.official)


def _check_compiled_identity(w: _Wheel, official_path: Path) -> list[str]:
    out = []
    with zipfile.ZipFile(official_path) as zo:
        for info in zo.infolist():
            n = info.filename
            if not (n.endswith(".so") or (info.external_attr >> 16) & 0o111):
                continue
            if n.endswith(".sh"):
                continue
            mine = w.read(n)
            if mine is None:
                out.append(f"{n}: compiled member of the official wheel is missing")
            elif hashlib.sha256(mine).digest() != hashlib.sha256(zo.read(n)).digest():
                out.append(f"{n}: differs from the official wheel's compiled member")
    return out
