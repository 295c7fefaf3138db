"""What an import takes and what the new change says: the request (``Request``: a patch
file, a pull request, or a later release's files), the patch read (a pull request fetched
from the git host), and the new change's fields (``Meta``) from the source and the options."""

from __future__ import annotations

import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay.errors import ChangeImportError, UsageError
from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.overlay.mbox import PatchSeries, parse_mbox
from vllm_overlay.pin.lockfile import Lock

FETCH_TIMEOUT = 20


@dataclass
class Meta:
    """What the new [[change]] says about itself."""

    id: str
    title: str
    why: str
    origin: str
    drop_when: str
    tests: list[str] | None = None  # None: the test files the change touches
    authors: list[str] = field(default_factory=list)
    # None: the test files (tests/**/test_*.py) the imported upstream diff adds or changes
    upstream_tests: list[str] | None = None


@dataclass(frozen=True)
class Request:
    """What to import (one of ``patch``, ``pr``, ``from_release``) into which checkout, and
    what the new change says where its source does not (None: from the source)."""

    checkout: Path
    patch: Path | None = None
    pr: int | None = None
    from_release: str | None = None
    paths: list[str] | None = None  # with from_release: files or directories to take
    base_release: str | None = None  # the release a patch was written on
    id: str | None = None
    title: str | None = None
    why: str | None = None
    origin: str | None = None
    drop_when: str | None = None
    tests: list[str] | None = None
    upstream_tests: list[str] | None = None
    settings: Settings = DEFAULTS  # the index; the checkout's pristine tree; --git-url


def web_url(git_url: str) -> str | None:
    """``https://host/owner/repo`` for an http(s) git URL, else None."""
    if not re.match(r"^https?://", git_url):
        return None
    return git_url.rstrip("/").removesuffix(".git")


def fetch_pr(git_url: str, number: int) -> tuple[str, str]:
    """(the pull request's .patch text, its URL) from the git host; one clear error if it
    cannot be reached."""
    web = web_url(git_url)
    if web is None:
        raise ChangeImportError(
            f"--pr needs an http(s) git URL to find the pull request, and upstream.lock's is "
            f"{git_url}. Pass --git-url https://HOST/OWNER/REPO.git, or download the .patch and "
            "use --patch FILE."
        )
    url = f"{web}/pull/{number}.patch"
    req = urllib.request.Request(url, headers={"User-Agent": "vllm-overlay"})
    try:
        with urllib.request.urlopen(req, timeout=FETCH_TIMEOUT) as resp:
            data = resp.read()
    except urllib.error.HTTPError as e:
        raise ChangeImportError(
            f"{url} answered HTTP {e.code} ({e.reason}): is #{number} a pull request of "
            f"{web}? Nothing was written."
        ) from e
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ChangeImportError(
            f"cannot fetch {url}: {reason}. The git host is not reachable from here; nothing "
            "was written. Download the pull request's .patch where it is reachable and run "
            "`vllm-overlay import --patch FILE`, or pass --git-url for a reachable mirror."
        ) from e
    return data.decode("utf-8", errors="surrogateescape"), url


def read_series(req: Request, git_url: str) -> PatchSeries:
    if req.patch is not None:
        if not req.patch.is_file():
            raise UsageError(f"{req.patch}: no such file")
        text, source = req.patch.read_text(errors="surrogateescape"), str(req.patch)
    else:
        assert req.pr is not None
        text, source = fetch_pr(git_url, req.pr)
    return parse_mbox(text, source)


def slug(title: str) -> str:
    """A change id from a title: kebab-case words, at most 48 characters."""
    words = re.sub(r"[^a-z0-9]+", " ", title.lower()).split()
    out = ""
    for w in words:
        if len(out) + len(w) + 1 > 48:
            break
        out = f"{out}-{w}" if out else w
    return out


def patch_meta(req: Request, series: PatchSeries, web: str | None) -> Meta:
    title = req.title or series.title
    if not title:
        raise UsageError("the patch has no commit subject; pass --title")
    pr = series.pr
    origin = req.origin or (f"{web}/pull/{pr}" if pr and web else None)
    if origin is None:
        raise UsageError('no pull request number found in the patch ("(#NNNN)"); pass --origin URL')
    if not req.drop_when:
        raise UsageError('pass --drop-when, e.g. "vllm>=0.28.0" (the first release with the fix)')
    return Meta(
        id=req.id or slug(title),
        title=title,
        why=req.why or series.why or title,
        origin=origin,
        drop_when=req.drop_when,
        tests=req.tests,
        authors=series.authors,
        upstream_tests=req.upstream_tests,
    )


def release_meta(req: Request, lock: Lock, web: str | None) -> Meta:
    if not req.paths:
        raise UsageError("--from-release needs --paths PATH... (what to take from the release)")
    if not req.id:
        raise UsageError("--from-release needs --id (there is no commit subject to derive it from)")
    v, name = req.from_release, lock.upstream.name
    origin = req.origin or (f"{web}/compare/{lock.upstream.tag}...v{v}" if web else None)
    if origin is None:
        raise UsageError("pass --origin URL (upstream.lock's git URL is not http(s))")
    paths = ", ".join(req.paths)
    return Meta(
        id=req.id,
        title=req.title or f"{paths} as in {name} {v}",
        why=req.why
        or f"Upstream's changes to {paths} between {name} {lock.upstream.version} and {v}.",
        origin=origin,
        drop_when=req.drop_when or f"{name}>={v}",
        tests=req.tests,
        upstream_tests=req.upstream_tests,
    )
