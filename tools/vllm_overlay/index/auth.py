"""Credentials for a package index, found where pip finds them, and the one redaction helper.

For a URL, first found wins (pip's order):

1. the user part of the URL itself, or of the configured index URL on the same host
   (``--index-url``, ``PIP_INDEX_URL``, pip.conf: ``https://user:token@host/simple/``);
2. extra environment variables the caller names (the upload side passes
   ``VLLM_OVERLAY_INDEX_USERNAME``/``_PASSWORD`` and ``TWINE_USERNAME``/``_PASSWORD``);
3. ``~/.netrc`` (or ``$NETRC``), the entry for the URL's host;
4. keyring, when it is installed, asked only after the server answers 401: the index URL
   first, then ``host[:port]``, as pip asks it.

Credentials are sent only to the host (and port) they belong to: a redirect to another
host gets that host's own credentials (netrc, keyring), never the index's, as pip does.
Every secret found is remembered for this process so ``redact`` can hide it in any text.
"""

from __future__ import annotations

import netrc
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/\s?#@]+@")
_SECRETS: set[str] = set()


def redact(text: str) -> str:
    """``text`` with the user part of every URL and every known secret replaced by ``****``."""
    for secret in sorted(_SECRETS, key=len, reverse=True):
        text = text.replace(secret, "****")
    return _USERINFO.sub(r"\1****@", text)


def remember_secret(secret: str | None) -> None:
    """Hide ``secret`` (and its URL-quoted form) in everything ``redact`` sees from now on."""
    if secret and len(secret) >= 4:  # a 1-3 character "secret" would redact ordinary words
        _SECRETS.update({secret, quote(secret, safe="")})


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str = field(repr=False)
    source: str  # where they came from, for messages (never the values)

    def __post_init__(self) -> None:
        remember_secret(self.password)


def host_key(url: str) -> str:
    """``host[:port]`` of ``url``, lower case: what credentials are bound to."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    return f"{host}:{parts.port}" if parts.port else host


def split_userinfo(url: str) -> tuple[str, Credentials | None]:
    """``url`` without its user part, and the credentials that part held (if any)."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, None
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    clean = urlunsplit(parts._replace(netloc=netloc))
    user = unquote(parts.username or "")
    password = unquote(parts.password or "")
    return clean, Credentials(user, password, "the URL's user part")


def netrc_file(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    if environ.get("NETRC"):
        return Path(environ["NETRC"])
    return Path(environ.get("HOME") or Path.home()) / ".netrc"


def from_netrc(url: str, environ: Mapping[str, str] | None = None) -> Credentials | None:
    path = netrc_file(environ)
    if not path.is_file():
        return None
    try:
        entry = netrc.netrc(str(path)).authenticators(urlsplit(url).hostname or "")
    except (netrc.NetrcParseError, OSError):
        return None  # pip ignores an unreadable netrc too; the 401 message names the file
    if not entry:
        return None
    login, _account, password = entry
    return Credentials(login or "", password or "", str(path))


def from_keyring(
    service_urls: Sequence[str], username: str | None = None
) -> tuple[Credentials | None, str]:
    """(credentials, what was asked) from keyring, if it is installed and has an entry."""
    try:
        import keyring  # an optional dependency, as for pip
    except ImportError:
        return None, "keyring (not installed)"
    asked: list[str] = []
    for service in service_urls:
        asked.append(service)
        try:
            if username:
                pw = keyring.get_password(service, username)
                cred = (username, pw) if pw is not None else None
            else:
                got = keyring.get_credential(service, None)
                cred = (got.username, got.password) if got is not None else None
        except Exception:  # noqa: BLE001 - a broken backend must not hide the 401
            cred = None
        if cred is not None:
            return Credentials(cred[0] or "", cred[1] or "", f"keyring ({service})"), ""
    backend = type(keyring.get_keyring()).__name__
    return None, f"keyring ({backend}: nothing for {', '.join(redact(s) for s in asked)})"


class Auth:
    """Credentials per host for one run, looked up once per host in pip's order.

    ``index_urls`` are the configured index URLs (with or without a user part); ``env``
    names extra (username variable, password variable) pairs to read, in order.
    """

    def __init__(
        self,
        index_urls: Sequence[str] = (),
        *,
        env: Sequence[tuple[str, str]] = (),
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.environ = os.environ if environ is None else environ
        self.env = list(env)
        self.index_urls: list[str] = []
        self._known: dict[str, Credentials] = {}
        self._keyring_tried: dict[str, str] = {}
        for url in index_urls:
            clean, cred = split_userinfo(url)
            self.index_urls.append(clean)
            if cred is not None:
                self._known.setdefault(host_key(clean), cred)

    def for_url(self, url: str) -> Credentials | None:
        """What to send to ``url`` before any 401: its own user part, the index's for the
        same host, the named environment variables, netrc."""
        clean, cred = split_userinfo(url)
        key = host_key(clean)
        if cred is not None:
            self._known.setdefault(key, cred)
            return cred
        if key in self._known:
            return self._known[key]
        for user_var, pass_var in self.env:
            user, pw = self.environ.get(user_var), self.environ.get(pass_var)
            if user or pw:
                cred = Credentials(user or "", pw or "", f"{user_var}/{pass_var}")
                self._known[key] = cred
                return cred
        cred = from_netrc(clean, self.environ)
        if cred is not None:
            self._known[key] = cred
        return cred

    def after_401(self, url: str) -> Credentials | None:
        """keyring, asked once per host after a 401 (for the index URL, then host[:port])."""
        clean, _ = split_userinfo(url)
        key = host_key(clean)
        if key in self._keyring_tried:
            return None
        services = [u for u in self.index_urls if host_key(u) == key] + [key]
        known = self._known.get(key)
        cred, asked = from_keyring(services, known.username if known else None)
        self._keyring_tried[key] = asked
        if cred is not None:
            self._known[key] = cred
        return cred

    def searched(self, url: str) -> str:
        """Where credentials for ``url`` were looked for, for a 401/403 message."""
        clean, _ = split_userinfo(url)
        key = host_key(clean)
        known = self._known.get(key)
        places = ["the URL's user part (--index-url, PIP_INDEX_URL or pip.conf)"]
        places += [f"{u}/{p}" for u, p in self.env]
        places.append(f"{netrc_file(self.environ)} (machine {urlsplit(clean).hostname})")
        places.append(self._keyring_tried.get(key) or "keyring")
        used = f"; sent those from {known.source}" if known else "; none were found"
        return "looked in " + ", ".join(places) + used
