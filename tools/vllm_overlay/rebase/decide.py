"""Where each change of the series lands on one release, from the touched files alone.

The same decisions as ``rebase`` makes in a checkout, made on blobs in a scratch directory
with git's own three-way merge (``git merge-file``), ``git apply -R --check`` and git's rename
detection (``git diff --no-index -M``), so that every release takes a fraction of a second:

- **dropped**: ``drop_when`` holds, or the release already has the change (our patch applies
  in reverse, the merge leaves upstream's file unchanged, or a file we add is identical);
  also when the three-way merge changes nothing;
- **moved**: a file the change patches is gone (renamed: git's candidates; or deleted);
- **collision**: a file the change adds now exists upstream, different from ours;
- **conflict**: the three-way merge leaves conflict markers (the hunks are kept);
- **kept**: the change merges and its exported patch is byte-identical;
- **refreshed**: it merges cleanly with new context.

This is the one decision of the tool: the walk (``rebase/releasewalk.py``) calls ``decide`` for each
change at each release, for ``rebase``, ``track`` and ``outlook`` alike. A change is judged in
its current form (its files before and after it, as the walk last carried it) on the
release's files as the changes before it leave them. Rename candidates are looked for among
the release's new files with the same suffix.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from vllm_overlay.gitrepo import apply_patch, diff_no_index, merge_file
from vllm_overlay.overlay.export import DIFF_OPTS
from vllm_overlay.overlay.model import RUNNER_FILES, Change

KEPT, REFRESHED, DROPPED = "kept", "refreshed", "dropped"
CONFLICT, MOVED, COLLISION = "conflict", "moved", "collision"
CLEAN = (KEPT, REFRESHED, DROPPED)  # a rebase goes through without a person
CONTEXT = 3

Files = Mapping[str, "bytes | None"]


@dataclass(frozen=True)
class Step:
    """One change at the pin: its files before it and after it (None: absent)."""

    change: Change
    before: dict[str, bytes | None]
    after: dict[str, bytes | None]


@dataclass
class Outcome:
    """Where one change lands on one release."""

    id: str
    state: str
    reason: str = ""
    files: list[str] = field(default_factory=list)  # the files behind a stop
    problems: dict[str, str] = field(default_factory=dict)  # path -> "kind: what happened"
    hunks: dict[str, str] = field(default_factory=dict)  # path -> conflict regions (diff3)
    candidates: dict[str, list[list]] = field(default_factory=dict)  # moved: path -> [[p, %]]
    notes: list[str] = field(default_factory=list)
    # A drop because the release has none of the model runners the change serves: the proof
    # is the tree itself (the runner's file is gone), not the change's tests (walkdata.Fact).
    runners_gone: bool = False
    merged: dict[str, bytes | None] = field(default_factory=dict, repr=False)  # clean results
    conflicted: dict[str, bytes] = field(default_factory=dict, repr=False)  # diff3 results

    def to_json(self) -> dict:
        return {
            "id": self.id,
            "state": self.state,
            "reason": self.reason,
            "files": self.files,
            "hunks": self.hunks,
            "candidates": self.candidates,
            "notes": self.notes,
        }


class Scratch:
    """A directory for blobs and git's file-level tools."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.n = 0

    def write(self, data: bytes, name: str = "blob") -> Path:
        self.n += 1
        p = self.root / f"{self.n:05d}-{PurePosixPath(name).name}"
        p.write_bytes(data)
        return p

    def merge(self, new: bytes, old: bytes, ours: bytes, labels: tuple[str, str, str]):
        """(merged bytes, number of conflicts) of ``git merge-file --diff3``."""
        return merge_file(new, old, ours, labels)

    def hunks(self, a: bytes, b: bytes) -> str:
        """The hunks of the canonical diff of ``a`` -> ``b`` (headers dropped: they name the
        scratch files)."""
        fa, fb = self.write(a, "a"), self.write(b, "b")
        text = diff_no_index(fa, fb, *DIFF_OPTS).decode(errors="surrogateescape")
        at = text.find("\n@@")
        return text[at + 1 :] if at >= 0 else ""

    def reverse_applies(self, path: str, before: bytes, after: bytes, new: bytes) -> bool:
        """Our patch (``before`` -> ``after``) applies in reverse to ``new`` (no fuzz)."""
        body = self.hunks(before, after)
        if not body:
            return False
        work = self.root / f"apply-{self.n}"
        self.n += 1
        target = work / path
        target.parent.mkdir(parents=True)
        target.write_bytes(new)
        patch = f"--- a/{path}\n+++ b/{path}\n{body}"
        return apply_patch(patch.encode(errors="surrogateescape"), work, "-R", "--check")

    def renames(self, path: str, old: bytes, candidates: Files) -> list[list]:
        """git's rename candidates for ``path`` among ``candidates`` ([[path, similarity]])."""
        if not candidates:
            return []
        self.n += 1
        a, b = self.root / f"ren-{self.n}" / "a", self.root / f"ren-{self.n}" / "b"
        (a / path).parent.mkdir(parents=True)
        (a / path).write_bytes(old)
        for p, data in candidates.items():
            if data is None:
                continue
            (b / p).parent.mkdir(parents=True, exist_ok=True)
            (b / p).write_bytes(data)
        if not b.exists():
            return []
        out = diff_no_index("a", "b", "-M", "-l0", "--name-status", "-z", "--diff-filter=R",
                            cwd=a.parent)  # fmt: skip
        parts = [p for p in out.decode(errors="surrogateescape").split("\0") if p]
        found = []
        for i in range(0, len(parts) - 2, 3):
            status, _src, dst = parts[i : i + 3]
            found.append([dst.removeprefix("b/"), int(status[1:] or 0)])
        return sorted(found, key=lambda x: -x[1])


