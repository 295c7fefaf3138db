"""One change of ours as upstream would take it: a commit on a clone of the release's tree.

The tree is the pinned release's sdist as a git repository (``pin/trees.py``, what apply and
the walk start from), cloned into the output directory. The change's files there are its own
edits alone, without the changes before it in our series: for each file, upstream's at the
release plus the change's diff, merged three-way (``git merge-file``: base = the file as the
earlier changes leave it, ours = upstream's, theirs = the file after the change). Where the
change's lines only sit next to an earlier change's (an insertion beside lines upstream does
not have), the insertion is kept and the earlier change's lines are not (``_adjacent``); any
other overlap is refused, naming the earlier changes.

A change may name earlier changes of ours that upstream must take first (``upstream_after`` in
overlay.toml: its tests use a helper they add, or it needs their code on the CPU). It is then
prepared on top of them, a stacked pull request: "upstream's" side of every merge is the release
with those changes, each prepared the same way (``Prepared.stack``), and they go into the clone
as commits of their own before it.

Tests go into vLLM's own layout: our test files already live at vLLM's paths; a test helper
that an earlier change of ours added and these tests import (``tests/...`` modules) comes
along whole. Every test file is scrubbed of our scaffolding (``scrub.py``); a mention of the
overlay left anywhere in the commit is refused.
"""

from __future__ import annotations

import ast
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay.errors import UpstreamError
from vllm_overlay.gitrepo import git, merge_file, open_repo, run_git, show_bytes, switch
from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.overlay.checkout import plan
from vllm_overlay.overlay.model import Change, Overlay, safe_join
from vllm_overlay.pin.lockfile import Lock
from vllm_overlay.pin.trees import BASE_REF, sdist_repo
from vllm_overlay.rebase.records import split_diff3
from vllm_overlay.upstream import scrub

BRANCH_PREFIX = "upstream/"


@dataclass
class Prepared:
    """The change's files as upstream would take them, before the commit."""

    change: Change
    files: dict[str, bytes]  # path -> content in the commit
    base_files: dict[str, bytes | None]  # path -> upstream's content at the release (None: new)
    brought: dict[str, str] = field(default_factory=dict)  # helper path -> the change adding it
    notes: list[str] = field(default_factory=list)
    # The changes upstream takes first (``upstream_after``), prepared, in series order.
    stack: list[Prepared] = field(default_factory=list)
    raw: dict[str, bytes] = field(default_factory=dict)  # the files before the scrub

    @property
    def tests(self) -> list[str]:
        """The change's test files (and helpers) in the commit."""
        return sorted(p for p in self.files if p.startswith("tests/") and p.endswith(".py"))


def _adjacent(merged: bytes) -> bytes | None:
    """``merged`` (diff3 output, read as the rebase's records read it) with each conflict
    resolved where one side only inserted lines next to the base's (theirs = X + base or
    base + X: X, then ours); None where a conflict is anything else."""
    split = split_diff3(merged.decode("utf-8", "surrogateescape"))
    if split is None:
        return None
    common, hunks = split
    out = common[0]
    for h, after in zip(hunks, common[1:], strict=True):
        ours, base, theirs = h.release_side, h.base_side, h.ours_side
        before = theirs[: len(theirs) - len(base)]
        if base and theirs.endswith(base) and (not before or before.endswith("\n")):
            out += before + ours  # whole lines inserted before the base's
        elif base and theirs.startswith(base):
            out += ours + theirs[len(base) :]  # inserted after them
        else:
            return None
        out += after
    return out.encode("utf-8", "surrogateescape")


