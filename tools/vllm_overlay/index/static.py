"""A static package index in a directory (the wheels are read and checked by index/wheels.py).

Layout of an index directory (servable as-is by any web server or object store)::

    packages/<wheel>                 the wheels, never overwritten
    packages/<wheel>.metadata        PEP 658: the wheel's .dist-info/METADATA, byte for byte
    simple/index.html                PEP 503 project list
    simple/index.json                PEP 691 JSON form of the same list
    simple/<project>/index.html      PEP 503 links with #sha256=, data-requires-python and
                                     PEP 658/714 data-core-metadata / data-dist-info-metadata
    simple/<project>/index.json      PEP 691 + PEP 700 (versions, size, upload-time)
    vllm-overlay-index.json          the record every page is generated from (one entry per
                                     file, with the upload-time of its first publication)
    .vllm-overlay-index.lock         held while publishing so two publishers never race

Every page is a pure function of the record, so the same record gives the same bytes.
New files are written as temporary files first and then renamed into place, wheels and
metadata files with ``os.link`` (which never replaces an existing file), pages with
``os.replace``; a reader sees the old index or the new one, never half of one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import html
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from packaging.version import Version

from vllm_overlay.errors import PublishError
from vllm_overlay.index.wheels import PublishResult, WheelFile
from vllm_overlay.util import exclusive_lock, link_new, sha256_file

API_VERSION = "1.1"  # PEP 691 with PEP 700's versions, size and upload-time
STATE_FILE = "vllm-overlay-index.json"
LOCK_FILE = ".vllm-overlay-index.lock"
PACKAGES_DIR = "packages"
SIMPLE_DIR = "simple"
STATE_FORMAT = 1


# --------------------------------------------------------------------------- the record


@dataclass(frozen=True)
class IndexEntry:
    """One published file as the index records it."""

    filename: str
    project: str
    version: str
    sha256: str
    size: int
    metadata_sha256: str
    requires_python: str | None
    upload_time: str

    def to_json(self) -> dict[str, object]:
        return {
            "filename": self.filename,
            "project": self.project,
            "version": self.version,
            "sha256": self.sha256,
            "size": self.size,
            "metadata-sha256": self.metadata_sha256,
            "requires-python": self.requires_python,
            "upload-time": self.upload_time,
        }

    @classmethod
    def from_json(cls, d: Mapping[str, object]) -> IndexEntry:
        rp = d.get("requires-python")
        return cls(
            filename=str(d["filename"]),
            project=str(d["project"]),
            version=str(d["version"]),
            sha256=str(d["sha256"]),
            size=int(d["size"]),  # type: ignore[call-overload]
            metadata_sha256=str(d["metadata-sha256"]),
            requires_python=None if rp is None else str(rp),
            upload_time=str(d["upload-time"]),
        )


def upload_time_now(environ: Mapping[str, str] | None = None) -> str:
    """PEP 700 upload-time for a new file: $SOURCE_DATE_EPOCH if set, else now (UTC)."""
    environ = os.environ if environ is None else environ
    epoch = environ.get("SOURCE_DATE_EPOCH")
    if epoch:
        try:
            when = dt.datetime.fromtimestamp(int(epoch), dt.UTC)
        except (ValueError, OverflowError, OSError) as e:
            raise PublishError(
                f"SOURCE_DATE_EPOCH={epoch!r} is not a number of seconds since 1970. "
                "Unset it or set it to an integer."
            ) from e
    else:
        when = dt.datetime.now(dt.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def load_state(index_dir: Path) -> dict[str, IndexEntry]:
    """The record of an index directory, by file name (empty for a new index)."""
    state_path = index_dir / STATE_FILE
    try:
        raw = state_path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise PublishError(f"cannot read {state_path}: {e}.") from e
    try:
        doc = json.loads(raw)
        if doc.get("format") != STATE_FORMAT:
            raise ValueError(f"unknown format {doc.get('format')!r}")
        entries = [IndexEntry.from_json(d) for d in doc["files"]]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise PublishError(
            f"{state_path} is not a valid index record ({e}). It lists every published file; "
            "restore it from version control or a backup of the index, then run again."
        ) from e
    return {e.filename: e for e in entries}


def render_state(entries: Mapping[str, IndexEntry]) -> bytes:
    doc = {
        "format": STATE_FORMAT,
        "files": [entries[k].to_json() for k in sorted(entries)],
    }
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


# --------------------------------------------------------------------------- pages


def _by_project(entries: Mapping[str, IndexEntry]) -> dict[str, list[IndexEntry]]:
    projects: dict[str, list[IndexEntry]] = {}
    for e in entries.values():
        projects.setdefault(e.project, []).append(e)
    for files in projects.values():
        files.sort(key=lambda e: (Version(e.version), e.filename))
    return dict(sorted(projects.items()))


def _file_url(filename: str) -> str:
    """Link from simple/<project>/ to the wheel; '+' becomes %2B (object stores read '+' as
    a space)."""
    return f"../../{PACKAGES_DIR}/{quote(filename)}"


def _html_page(title: str, links: Sequence[str]) -> bytes:
    lines = [
        "<!DOCTYPE html>",
        "<html>",
        "  <head>",
        f'    <meta name="pypi:repository-version" content="{API_VERSION}">',
        f"    <title>{html.escape(title)}</title>",
        "  </head>",
        "  <body>",
        f"    <h1>{html.escape(title)}</h1>",
        *(f"    {link}<br>" for link in links),
        "  </body>",
        "</html>",
    ]
    return ("\n".join(lines) + "\n").encode()


def _json_page(doc: dict[str, object]) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()


def _root_pages(projects: Sequence[str]) -> dict[str, bytes]:
    links = [f'<a href="{quote(p)}/">{html.escape(p)}</a>' for p in projects]
    doc: dict[str, object] = {
        "meta": {"api-version": API_VERSION},
        "projects": [{"name": p} for p in projects],
    }
    return {
        f"{SIMPLE_DIR}/index.html": _html_page("Simple index", links),
        f"{SIMPLE_DIR}/index.json": _json_page(doc),
    }


def _anchor(e: IndexEntry) -> str:
    attrs = [f'href="{html.escape(_file_url(e.filename))}#sha256={e.sha256}"']
    if e.requires_python:
        attrs.append(f'data-requires-python="{html.escape(e.requires_python)}"')
    attrs.append(f'data-dist-info-metadata="sha256={e.metadata_sha256}"')
    attrs.append(f'data-core-metadata="sha256={e.metadata_sha256}"')
    return f"<a {' '.join(attrs)}>{html.escape(e.filename)}</a>"


def _file_json(e: IndexEntry) -> dict[str, object]:
    d: dict[str, object] = {
        "filename": e.filename,
        "url": _file_url(e.filename),
        "hashes": {"sha256": e.sha256},
        "core-metadata": {"sha256": e.metadata_sha256},
        "dist-info-metadata": {"sha256": e.metadata_sha256},
        "size": e.size,
        "upload-time": e.upload_time,
        "yanked": False,
    }
    if e.requires_python:
        d["requires-python"] = e.requires_python
    return d


def _project_pages(project: str, files: Sequence[IndexEntry]) -> dict[str, bytes]:
    versions = sorted({Version(e.version) for e in files})
    doc: dict[str, object] = {
        "meta": {"api-version": API_VERSION},
        "name": project,
        "versions": [str(v) for v in versions],
        "files": [_file_json(e) for e in files],
    }
    base = f"{SIMPLE_DIR}/{project}"
    return {
        f"{base}/index.html": _html_page(f"Links for {project}", [_anchor(e) for e in files]),
        f"{base}/index.json": _json_page(doc),
    }


def render_pages(entries: Mapping[str, IndexEntry]) -> dict[str, bytes]:
    """Every page of the index, by path relative to the index directory; project pages first."""
    projects = _by_project(entries)
    pages: dict[str, bytes] = {}
    for project, files in projects.items():
        pages.update(_project_pages(project, files))
    pages.update(_root_pages(list(projects)))
    return pages


# --------------------------------------------------------------------------- writing


class _Staging:
    """Temporary files beside their targets, renamed into place only by ``commit``."""

    def __init__(self) -> None:
        self._items: list[tuple[Path, Path, bool]] = []  # (tmp, final, never_replace)

    def _tmp(self, final: Path) -> tuple[int, Path]:
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
        return fd, Path(tmp)

    def add_bytes(self, final: Path, data: bytes, *, never_replace: bool) -> None:
        fd, tmp = self._tmp(final)
        self._items.append((tmp, final, never_replace))
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)

    def add_copy(self, final: Path, source: Path) -> None:
        fd, tmp = self._tmp(final)
        self._items.append((tmp, final, True))
        with os.fdopen(fd, "wb") as out, open(source, "rb") as src:
            shutil.copyfileobj(src, out, 1 << 20)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, 0o644)

    def commit(self) -> None:
        for tmp, final, never_replace in self._items:
            if not never_replace:
                os.replace(tmp, final)
                continue
            try:
                link_new(tmp, final)
            except FileExistsError as e:
                raise PublishError(
                    f"{final} appeared while publishing with other bytes; it was left as it "
                    "is. Run publish again."
                ) from e
            tmp.unlink()
        self._items.clear()

    def discard(self) -> None:
        for tmp, _final, _ in self._items:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        self._items.clear()


@contextlib.contextmanager
def _writing(index_dir: Path) -> Iterator[None]:
    """Turn OS errors while writing the index into one clear message."""
    try:
        yield
    except OSError as e:
        raise PublishError(
            f"cannot write to the index directory {index_dir}: {e}. Check that the path is a "
            "directory you can write to (permissions, read-only mount, immutable flag); "
            "the index was left as it was."
        ) from e


def _prepare_dir(index_dir: Path) -> None:
    if index_dir.exists() and not index_dir.is_dir():
        raise PublishError(
            f"{index_dir} exists and is not a directory. Pass --to a directory for a static "
            "index, or an http(s):// URL for an index server."
        )
    with _writing(index_dir):
        index_dir.mkdir(parents=True, exist_ok=True)


# --------------------------------------------------------------------------- publishing


@dataclass(frozen=True)
class _Plan:
    new: list[WheelFile]  # to copy in
    adopt: list[WheelFile]  # already in packages/ (an interrupted publish), not yet recorded
    results: list[PublishResult]


def _plan(index_dir: Path, wheels: Sequence[WheelFile], state: Mapping[str, IndexEntry]) -> _Plan:
    """Decide per wheel; refuse before writing anything if a name is taken by other bytes."""
    new: list[WheelFile] = []
    adopt: list[WheelFile] = []
    results: list[PublishResult] = []
    conflicts: list[str] = []
    for w in wheels:
        on_disk = index_dir / PACKAGES_DIR / w.filename
        recorded = state.get(w.filename)
        present = on_disk.is_file()
        known = recorded.sha256 if recorded else (sha256_file(on_disk) if present else None)
        if known is None:
            new.append(w)
            results.append(PublishResult.of(w, "published", "new file"))
        elif known == w.sha256 and not present:
            new.append(w)
            results.append(
                PublishResult.of(w, "published", "restored a file missing from packages/")
            )
        elif known != w.sha256:
            conflicts.append(
                f"{w.filename} is already published with sha256 {known}, "
                f"but {w.path} has sha256 {w.sha256}"
            )
        elif recorded is None:
            adopt.append(w)
            results.append(PublishResult.of(w, "published", "recorded a file already in packages/"))
        else:
            results.append(PublishResult.of(w, "skipped", "already published, same sha256"))
    if conflicts:
        raise PublishError(
            "; ".join(conflicts) + ". A published file is never overwritten: give the new "
            "build a new version (bump the overlay revision in its local version label)."
        )
    return _Plan(new, adopt, results)


def _entry(w: WheelFile, upload_time: str) -> IndexEntry:
    return IndexEntry(
        filename=w.filename,
        project=w.project,
        version=w.version,
        sha256=w.sha256,
        size=w.size,
        metadata_sha256=w.metadata_sha256,
        requires_python=w.requires_python,
        upload_time=upload_time,
    )


def _stage_metadata(staging: _Staging, index_dir: Path, w: WheelFile) -> None:
    path = index_dir / PACKAGES_DIR / f"{w.filename}.metadata"
    if not path.exists():
        staging.add_bytes(path, w.metadata, never_replace=True)
    elif path.read_bytes() != w.metadata:
        raise PublishError(
            f"{path} does not hold the METADATA of {w.filename}. Someone changed the index by "
            "hand; restore that file (it must equal the wheel's .dist-info/METADATA)."
        )


def _stage_changed(staging: _Staging, index_dir: Path, files: Mapping[str, bytes]) -> None:
    """Stage the pages and record whose bytes differ from what is there (so a no-op writes
    nothing, and a deleted page comes back)."""
    for rel, data in files.items():
        path = index_dir / rel
        try:
            same = path.read_bytes() == data
        except (FileNotFoundError, NotADirectoryError):
            same = False
        if not same:
            staging.add_bytes(path, data, never_replace=False)


def publish_to_directory(
    wheels: Sequence[WheelFile],
    index_dir: str | os.PathLike[str],
    *,
    upload_time: str | None = None,
) -> list[PublishResult]:
    """Add ``wheels`` to the static index in ``index_dir`` (created if missing).

    All-or-nothing: every wheel is checked and every name compared before anything is
    written. ``upload_time`` (PEP 700) is recorded for files published now; it defaults to
    ``upload_time_now()``. Files already published keep theirs.
    """
    index_dir = Path(index_dir)
    _prepare_dir(index_dir)
    stamp = upload_time or upload_time_now()
    with _writing(index_dir), exclusive_lock(index_dir / LOCK_FILE, f"the index {index_dir}"):
        state = load_state(index_dir)
        plan = _plan(index_dir, wheels, state)
        entries = dict(state)
        for w in [*plan.new, *plan.adopt]:
            recorded = state.get(w.filename)
            entries[w.filename] = _entry(w, recorded.upload_time if recorded else stamp)
        staging = _Staging()
        try:
            for w in plan.new:
                staging.add_copy(index_dir / PACKAGES_DIR / w.filename, w.path)
            for w in [*plan.new, *plan.adopt]:
                _stage_metadata(staging, index_dir, w)
            _stage_changed(staging, index_dir, {STATE_FILE: render_state(entries)})
            _stage_changed(staging, index_dir, render_pages(entries))
            staging.commit()
        finally:
            staging.discard()
    return plan.results
