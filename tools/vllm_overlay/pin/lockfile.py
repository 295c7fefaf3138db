"""upstream.lock: the exact upstream pin, machine-written, one line per fact.

The file is TOML written by ``render_lock`` in a fixed order, so that moving the pin
changes only the lines whose values changed (a bump is a short, reviewable diff).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from packaging.utils import parse_wheel_filename

from vllm_overlay.errors import LockFileError
from vllm_overlay.util import atomic_write_text, sha256_bytes

ABSENT = "absent"
HEADER = (
    "# upstream.lock: the exact upstream vLLM this overlay applies to.\n"
    "# Written by `vllm-overlay lock`; never edit by hand (`vllm-overlay lock --check` verifies it).\n"
)
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class Artifact:
    """A release file on the package index: the sdist or one official wheel."""

    kind: str  # "sdist" | "wheel"
    filename: str
    sha256: str
    size: int

    @property
    def platform_tag(self) -> str | None:
        if self.kind != "wheel":
            return None
        _name, _version, _build, tags = parse_wheel_filename(self.filename)
        return ".".join(sorted({t.platform for t in tags}))


@dataclass(frozen=True)
class Upstream:
    name: str
    version: str
    git: str
    tag: str
    commit: str

    def as_dict(self) -> dict[str, str]:
        return {
            "name": self.name,
            "version": self.version,
            "tag": self.tag,
            "commit": self.commit,
            "git": self.git,
        }


@dataclass(frozen=True)
class Lock:
    upstream: Upstream
    artifacts: tuple[Artifact, ...]
    base: dict[str, str] = field(default_factory=dict)  # path -> "sha256:<hex>" | "absent"

    def sdist(self) -> Artifact:
        for a in self.artifacts:
            if a.kind == "sdist":
                return a
        raise LockFileError(
            'upstream.lock pins no sdist ([[artifact]] with kind = "sdist"). '
            "Rewrite it with `vllm-overlay lock --version VERSION`."
        )

    def wheels(self) -> list[Artifact]:
        return [a for a in self.artifacts if a.kind == "wheel"]

    def wheel(self, platform_tag: str = "manylinux_2_28_x86_64") -> Artifact:
        """The official wheel for ``platform_tag`` (the file name's last tag)."""
        for a in self.wheels():
            if a.platform_tag == platform_tag:
                return a
        have = ", ".join(a.filename for a in self.wheels()) or "none"
        raise LockFileError(
            f"upstream.lock pins no official {self.upstream.name} {self.upstream.version} wheel "
            f"for platform {platform_tag} (pinned wheels: {have}). Build with --strategy source, "
            "or choose a platform the release publishes."
        )

    def with_base(self, base: dict[str, str]) -> Lock:
        return replace(self, base=dict(base))


def base_hash(data: bytes | None) -> str:
    """The [base] value for a file's bytes (None: the file does not exist upstream)."""
    if data is None:
        return ABSENT
    return "sha256:" + sha256_bytes(data)


def _q(s: str) -> str:
    """A TOML basic string."""
    out = s.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{out}"'


def render_lock(lock: Lock) -> str:
    u = lock.upstream
    lines = [
        HEADER,
        "[upstream]",
        f"name = {_q(u.name)}",
        f"version = {_q(u.version)}",
        f"git = {_q(u.git)}",
        f"tag = {_q(u.tag)}",
        f"commit = {_q(u.commit)}",
        "",
    ]
    kinds = {"sdist": 0, "wheel": 1}
    for a in sorted(lock.artifacts, key=lambda a: (kinds.get(a.kind, 9), a.filename)):
        lines += [
            "[[artifact]]",
            f"kind = {_q(a.kind)}",
            f"filename = {_q(a.filename)}",
            f"sha256 = {_q(a.sha256)}",
            f"size = {a.size}",
            "",
        ]
    lines.append('# Upstream files the overlay touches: sha256 of each at the pin, or "absent".')
    lines.append("[base]")
    for path in sorted(lock.base):
        lines.append(f"{_q(path)} = {_q(lock.base[path])}")
    return "\n".join(lines) + "\n"


def parse_lock(text: str, source: str = "upstream.lock") -> Lock:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise LockFileError(
            f"{source} is not valid TOML ({e}). Restore it from git "
            "(`git checkout -- upstream.lock`) or rewrite it with `vllm-overlay lock`."
        ) from e

    def need(table: dict, key: str, where: str, typ: type = str):
        if key not in table:
            raise LockFileError(
                f"{source}: {where} lacks `{key}`. Rewrite it with `vllm-overlay lock`."
            )
        val = table[key]
        if not isinstance(val, typ) or isinstance(val, bool):
            raise LockFileError(
                f"{source}: {where}.{key} should be a {typ.__name__}, got {val!r}. "
                "Rewrite it with `vllm-overlay lock`."
            )
        return val

    up = data.get("upstream")
    if not isinstance(up, dict):
        raise LockFileError(
            f"{source} has no [upstream] table. Rewrite it with `vllm-overlay lock`."
        )
    upstream = Upstream(
        name=need(up, "name", "[upstream]"),
        version=need(up, "version", "[upstream]"),
        git=need(up, "git", "[upstream]"),
        tag=need(up, "tag", "[upstream]"),
        commit=need(up, "commit", "[upstream]"),
    )
    if not _COMMIT_RE.match(upstream.commit):
        raise LockFileError(
            f"{source}: [upstream].commit should be a full 40-hex commit id, got "
            f"{upstream.commit!r}. Rewrite it with `vllm-overlay lock --commit SHA`."
        )
    arts = []
    for i, a in enumerate(data.get("artifact", [])):
        where = f"[[artifact]] #{i + 1}"
        art = Artifact(
            kind=need(a, "kind", where),
            filename=need(a, "filename", where),
            sha256=need(a, "sha256", where),
            size=need(a, "size", where, int),
        )
        if art.kind not in ("sdist", "wheel"):
            raise LockFileError(
                f'{source}: {where}.kind must be "sdist" or "wheel", got {art.kind!r}.'
            )
        if not _SHA_RE.match(art.sha256):
            raise LockFileError(
                f"{source}: {where}.sha256 is not 64 lowercase hex digits: {art.sha256!r}."
            )
        arts.append(art)
    base_tbl = data.get("base", {})
    if not isinstance(base_tbl, dict):
        raise LockFileError(f"{source}: [base] must be a table of path = hash.")
    base: dict[str, str] = {}
    for path, val in base_tbl.items():
        if not isinstance(val, str) or not (
            val == ABSENT or (val.startswith("sha256:") and _SHA_RE.match(val[7:]))
        ):
            raise LockFileError(
                f'{source}: [base] {path!r} must be "sha256:<64 hex>" or "absent", got {val!r}.'
            )
        base[path] = val
    return Lock(upstream=upstream, artifacts=tuple(arts), base=base)


def read_lock(path: Path) -> Lock:
    if not path.is_file():
        raise LockFileError(
            f"{path} does not exist. Create it with `vllm-overlay lock --version VERSION`."
        )
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise LockFileError(f"cannot read {path}: {e}. Restore it from git.") from e
    return parse_lock(text, str(path.name))


def write_lock(path: Path, lock: Lock) -> bool:
    """Write the lock atomically; return True if the bytes changed."""
    text = render_lock(lock)
    if path.is_file() and path.read_text() == text:
        return False
    atomic_write_text(path, text)
    return True
