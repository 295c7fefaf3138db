"""The one client for reading a package index: simple pages (PEP 691 JSON, PEP 503 HTML as
fallback) and the files they link, with credentials as pip finds them (``index/auth.py``)
and pip's TLS settings (``cert``: the CA bundle; ``client-cert``: one PEM with the key).

No index host is written here: the index is --index-url, else what pip is configured with
(PIP_INDEX_URL, pip.conf), else pip's own default, asked from the installed pip. A command
makes its clients from its ``Settings`` (``index/settings.py``). pip's
configuration is read by ``index/pipconfig.py`` (``pip_setting``, once per process; the
installer passes it on to uv).
Every URL that reaches a message goes through ``auth.redact``.
"""

from __future__ import annotations

import base64
import html.parser
import json
import os
import ssl
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from http.client import HTTPResponse
from pathlib import Path

from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from vllm_overlay.errors import IndexAuthError, IndexError_
from vllm_overlay.index.auth import Auth, Credentials, host_key, redact, split_userinfo
from vllm_overlay.index.pipconfig import SECTIONS, pip_config, pip_setting

JSON_CT = "application/vnd.pypi.simple.v1+json"
ACCEPT = f"{JSON_CT}, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"
TIMEOUT = 60.0
MAX_REDIRECTS = 10
FETCH_HINT = "Check --index-url / PIP_INDEX_URL (or pip.conf)"
# pip.conf sections, strongest first (pip: environment, then the command's, then global)


@dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str  # never with a user part
    sha256: str | None
    size: int | None
    requires_python: str | None = None
    yanked: bool = False


@dataclass(frozen=True)
class Page:
    url: str  # after redirects, without a user part
    content_type: str
    body: bytes


def normalize(name: str) -> str:
    """The PEP 503 form of a project name."""
    return canonicalize_name(name)


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
    conf = pip_config() if not env_primary else {}
    primary = env_primary
    extras: list[str] = []
    for section in SECTIONS:
        if primary is None and f"{section}.index-url" in conf:
            primary = conf[f"{section}.index-url"]
        if f"{section}.extra-index-url" in conf and not extras:
            extras = conf[f"{section}.extra-index-url"].split()
    if env_extra:
        extras = env_extra.split()
    if primary is None:
        primary = _pip_default_index()
    return [primary, *[e for e in extras if e != primary]]


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None  # redirects surface as HTTPError and are followed by IndexClient.open


_REDIRECTS = (301, 302, 303, 307, 308)


def _request(url: str, cred: Credentials | None, accept: str | None) -> urllib.request.Request:
    headers = {"User-Agent": "vllm-overlay"}
    if accept:
        headers["Accept"] = accept
    req = urllib.request.Request(url, headers=headers)
    if cred is not None:
        token = base64.b64encode(f"{cred.username}:{cred.password}".encode()).decode()
        req.add_unredirected_header("Authorization", f"Basic {token}")
    return req


TLS_HINT = (
    "If the index's certificate comes from a private CA, give pip its CA bundle: `cert = "
    "/path/ca.pem` under [global] in pip.conf (pip config set global.cert /path/ca.pem) or "
    "PIP_CERT=/path/ca.pem; if the server asks for a client certificate, `client-cert` / "
    "PIP_CLIENT_CERT names one PEM file holding the certificate and its key"
)


@dataclass(frozen=True)
class TLSSettings:
    """pip's ``cert`` (CA bundle file or directory; empty: the system's CAs) and
    ``client-cert`` (one PEM file with certificate and key; empty: none)."""

    cert: str = ""
    client_cert: str = ""

    @classmethod
    def from_pip(cls) -> TLSSettings:
        return cls(pip_setting("cert"), pip_setting("client-cert"))

    def describe(self) -> str:
        ca = f"CA bundle {self.cert} (pip's cert)" if self.cert else "the system's CA certificates"
        client = f", client certificate {self.client_cert}" if self.client_cert else ""
        return ca + client

    def context(self) -> ssl.SSLContext:
        """The verifying context these settings give (as requests' verify=PATH: only that CA
        bundle when one is set)."""
        try:
            if not self.cert:
                ctx = ssl.create_default_context()
            elif os.path.isdir(self.cert):
                ctx = ssl.create_default_context(capath=self.cert)
            else:
                ctx = ssl.create_default_context(cafile=self.cert)
        except (OSError, ssl.SSLError) as e:
            raise IndexError_(
                f"pip's `cert` setting names {self.cert}, which is not a readable CA bundle "
                f"({e}). Fix `cert` in pip.conf or PIP_CERT."
            ) from None
        if self.client_cert:
            try:
                ctx.load_cert_chain(self.client_cert)
            except (OSError, ssl.SSLError) as e:
                raise IndexError_(
                    f"pip's `client-cert` setting names {self.client_cert}, which is not one "
                    f"PEM file holding a certificate and its unencrypted key ({e}). Fix "
                    "`client-cert` in pip.conf or PIP_CLIENT_CERT."
                ) from None
        return ctx


