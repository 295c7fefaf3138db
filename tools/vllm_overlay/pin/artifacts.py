"""Release artifacts in a content-addressed cache: download once, verify always.

Layout: ``<cache>/artifacts/sha256/<hex>/<filename>``. A file enters the cache only after
its sha256 and size match the pin; downloads go to ``<cache>/tmp`` and are renamed into
place, so the cache never holds a partial file. A cached artifact is used without any
network request.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

from vllm_overlay.errors import DownloadError, IntegrityError
from vllm_overlay.index.auth import redact
from vllm_overlay.index.client import IndexClient, IndexFile
from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.pin.lockfile import Artifact
from vllm_overlay.util import cache_dir, exclusive_lock, hold, info, release, sha256_file, touch

CHUNK = 1 << 20


def cached_path(a: Artifact, root: Path | None = None) -> Path:
    return (root or cache_dir()) / "artifacts" / "sha256" / a.sha256 / a.filename


def lock_path(sha256: str) -> Path:
    """The lock of the cache entry ``artifacts/sha256/<sha256>``: its downloader takes it
    exclusively, every process using it shares it (``util.hold``)."""
    return cache_dir() / "locks" / f"{sha256}.lock"


def verify_file(path: Path, a: Artifact) -> None:
    """Raise IntegrityError unless ``path`` has the pinned size and sha256."""
    size = path.stat().st_size
    if size != a.size:
        raise IntegrityError(
            f"{a.filename}: size mismatch: expected {a.size} bytes (upstream.lock), got {size}. "
            "The file was not cached. If the index serves a different file under this name, "
            "stop and investigate; re-pin only with `vllm-overlay lock` after review."
        )
    got = sha256_file(path)
    if got != a.sha256:
        raise IntegrityError(
            f"{a.filename}: sha256 mismatch: expected {a.sha256} (upstream.lock), got {got}. "
            "The file was not cached. If the index serves a different file under this name, "
            "stop and investigate; re-pin only with `vllm-overlay lock` after review."
        )


def _progress(name: str, done: int, total: int | None, started: float, last: list[float]) -> None:
    now = time.monotonic()
    if now - last[0] < 2.0 and (total is None or done < total):
        return
    last[0] = now
    rate = done / max(now - started, 1e-6) / 1e6
    if total:
        info(
            f"  {name}: {done / 1e6:.1f}/{total / 1e6:.1f} MB ({100 * done // total}%, {rate:.0f} MB/s)"
        )
    else:
        info(f"  {name}: {done / 1e6:.1f} MB ({rate:.0f} MB/s)")


def download_to(
    url: str, dest: Path, expected_size: int | None, label: str, client: IndexClient | None = None
) -> None:
    """Stream ``url`` into ``dest`` (which should be a temp path), with progress; ``client``
    carries the index's credentials (sent only to the index's own host)."""
    if url.startswith("file://"):
        src = Path(urllib.request.url2pathname(url[len("file://") :]))
        with open(src, "rb") as fi, open(dest, "wb") as fo:
            for chunk in iter(lambda: fi.read(CHUNK), b""):
                fo.write(chunk)
        return
    client = client or IndexClient(timeout=120)
    resp = client.open(url)
    if resp is None:
        raise DownloadError(
            f"{redact(url)} is gone from the package index (HTTP 404). Nothing was cached; "
            "check that the index still has the pinned file."
        )
    started = time.monotonic()
    last = [started]
    done = 0
    try:
        with resp, open(dest, "wb") as fo:
            total = expected_size or int(resp.headers.get("Content-Length") or 0) or None
            info(f"downloading {label} ({total / 1e6:.1f} MB)" if total else f"downloading {label}")
            while True:
                chunk = resp.read(CHUNK)
                if not chunk:
                    break
                fo.write(chunk)
                done += len(chunk)
                _progress(label, done, total, started, last)
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise DownloadError(
            f"downloading {label} from {redact(url)} failed after {done} bytes ({reason}). "
            "Nothing was cached; run the command again to restart the download."
        ) from e
    if expected_size is not None and done != expected_size:
        raise DownloadError(
            f"downloading {label} from {redact(url)} stopped at {done} of {expected_size} "
            "bytes (connection closed early). Nothing was cached; run the command again."
        )


def ensure_artifact(
    a: Artifact,
    *,
    settings: Settings = DEFAULTS,
    verify_cached: bool = True,
    entry: IndexFile | None = None,
    mismatch: str = "",
) -> Path:
    """The verified cached file for ``a``; downloads it through the index (from the page of
    ``a.project``) only if missing.

    ``entry`` is the index's listing of the file when the caller already has it (else it is
    looked up); ``mismatch`` is said first when the download does not match ``a``.
    """
    root = cache_dir()
    dest = cached_path(a, root)
    lock = lock_path(a.sha256)
    what = f"the cache entry for {a.filename}"
    if dest.is_file():
        hold(lock, what)  # in use by this process: a prune passes it by
    if dest.is_file():
        if verify_cached:
            try:
                verify_file(dest, a if a.size else _sized(a, dest))
            except IntegrityError as e:
                raise IntegrityError(
                    f"the cached {dest} is corrupt ({e}). Delete it and fetch again."
                ) from None
        touch(dest.parent)
        return dest
    release(lock)  # this process's own shared lock would block its exclusive one
    with exclusive_lock(lock, what):
        if not dest.is_file():  # else another process fetched it while this one waited
            _download(a, dest, root, settings=settings, entry=entry, mismatch=mismatch)
    hold(lock, what)
    return dest


def _download(
    a: Artifact, dest: Path, root: Path, *, settings: Settings, entry: IndexFile | None,
    mismatch: str,
) -> None:  # fmt: skip
    client = settings.client(timeout=120)
    if entry is None:
        entry = client.find_file(a.filename, a.project, settings.index_urls)
    if entry.sha256 and entry.sha256 != a.sha256:
        raise IntegrityError(
            f"{a.filename}: the index publishes sha256 {entry.sha256}, but upstream.lock pins "
            f"{a.sha256}. Nothing was downloaded. Either the index serves a different file "
            "under this name (investigate) or the lock is wrong (re-pin with `vllm-overlay lock`)."
        )
    tmpdir = root / "tmp"
    tmpdir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{a.filename}.", suffix=".part", dir=tmpdir)
    os.close(fd)
    try:
        download_to(entry.url, Path(tmp), a.size or None, a.filename, client)
        try:
            verify_file(Path(tmp), a if a.size else _sized(a, Path(tmp)))
        except IntegrityError as e:
            if not mismatch:
                raise
            raise IntegrityError(f"{mismatch} ({e}). Nothing was cached.") from None
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(tmp, 0o444)
        os.replace(tmp, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    info(f"cached {a.filename} (sha256 {a.sha256[:12]}…)")


def _sized(a: Artifact, path: Path) -> Artifact:
    """``a`` with the size of ``path``: for a listing that gives the sha256 but no size."""
    return replace(a, size=path.stat().st_size)