def conflict_regions(merged: bytes) -> str:
    """The conflicted regions of a diff3 merge result, each with a little context."""
    lines = merged.decode(errors="replace").splitlines(keepends=True)
    keep: set[int] = set()
    start = None
    for i, line in enumerate(lines):
        if line.startswith("<<<<<<< "):
            start = i
        elif line.startswith(">>>>>>> ") and start is not None:
            keep.update(range(max(0, start - CONTEXT), min(len(lines), i + 1 + CONTEXT)))
            start = None
    out: list[str] = []
    prev = -2
    for i in sorted(keep):
        if i != prev + 1 and out:
            out.append("...\n")
        out.append(f"{i + 1:5d}  {lines[i]}")
        prev = i
    return "".join(out)


@dataclass(frozen=True)
class Release:
    """The release a change is judged on: its name and version, the names of every file in
    its tree, and a reader for files the change does not touch (rename candidates)."""

    name: str
    version: str
    names: frozenset[str]
    read: Callable[[list[str]], Files]

    @property
    def where(self) -> str:
        return f"{self.name} {self.version}"


def runners_gone(change: Change, names: frozenset[str]) -> list[str]:
    """The runner files of a change that serves only runners the release (its ``names``)
    does not have; empty where one of them is there, or the change does not say."""
    files = [RUNNER_FILES[r] for r in change.runners]
    return files if files and not any(f in names for f in files) else []


def decide(step: Step, scratch: Scratch, state: Files, rel: Release, old_names: frozenset[str],
           labels: tuple[str, str, str]) -> Outcome:  # fmt: skip
    """The one decision: where ``step`` (a change in its current form) lands on ``state``
    (the release's files as the changes before it leave them). ``labels`` name the three
    sides of git's diff3 markers: (the release, the change's base, our change)."""
    change = step.change
    dropped = _dropped(step, scratch, state, rel)
    if dropped is not None:
        return dropped
    o = Outcome(change.id, KEPT)
    problems = _gone_or_taken(step, scratch, state, rel, old_names, o)
    _merge_files(step, scratch, state, rel.where, labels, o, problems)
    if problems:
        kinds = {v.split(":", 1)[0] for v in problems.values()}
        o.state = MOVED if MOVED in kinds else COLLISION if COLLISION in kinds else CONFLICT
        o.files = sorted(problems)
        o.problems = {p: problems[p] for p in o.files}
        o.reason = "; ".join(f"{p}: {problems[p].split(': ', 1)[1]}" for p in o.files)
        return o  # merged: the files that did merge (a stop writes them for the person)
    if all(o.merged[p] == state.get(p) for p in change.files):
        return Outcome(change.id, DROPPED, f"the three-way merge onto {rel.where} changes "
                       "nothing: upstream already has it")  # fmt: skip
    _kept_or_refreshed(step, scratch, state, o)
    return o


def _dropped(step: Step, scratch: Scratch, state: Files, rel: Release) -> Outcome | None:
    """The change dropped before any merge: its ``drop_when`` holds, the release has none of
    the runners it serves, or the release already has it (None: none of these)."""
    change, where = step.change, rel.where
    if change.dropped_by(rel.name, rel.version):
        return Outcome(change.id, DROPPED, f"drop_when {change.drop_when} holds for {where}")
    gone = runners_gone(change, rel.names)
    if gone:
        served = " and ".join(f"Model Runner {r.upper()}" for r in change.runners)
        return Outcome(change.id, DROPPED, f"it serves {served} only (runners), and {where} "
                       f"has none: {', '.join(gone)} deleted", runners_gone=True)  # fmt: skip
    how = _contained(step, scratch, state)
    if how:
        return Outcome(change.id, DROPPED, f"{where} already has it: " + "; ".join(how))
    return None


