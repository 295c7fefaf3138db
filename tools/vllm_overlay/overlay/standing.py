"""Where a change stands upstream: overlay.toml's ``forwarded`` (DEP-3's ``Forwarded:``).

Debian's patch headers say of each patch whether it went upstream: ``no``, ``not-needed`` or
where it went. Ours says the same of each change, validated:

  forwarded = "not-yet"                                        our own, not sent yet
  forwarded = { state = "not-needed", reason = "..." }         upstream solves it another way
  forwarded = { state = "sent", to = "URL" }                   a pull request or an advisory
  forwarded = { state = "merged", to = "URL", release = "V" }  in upstream's release V

A backport's standing is its origin (the pull request it came from): it needs no
``forwarded`` and may say only ``sent`` or ``merged`` (``to`` defaults to ``origin``). Our own
change (``origin_kind = "original"``) must say. ``merged`` needs a ``drop_when`` that its
release satisfies: the walk drops the change there, with proof. Overlays written before the
field had a free-text ``upstream_status``; it is still read (a change with it and without
``forwarded`` stands "unrecorded") and never together with ``forwarded``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from vllm_overlay.errors import OverlayConfigError

NOT_YET, NOT_NEEDED, SENT, MERGED = "not-yet", "not-needed", "sent", "merged"
UNRECORDED = "unrecorded"  # an overlay from before `forwarded`: only `upstream_status`
STATES = (NOT_YET, NOT_NEEDED, SENT, MERGED)
_KEYS = {NOT_YET: (), NOT_NEEDED: ("reason",), SENT: ("to",), MERGED: ("to", "release")}
PULL_RE = re.compile(r"^https?://[^\s]+/pull/(\d+)/?$")
ADVISORY_RE = re.compile(r"^https?://[^\s]+/security/advisories/GHSA-[\w-]+/?$")
EXAMPLE = (
    'forwarded = "not-yet", or { state = "not-needed", reason = "..." }, '
    '{ state = "sent", to = "<pull request or advisory URL>" }, '
    '{ state = "merged", to = "<URL>", release = "0.35.0" }'
)


@dataclass(frozen=True)
class Forwarded:
    """A change's standing upstream."""

    state: str
    reason: str = ""  # not-needed: why upstream needs none of it
    to: str = ""  # sent, merged: the pull request or advisory
    release: str = ""  # merged: the first release that has it
    note: str = ""  # unrecorded: the old free-text upstream_status

    @property
    def pull_request(self) -> str:
        """The pull request it went (or came back) through, where ``to`` is one; else ''."""
        return self.to if PULL_RE.match(self.to) else ""

    @property
    def advisory(self) -> bool:
        return bool(ADVISORY_RE.match(self.to))

    def summary(self) -> str:
        """One line, as status and the outlook show it."""
        if self.state == NOT_YET:
            return "not yet sent upstream"
        if self.state == NOT_NEEDED:
            return f"not needed upstream: {self.reason}"
        what = "advisory" if self.advisory else "pull request" if self.pull_request else ""
        to = f"{what} {self.to}".strip()
        if self.state == SENT:
            return f"sent upstream ({to})"
        if self.state == MERGED:
            return f"merged upstream ({to}), released in {self.release}"
        return f"unrecorded (upstream_status: {self.note}); replace it with `forwarded`"

    def to_json(self) -> dict:
        out = {"state": self.state, "summary": self.summary()}
        for key in ("reason", "to", "release", "note"):
            if getattr(self, key):
                out[key] = getattr(self, key)
        if self.pull_request:
            out["pull_request"] = self.pull_request
        return out


def parse_forwarded(tbl: dict, kind: str, where: str) -> Forwarded:
    """The standing of the [[change]] ``tbl`` (its ``forwarded``, or what its kind implies)."""
    raw = tbl.get("forwarded")
    legacy = tbl.get("upstream_status")
    if raw is not None and legacy is not None:
        raise OverlayConfigError(
            f"{where}: has both `forwarded` and the older `upstream_status`; keep `forwarded` "
            "and delete `upstream_status`."
        )
    if raw is None:
        if kind == "backport":
            return Forwarded(SENT, to=tbl.get("origin", ""))
        if legacy is not None:
            return Forwarded(UNRECORDED, note=str(legacy))
        raise OverlayConfigError(
            f"{where}: our own change needs `forwarded`, where it stands upstream: {EXAMPLE}."
        )
    if isinstance(raw, str):
        raw = {"state": raw}
    if not isinstance(raw, dict):
        raise OverlayConfigError(f"{where}: `forwarded` must be a string or a table: {EXAMPLE}.")
    state = raw.get("state")
    if state not in STATES:
        raise OverlayConfigError(
            f"{where}: `forwarded` state must be one of {', '.join(STATES)}, got {state!r}: "
            f"{EXAMPLE}."
        )
    wanted = set(_KEYS[state])
    if kind == "backport":
        if state not in (SENT, MERGED):
            raise OverlayConfigError(
                f"{where}: a backport's standing is its origin: `forwarded` may say only "
                f'"{SENT}" or "{MERGED}" (with its release), got {state!r}.'
            )
        raw = {"to": tbl.get("origin", ""), **raw}
    extra = set(raw) - wanted - {"state"}
    missing = sorted(wanted - set(raw))
    if extra or missing:
        raise OverlayConfigError(
            f"{where}: `forwarded` {state!r} takes "
            + (", ".join(f"`{k}`" for k in sorted(wanted)) or "nothing else")
            + (f"; missing {missing}" if missing else "")
            + (f"; unknown {sorted(extra)}" if extra else "")
            + f": {EXAMPLE}."
        )
    for key in wanted:
        if not isinstance(raw[key], str) or not raw[key].strip():
            raise OverlayConfigError(f"{where}: `forwarded.{key}` must be a non-empty string.")
    to = raw.get("to", "")
    if to and not re.match(r"^https?://\S+$", to):
        raise OverlayConfigError(
            f"{where}: `forwarded.to` must be the URL of the pull request or advisory, got {to!r}."
        )
    release = raw.get("release", "")
    if release:
        try:
            Version(release)
        except InvalidVersion:
            raise OverlayConfigError(
                f"{where}: `forwarded.release` must be a release version like 0.35.0, got "
                f"{release!r}."
            ) from None
    return Forwarded(state, reason=raw.get("reason", ""), to=to, release=release)


def check_since(val: object, where: str) -> str:
    """``since``: the upstream release the change was first carried on."""
    if not isinstance(val, str):
        raise OverlayConfigError(f'{where}: `since` must be a release version like "0.24.0".')
    try:
        Version(val)
    except InvalidVersion:
        raise OverlayConfigError(
            f'{where}: `since` must be a release version like "0.24.0", got {val!r}.'
        ) from None
    return val
