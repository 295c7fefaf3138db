"""Pristine upstream trees as git repositories in the cache.

From the release sdist: the archive is unpacked and committed with a fixed identity and date,
so the same sdist always gives the same base commit id. From a git remote: only the pinned
commit is fetched, and its id is checked. Either way the result is a bare repository under
``<cache>/trees/`` with the base commit at ``refs/vllm-overlay/base``.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from vllm_overlay.errors import IntegrityError, OverlayError
from vllm_overlay.gitrepo import git, open_repo, remote_git, rev_parse, set_ref
from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.pin.artifacts import ensure_artifact
from vllm_overlay.pin.lockfile import Lock
from vllm_overlay.util import cache_dir, exclusive_lock, hold, info, release, touch

BASE_REF = "refs/vllm-overlay/base"
SOURCES = ("sdist", "git")


def _strip_top(extract_dir: Path) -> Path:
    entries = [p for p in extract_dir.iterdir()]
    if len(entries) == 1 and entries[0].is_dir():
        return entries[0]
    return extract_dir


def _extract(sdist: Path, dest: Path) -> Path:
    try:
        with tarfile.open(sdist) as tf:
            tf.extractall(dest, filter="data")
    except (tarfile.TarError, OSError) as e:
        raise IntegrityError(
            f"cannot unpack {sdist.name}: {e}. Delete it from the cache and fetch again."
        ) from e
    return _strip_top(dest)


def commit_tree(worktree: Path, git_dir: Path, message: str) -> str:
    """Commit every file under ``worktree`` (ignored ones too) into ``git_dir``; return the id."""
    env_args = ("--git-dir", str(git_dir), "--work-tree", str(worktree))
    git(*env_args, "add", "-A", "-f", "--", ".", cwd=worktree)
    tree = git(*env_args, "write-tree", cwd=worktree).stdout.strip()
    return git(*env_args, "commit-tree", tree, "-m", message, cwd=worktree).stdout.strip()


def _init_bare(repo: Path) -> None:
    git("init", "-q", "--bare", str(repo))


def _publish_repo(tmp: Path, final: Path) -> None:
    try:
        os.replace(tmp, final)
    except OSError:
        if final.is_dir() and rev_parse(final, BASE_REF):
            shutil.rmtree(tmp, ignore_errors=True)  # someone else finished first
        else:
            raise


def lock_path(key: str) -> Path:
    """The lock of the tree ``trees/sdist-<key>.git`` or ``trees/git-<key>.git`` (the sdist's
    sha256, or the commit): its builder takes it exclusively, users share it."""
    return cache_dir() / "locks" / f"tree-{key}.lock"


def tree_key(repo: Path) -> str:
    """The key of a tree in the cache, from its directory's name."""
    return repo.name.split("-", 1)[-1].removesuffix(".git")


def _cached(final: Path, tree_lock: Path, what: str) -> str | None:
    """The base commit of the complete tree ``final``, held in use by this process (a prune
    passes it by); None where it is absent or incomplete."""
    if not final.is_dir():
        return None
    hold(tree_lock, what)
    base = rev_parse(final, BASE_REF)
    if base:
        touch(final)
        return base
    release(tree_lock)  # this process's own shared lock would block its exclusive one
    return None


def _built(final: Path, tree_lock: Path, what: str) -> None:
    """After a build (or a wait for another process's): in use by this process."""
    hold(tree_lock, what)
    touch(final)


def sdist_repo(lock: Lock, *, settings: Settings = DEFAULTS) -> tuple[Path, str]:
    """(bare repo, base commit) for the pinned sdist, building it once."""
    art = lock.sdist()
    root = cache_dir() / "trees"
    final = root / f"sdist-{art.sha256}.git"
    tree_lock = lock_path(art.sha256)
    what = f"the tree of {art.filename}"
    if base := _cached(final, tree_lock, what):
        return final, base
    sdist = ensure_artifact(art, settings=settings)
    root.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(tree_lock, what):
        base = rev_parse(final, BASE_REF) if final.is_dir() else None
        if not base:
            if final.exists():
                shutil.rmtree(final)  # an incomplete leftover
            info(f"unpacking {art.filename} into a git repository")
            with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
                tmp_path = Path(tmp)
                top = _extract(sdist, tmp_path / "src")
                repo = tmp_path / "repo.git"
                _init_bare(repo)
                msg = (
                    f"{lock.upstream.name} {lock.upstream.version} from {art.filename}\n\n"
                    f"sdist-sha256: {art.sha256}\n"
                )
                base = commit_tree(top, repo, msg)
                with open_repo(repo) as r:
                    set_ref(r, BASE_REF, base)
                _publish_repo(repo, final)
    _built(final, tree_lock, what)
    return final, base


def git_repo(lock: Lock, *, git_url: str | None = None) -> tuple[Path, str]:
    """(bare repo, base commit) holding only the pinned upstream commit, fetched once."""
    commit = lock.upstream.commit
    url = git_url or lock.upstream.git
    if not lock.upstream.commit_verified:
        raise OverlayError(
            f"the lock pins vllm {lock.upstream.version} by its sdist; its commit {commit} is "
            "abbreviated and unverified, so there is no commit to fetch. Use --source sdist, "
            f"or verify the commit first: vllm-overlay lock --version {lock.upstream.version} "
            "--commit SHA."
        )
    root = cache_dir() / "trees"
    final = root / f"git-{commit}.git"
    tree_lock = lock_path(commit)
    if base := _cached(final, tree_lock, f"the tree of {commit}"):
        return final, base
    root.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(tree_lock, f"the tree of {commit}"):
        if not (final.is_dir() and rev_parse(final, BASE_REF)):
            _fetch_commit(final, root, commit, url)
    _built(final, tree_lock, f"the tree of {commit}")
    return final, commit


def _fetch_commit(final: Path, root: Path, commit: str, url: str) -> None:
    if final.exists():
        shutil.rmtree(final)
    info(f"fetching {commit} from {url}")
    with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
        repo = Path(tmp) / "repo.git"
        _init_bare(repo)
        remote_git(
            "fetch", "-q", "--depth", "1", "--no-tags", url, commit, url=url, cwd=repo,
            hint=(
                f"Could not fetch commit {commit} from {url}. Check the URL (pass --git-url "
                "for a mirror) and that the server allows fetching a commit by id; or use "
                "--source sdist."
            ),
        )  # fmt: skip
        with open_repo(repo) as r:
            got = rev_parse(r, "FETCH_HEAD")
            if got != commit:
                raise IntegrityError(
                    f"{url} returned commit {got} for the pinned {commit}. Refusing to use it."
                )
            set_ref(r, BASE_REF, commit)
        _publish_repo(repo, final)


def upstream_repo(lock: Lock, *, settings: Settings = DEFAULTS) -> tuple[Path, str]:
    """(bare repo, base commit) of the pinned tree, from where ``settings.source`` says."""
    if settings.source == "sdist":
        return sdist_repo(lock, settings=settings)
    if settings.source == "git":
        return git_repo(lock, git_url=settings.git_url)
    raise OverlayError(f"unknown source {settings.source!r}; use one of {', '.join(SOURCES)}.")
