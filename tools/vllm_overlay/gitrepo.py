"""The git layer: GitPython's ``Repo`` for reading, ``repo.git`` for what only git's CLI does.

Reads (refs, commits, trees and blobs, config, which paths differ, unmerged entries, untracked
files) go through ``git.Repo`` objects. Writes (``update-ref``, ``config``, ``commit``,
``checkout``, ``cherry-pick``, ``stash``, ``fetch``, ``clone``) go through ``repo.git``: git
itself takes its lock files and renames into place, so nothing is half-written when the
process is killed (GitPython's own ref and config writers rewrite files in place). git's
file-level tools (``merge-file``, ``apply``, ``diff --no-index``: import's merges and the
rebase's decision) run here too, on bytes (``git_bytes``): a file need not be UTF-8.

Every git child starts in ``process.py``, the one runner, with a time limit and the process
group's stop (``gitcmd.py``: GitPython's command object on that runner). Git that talks to a
remote (``remote_git``: ``ls-remote``, ``fetch``) gets ``NETWORK_TIMEOUT``, and its timeout
names the host.

Every git process gets the same clean environment: no ``GIT_*`` variables from the caller (they
are dropped from this process's environment the first time the layer is used, because
GitPython copies ``os.environ`` into every child and reads ``GIT_DIR`` and friends itself), no
user or system config, the config below through ``GIT_CONFIG_COUNT``, a fixed identity and
fixed dates, no signing. The same inputs give the same commit ids.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import git as gitpython
from git.diff import INDEX
from git.exc import BadName, BadObject, GitCommandError

from vllm_overlay.errors import CommandError, CommandTimeout, OverlayError
from vllm_overlay.gitcmd import GIT_TIMEOUT, NETWORK_TIMEOUT, Git, GitRepo, run_in
from vllm_overlay.process import BytesOutput, Output, run

Repo = gitpython.Repo
IDENTITY = ("vllm-overlay", "vllm-overlay@localhost")
FIXED_DATE = "2000-01-01T00:00:00+0000"
CONFIG = {
    "commit.gpgsign": "false",
    "tag.gpgsign": "false",
    "core.autocrlf": "false",
    "core.safecrlf": "false",
    "core.quotepath": "off",
    "core.fileMode": "true",
    "init.defaultBranch": "main",
    "advice.detachedHead": "false",
    "gc.auto": "0",
    "maintenance.auto": "false",
}


def git_env(date: str = FIXED_DATE, config: dict[str, str] | None = None) -> dict[str, str]:
    """The variables every git process gets on top of the (``GIT_*``-free) environment."""
    settings = {**CONFIG, **(config or {})}
    env = {
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_AUTHOR_NAME": IDENTITY[0],
        "GIT_AUTHOR_EMAIL": IDENTITY[1],
        "GIT_COMMITTER_NAME": IDENTITY[0],
        "GIT_COMMITTER_EMAIL": IDENTITY[1],
        "GIT_AUTHOR_DATE": date,
        "GIT_COMMITTER_DATE": date,
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_CONFIG_COUNT": str(len(settings)),
        "LC_ALL": "C",
    }
    for i, (key, value) in enumerate(settings.items()):
        env[f"GIT_CONFIG_KEY_{i}"] = key
        env[f"GIT_CONFIG_VALUE_{i}"] = value
    return env


def _drop_outside_git_vars() -> None:
    for key in [k for k in os.environ if k.startswith("GIT_") and not k.startswith("GIT_PYTHON")]:
        del os.environ[key]


def _cmd(working_dir: Path | None) -> gitpython.Git:
    _drop_outside_git_vars()
    g = Git(working_dir)
    g.update_environment(**git_env())
    return g


def open_repo(path: Path) -> Repo:
    """A ``Repo`` (work tree or bare) whose git processes run in the clean environment.

    Use it as a context manager (``with open_repo(p) as repo:``) so its long-lived
    ``cat-file`` processes end with it.
    """
    _drop_outside_git_vars()
    try:
        repo = GitRepo(path, search_parent_directories=False)
    except (gitpython.InvalidGitRepositoryError, gitpython.NoSuchPathError) as e:
        raise OverlayError(f"{path} is not a git repository ({type(e).__name__}).") from e
    repo.git.update_environment(**git_env())
    return repo


@contextmanager
def opened(repo: Repo | Path) -> Iterator[Repo]:
    if isinstance(repo, Repo):
        yield repo
    else:
        with open_repo(Path(repo)) as r:
            yield r


def run_git(
    g: gitpython.Git,
    *args: str | os.PathLike[str],
    check: bool = True,
    input: str | None = None,
    hint: str = "",
    env: dict[str, str] | None = None,
    timeout: float | None = GIT_TIMEOUT,
) -> Output:
    """``git ARGS`` in ``g``'s repository (a ``repo.git``): the exit status, stdout and stderr
    as text, a ``CommandError`` (command, status, output, ``hint``) when it fails and
    ``check``; a ``CommandTimeout`` past ``timeout`` seconds (the child stopped)."""
    data = input.encode("utf-8", "surrogateescape") if input is not None else None
    out = run_git_bytes(g, *args, check=check, input=data, hint=hint, env=env, timeout=timeout)
    return Output(out.returncode, out.stdout.decode(errors="surrogateescape"), out.stderr)


def run_git_bytes(
    g: gitpython.Git,
    *args: str | os.PathLike[str],
    check: bool = True,
    input: bytes | None = None,
    hint: str = "",
    env: dict[str, str] | None = None,
    timeout: float | None = GIT_TIMEOUT,
) -> BytesOutput:
    """``run_git`` with bytes in and out: stdin and stdout are bytes, stderr is text."""
    argv = ("git", *(os.fspath(a) for a in args))
    out = run_in(g, argv, input, env, timeout, hint)
    if check and out.returncode != 0:
        raise CommandError(argv, out.returncode, out.stdout.decode(errors="replace"),
                           out.stderr, hint)  # fmt: skip
    return out


def git(*args: str | os.PathLike[str], cwd: Path | None = None, check: bool = True,
        input: str | None = None, hint: str = "",
        timeout: float | None = GIT_TIMEOUT) -> Output:  # fmt: skip
    """``git ARGS`` in ``cwd`` (or no repository: ``init``, ``clone``)."""
    return run_git(_cmd(cwd), *args, check=check, input=input, hint=hint, timeout=timeout)


def git_bytes(*args: str | os.PathLike[str], cwd: Path | None = None, check: bool = True,
              input: bytes | None = None, hint: str = "") -> BytesOutput:  # fmt: skip
    """``git ARGS`` in ``cwd`` with bytes in and out (``run_git_bytes``)."""
    return run_git_bytes(_cmd(cwd), *args, check=check, input=input, hint=hint)


def remote_git(*args: str | os.PathLike[str], url: str, cwd: Path | None = None,
               check: bool = True, hint: str = "", timeout: float | None = None) -> Output:  # fmt: skip
    """``git ARGS`` that talks to ``url`` (``ls-remote``, ``fetch``): ``timeout`` seconds at
    most (``NETWORK_TIMEOUT``), then a ``CommandTimeout`` that names the host."""
    timeout = NETWORK_TIMEOUT if timeout is None else timeout
    try:
        return git(*args, cwd=cwd, check=check, hint=hint, timeout=timeout)
    except CommandTimeout as e:
        raise CommandTimeout(
            e.cmd, e.returncode, e.stdout, e.stderr,
            f"{host_of(url)} did not answer git {os.fspath(args[0])} within {timeout:g} s (the "
            "child was stopped). Check the network and the host, or pass --git-url for a "
            "mirror.",
        ) from e  # fmt: skip


def host_of(url: str) -> str:
    """The host ``url`` names (``user@host:path`` too), without credentials; a local path
    as it is."""
    if "://" in url:
        return urlsplit(url).hostname or url
    head, sep, _ = url.partition(":")
    return head.rpartition("@")[2] if sep and "/" not in head else url


# ---------------------------------------------------------------------------------------------
# File-level tools on bytes, outside any repository (import's merges, the rebase's decision)


def merge_file(current: bytes, base: bytes, other: bytes,
               labels: tuple[str, str, str]) -> tuple[bytes, int]:  # fmt: skip
    """``git merge-file --diff3`` of base -> ``other`` into ``current``: (the result, the
    number of conflicts). ``labels`` name the three sides in the markers, in that order."""
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-merge-") as tmp:
        names = []
        for name, data in (("current", current), ("base", base), ("other", other)):
            Path(tmp, name).write_bytes(data)
            names.append(os.path.join(tmp, name))
        label_args = [a for lab in labels for a in ("-L", lab)]
        out = git_bytes("merge-file", "-p", "--diff3", *label_args, *names, check=False)
    if not 0 <= out.returncode <= 127:  # 0: clean; 1..127: conflicts; 255: an error
        raise CommandError(("git", "merge-file"), out.returncode, "", out.stderr)
    return out.stdout, out.returncode


def diff_no_index(a: str | os.PathLike[str], b: str | os.PathLike[str], *options: str,
                  cwd: Path | None = None) -> bytes:  # fmt: skip
    """``git diff --no-index OPTIONS a b`` (two files or directories): its output, bytes."""
    out = git_bytes("diff", "--no-index", *options, a, b, cwd=cwd, check=False)
    if out.returncode not in (0, 1):  # 1: they differ
        raise CommandError(("git", "diff", "--no-index"), out.returncode, "", out.stderr)
    return out.stdout


def apply_patch(patch: bytes, cwd: Path, *options: str) -> bool:
    """``git apply OPTIONS`` of ``patch`` (bytes, on stdin) in the directory ``cwd``, which
    need not be a repository (exact context, no fuzz): True when it applies."""
    return git_bytes("apply", *options, "-", cwd=cwd, check=False, input=patch).returncode == 0


# ---------------------------------------------------------------------------------------------
# Reading


def commit_of(repo: Repo, rev: str) -> gitpython.Commit | None:
    """The commit ``rev`` names (a ref, ``HEAD``, an id), or None."""
    try:
        obj = repo.rev_parse(f"{rev}^{{commit}}")
    except (BadName, BadObject, ValueError, IndexError, KeyError, GitCommandError):
        return None
    return obj if isinstance(obj, gitpython.Commit) else None


def rev_parse(repo: Repo | Path, rev: str) -> str | None:
    """The full id of the commit ``rev`` names, or None."""
    with opened(repo) as r:
        c = commit_of(r, rev)
        return c.hexsha if c is not None else None


def show_bytes(repo: Repo | Path, rev: str, path: str) -> bytes | None:
    """The bytes of ``path`` at ``rev``, or None if it does not exist there."""
    with opened(repo) as r:
        c = commit_of(r, rev)
        if c is None:
            return None
        try:
            obj = c.tree / path
        except KeyError:
            return None
        return obj.data_stream.read() if isinstance(obj, gitpython.Blob) else None


def blob_bytes(repo: Repo | Path, rev: str) -> bytes | None:
    """The bytes of the blob ``rev`` names (an id, ``REV:PATH``), or None where it has none."""
    with opened(repo) as r:
        try:
            obj = r.rev_parse(f"{rev}^{{blob}}")
        except (BadName, BadObject, ValueError, IndexError, KeyError, GitCommandError):
            return None
        return obj.data_stream.read() if isinstance(obj, gitpython.Blob) else None


def current_branch(repo: Repo) -> str | None:
    """The branch HEAD is on (its short name), or None when HEAD is detached."""
    return None if repo.head.is_detached else repo.head.reference.name


def untracked(repo: Repo) -> list[str]:
    """Untracked files that are not ignored.

    CLI (``ls-files --others``): GitPython's ``untracked_files`` runs a full ``git status``,
    twice as slow on vLLM's tree (docs/design.md, "Git layer").
    """
    out = run_git(repo.git, "ls-files", "-z", "--others", "--exclude-standard").stdout
    return [p for p in out.split("\0") if p]


def changed_since(repo: Repo, rev: str, other: str | None = None) -> list[str]:
    """Paths that differ between ``rev`` and ``other`` (None: the work tree, tracked files),
    without rename detection (a moved file is its old and its new path)."""
    diffs = repo.commit(rev).diff(other, no_renames=True)
    return sorted({p for d in diffs for p in (d.a_path, d.b_path) if p})


def staged(repo: Repo) -> list[gitpython.Diff]:
    """What the index changes from HEAD (HEAD on the ``a`` side, the index on ``b``)."""
    return list(repo.head.commit.diff(INDEX))


def uncommitted(repo: Repo) -> list[str]:
    """Uncommitted changes (staged, unstaged, untracked and not ignored), one ``XY path``
    line each as ``git status --porcelain`` prints them (``XY orig -> path`` for a rename).

    CLI (one ``git status``): GitPython needs three processes (``index.diff`` twice and
    ``untracked_files``), twice the time on vLLM's tree (docs/design.md, "Git layer").
    """
    out = run_git(repo.git, "status", "--porcelain=v1", "-z", "--untracked-files=all").stdout
    fields = iter(out.split("\0"))
    lines = []
    for entry in fields:
        if entry:
            xy, path = entry[:2], entry[3:]
            if "R" in xy or "C" in xy:  # -z puts the original path in the next field
                path = f"{next(fields, '')} -> {path}"
            lines.append(f"{xy} {path}")
    return lines


def unmerged(repo: Repo) -> list[str]:
    """Paths the index holds in conflict (stages 1-3)."""
    return sorted(str(p) for p in repo.index.unmerged_blobs())


def is_ancestor(repo: Repo, ancestor: str, rev: str) -> bool:
    return repo.is_ancestor(ancestor, rev)


def config_get(repo: Repo | Path, key: str) -> str | None:
    """``key`` (``section.name``) from the repository's own config, or None."""
    section, _, option = key.rpartition(".")
    with opened(repo) as r:
        reader = r.config_reader("repository")
        if not reader.has_option(section, option):
            return None
        return str(reader.get_value(section, option))


