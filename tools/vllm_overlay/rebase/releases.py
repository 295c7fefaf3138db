"""The releases of upstream, as the package index lists them: the one list that the rebase
(``--to latest``), the tracking run and the outlook read.

Every final release newer than the pinned one is a column of the outlook. A release the index
lists without an sdist, or whose sdist is yanked, cannot be a target (the tool builds from the
sdist): it is kept as a column with a note saying why, or refused when asked for by name.
Downloading an sdist checks its sha256 against the index's and refuses a mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from packaging.version import InvalidVersion, Version

from vllm_overlay.errors import IntegrityError, ReleaseError, UsageError
from vllm_overlay.index.client import IndexFile, release_of
from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.pin.artifacts import ensure_artifact
from vllm_overlay.pin.lockfile import Artifact


@dataclass
class Release:
    """One release of upstream on the index."""

    version: str
    sdist: IndexFile | None = None
    yanked: bool = False
    wheels: list[IndexFile] = field(default_factory=list)

    @property
    def usable(self) -> bool:
        return self.sdist is not None and not self.yanked

    @property
    def why_not(self) -> str:
        """Why the release cannot be a target ('' when it can)."""
        if self.sdist is None:
            return "the index lists no sdist for it (the tool builds from the release sdist)"
        if self.yanked:
            return "its sdist is yanked on the index"
        return ""

    def artifact(self, project: str) -> Artifact:
        """The sdist as an artifact of ``project`` (the upstream's name)."""
        assert self.sdist is not None
        if not self.sdist.sha256:
            raise IntegrityError(
                f"the index publishes no sha256 for {self.sdist.filename}; the outlook reads only "
                "sdists it can verify. Use an index that publishes hashes (PEP 503/691)."
            )
        return Artifact(
            "sdist", self.sdist.filename, self.sdist.sha256, self.sdist.size or 0, project
        )


def _final(v: str) -> Version | None:
    try:
        parsed = Version(v)
    except InvalidVersion:
        return None
    return None if parsed.is_prerelease or parsed.is_devrelease else parsed


def list_releases(name: str, settings: Settings) -> dict[str, Release]:
    """Every final release of ``name`` the index lists, by version (first index wins)."""
    out: dict[str, Release] = {}
    client = settings.client()
    for url in settings.index_urls:
        seen: dict[str, Release] = {}
        for f in client.list_files(name, url):
            found = release_of(f.filename, name)
            v = found[1] if found else None
            if v is None or _final(v) is None or v in out:
                continue
            rel = seen.setdefault(v, Release(v))
            if f.filename.endswith(".tar.gz"):
                rel.sdist = f
                rel.yanked = f.yanked
            else:
                rel.wheels.append(f)
        out.update(seen)
    return out


def newer_releases(
    name: str,
    pinned: str,
    settings: Settings,
    *,
    to: str | None = None,
    only: list[str] | None = None,
) -> tuple[list[Release], list[str]]:
    """(the releases to look at, oldest first; notes on the ones skipped).

    Default: every final release newer than ``pinned``. ``to``: those up to it (it must be a
    usable release). ``only``: exactly these (each must be usable).
    """
    releases = list_releases(name, settings)
    where = settings.where()
    asked = list(only or []) + ([to] if to else [])
    for v in asked:
        if _final(v) is None and v not in releases:
            raise UsageError(f"{v!r} is not a final release version (like 0.25.0).")
        rel = releases.get(v)
        if rel is None:
            raise ReleaseError(
                f"{name} {v} is not on the package index ({where}). Check the version; "
                "`vllm-overlay outlook` without it lists every newer release."
            )
        if not rel.usable:
            raise ReleaseError(
                f"{name} {v} cannot be a target: {rel.why_not}. Pick another release."
            )
    pin = Version(pinned)
    if only:
        chosen = [releases[v] for v in only]
    else:
        limit = Version(to) if to else None
        chosen = [
            r
            for r in releases.values()
            if Version(r.version) > pin and (limit is None or Version(r.version) <= limit)
        ]
    chosen.sort(key=lambda r: Version(r.version))
    notes = [f"{name} {r.version} skipped: {r.why_not}" for r in chosen if not r.usable]
    return [r for r in chosen if r.usable], notes


def newest_release(name: str, settings: Settings) -> tuple[Release, list[str]]:
    """The newest usable final release, and notes on newer ones that are not usable."""
    releases = sorted(list_releases(name, settings).values(), key=lambda r: Version(r.version))
    notes: list[str] = []
    for rel in reversed(releases):
        if rel.usable:
            return rel, notes
        notes.append(f"{name} {rel.version} skipped: {rel.why_not}")
    where = settings.where()
    raise ReleaseError(f"the package index ({where}) lists no usable final release of {name}.")


def ensure_sdist(rel: Release, name: str, settings: Settings = DEFAULTS) -> Path:
    """The release's sdist in the artifact cache, downloaded once and checked against the
    sha256 the index publishes (a mismatch is refused, nothing is cached)."""
    assert rel.sdist is not None
    return ensure_artifact(
        rel.artifact(name),
        settings=settings,
        entry=rel.sdist,
        verify_cached=False,
        mismatch=(
            f"{name} {rel.version}: the sdist downloaded from the index does not match the "
            "sha256 the index publishes for it. The index serves a different file than it "
            "describes: investigate, or use another index (--index-url)"
        ),
    )
