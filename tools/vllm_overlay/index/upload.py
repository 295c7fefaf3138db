"""Upload wheels to an index server (pypiserver, devpi, Artifactory, ...) through twine.

Before each upload the server's simple page for the project is read: a file already
there with the same sha256 is skipped, one with a different sha256 is refused. Uploads go
through twine's documented command line (``python -m twine upload --repository-url``), so
the upload protocol is twine's, not ours.

Credentials, first found wins, per field: the user part of the URL given to ``--to``;
``VLLM_OVERLAY_INDEX_USERNAME`` / ``VLLM_OVERLAY_INDEX_PASSWORD``; ``TWINE_USERNAME`` /
``TWINE_PASSWORD``; then twine's own keyring lookup. They are handed to twine through its
environment, never its command line, and every message is passed through ``redact``.
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.error
import urllib.request
from base64 import b64encode
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from hashlib import sha256
from html.parser import HTMLParser
from pathlib import PurePosixPath
from urllib.parse import quote, unquote, urljoin, urlsplit, urlunsplit

from vllm_overlay.errors import CommandError, PublishError
from vllm_overlay.index.static import PublishResult, WheelFile
from vllm_overlay.util import info, run

ENV_USERNAME = "VLLM_OVERLAY_INDEX_USERNAME"
ENV_PASSWORD = "VLLM_OVERLAY_INDEX_PASSWORD"
JSON_TYPE = "application/vnd.pypi.simple.v1+json"
ACCEPT = f"{JSON_TYPE}, application/vnd.pypi.simple.v1+html;q=0.2, text/html;q=0.1"
_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s?#]+@")
_CREDENTIALS_HINT = (
    f"Set {ENV_USERNAME} and {ENV_PASSWORD} (or TWINE_USERNAME and TWINE_PASSWORD, or store "
    "the password in keyring) to an account that may upload there, then run again."
)


def strip_userinfo(text: str) -> str:
    """``text`` with the user part of every URL in it (``user:password@``) replaced."""
    return _USERINFO.sub(r"\1****@", text)


@dataclass(frozen=True)
class ServerIndex:
    """Where to upload and where to look; URLs here never carry credentials."""

    upload_url: str
    simple_url: str  # ends with "/"
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    def redact(self, text: str) -> str:
        """``text`` with every URL's user part and the password replaced by ``****``."""
        if self.password:
            for secret in sorted({self.password, quote(self.password, safe="")}, key=len)[::-1]:
                text = text.replace(secret, "****")
        return strip_userinfo(text)

    def fail(self, message: str) -> PublishError:
        return PublishError(self.redact(message))


def _split_userinfo(url: str) -> tuple[str, str | None, str | None]:
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None, None
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    clean = urlunsplit(parts._replace(netloc=netloc))
    user = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password else None
    return clean, user, password


def server_index(
    to: str, simple_url: str | None = None, environ: Mapping[str, str] | None = None
) -> ServerIndex:
    """The server behind ``--to URL``; its simple API is ``URL/simple/`` unless given."""
    environ = os.environ if environ is None else environ
    upload_url, url_user, url_password = _split_userinfo(to)
    if simple_url:
        simple, simple_user, simple_password = _split_userinfo(simple_url)
        url_user, url_password = url_user or simple_user, url_password or simple_password
    else:
        simple = upload_url.rstrip("/") + "/simple/"
    username = url_user or environ.get(ENV_USERNAME) or environ.get("TWINE_USERNAME") or None
    password = url_password or environ.get(ENV_PASSWORD) or environ.get("TWINE_PASSWORD") or None
    if not simple.endswith("/"):
        simple += "/"
    for url in (upload_url, simple):
        if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
            raise PublishError(f"{strip_userinfo(url)} is not an http(s) URL with a host.")
    return ServerIndex(upload_url, simple, username, password)


# --------------------------------------------------------------------------- reading


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None  # redirects surface as HTTPError and are decided in _get


_OPENER = urllib.request.build_opener(_NoRedirect)


def _same_origin(a: str, b: str) -> bool:
    pa, pb = urlsplit(a), urlsplit(b)
    return (pa.scheme, pa.hostname, pa.port) == (pb.scheme, pb.hostname, pb.port)