# ---------------------------------------------------------------------------------------------
# Writing (through git, which locks and renames)


def config_set(repo: Repo | Path, key: str, value: str | None) -> None:
    """Set ``key`` in the repository's own config (None: unset it)."""
    with opened(repo) as r:
        if value is None:
            run_git(r.git, "config", "--local", "--unset", key, check=False)
        else:
            run_git(r.git, "config", "--local", key, value)


def set_ref(repo: Repo, ref: str, value: str | None) -> None:
    """Point ``ref`` at ``value`` (None: delete it)."""
    if value:
        run_git(repo.git, "update-ref", ref, value)
    else:
        run_git(repo.git, "update-ref", "-d", ref, check=False)


def commit_message(subject: str, body: str = "", trailers: dict[str, str] | None = None) -> str:
    """``subject``, a blank line, ``body``, a blank line, ``Key: value`` trailers."""
    parts = [subject, body] if body else [subject]
    if trailers:
        parts.append("\n".join(f"{k}: {v}" for k, v in trailers.items()))
    return "\n\n".join(parts) + "\n"


def commit(repo: Repo, message: str, *paths: str) -> str:
    """Commit what is staged (after ``git add -f`` of ``paths``); returns the new HEAD."""
    if paths:
        run_git(repo.git, "add", "-f", "--", *paths)
    run_git(repo.git, "commit", "-q", "--no-verify", "-m", message)
    return repo.head.commit.hexsha


