"""The release lines this repository has carried: the last commit that pins each vLLM release.

Tests that need the series on an older release (the 0.24.0 line: fifteen changes and nine
newer releases to walk) take its project from this repository's own history, as a person
rebuilding that line would (docs/building.md, "An older line").
"""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout


def line_head(version: str, repo: Path = REPO) -> str:
    """The last commit of ``repo`` whose upstream.lock pins vLLM ``version``: the parent of
    the commit that moved the pin on (HEAD when the pin is still ``version``)."""
    moved_on = None  # the newer commit of upstream.lock's history, once past it
    for commit in _git(
        "log", "--first-parent", "--format=%H", "--", "upstream.lock", cwd=repo
    ).split():
        lock = tomllib.loads(_git("show", f"{commit}:upstream.lock", cwd=repo))
        if lock["upstream"]["version"] == version:
            head = f"{moved_on}^" if moved_on else "HEAD"
            return _git("rev-parse", head, cwd=repo).strip()
        moved_on = commit
    raise RuntimeError(
        f"no commit of {repo} pins vllm {version} (a shallow clone? `git fetch --unshallow`)"
    )


def line_project(dest: Path, version: str) -> Path:
    """``dest`` holding the upstream.lock and overlay/ of the ``version`` line's head."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "archive", line_head(version), "upstream.lock", "overlay"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout  # fmt: skip
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def line_clone(dest: Path, version: str) -> Path:
    """A clone of this repository on a branch at the ``version`` line's head."""
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(dest)], check=True)
    _git("checkout", "-q", "-B", f"line-{version}", line_head(version), cwd=dest)
    return dest