def _auth_header(index: ServerIndex) -> dict[str, str]:
    if not (index.username and index.password):
        return {}
    token = b64encode(f"{index.username}:{index.password}".encode()).decode()
    return {"Authorization": f"Basic {token}"}


def _get(index: ServerIndex, url: str, timeout: float) -> tuple[str, str, bytes] | None:
    """GET ``url`` as (final URL, content type, body); None when the server has no such page.

    A redirect to another host (pypiserver's fallback to a public index) counts as none:
    what matters is what this server holds. A 401 is retried once with the credentials.
    """
    headers = {"Accept": ACCEPT}
    for _ in range(6):
        req = urllib.request.Request(url, headers=headers)
        try:
            with _OPENER.open(req, timeout=timeout) as resp:
                return resp.geturl(), resp.headers.get("Content-Type", ""), resp.read()
        except urllib.error.HTTPError as e:
            if e.code in (301, 302, 303, 307, 308):
                target = urljoin(url, e.headers.get("Location", ""))
                if not _same_origin(url, target):
                    return None
                url = target
            elif e.code == 401 and "Authorization" not in headers and _auth_header(index):
                headers.update(_auth_header(index))
            elif e.code in (401, 403):
                raise index.fail(
                    f"the index refused to show {url} (HTTP {e.code}): the credentials are "
                    f"missing or wrong. {_CREDENTIALS_HINT}"
                ) from None
            elif e.code in (404, 410):
                return None
            else:
                raise index.fail(
                    f"the index answered HTTP {e.code} {e.reason} for {url}. Check --to / "
                    "--simple-url (the simple API is <to>/simple/ unless --simple-url says "
                    "otherwise) and the server's health, then run again."
                ) from None
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise index.fail(
                f"cannot reach the index at {url}: {reason}. Check the URL, that the server "
                "is running and reachable from here (proxy settings included), then run again."
            ) from None
    raise index.fail(f"too many redirects from {url}. Check --simple-url.")


class _Anchors(HTMLParser):
    """The href of every <a> on a PEP 503 page."""

    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "a":
            href = dict(attrs).get("href")
            if href:
                self.hrefs.append(href)


def _parse_page(page_url: str, content_type: str, body: bytes) -> dict[str, tuple[str, str | None]]:
    """File name -> (absolute URL, sha256 or None), from a PEP 691 JSON or PEP 503 page."""
    files: dict[str, tuple[str, str | None]] = {}
    if content_type.split(";")[0].strip() == JSON_TYPE:
        for f in json.loads(body).get("files", []):
            url = urljoin(page_url, f["url"])
            files[f["filename"]] = (url, f.get("hashes", {}).get("sha256"))
        return files
    parser = _Anchors()
    parser.feed(body.decode("utf-8", errors="replace"))
    for href in parser.hrefs:
        url, _, fragment = urljoin(page_url, href).partition("#")
        name = unquote(PurePosixPath(urlsplit(url).path).name)
        algo, _, digest = fragment.partition("=")
        files[name] = (url, digest.lower() if algo == "sha256" and digest else None)
    return files


def _download_sha256(index: ServerIndex, url: str, timeout: float) -> str:
    """Hash a file on the server whose page gives no sha256 (credentials go only to the
    simple API's own host)."""
    headers = _auth_header(index) if _same_origin(url, index.simple_url) else {}
    req = urllib.request.Request(url, headers=headers)
    h = sha256()
    try:
        with _OPENER.open(req, timeout=timeout) as resp:
            for chunk in iter(lambda: resp.read(1 << 20), b""):
                h.update(chunk)
    except (urllib.error.URLError, OSError) as e:
        raise index.fail(f"cannot download {url} to compare it: {e}.") from None
    return h.hexdigest()


def published_files(
    index: ServerIndex, project: str, timeout: float = 60.0
) -> dict[str, tuple[str, str | None]]:
    """What the server's simple page lists for ``project``: name -> (URL, sha256 or None)."""
    page = _get(index, f"{index.simple_url}{project}/", timeout)
    if page is None:
        return {}
    try:
        return _parse_page(*page)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise index.fail(
            f"cannot read the simple page {page[0]} ({e}). Check --simple-url: it must be "
            "the index's PEP 503/691 simple API."
        ) from None


# --------------------------------------------------------------------------- uploading