@dataclass(frozen=True)
class HeadState:
    """Where HEAD was: a branch at a commit, or a detached commit (None: no commit yet)."""

    commit: str | None
    branch: str | None


def head_state(repo: Repo) -> HeadState:
    return HeadState(commit=rev_parse(repo, "HEAD"), branch=current_branch(repo))


def switch(repo: Repo, commit: str, branch: str | None, *, clean: bool = False) -> None:
    """Check out ``commit`` forcibly, on ``branch`` (created or moved there) or detached;
    an unfinished merge or cherry-pick is dropped first; ``clean`` removes untracked files."""
    run_git(repo.git, "reset", "-q", "--merge", check=False)
    if branch:
        run_git(repo.git, "checkout", "-q", "-f", "-B", branch, commit)
    else:
        run_git(repo.git, "checkout", "-q", "-f", "--detach", commit)
    if clean:
        run_git(repo.git, "clean", "-q", "-f", "-d")


def restore_head(repo: Repo, state: HeadState, *, clean: bool = False) -> None:
    """Put HEAD (and the work tree) back where ``head_state`` found it."""
    if state.commit:
        switch(repo, state.commit, state.branch, clean=clean)


# ---------------------------------------------------------------------------------------------
# The user's own identity (the one read of the user's git config)


def user_identity(cwd: Path) -> tuple[str, str] | None:
    """``(user.name, user.email)`` as the user's own git config gives them in ``cwd`` (global
    and repository config; the clean environment above reads neither), or None where either
    is unset. What `upstream` signs off with: a commit meant for upstream is the user's, not
    this tool's fixed identity."""
    name, email = user_config(cwd, "user.name"), user_config(cwd, "user.email")
    return (name, email) if name and email else None


def user_config(cwd: Path, key: str) -> str | None:
    """``key`` as the user's own git config gives it in ``cwd`` (global and repository
    config, which the clean environment above reads neither of); None where it is unset."""
    out = run("git", "config", "--get", key, cwd=cwd, check=False, timeout=GIT_TIMEOUT)
    return out.stdout.strip() or None if out.returncode == 0 else None


def last_commit_date(cwd: Path, path: str) -> str | None:
    """The author date (ISO 8601) of the last commit touching ``path`` in the repository at
    ``cwd``; None where there is none (no repository, no history)."""
    out = git("log", "-1", "--format=%aI", "--", path, cwd=cwd, check=False)
    return out.stdout.strip() or None if out.returncode == 0 else None
