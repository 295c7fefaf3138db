"""Import's merges, in memory: each file of the upstream work merged three-way onto the file
as the series leaves it (``overlay/importing.py`` writes the result into the checkout).

- a patch that applies to ``ours`` as it is (``git apply``: exact context, no fuzz) is applied;
- otherwise a base it applies to is looked for: the file an earlier mail of the same import
  produced, the blob the diff names in its ``index`` line (when the checkout has it), or the
  file in ``--base-release``; ``git merge-file --diff3`` then merges base -> theirs into ours;
- a release import merges pin -> release into ours the same way.

A file no base can be found for raises ``ChangeImportError`` with nothing written.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay.errors import ChangeImportError
from vllm_overlay.gitrepo import apply_patch, blob_bytes, git, merge_file, show_bytes
from vllm_overlay.overlay.mbox import FileDiff, PatchSeries
from vllm_overlay.overlay.model import safe_join
from vllm_overlay.pin.trees import BASE_REF


@dataclass
class Merged:
    """One file of the import, merged: its content (diff3 markers where ``conflicted``) and
    how it was merged."""

    path: str
    content: bytes
    conflicted: bool
    how: str


def _apply_one(data: bytes | None, fd: FileDiff) -> bytes | None:
    """``fd`` applied to ``data`` by ``git apply`` (exact context, no fuzz), or None."""
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-import-") as tmp:
        root = Path(tmp, "t")
        target = safe_join(root, fd.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        if data is not None:
            target.write_bytes(data)
        patch = fd.text.encode(errors="surrogateescape")  # the mail's bytes, as they came
        if not apply_patch(patch, root, "--whitespace=nowarn") or not target.is_file():
            return None
        return target.read_bytes()


def merge_patch(
    series: PatchSeries, checkout: Path, base_release: tuple[str, Path, str] | None
) -> list[Merged]:
    """Each file diff of ``series`` merged onto the checkout's HEAD, in order."""
    cur: dict[str, bytes | None] = {}
    done: dict[str, Merged] = {}
    prev_theirs: dict[str, bytes] = {}
    for fd in series.files:
        if fd.path not in cur:
            cur[fd.path] = show_bytes(checkout, "HEAD", fd.path)
        ours = cur[fd.path]
        m = _merge_one(fd, ours, checkout, prev_theirs.get(fd.path), base_release)
        if fd.path in done and done[fd.path].conflicted:
            raise ChangeImportError(
                f"{fd.path}: a later commit of the patch changes it again after a conflicted "
                "merge; import the commits one at a time (split the mbox)."
            )
        cur[fd.path] = m.content
        done[fd.path] = m
        theirs = _theirs_after(fd, ours, prev_theirs.get(fd.path))
        if theirs is not None:
            prev_theirs[fd.path] = theirs
    return list(done.values())


def _theirs_after(fd: FileDiff, ours: bytes | None, prev: bytes | None) -> bytes | None:
    for base in (prev, ours):
        if base is not None or fd.new_file:
            got = _apply_one(base, fd)
            if got is not None:
                return got
    return None


def _merge_one(
    fd: FileDiff,
    ours: bytes | None,
    checkout: Path,
    prev: bytes | None,
    base_release: tuple[str, Path, str] | None,
) -> Merged:
    if fd.new_file:
        theirs = _apply_one(None, fd)
        if theirs is None:
            raise ChangeImportError(f"the patch's new file {fd.path} does not apply to nothing.")
        if ours is None:
            return Merged(fd.path, theirs, False, "added")
        content, conflicts = merge_file(ours, b"", theirs, ("series", "absent", "import"))
        return Merged(fd.path, content, conflicts > 0, "added, but the series already has it")
    if ours is None:
        raise ChangeImportError(
            f"the patch changes {fd.path}, which neither the pinned upstream nor the series "
            "has. Nothing was written; check the patch (or the pin)."
        )
    direct = _apply_one(ours, fd)
    if direct is not None:
        return Merged(fd.path, direct, False, "applied")
    bases: list[tuple[str, bytes]] = []
    if prev is not None:
        bases.append(("the previous commit of the patch", prev))
    if fd.pre_blob:
        data = blob_bytes(checkout, fd.pre_blob)
        if data is not None:
            bases.append((f"blob {fd.pre_blob}", data))
    if base_release is not None:
        version, repo, rev = base_release
        data = show_bytes(repo, rev, fd.path)
        if data is not None:
            bases.append((f"{fd.path} of {version}", data))
    for name, base in bases:
        theirs = _apply_one(base, fd)
        if theirs is None:
            continue
        content, conflicts = merge_file(ours, base, theirs, ("series", name, "import"))
        return Merged(fd.path, content, conflicts > 0, f"three-way merge over {name}")
    tried = ", ".join(n for n, _ in bases) or "none"
    blob = (
        "names no blob it was written against"
        if not fd.pre_blob
        else f"was written against blob {fd.pre_blob}, which the checkout "
        + ("has but the patch does not apply to" if any(n.startswith("blob") for n, _ in bases)
           else "does not have")
    )  # fmt: skip
    raise ChangeImportError(
        f"the patch of {fd.path} does not apply to the file as the series leaves it, and no "
        f"base for a three-way merge takes it (bases tried: {tried}; the patch {blob}). "
        "Nothing was written. Pass --base-release VERSION: a release whose "
        f"{fd.path} the patch applies to (its sdist is the merge base)."
    )


def merge_release(
    checkout: Path, paths: list[str], version: str, repo: Path, rev: str
) -> list[Merged]:
    """pin -> ``version`` of each path, merged onto the checkout's HEAD."""
    out = []
    for path in paths:
        pinned = show_bytes(checkout, BASE_REF, path)
        theirs = show_bytes(repo, rev, path)
        ours = show_bytes(checkout, "HEAD", path)
        if theirs is None:
            what = "deletes" if pinned is not None else "does not have"
            raise ChangeImportError(
                f"release {version} {what} {path}; an overlay change patches and adds files "
                "only. Leave it out of --paths; nothing was written."
            )
        if pinned == theirs:
            continue
        if ours is None:
            out.append(Merged(path, theirs, False, f"added from {version}"))
            continue
        content, conflicts = merge_file(
            ours, pinned or b"", theirs, ("series", "pin", f"release {version}")
        )
        out.append(Merged(path, content, conflicts > 0, f"three-way merge pin -> {version}"))
    if not out:
        raise ChangeImportError(
            f"{', '.join(paths)}: the same in the pin and in {version}; nothing to import."
        )
    return out


def release_paths(checkout: Path, repo: Path, rev: str, paths: list[str]) -> list[str]:
    """Files under each of ``paths`` (a file or a directory) in the pin or the release."""
    found: list[str] = []
    for p in paths:
        here = git("ls-tree", "-r", "-z", "--name-only", BASE_REF, "--", p, cwd=checkout)
        there = git("ls-tree", "-r", "-z", "--name-only", rev, "--", p, cwd=repo)
        names = {n for n in (here.stdout + "\0" + there.stdout).split("\0") if n}
        if not names:
            raise ChangeImportError(f"{p} is in neither the pinned tree nor the release.")
        found += sorted(n for n in names if n not in found)
    return found
