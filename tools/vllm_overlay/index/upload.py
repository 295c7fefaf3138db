"""Upload wheels to an index server (pypiserver, devpi, Artifactory, ...) through twine.

Before each upload the server's simple page for the project is read: a file already
there with the same sha256 is skipped, one with a different sha256 is refused. Uploads go
through twine's documented command line (``python -m twine upload --repository-url``), so
the upload protocol is twine's, not ours.

Credentials come from the one lookup (``index/auth.py``): the user part of the URL given to
``--to``; ``VLLM_OVERLAY_INDEX_USERNAME`` / ``VLLM_OVERLAY_INDEX_PASSWORD``;
``TWINE_USERNAME`` / ``TWINE_PASSWORD``; ~/.netrc; then keyring (twine's own lookup for the
upload, ours for reading after a 401). They are handed to twine through its environment,
never its command line, and every message is passed through ``redact``.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from urllib.parse import urlsplit

from vllm_overlay.errors import CommandError, PublishError
from vllm_overlay.index.auth import Auth, redact, remember_secret, split_userinfo
from vllm_overlay.index.client import IndexClient, pip_setting
from vllm_overlay.index.wheels import PublishResult, WheelFile
from vllm_overlay.process import run
from vllm_overlay.progress import is_terminal
from vllm_overlay.util import cache_dir

ENV_USERNAME = "VLLM_OVERLAY_INDEX_USERNAME"
ENV_PASSWORD = "VLLM_OVERLAY_INDEX_PASSWORD"
ENV_PAIRS = ((ENV_USERNAME, ENV_PASSWORD), ("TWINE_USERNAME", "TWINE_PASSWORD"))
_CREDENTIALS_HINT = (
    f"Set {ENV_USERNAME} and {ENV_PASSWORD} (or TWINE_USERNAME and TWINE_PASSWORD, or store "
    "the password in keyring) to an account that may upload there, then run again."
)
_READ_HINT = (
    "Check --to / --simple-url (the simple API is <to>/simple/ unless --simple-url says otherwise)"
)


@dataclass(frozen=True)
class ServerIndex:
    """Where to upload and where to look; URLs here never carry credentials."""

    upload_url: str
    simple_url: str  # ends with "/"
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    auth: Auth = field(default_factory=Auth, repr=False, compare=False)

    def __post_init__(self) -> None:
        remember_secret(self.password)

    def redact(self, text: str) -> str:
        """``text`` with every URL's user part and every known secret replaced by ``****``."""
        return redact(text)

    def fail(self, message: str) -> PublishError:
        return PublishError(redact(message))

    def client(self, timeout: float) -> IndexClient:
        return IndexClient(auth=self.auth, timeout=timeout, hint=_READ_HINT)


def server_index(
    to: str, simple_url: str | None = None, environ: Mapping[str, str] | None = None
) -> ServerIndex:
    """The server behind ``--to URL``; its simple API is ``URL/simple/`` unless given.

    Credentials (index/auth.py): the URL's user part, then the environment variables of
    ``ENV_PAIRS``, then ~/.netrc; twine asks keyring itself when none are found.
    """
    environ = os.environ if environ is None else environ
    auth = Auth([u for u in (to, simple_url) if u], env=ENV_PAIRS, environ=environ)
    upload_url, _ = split_userinfo(to)
    simple = split_userinfo(simple_url)[0] if simple_url else upload_url.rstrip("/") + "/simple/"
    if not simple.endswith("/"):
        simple += "/"
    for url in (upload_url, simple):
        if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).hostname:
            raise PublishError(f"{redact(url)} is not an http(s) URL with a host.")
    cred = auth.for_url(upload_url) or auth.for_url(simple)
    username = (cred.username if cred else None) or None
    password = (cred.password if cred else None) or None
    if cred is not None and password is None:  # user in the URL, password from the environment
        password = environ.get(ENV_PASSWORD) or environ.get("TWINE_PASSWORD") or None
    return ServerIndex(upload_url, simple, username, password, auth)


# --------------------------------------------------------------------------- reading


def published_files(
    index: ServerIndex, project: str, timeout: float = 60.0
) -> dict[str, tuple[str, str | None]]:
    """What the server's simple page lists for ``project``: name -> (URL, sha256 or None).

    A redirect to another host (pypiserver's fallback to a public index) counts as none:
    what matters is what this server holds."""
    files = index.client(timeout).list_files(project, index.simple_url, other_hosts=False)
    return {f.filename: (f.url, f.sha256) for f in files}


def _download_sha256(index: ServerIndex, url: str, timeout: float) -> str:
    """Hash a file on the server whose page gives no sha256."""
    resp = index.client(timeout).open(url)
    if resp is None:
        raise index.fail(f"the index lists {url} but does not serve it (HTTP 404).")
    h = sha256()
    try:
        with resp:
            for chunk in iter(lambda: resp.read(1 << 20), b""):
                h.update(chunk)
    except OSError as e:
        raise index.fail(f"cannot download {url} to compare it: {e}.") from None
    return h.hexdigest()


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
    index: ServerIndex,
    wheel: WheelFile,
    environ: Mapping[str, str],
    timeout: float | None,
    log_dir: Path,
) -> None:
    cmd = [sys.executable, "-m", "twine", "--no-color", "upload"]
    cmd += ["--repository-url", index.upload_url, "--non-interactive"]
    if not is_terminal(sys.stderr):  # on a terminal, twine draws its bar there
        cmd.append("--disable-progress-bar")
    for key in ("cert", "client-cert"):  # pip's TLS settings, as the index client takes them
        if value := pip_setting(key):
            cmd += [f"--{key}", value]
    cmd.append(str(wheel.path))
    log = log_dir / f"upload-{wheel.filename}.log"
    try:
        out = run(*cmd, env=_twine_env(index, environ), check=False, timeout=timeout, log=log,
                  what=f"uploading {wheel.filename} to {index.upload_url}", terminal=True)  # fmt: skip
    except CommandError as e:
        raise index.fail(f"twine upload of {wheel.filename} failed: {e}") from None
    if out.returncode != 0:
        raise index.fail(
            _upload_error(index, wheel, out.returncode, out.stdout + out.stderr)
            + f" twine's output is in {log}."
        )


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
    log_dir: Path | None = None,
) -> list[PublishResult]:
    """Upload each wheel the server does not hold yet; refuse before uploading anything if
    the server holds a file of the same name with other bytes. Each upload's output goes to
    ``log_dir/upload-<file>.log`` as it runs (default: ``logs/`` in the cache)."""
    log_dir = cache_dir() / "logs" if log_dir is None else log_dir
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
            _twine_upload(index, by_name[r.filename], environ, upload_timeout, log_dir)
        except PublishError as e:
            if done:
                raise PublishError(
                    f"{e} (already uploaded in this run: {', '.join(done)})"
                ) from None
            raise
        done.append(r.filename)
    return results
