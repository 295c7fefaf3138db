"""The tracking run's copy of the project: a git worktree on its own branch.

The tracking run (``track/track.py``) never touches the person's checkout or branch: it
rebases a copy, ``git worktree add -B track/vllm-<version> .work/track/vllm-<version> HEAD``.
A leftover of an interrupted run is removed first, so every run starts clean; a stale copy of
our own (an earlier run of the project from another place) that holds the branch is removed
too, and anything else that holds it is named, with how to free it.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay.errors import TrackError
from vllm_overlay.gitrepo import git, rev_parse
from vllm_overlay.overlay.project import Project
from vllm_overlay.util import info, lock_if_free


@dataclass(frozen=True)
class Copy:
    """The copy a tracking run rebases."""

    repo_root: Path  # the project's git work tree (the person's)
    worktree: Path  # the copy
    branch: str
    project: Project  # the project inside the copy


def repo_root(project: Project) -> Path:
    """The git work tree the project is in (it must have a commit: the copy is made from HEAD)."""
    out = git("rev-parse", "--show-toplevel", cwd=project.root, check=False)
    if out.returncode != 0 or rev_parse(project.root, "HEAD") is None:
        raise TrackError(
            f"{project.root} is not in a git repository with a commit. `vllm-overlay track` "
            "rebases a copy of the project made with `git worktree` from HEAD: commit the "
            "project first."
        )
    return Path(out.stdout.strip())


def make_copy(project: Project, version: str) -> Copy:
    """A fresh copy of the project for ``version``: a worktree of HEAD on ``track/vllm-V`` at
    ``.work/track/vllm-V`` (a leftover there, or a stale copy of ours holding the branch,
    removed first)."""
    root = repo_root(project)
    branch = f"track/vllm-{version}"
    worktree = project.work_dir / "track" / f"vllm-{version}"
    _remove_copy(root, worktree)
    if rev_parse(root, "refs/heads/track"):
        raise TrackError(
            f"the branch `track` exists in {root}, so git cannot create {branch} (a branch "
            "cannot also be a folder of branches). Rename it (`git branch -m track OTHER`) "
            "and run this again."
        )
    _free_branch(root, branch)
    worktree.parent.mkdir(parents=True, exist_ok=True)
    git("worktree", "add", "-q", "-f", "-B", branch, str(worktree), "HEAD", cwd=root)
    rel = project.root.resolve().relative_to(root.resolve())
    return Copy(root, worktree, branch, Project(worktree / rel))


def _remove_copy(root: Path, worktree: Path) -> None:
    """Remove a leftover copy (an interrupted run) so the run starts clean."""
    if worktree.exists():
        git("worktree", "remove", "--force", "--force", str(worktree), cwd=root, check=False)
        shutil.rmtree(worktree, ignore_errors=True)
    git("worktree", "prune", cwd=root, check=False)


def _holders(root: Path, branch: str) -> list[Path]:
    """The worktrees of ``root``'s repository that have ``branch`` checked out."""
    out, path, found = git("worktree", "list", "--porcelain", cwd=root).stdout, None, []
    for line in out.splitlines():
        if line.startswith("worktree "):
            path = Path(line.removeprefix("worktree "))
        elif line == f"branch refs/heads/{branch}" and path is not None:
            found.append(path)
    return found


def _own_stale_copy(path: Path, branch: str) -> bool:
    """``path`` is a copy an earlier tracking run made (``<project>/.work/track/vllm-V`` for
    ``branch``) and no tracking run of that project is using it now (its lock is free)."""
    if path.parts[-3:] != (".work", "track", branch.removeprefix("track/")):
        return False
    with lock_if_free(path.parent.parent / "track.lock") as free:
        return free


def _free_branch(root: Path, branch: str) -> None:
    """Make ``branch`` movable: git will not reset a branch another worktree has checked
    out. A stale copy of our own (an earlier run of the project from another place) is
    removed; anything else that holds the branch is named, with how to free it."""
    for path in _holders(root, branch):
        if _own_stale_copy(path, branch):
            info(f"removing a stale tracking copy at {path} (it held {branch})")
            _remove_copy(root, path)
            continue
        raise TrackError(
            f"the branch {branch} is checked out in the worktree {path}, so the tracking run "
            f"cannot move it. Free it with `git worktree remove {path}` (save any work there "
            "first), or `git worktree prune` if that directory is already gone; then run "
            "this again."
        )


def uncommitted(project: Project, root: Path) -> list[str]:
    """The person's uncommitted edits of upstream.lock and overlay/ (the copy has HEAD's)."""
    out = git("status", "--porcelain=v1", "--", str(project.lock_path), str(project.overlay_dir),
              cwd=root)  # fmt: skip
    return [line[3:] for line in out.stdout.splitlines() if line.strip()]