def _imported_helpers(path: str, text: str) -> list[str]:
    """The ``tests/...`` modules a test file imports, as paths."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    mods = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            mods.append(node.module)
        elif isinstance(node, ast.Import):
            mods += [a.name for a in node.names]
    return [m.replace(".", "/") + ".py" for m in mods if m.startswith("tests.")]


def prepare(lock: Lock, overlay: Overlay, change_id: str, *, settings: Settings = DEFAULTS
            ) -> tuple[Prepared, Path, str]:  # fmt: skip
    """The change's files for upstream; with the release's repository and base commit."""
    change = overlay.change(change_id)
    if change.build_only:  # said, not skipped: a build-only change is ours to carry
        raise UpstreamError(
            f"{change_id} is a build-only change (builds = {list(change.builds)}): it edits our "
            "build of vLLM, not vLLM, and its proof is the build it enables, not a test "
            f"upstream runs. Nothing to send; its standing: {change.forwarded.summary()}."
        )
    repo, base = sdist_repo(lock, settings=settings)
    planned = plan(lock, overlay, repo, base)
    order = [pc.change.id for pc in planned]
    wanted: set[str] = set()
    todo = [change_id]
    while todo:  # the changes upstream takes first, and theirs
        for after in overlay.change(todo.pop()).upstream_after:
            if after not in wanted:
                wanted.add(after)
                todo.append(after)
    stack: list[Prepared] = []
    for cid in sorted(wanted, key=order.index):
        stack.append(_prepare_one(lock, overlay, cid, repo, base, planned, stack))
    prep = _prepare_one(lock, overlay, change_id, repo, base, planned, stack)
    prep.stack = stack
    return prep, repo, base


def _prepare_one(lock: Lock, overlay: Overlay, change_id: str, repo: Path, base: str,
                 planned: list, stack: list[Prepared]) -> Prepared:  # fmt: skip
    """One change's files on the release plus ``stack`` (prepared before it), scrubbed."""
    change = overlay.change(change_id)
    stacked: dict[str, bytes] = {}  # the release as the stack leaves it (unscrubbed)
    for below in stack:
        stacked.update(below.raw)
    idx = [pc.change.id for pc in planned].index(change_id)
    series: dict[str, bytes] = {}  # the tree (touched files) as the earlier changes leave it
    added_by: dict[str, str] = {}
    for pc in planned[:idx]:
        series.update(pc.files)
        for p in pc.added:
            added_by.setdefault(p, pc.change.id)
    after = planned[idx].files
    prep = Prepared(change, {}, {})
    for path in change.files:
        prep.base_files[path] = show_bytes(repo, base, path)
        pristine = stacked.get(path, prep.base_files[path])
        before, new = series.get(path, pristine), after[path]
        if pristine is None and before is not None and not path.startswith("tests/"):
            raise UpstreamError(
                f"{path} does not exist in {lock.upstream.name} {lock.upstream.version}: "
                f"{added_by.get(path, 'an earlier change')} adds it, and {change_id} edits it. "
                "Send that change first (or together with this one)."
            )
        if before is None or before == pristine:
            prep.files[path] = new
            continue
        if pristine is None:  # a test file an earlier change added: it comes whole
            prep.files[path] = new
            prep.brought[path] = added_by.get(path, "an earlier change")
            continue
        merged, conflicts = merge_file(pristine, before, new, ("upstream", "series", change_id))
        result = merged if not conflicts else _adjacent(merged)
        if result is None:
            earlier = [c.id for c in overlay.owners(path) if c.id != change_id]
            raise UpstreamError(
                f"{change_id}'s edit of {path} overlaps the earlier changes' "
                f"({', '.join(earlier)}) there: it does not apply to {lock.upstream.name} "
                f"{lock.upstream.version} alone. Send those first, or make the change stand on "
                "its own (`vllm-overlay edit`, export)."
            )
        if conflicts:
            prep.notes.append(
                f"{path}: the change's lines sit next to an earlier change's; kept without them"
            )
        prep.files[path] = result
    _bring_helpers(prep, repo, base, {**series, **after}, added_by)
    prep.raw = dict(prep.files)
    for path in prep.tests:
        prep.files[path] = scrub.scrub(prep.files[path].decode()).encode()
    return prep


def _bring_helpers(prep: Prepared, repo: Path, base: str, tree: dict[str, bytes],
                   added_by: dict[str, str]) -> None:  # fmt: skip
    todo = list(prep.tests)
    while todo:
        path = todo.pop()
        for helper in _imported_helpers(path, prep.files[path].decode(errors="replace")):
            if helper in prep.files or show_bytes(repo, base, helper) is not None:
                continue
            if helper not in tree:
                raise UpstreamError(
                    f"{path} imports {helper}, which neither the release nor our series has."
                )
            prep.files[helper] = tree[helper]
            prep.base_files[helper] = None
            prep.brought[helper] = added_by.get(helper, prep.change.id)
            todo.append(helper)
    for helper, cid in sorted(prep.brought.items()):
        prep.notes.append(f"{helper}: a test helper {cid} adds; it comes along whole")


