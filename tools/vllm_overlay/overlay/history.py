"""Edit overlay/overlay.toml after a rebase, keeping its formatting and comments.

A rebase removes the ``[[change]]`` tables of dropped changes and records each in a
``[[dropped]]`` table (the overlay's history, with the upstream tests that proved the drop),
updates the ``files`` and ``tests`` of changes whose paths moved, takes a dropped change out
of the others' ``upstream_after`` (upstream has it), and bumps the top-level
``revision`` when the overlay's content changed. Everything else in the file (comments, key
order, string styles, a kept change's ``upstream_tests``) is left as it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import tomlkit
from tomlkit.items import AoT, Array, Table

from vllm_overlay.errors import OverlayConfigError


@dataclass(frozen=True)
class DroppedRecord:
    """One entry of the overlay's history: a change upstream absorbed."""

    id: str
    title: str
    origin: str
    dropped_in: str
    reason: str
    proof: str
    upstream_tests: Sequence[str] = ()  # the change's upstream tests, written when there are any
    # The pull request it came back through (its `forwarded`, sent or merged), when known.
    pull_request: str = ""

    def table(self) -> Table:
        t = tomlkit.table()
        for key in ("id", "title", "origin", "dropped_in", "reason", "proof"):
            t[key] = getattr(self, key)
        if self.pull_request:
            t["pull_request"] = self.pull_request
        if self.upstream_tests:
            arr = _array_like(None, list(self.upstream_tests))
            arr.multiline(len(self.upstream_tests) > 1)
            t["upstream_tests"] = arr
        return t


def _array_like(old: object, values: Sequence[str]) -> Array:
    arr = tomlkit.array()
    arr.extend(values)
    multiline = isinstance(old, Array) and "\n" in old.as_string()
    arr.multiline(multiline)
    return arr


def _changes(doc: tomlkit.TOMLDocument) -> AoT | None:
    aot = doc.get("change")
    if aot is None:
        return None
    if not isinstance(aot, AoT):
        raise OverlayConfigError("overlay.toml: `change` must be an array of tables ([[change]]).")
    return aot


def rewrite(
    text: str,
    *,
    dropped: Sequence[DroppedRecord] = (),
    files: Mapping[str, Sequence[str]] | None = None,
    tests: Mapping[str, Sequence[str]] | None = None,
    bump_revision: bool = False,
) -> str:
    """``text`` (overlay.toml) with the rebase's edits applied."""
    doc = tomlkit.parse(text)
    files = files or {}
    tests = tests or {}
    drop_ids = {d.id for d in dropped}
    aot = _changes(doc)
    if aot is not None:
        for i in reversed(range(len(aot))):
            tbl = aot[i]
            cid = tbl.get("id")
            if cid in drop_ids:
                del aot[i]
                continue
            after = list(tbl.get("upstream_after", []))
            if set(after) & drop_ids:  # upstream has it now: nothing to go after
                kept = [a for a in after if a not in drop_ids]
                if kept:
                    tbl["upstream_after"] = _array_like(tbl["upstream_after"], kept)
                else:
                    del tbl["upstream_after"]
            if cid in files and list(tbl.get("files", [])) != list(files[cid]):
                tbl["files"] = _array_like(tbl.get("files"), files[cid])
            if cid in tests and list(tbl.get("tests", [])) != list(tests[cid]):
                tbl["tests"] = _array_like(tbl.get("tests"), tests[cid])
        if len(aot) == 0:
            del doc["change"]
    if dropped:
        history = doc.get("dropped")
        if history is None:
            history = tomlkit.aot()
            for d in dropped:
                history.append(d.table())
            doc.append("dropped", history)
        else:
            for d in dropped:
                history.append(d.table())
    if bump_revision:
        revision = doc.get("revision", 1)
        if "revision" in doc:
            doc["revision"] = int(revision) + 1
        else:
            doc.add("revision", int(revision) + 1)
    return tomlkit.dumps(doc).rstrip("\n") + "\n"


CHANGE_KEYS = (
    "id", "title", "why", "origin", "origin_kind", "bugs", "authors", "since", "drop_when", "drop_condition", "files", "tests", "upstream_tests", "notes", "runners",
)  # fmt: skip


def add_change(text: str, fields: Mapping[str, object], *, bump_revision: bool = True) -> str:
    """``text`` (overlay.toml) with a [[change]] appended last (the series order) and, by
    default, the revision bumped; comments and formatting of the rest are kept."""
    doc = tomlkit.parse(text)
    tbl = tomlkit.table()
    for key in CHANGE_KEYS:
        if key not in fields or fields[key] in ((), [], None, ""):
            if key in ("files", "tests"):
                tbl[key] = _array_like(None, [])
            continue
        val = fields[key]
        if isinstance(val, list | tuple):
            arr = _array_like(None, [str(v) for v in val])
            arr.multiline(len(val) > 1)
            tbl[key] = arr
        elif key == "why" and "\n" in str(val):
            tbl[key] = tomlkit.string(str(val).strip("\n") + "\n", multiline=True)
        else:
            tbl[key] = str(val)
    _changes(doc)  # `change` must be an array of tables
    aot = tomlkit.aot()
    aot.append(tbl)
    new = tomlkit.document()
    new.append("change", aot)
    out = text.rstrip("\n") + "\n\n" + tomlkit.dumps(new).strip("\n") + "\n"
    return rewrite(out, bump_revision=True) if bump_revision else out
