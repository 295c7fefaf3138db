"""Small typed helpers over git, run through the one subprocess wrapper.

Every call gets a clean environment: no GIT_* variables from the caller, no user or system
config, a fixed identity and fixed dates, no signing. The same inputs give the same commit ids.
"""

from __future__ import annotations

import os
from pathlib import Path

from vllm_overlay.util import Output, run

IDENTITY = ("vllm-overlay", "vllm-overlay@localhost")
FIXED_DATE = "2000-01-01T00:00:00+0000"
_CONFIG = (
    "-c", "commit.gpgsign=false",
    "-c", "tag.gpgsign=false",
    "-c", "core.autocrlf=false",
    "-c", "core.safecrlf=false",
    "-c", "core.quotepath=off",
    "-c", "core.fileMode=true",
    "-c", "init.defaultBranch=main",
    "-c", "advice.detachedHead=false",
    "-c", "gc.auto=0",
    "-c", "maintenance.auto=false",
)  # fmt: skip


def git_env(date: str = FIXED_DATE) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(
        GIT_CONFIG_NOSYSTEM="1",
        GIT_CONFIG_GLOBAL=os.devnull,
        GIT_AUTHOR_NAME=IDENTITY[0],
        GIT_AUTHOR_EMAIL=IDENTITY[1],
        GIT_COMMITTER_NAME=IDENTITY[0],
        GIT_COMMITTER_EMAIL=IDENTITY[1],
        GIT_AUTHOR_DATE=date,
        GIT_COMMITTER_DATE=date,
        GIT_TERMINAL_PROMPT="0",
        LC_ALL="C",
    )
    return env


def git(*args: str | os.PathLike[str], cwd: Path | None = None, check: bool = True,
        input: str | None = None, hint: str = "") -> Output:  # fmt: skip
    return run("git", *_CONFIG, *args, cwd=cwd, env=git_env(), check=check, input=input, hint=hint)


def rev_parse(repo: Path, rev: str) -> str | None:
    out = git("rev-parse", "--verify", "-q", f"{rev}^{{commit}}", cwd=repo, check=False)
    return out.stdout.strip() if out.returncode == 0 else None


def show_bytes(repo: Path, rev: str, path: str) -> bytes | None:
    """The bytes of ``path`` at ``rev``, or None if it does not exist there."""
    import subprocess

    proc = subprocess.run(
        ["git", *_CONFIG, "cat-file", "blob", f"{rev}:{path}"],
        cwd=repo,
        env=git_env(),
        capture_output=True,
    )
    if proc.returncode != 0:
        return None
    return proc.stdout


def status_porcelain(repo: Path) -> list[str]:
    """Uncommitted changes (tracked and untracked, not ignored), NUL-split porcelain entries."""
    out = git("status", "--porcelain=v1", "-z", "--untracked-files=all", cwd=repo)
    return [e for e in out.stdout.split("\0") if e]


def ls_files_z(repo: Path, *args: str) -> list[str]:
    out = git("ls-files", "-z", *args, cwd=repo)
    return [e for e in out.stdout.split("\0") if e]


def config_get(repo: Path, key: str) -> str | None:
    out = git("config", "--local", "--get", key, cwd=repo, check=False)
    return out.stdout.strip() if out.returncode == 0 else None


def config_set(repo: Path, key: str, value: str) -> None:
    git("config", "--local", key, value, cwd=repo)