def _gone_or_taken(step: Step, scratch: Scratch, state: Files, rel: Release,
                   old_names: frozenset[str], o: Outcome) -> dict[str, str]:  # fmt: skip
    """The files the change patches that the release renamed or deleted (``moved``, with
    git's rename candidates in ``o``) and those it adds that the release now has
    (``collision``): path -> "kind: what happened"."""
    where = rel.where
    problems: dict[str, str] = {}
    for path in step.change.files:
        before, after, new = step.before.get(path), step.after.get(path), state.get(path)
        if before is not None and new is None:
            cands = _rename_candidates(path, before, scratch, old_names, rel.names, rel.read)
            o.candidates[path] = cands
            if cands:
                shown = ", ".join(f"{p} ({s}% similar)" for p, s in cands)
                problems[path] = f"{MOVED}: {where} renamed it: git's candidates: {shown}"
            else:
                problems[path] = f"{MOVED}: {where} deleted it (git finds no rename candidate)"
        elif before is None and new is not None:
            same = "an identical file" if new == after else "its own, different file"
            problems[path] = f"{COLLISION}: the change adds it, and {where} now has {same}"
    return problems


def _merge_files(step: Step, scratch: Scratch, state: Files, where: str,
                 labels: tuple[str, str, str], o: Outcome, problems: dict[str, str]
                 ) -> None:  # fmt: skip
    """Each file not already in ``problems`` merged onto the release into ``o.merged``, or
    its conflict (in ``o.hunks``, ``o.conflicted`` and ``problems``)."""
    for path in step.change.files:
        if path in problems:
            continue
        before, after, new = step.before.get(path), step.after.get(path), state.get(path)
        if before is None:  # a file we add, absent upstream: ours as it is
            o.merged[path] = after
            continue
        if after is None:  # a file we delete
            if new == before:
                o.merged[path] = None
            else:
                problems[path] = f"{CONFLICT}: we delete it and {where} changed it"
            continue
        assert new is not None
        merged, conflicts = scratch.merge(new, before, after, labels)
        if conflicts:
            o.hunks[path] = conflict_regions(merged)
            o.conflicted[path] = merged
            problems[path] = (
                f"{CONFLICT}: {where} and our change edit the same lines "
                f"({conflicts} conflict{'s' if conflicts != 1 else ''})"
            )
        else:
            o.merged[path] = merged


def _kept_or_refreshed(step: Step, scratch: Scratch, state: Files, o: Outcome) -> None:
    """A clean merge: ``kept`` where the exported patch is byte-identical, else ``refreshed``
    (the files with new context named)."""
    change = step.change
    same = []
    for path in change.files:
        before, after = step.before.get(path), step.after.get(path)
        new, merged = state.get(path), o.merged[path]
        if before is None or after is None or merged is None or new is None:
            same.append(merged == after)
            continue
        if merged == new:
            o.notes.append(f"no longer touches {path}")
            same.append(False)
            continue
        same.append(scratch.hunks(before, after) == scratch.hunks(new, merged))
    if all(same):
        o.reason = "merges unchanged: the exported patch is byte-identical"
    else:
        o.state = REFRESHED
        changed = [p for p, s in zip(change.files, same, strict=True) if not s]
        o.reason = "merges cleanly with new context in " + ", ".join(changed)


def _contained(step: Step, scratch: Scratch, state: Files) -> list[str] | None:
    """How the release already holds the change (None: it does not). Test files the change
    adds and lists in its tests are not required (upstream seldom takes our tests as they
    are; they run against the release as the proof)."""
    change = step.change
    own_tests = {t.partition("::")[0] for t in change.tests}
    how = []
    for path in change.files:
        before, ours, new = step.before.get(path), step.after.get(path), state.get(path)
        if before is None and path in own_tests and new != ours:
            continue
        if new is None or ours is None:
            return None
        if before is None:
            if new != ours:
                return None
            how.append(f"upstream's {path} is identical to ours")
        elif scratch.reverse_applies(path, before, ours, new):
            how.append(f"our patch of {path} applies in reverse")
        else:
            merged, conflicts = scratch.merge(new, before, ours, ("new", "old", "ours"))
            if conflicts or merged != new:
                return None
            how.append(f"the three-way merge of our {path} leaves upstream's unchanged")
    return how or None


def _rename_candidates(
    path: str, old: bytes, scratch: Scratch, old_names: frozenset[str],
    new_names: frozenset[str], read_new: Callable[[list[str]], Files],
) -> list[list]:  # fmt: skip
    suffix = os.path.splitext(path)[1]
    added = sorted(p for p in new_names - old_names if os.path.splitext(p)[1] == suffix)
    if not added:
        return []
    return scratch.renames(path, old, read_new(added))
