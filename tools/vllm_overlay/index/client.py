"""Reading a package index (PEP 691 JSON, PEP 503 HTML as fallback) found through pip's config.

No index host is written here: the index is --index-url, else what pip is configured with
(PIP_INDEX_URL, pip.conf), else pip's own default, asked from the installed pip.
"""

from __future__ import annotations

import html.parser
import json
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay.errors import IndexError_
from vllm_overlay.util import run

JSON_CT = "application/vnd.pypi.simple.v1+json"
ACCEPT = f"{JSON_CT}, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"
TIMEOUT = 60.0


@dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str
    sha256: str | None
    size: int | None
    requires_python: str | None = None
    yanked: bool = False


def sanitize_url(url: str) -> str:
    """Drop user:password from a URL before it reaches any message."""
    parts = urllib.parse.urlsplit(url)
    if parts.username or parts.password:
        host = parts.hostname or ""
        if parts.port:
            host += f":{parts.port}"
        parts = parts._replace(netloc=f"***@{host}")
    return urllib.parse.urlunsplit(parts)


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _pip_config() -> dict[str, str]:
    """pip's configuration as `section.key` -> value (pip config list)."""
    out = run(sys.executable, "-m", "pip", "config", "list", check=False)
    conf: dict[str, str] = {}
    for line in out.stdout.splitlines():
        m = re.match(r"^([^=]+)=(.*)$", line.strip())
        if not m:
            continue
        val = m.group(2).strip()
        if len(val) >= 2 and val[0] == val[-1] and val[0] in "'\"":
            val = val[1:-1]
        conf[m.group(1).strip()] = val
    return conf


def _pip_default_index() -> str:
    try:
        from pip._internal.models.index import PyPI  # pip's own default, not a literal here

        return PyPI.simple_url
    except Exception as e:  # pragma: no cover - only without pip
        raise IndexError_(
            "no package index configured and pip's default could not be determined "
            f"({e}). Pass --index-url URL or set PIP_INDEX_URL."
        ) from e


def configured_index_urls(explicit: str | None = None) -> list[str]:
    """The index URLs to search, primary first, as pip would use them."""
    if explicit:
        return [explicit]
    env_primary = os.environ.get("PIP_INDEX_URL")
    env_extra = os.environ.get("PIP_EXTRA_INDEX_URL")
    conf = _pip_config() if not env_primary else {}
    primary = env_primary
    extras: list[str] = []
    for section in (":env:", "download", "install", "global"):
        if primary is None and f"{section}.index-url" in conf:
            primary = conf[f"{section}.index-url"]
        if f"{section}.extra-index-url" in conf and not extras:
            extras = conf[f"{section}.extra-index-url"].split()
    if env_extra:
        extras = env_extra.split()
    if primary is None:
        primary = _pip_default_index()
    return [primary, *[e for e in extras if e != primary]]


class _LinkParser(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[dict[str, str | None]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.links.append(dict(attrs))


def _get(url: str) -> tuple[bytes, str, str]:
    """GET url -> (body, content type, final url). file:// URLs read index.html."""
    if url.startswith("file://"):
        path = Path(urllib.parse.unquote(urllib.parse.urlsplit(url).path))
        for cand in (path / "index.json", path / "index.html"):
            if cand.is_file():
                ct = JSON_CT if cand.suffix == ".json" else "text/html"
                return cand.read_bytes(), ct, cand.parent.as_uri() + "/"
        raise FileNotFoundError(str(path))
    req = urllib.request.Request(url, headers={"Accept": ACCEPT, "User-Agent": "vllm-overlay"})
    with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
        return resp.read(), resp.headers.get("Content-Type", ""), resp.geturl()


def list_files(project: str, index_url: str) -> list[IndexFile]:
    """All files the index lists for ``project``."""
    url = index_url.rstrip("/") + "/" + normalize(project) + "/"
    try:
        body, ctype, final = _get(url)
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return []
        raise IndexError_(
            f"the package index answered {e.code} {e.reason} for {sanitize_url(url)}. "
            "Check --index-url / PIP_INDEX_URL and your credentials."
        ) from e
    except FileNotFoundError:
        return []
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise IndexError_(
            f"the package index {sanitize_url(index_url)} is unreachable ({reason}). "
            "Check the network, or point --index-url / PIP_INDEX_URL at a reachable mirror."
        ) from e
    if JSON_CT in ctype or ctype.startswith("application/json"):
        data = json.loads(body)
        out = []
        for f in data.get("files", []):
            hashes = f.get("hashes") or {}
            out.append(
                IndexFile(
                    filename=f["filename"],
                    url=urllib.parse.urljoin(final, f["url"]),
                    sha256=hashes.get("sha256"),
                    size=f.get("size"),
                    requires_python=f.get("requires-python"),
                    yanked=bool(f.get("yanked")),
                )
            )
        return out
    parser = _LinkParser()
    parser.feed(body.decode("utf-8", errors="replace"))
    out = []
    for a in parser.links:
        href = a.get("href")
        if not href:
            continue
        full = urllib.parse.urljoin(final, href)
        frag = urllib.parse.urlsplit(full).fragment
        sha = frag[len("sha256=") :] if frag.startswith("sha256=") else None
        name = urllib.parse.unquote(urllib.parse.urlsplit(full).path.rsplit("/", 1)[-1])
        out.append(
            IndexFile(
                filename=name,
                url=full.split("#", 1)[0],
                sha256=sha,
                size=None,
                requires_python=a.get("data-requires-python"),
                yanked="data-yanked" in a,
            )
        )
    return out


def release_file_kind(filename: str, project: str, version: str) -> str | None:
    """ "sdist" or "wheel" when ``filename`` is a release file of project==version, else None."""
    want = normalize(project)
    if filename.endswith(".tar.gz"):
        stem = filename[: -len(".tar.gz")]
        name, _, ver = stem.rpartition("-")
        return "sdist" if normalize(name) == want and ver == version else None
    if filename.endswith(".whl"):
        parts = filename[: -len(".whl")].split("-")
        if len(parts) in (5, 6) and normalize(parts[0]) == want and parts[1] == version:
            return "wheel"
    return None


def find_release_files(
    project: str, version: str, index_urls: list[str]
) -> tuple[str, list[IndexFile]]:
    """(index url, files) for ``project==version`` from the first index that has it."""
    for idx in index_urls:
        files = [
            f for f in list_files(project, idx) if release_file_kind(f.filename, project, version)
        ]
        if files:
            return idx, files
    raise IndexError_(
        f"{project} {version} is not on the package index "
        f"({', '.join(sanitize_url(u) for u in index_urls)}). Check the version, or point "
        "--index-url / PIP_INDEX_URL at an index that mirrors it."
    )


def find_file(filename: str, project: str, index_urls: list[str]) -> IndexFile:
    """The index entry for one exact file name."""
    for idx in index_urls:
        for f in list_files(project, idx):
            if f.filename == filename:
                return f
    raise IndexError_(
        f"{filename} is not on the package index "
        f"({', '.join(sanitize_url(u) for u in index_urls)}). Point --index-url / "
        "PIP_INDEX_URL at an index that has it, or re-pin with `vllm-overlay lock`."
    )
