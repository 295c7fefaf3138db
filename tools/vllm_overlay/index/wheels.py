"""The wheels publish takes: checked that the file name agrees with METADATA and the
.dist-info directory, hashed; shared by the static index and the server upload. Members are
decompressed once, by the installer checks (CRC and RECORD hash in one read), not here."""

from __future__ import annotations

import contextlib
import email.parser
import email.policy
import os
import re
import zipfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from vllm_overlay.errors import PublishError
from vllm_overlay.util import sha256_bytes, sha256_file

Action = Literal["published", "skipped"]


@dataclass(frozen=True)
class WheelFile:
    """A wheel that passed the checks: its name agrees with its METADATA."""

    path: Path
    filename: str
    project: str  # PEP 503 normalised name
    version: str  # as METADATA spells it
    sha256: str
    size: int
    metadata: bytes  # .dist-info/METADATA, exactly as stored in the wheel
    requires_python: str | None

    @property
    def metadata_sha256(self) -> str:
        return sha256_bytes(self.metadata)


@dataclass(frozen=True)
class PublishResult:
    """What publish did with one wheel."""

    filename: str
    project: str
    version: str
    sha256: str
    action: Action
    detail: str

    @classmethod
    def of(cls, wheel: WheelFile, action: Action, detail: str) -> PublishResult:
        return cls(wheel.filename, wheel.project, wheel.version, wheel.sha256, action, detail)


def read_wheel(path: str | os.PathLike[str]) -> WheelFile:
    """Check that ``path`` is a readable wheel whose file name agrees with its METADATA."""
    path = Path(path)
    if not path.is_file():
        raise PublishError(f"{path}: no such file. Pass the path of a built wheel (dist/*.whl).")
    name_part, version_part = _parse_filename(path)
    metadata_name, metadata = _read_metadata(path)
    fields = _parse_metadata(path, metadata_name, metadata)
    _check_agreement(path, name_part, version_part, metadata_name, fields)
    return WheelFile(
        path=path,
        filename=path.name,
        project=canonicalize_name(fields["Name"]),
        version=fields["Version"],
        sha256=sha256_file(path),
        size=path.stat().st_size,
        metadata=metadata,
        requires_python=fields.get("Requires-Python"),
    )


def _parse_filename(path: Path) -> tuple[str, Version]:
    if not path.name.endswith(".whl"):
        raise PublishError(
            f"{path} is not a wheel: expected a file named <name>-<version>-<tags>.whl "
            "(only wheels are published; build one with `make build-wheel`)."
        )
    try:
        name, version, _build, _tags = parse_wheel_filename(path.name)
    except (InvalidWheelFilename, InvalidVersion) as e:
        raise PublishError(
            f"{path.name} is not a valid wheel file name ({e}). "
            "Publish the file as the build wrote it, without renaming it."
        ) from e
    return name, version


_METADATA_MEMBER = re.compile(r"^([^/]+)\.dist-info/METADATA$")


def _read_metadata(path: Path) -> tuple[str, bytes]:
    """The .dist-info directory's name and METADATA bytes, after checking that every member's
    local header agrees with the central directory (name, not encrypted). Nothing else is
    decompressed here: every member's CRC, size and RECORD hash are checked in one read by
    the installer checks that follow (``wheel.verify.check_installable``)."""
    try:
        with zipfile.ZipFile(path) as zf:
            for info in zf.infolist():
                with zf.open(info):  # reads the local header only
                    pass
            members = [m for m in zf.namelist() if _METADATA_MEMBER.match(m)]
            if len(members) != 1:
                found = ", ".join(members) or "none"
                raise PublishError(
                    f"{path} must hold exactly one <name>-<version>.dist-info/METADATA "
                    f"(found: {found}). Rebuild the wheel."
                )
            return members[0][: -len(".dist-info/METADATA")], zf.read(members[0])
    except (zipfile.BadZipFile, zlib.error, EOFError, RuntimeError, ValueError) as e:
        raise PublishError(
            f"{path} is not a readable wheel (zip archive): {e}. Rebuild it or check the copy."
        ) from e
    except OSError as e:
        raise PublishError(f"cannot read {path}: {e}.") from e


def _parse_metadata(path: Path, dist_info: str, metadata: bytes) -> dict[str, str]:
    """Name, Version and (if present) Requires-Python, read with the email parser."""
    msg = email.parser.BytesParser(policy=email.policy.compat32).parsebytes(metadata)
    fields: dict[str, str] = {}
    for key in ("Name", "Version", "Requires-Python"):
        value = msg.get(key)
        if value is not None and str(value).strip():
            fields[key] = str(value).strip()
    missing = [key for key in ("Name", "Version") if key not in fields]
    if missing:
        raise PublishError(
            f"{path}: {dist_info}.dist-info/METADATA lacks {' and '.join(missing)}. "
            "Rebuild the wheel."
        )
    return fields


def _check_agreement(
    path: Path, name: str, version: Version, dist_info: str, fields: Mapping[str, str]
) -> None:
    """File name, METADATA and .dist-info directory must name the same project and version."""
    try:
        meta_version = Version(fields["Version"])
    except InvalidVersion as e:
        raise PublishError(
            f"{path}: METADATA Version {fields['Version']!r} is not a PEP 440 version. "
            "Rebuild the wheel."
        ) from e
    if canonicalize_name(fields["Name"]) != name or meta_version != version:
        raise PublishError(
            f"{path.name} does not match its METADATA: the file name says {name} {version}, "
            f"METADATA says {fields['Name']} {fields['Version']}. A renamed or hand-edited "
            "wheel would be installed under the wrong version; publish the file the build wrote."
        )
    di_name, _, di_version = dist_info.rpartition("-")
    with contextlib.suppress(InvalidVersion):
        if canonicalize_name(di_name) == name and Version(di_version) == version:
            return
    raise PublishError(
        f"{path.name}: its {dist_info}.dist-info directory does not match the file name "
        f"({name} {version}); pip would refuse to install it. Rebuild the wheel."
    )


def read_wheels(paths: Sequence[str | os.PathLike[str]]) -> list[WheelFile]:
    """Check every wheel before anything is published; the same name twice must be one file."""
    wheels: list[WheelFile] = []
    seen: dict[str, WheelFile] = {}
    for p in paths:
        w = read_wheel(p)
        prior = seen.get(w.filename)
        if prior is None:
            seen[w.filename] = w
            wheels.append(w)
        elif prior.sha256 != w.sha256:
            raise PublishError(
                f"two different files named {w.filename} were given ({prior.path} and "
                f"{w.path}). Pass only the one you mean to publish."
            )
    return wheels
