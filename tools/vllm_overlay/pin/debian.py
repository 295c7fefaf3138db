"""Source tarballs from Debian's archive: what a source build needs that the package index
does not serve (oneDNN's source for the CPU build), fetched with apt-get and cached by
content like the release artifacts.

vLLM's CMake clones oneDNN from its git host, which a build here cannot reach; Debian's
archive serves the same upstream source as a source package. ``apt-get source
--download-only PACKAGE=VERSION`` fetches it (apt checks every file against the suite's
signed index), with a ``deb-src`` line for the pinned suite on the archive this machine's
apt is configured with, in a private apt state under the cache's tmp/ (the system's
configuration is left as it is). The upstream tarball is then checked against the pin's
sha256 and size and renamed into ``<cache>/artifacts/sha256/<hex>/<filename>``; a killed
fetch leaves nothing there.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from vllm_overlay.errors import DownloadError, IntegrityError
from vllm_overlay.pin.artifacts import cached_path, lock_path, verify_file
from vllm_overlay.pin.lockfile import Artifact, SourceInput
from vllm_overlay.process import run
from vllm_overlay.util import cache_dir, exclusive_lock, hold, info, release, touch

KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
APT_SOURCES = (Path("/etc/apt/sources.list.d"), Path("/etc/apt/sources.list"))
_DEB822_URI = re.compile(r"^URIs:\s*(\S+)", re.M)
_ONE_LINE = re.compile(r"^\s*deb(?:-src)?\s+(?:\[[^\]]*\]\s+)?(\S+)\s+(\S+)", re.M)


def as_artifact(si: SourceInput) -> Artifact:
    """The input as a content-addressed artifact (same cache layout, same checks)."""
    return Artifact("source", si.filename, si.sha256, si.size, si.name)


def source_path(si: SourceInput) -> Path:
    return cached_path(as_artifact(si))


def is_cached(si: SourceInput) -> bool:
    return source_path(si).is_file()


def archive_uri(sources: tuple[Path, ...] = APT_SOURCES) -> str | None:
    """The Debian archive this machine's apt uses (the first non-security URI), or None."""
    files: list[Path] = []
    for p in sources:
        if p.is_dir():
            files += sorted(x for x in p.iterdir() if x.suffix in (".sources", ".list"))
        elif p.is_file():
            files.append(p)
    for f in files:
        try:
            text = f.read_text(errors="replace")
        except OSError:
            continue
        uris = _DEB822_URI.findall(text) + [m.group(1) for m in _ONE_LINE.finditer(text)]
        for uri in uris:
            if "debian" in uri and "security" not in uri:
                return uri.rstrip("/")
    return None


def how_to_fetch(si: SourceInput) -> str:
    """What a person does to put the tarball in place by hand."""
    return (
        f"fetch it with a `deb-src <Debian archive> {si.suite} main` line and "
        f"`apt-get source --download-only {si.package}={si.version}`, then copy "
        f"{si.filename} (sha256 {si.sha256}) to {source_path(si)}"
    )


def ensure_source(si: SourceInput) -> Path:
    """The verified cached tarball of ``si``; fetched from Debian's archive if missing."""
    dest = source_path(si)
    art = as_artifact(si)
    lock = lock_path(si.sha256)
    what = f"the cache entry for {si.filename}"
    if dest.is_file():
        hold(lock, what)
        verify_file(dest, art)
        touch(dest.parent)
        return dest
    release(lock)
    with exclusive_lock(lock, what):
        if not dest.is_file():
            _fetch(si, dest)
    hold(lock, what)
    return dest


def _fetch(si: SourceInput, dest: Path) -> None:
    apt_get = shutil.which("apt-get")
    uri = archive_uri()
    if apt_get is None or uri is None:
        why = "apt-get is not installed" if apt_get is None else "no Debian archive is configured"
        raise DownloadError(f"{si.label} is not in the cache and {why} here; {how_to_fetch(si)}.")
    tmproot = cache_dir() / "tmp"
    tmproot.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"debian-{si.package}.", dir=tmproot))
    try:
        (work / "lists" / "partial").mkdir(parents=True)
        (work / "dl").mkdir()
        signed = f"[signed-by={KEYRING}] " if Path(KEYRING).is_file() else ""
        (work / "sources.list").write_text(f"deb-src {signed}{uri} {si.suite} main\n")
        opts = [
            "-o", f"Dir::Etc::SourceList={work / 'sources.list'}",
            "-o", "Dir::Etc::SourceParts=/dev/null",
            "-o", f"Dir::State::Lists={work / 'lists'}",
            "-o", "APT::Sandbox::User=root",
        ]  # fmt: skip
        hint = f"Fetching {si.label} from Debian failed; {how_to_fetch(si)}."
        info(f"fetching {si.label} from Debian's archive (apt-get source)")
        run(apt_get, *opts, "update", hint=hint, timeout=900)
        run(apt_get, *opts, "source", "--download-only", f"{si.package}={si.version}",
            cwd=work / "dl", hint=hint, timeout=900)  # fmt: skip
        got = work / "dl" / si.filename
        if not got.is_file():
            have = ", ".join(sorted(p.name for p in (work / "dl").iterdir()))
            raise DownloadError(
                f"apt-get source {si.package}={si.version} fetched {have}, not {si.filename}; "
                "the pin names another file. Re-pin the source build with `vllm-overlay lock`."
            )
        try:
            verify_file(got, as_artifact(si))
        except IntegrityError as e:
            raise IntegrityError(f"Debian's {si.filename} differs from the pin: {e}") from None
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(got, 0o444)
        os.replace(got, dest)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info(f"cached {si.filename} (sha256 {si.sha256[:12]}…)")