class IndexClient:
    """GETs from package indexes with pip's credentials: sent only to their own host."""

    def __init__(
        self,
        index_urls: Sequence[str] = (),
        *,
        auth: Auth | None = None,
        timeout: float = TIMEOUT,
        hint: str = FETCH_HINT,
        tls: TLSSettings | None = None,
    ) -> None:
        self.auth = auth if auth is not None else Auth(index_urls)
        self.timeout = timeout
        self.hint = hint
        self._tls = tls  # read from pip's configuration at the first https request
        self._openers: dict[str, urllib.request.OpenerDirector] = {}

    @property
    def tls(self) -> TLSSettings:
        if self._tls is None:
            self._tls = TLSSettings.from_pip()
        return self._tls

    def _opener(self, url: str) -> urllib.request.OpenerDirector:
        scheme = "https" if url.lower().startswith("https:") else "http"
        if scheme not in self._openers:
            handlers: list[urllib.request.BaseHandler] = [_NoRedirect()]
            if scheme == "https":
                handlers.append(urllib.request.HTTPSHandler(context=self.tls.context()))
            self._openers[scheme] = urllib.request.build_opener(*handlers)
        return self._openers[scheme]

    def open(
        self, url: str, *, accept: str | None = None, other_hosts: bool = True
    ) -> HTTPResponse | None:
        """The response for ``url`` after redirects (the caller closes it); None for 404/410,
        or for a redirect to another host when ``other_hosts`` is False."""
        self.auth.for_url(url)  # a user part in url is remembered for its host
        url, _ = split_userinfo(url)
        for _ in range(MAX_REDIRECTS):
            try:
                return self._send(url, accept)
            except urllib.error.HTTPError as e:
                e.close()
                if e.code in _REDIRECTS:
                    target, _ = split_userinfo(
                        urllib.parse.urljoin(url, e.headers["Location"] or "")
                    )
                    if not other_hosts and host_key(target) != host_key(url):
                        return None
                    url = target
                    continue
                if e.code in (404, 410):
                    return None
                if e.code in (401, 403):
                    raise IndexAuthError(
                        f"the package index refused {redact(url)} (HTTP {e.code} {e.reason}): "
                        f"the credentials are missing or wrong; {self.auth.searched(url)}. "
                        "Put user:token in the index URL, a `machine` entry in ~/.netrc, or "
                        f"the password in keyring. {self.hint}."
                    ) from None
                raise IndexError_(
                    f"the package index answered HTTP {e.code} {e.reason} for {redact(url)}. "
                    f"{self.hint} and the server's health."
                ) from None
            except (urllib.error.URLError, OSError, TimeoutError) as e:
                cause = e.reason if isinstance(e, urllib.error.URLError) else e
                if isinstance(cause, ssl.SSLError):
                    raise IndexError_(
                        f"the TLS connection to the package index at {redact(url)} failed "
                        f"({redact(str(cause))}), verifying with {self.tls.describe()}. "
                        f"{TLS_HINT}. {self.hint}."
                    ) from None
                reason = redact(str(getattr(e, "reason", e)))
                raise IndexError_(
                    f"the package index at {redact(url)} is unreachable ({reason}). Check the "
                    f"network and proxy settings; {self.hint}, or point it at a reachable mirror."
                ) from None
        raise IndexError_(f"too many redirects from {redact(url)}. {self.hint}.")

    def _send(self, url: str, accept: str | None) -> HTTPResponse:
        cred = self.auth.for_url(url)
        opener = self._opener(url)
        try:
            return opener.open(_request(url, cred, accept), timeout=self.timeout)
        except urllib.error.HTTPError as e:
            if e.code != 401:
                raise
            retry = self.auth.after_401(url)
            if retry is None or retry == cred:
                raise
            e.close()
        return opener.open(_request(url, retry, accept), timeout=self.timeout)

    def page(self, url: str, *, other_hosts: bool = True) -> Page | None:
        """A simple page; file:// URLs read the directory's index.json or index.html."""
        if url.startswith("file://"):
            path = Path(urllib.request.url2pathname(urllib.parse.urlsplit(url).path))
            for cand in (path / "index.json", path / "index.html"):
                if cand.is_file():
                    ct = JSON_CT if cand.suffix == ".json" else "text/html"
                    return Page(cand.parent.as_uri() + "/", ct, cand.read_bytes())
            return None
        resp = self.open(url, accept=ACCEPT, other_hosts=other_hosts)
        if resp is None:
            return None
        with resp:
            body = resp.read()
            final, _ = split_userinfo(resp.geturl())
            return Page(final, resp.headers.get("Content-Type", ""), body)

    def list_files(
        self, project: str, index_url: str, *, other_hosts: bool = True
    ) -> list[IndexFile]:
        """All files the index lists for ``project`` (empty when it has no such project)."""
        url = index_url.rstrip("/") + "/" + normalize(project) + "/"
        page = self.page(url, other_hosts=other_hosts)
        if page is None:
            return []
        try:
            return parse_page(page)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise IndexError_(
                f"cannot read the simple page {redact(page.url)} ({e}). It must be the "
                f"index's PEP 503/691 simple API; {self.hint}."
            ) from None

    def find_release_files(
        self, project: str, version: str, index_urls: Sequence[str]
    ) -> tuple[str, list[IndexFile]]:
        """(index url, files) for ``project==version`` from the first index that has it."""
        for idx in index_urls:
            files = [
                f
                for f in self.list_files(project, idx)
                if release_file_kind(f.filename, project, version)
            ]
            if files:
                return idx, files
        raise IndexError_(
            f"{project} {version} is not on the package index "
            f"({', '.join(redact(u) for u in index_urls)}). Check the version, or point "
            "--index-url / PIP_INDEX_URL at an index that mirrors it."
        )

    def find_file(self, filename: str, project: str, index_urls: Sequence[str]) -> IndexFile:
        """The index entry for one exact file name."""
        for idx in index_urls:
            for f in self.list_files(project, idx):
                if f.filename == filename:
                    return f
        raise IndexError_(
            f"{filename} is not on the package index "
            f"({', '.join(redact(u) for u in index_urls)}). Point --index-url / "
            "PIP_INDEX_URL at an index that has it, or re-pin with `vllm-overlay lock`."
        )