def leftovers(prep: Prepared, message: str) -> list[str]:
    """Every mention of our overlay left in the commit's files or message."""
    found = scrub.leftovers("commit message", message)
    for path, data in sorted(prep.files.items()):
        old = prep.base_files.get(path) or b""
        before = set(old.decode(errors="replace").splitlines())
        for hit in scrub.leftovers(path, data.decode(errors="replace")):
            if hit.split(": ", 1)[1] not in {ln.strip() for ln in before}:
                found.append(hit)
    return found


def clone(repo: Path, base: str, dest: Path, change_id: str) -> None:
    """A work tree of the release at ``dest`` (new), on branch ``upstream/<change id>``."""
    git("clone", "-q", "--no-checkout", str(repo), str(dest))
    with open_repo(dest) as w:
        run_git(w.git, "fetch", "-q", "--no-tags", str(repo), f"+{BASE_REF}:{BASE_REF}")
        run_git(w.git, "remote", "remove", "origin")
        switch(w, base, BRANCH_PREFIX + change_id)


def write(dest: Path, files: dict[str, bytes]) -> None:
    for path, data in files.items():
        target = safe_join(dest, path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


def commit(dest: Path, paths: list[str], message: str, identity: tuple[str, str], date: str) -> str:
    """Commit ``paths`` in ``dest`` as the user (author and committer), on ``date``."""
    name, email = identity
    env = {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_COMMITTER_NAME": name,
           "GIT_COMMITTER_EMAIL": email, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}  # fmt: skip
    with open_repo(dest) as w:
        run_git(w.git, "add", "-f", "--", *paths)
        run_git(w.git, "commit", "-q", "--no-verify", "-F", "-", input=message, env=env)
        return w.head.commit.hexsha


def amend_fixes(dest: Path, paths: list[str], date: str, identity: tuple[str, str]) -> bool:
    """Fold what the hooks fixed in the work tree into the commit; True when there was any."""
    with open_repo(dest) as w:
        changed = run_git(w.git, "status", "--porcelain", "--", *paths).stdout.strip()
        if not changed:
            return False
        name, email = identity
        env = {"GIT_AUTHOR_NAME": name, "GIT_AUTHOR_EMAIL": email, "GIT_COMMITTER_NAME": name,
               "GIT_COMMITTER_EMAIL": email, "GIT_AUTHOR_DATE": date,
               "GIT_COMMITTER_DATE": date}  # fmt: skip
        run_git(w.git, "add", "-f", "--", *paths)
        run_git(w.git, "commit", "-q", "--no-verify", "--amend", "--no-edit", env=env)
        return True


def format_patch(dest: Path, rev: str = "HEAD") -> bytes:
    """``git format-patch -1 --stdout`` of ``rev``: no signature (no tool version in it)."""
    with open_repo(dest) as w:
        return run_git(w.git, "format-patch", "-1", "--stdout", "--no-signature", rev
                       ).stdout.encode()  # fmt: skip


def test_tree(dest: Path, rev: str, out: Path, *, keep: list[str] | None = None) -> Path:
    """The files of ``rev`` in the new directory ``out``; ``keep``: then overlay these paths
    as the commit HEAD has them (the tests on the release without the change)."""
    from vllm_overlay.testing.proving import export_tree

    tree = export_tree(dest, rev, out)
    for path in keep or []:
        data = show_bytes(dest, "HEAD", path)
        if data is not None:
            target = safe_join(tree, path)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
    return tree


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def title_ok(title: str) -> bool:
    """vLLM's pull-request title rule (its .github/workflows/pr-title.yml): one or more
    ``[Tag]`` prefixes, a space, then the description."""
    return re.match(r"^(\[[^][]+\])+ +\S.*$", title) is not None


def numstat(dest: Path, base: str) -> dict[str, tuple[int, int]]:
    """path -> (lines added, lines removed) of the commit against the release."""
    with open_repo(dest) as w:
        out = run_git(w.git, "diff", "--numstat", "-z", base, "HEAD").stdout
    stats = {}
    for entry in out.split("\0"):
        parts = entry.split("\t")
        if len(parts) == 3 and parts[0].isdigit():
            stats[parts[2]] = (int(parts[0]), int(parts[1]))
    return stats