def _twine_env(index: ServerIndex, environ: Mapping[str, str]) -> dict[str, str]:
    env = {k: v for k, v in environ.items() if k not in (ENV_USERNAME, ENV_PASSWORD)}
    for key in ("TWINE_REPOSITORY", "TWINE_REPOSITORY_URL", "TWINE_USERNAME", "TWINE_PASSWORD"):
        env.pop(key, None)
    if index.username:
        env["TWINE_USERNAME"] = index.username
    if index.password:
        env["TWINE_PASSWORD"] = index.password
    return env


def _upload_error(index: ServerIndex, wheel: WheelFile, returncode: int, output: str) -> str:
    """One sentence for a failed twine upload, with what to do next."""
    where = index.upload_url
    if "Credential not found" in output or "could not determine credentials" in output:
        return f"no credentials for {where} to upload {wheel.filename}. {_CREDENTIALS_HINT}"
    if re.search(r"\b(401|403)\b", output):
        return (
            f"the index at {where} refused to accept {wheel.filename} (HTTP 401/403): the "
            f"credentials are wrong or the account may not upload there. {_CREDENTIALS_HINT}"
        )
    if re.search(r"\b409\b|already exists|File exists", output, re.IGNORECASE):
        return (
            f"{wheel.filename} already exists on {where} (uploaded by someone else since the "
            "check). A published file is never overwritten; run publish again to compare hashes."
        )
    if re.search(r"ConnectionError|Connection refused|Max retries|timed out", output):
        return f"cannot reach the index at {where} to upload {wheel.filename}. " + (
            "Check the URL and that the server is running, then run again."
        )
    tail = "\n".join("    " + line for line in output.strip().splitlines()[-20:])
    return f"twine could not upload {wheel.filename} to {where} (exit {returncode}):\n{tail}"


def _twine_upload(
    index: ServerIndex, wheel: WheelFile, environ: Mapping[str, str], timeout: float | None
) -> None:
    info(f"uploading {wheel.filename} to {index.upload_url} ...")
    cmd = [sys.executable, "-m", "twine", "--no-color", "upload"]
    cmd += ["--repository-url", index.upload_url, "--non-interactive", "--disable-progress-bar"]
    cmd.append(str(wheel.path))
    try:
        out = run(*cmd, env=_twine_env(index, environ), check=False, timeout=timeout)
    except CommandError as e:
        raise index.fail(f"twine upload of {wheel.filename} failed: {e}") from None
    if out.returncode != 0:
        raise index.fail(_upload_error(index, wheel, out.returncode, out.stdout + out.stderr))


def _known_sha256(
    index: ServerIndex, listed: tuple[str, str | None] | None, timeout: float
) -> str | None:
    if listed is None:
        return None
    url, digest = listed
    return digest if digest else _download_sha256(index, url, timeout)


def upload_to_server(
    wheels: Sequence[WheelFile],
    index: ServerIndex,
    *,
    environ: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    upload_timeout: float | None = None,
) -> list[PublishResult]:
    """Upload each wheel the server does not hold yet; refuse before uploading anything if
    the server holds a file of the same name with other bytes."""
    environ = os.environ if environ is None else environ
    listings = {p: published_files(index, p, timeout) for p in sorted({w.project for w in wheels})}
    results: list[PublishResult] = []
    conflicts: list[str] = []
    for w in wheels:
        known = _known_sha256(index, listings[w.project].get(w.filename), timeout)
        if known is None:
            results.append(PublishResult.of(w, "published", "uploaded"))
        elif known == w.sha256:
            results.append(PublishResult.of(w, "skipped", "already on the server, same sha256"))
        else:
            conflicts.append(
                f"{w.filename} is already on {index.simple_url} with sha256 {known}, "
                f"but {w.path} has sha256 {w.sha256}"
            )
    if conflicts:
        raise index.fail(
            "; ".join(conflicts) + ". A published file is never overwritten: give the new "
            "build a new version (bump the overlay revision in its local version label)."
        )
    by_name = {w.filename: w for w in wheels}
    done: list[str] = []
    for r in results:
        if r.action != "published":
            continue
        try:
            _twine_upload(index, by_name[r.filename], environ, upload_timeout)
        except PublishError as e:
            if done:
                raise PublishError(
                    f"{e} (already uploaded in this run: {', '.join(done)})"
                ) from None
            raise
        done.append(r.filename)
    return results