class _LinkParser(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[dict[str, str | None]] = []
        self.base: str | None = None  # the first <base href>, as HTML takes it

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            self.links.append(dict(attrs))
        elif tag == "base" and self.base is None:
            self.base = dict(attrs).get("href") or None


def parse_page(page: Page) -> list[IndexFile]:
    """The files of a PEP 691 JSON or PEP 503 HTML project page, with absolute URLs."""
    ctype = page.content_type.split(";")[0].strip()
    if ctype in (JSON_CT, "application/json"):
        out = []
        for f in json.loads(page.body).get("files", []):
            hashes = f.get("hashes") or {}
            out.append(
                IndexFile(
                    filename=f["filename"],
                    url=split_userinfo(urllib.parse.urljoin(page.url, f["url"]))[0],
                    sha256=hashes.get("sha256"),
                    size=f.get("size"),
                    requires_python=f.get("requires-python"),
                    yanked=bool(f.get("yanked")),
                )
            )
        return out
    parser = _LinkParser()
    parser.feed(page.body.decode("utf-8", errors="replace"))
    # Links resolve against <base href> (itself relative to the page) when there is one.
    base = urllib.parse.urljoin(page.url, parser.base) if parser.base else page.url
    out = []
    for a in parser.links:
        href = a.get("href")
        if not href:
            continue
        full, _, frag = urllib.parse.urljoin(base, href).partition("#")
        algo, _, digest = frag.partition("=")
        name = urllib.parse.unquote(urllib.parse.urlsplit(full).path.rsplit("/", 1)[-1])
        out.append(
            IndexFile(
                filename=name,
                url=split_userinfo(full)[0],
                sha256=digest.lower() if algo == "sha256" and digest else None,
                size=None,
                requires_python=a.get("data-requires-python"),
                yanked="data-yanked" in a,
            )
        )
    return out


def release_of(filename: str, project: str) -> tuple[str, str] | None:
    """("sdist" | "wheel", version) when ``filename`` is a release file of ``project``."""
    try:
        if filename.endswith(".whl"):
            name, version, _build, _tags = parse_wheel_filename(filename)
            kind = "wheel"
        else:
            name, version = parse_sdist_filename(filename)
            kind = "sdist"
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
        return None
    return (kind, str(version)) if name == canonicalize_name(project) else None


def release_file_kind(filename: str, project: str, version: str) -> str | None:
    """ "sdist" or "wheel" when ``filename`` is a release file of project==version, else None."""
    found = release_of(filename, project)
    try:
        return found[0] if found and Version(found[1]) == Version(version) else None
    except InvalidVersion:
        return None
