"""The one way this tool builds a cached environment: keyed by its recipe, built aside, renamed.

Both kinds of environment go through here: the test environment for vLLM's tests from a
source tree (``testenv``) and the engine environment with a built wheel installed
(``enginenv``). Each is a directory ``cache_dir()/testenv/<recipe hash>/`` holding a
virtualenv and a marker file written last; its presence means the build completed.

A build runs in a temporary sibling directory under an exclusive lock of its own recipe
(builds of other recipes go on; a second process waits, saying for which environment),
and is renamed into place when complete: a failed or interrupted build leaves nothing
behind, and leftovers of a killed one are removed by the next build.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from packaging.utils import canonicalize_name

from vllm_overlay import util

MARKER = "testenv.json"
VENV = "venv"


def root() -> Path:
    """Where the environments live."""
    return util.cache_dir() / "testenv"


def lock_path(recipe_hash: str) -> Path:
    """One lock per recipe: builds of different environments do not wait for each other."""
    return root() / "locks" / f"{recipe_hash}.lock"


def read_marker(path: Path) -> dict | None:
    """The marker of the complete environment at ``path``; None when absent or unfinished."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None
    if not isinstance(marker, dict) or not (path / VENV / "bin" / "python").exists():
        return None
    return marker


def ensure(
    recipe_hash: str,
    what: str,
    build: Callable[[Path], dict],
    *,
    rebuild: bool = False,
) -> Path:
    """The environment ``recipe_hash``: the cached one, else built now by ``build(staging)``.

    ``build`` makes the environment in the (empty) staging directory and returns its marker
    (a JSON object, written last by this function). Returns at once, without building, when
    the environment exists and is complete; ``rebuild`` builds it anew and replaces it.
    ``what`` names it in the waiting message ("the test environment 55c4…").
    """
    final = root() / recipe_hash
    if not rebuild and read_marker(final) is not None:
        return final
    with util.exclusive_lock(lock_path(recipe_hash), what):
        if not rebuild and read_marker(final) is not None:
            return final  # another process finished it while this one waited
        for stale in [*root().glob(f"{recipe_hash}.build-*"), root() / f"{recipe_hash}.old"]:
            shutil.rmtree(stale, ignore_errors=True)  # left by a killed build
        staging = Path(tempfile.mkdtemp(prefix=f"{recipe_hash}.build-", dir=root()))
        try:
            marker = build(staging)
            _retarget_scripts(staging, final)
            # Written last: its presence means the environment is complete.
            util.atomic_write_text(
                staging / MARKER, json.dumps(marker, indent=2, sort_keys=True) + "\n"
            )
            if final.exists():
                old = final.with_name(f"{recipe_hash}.old")
                os.replace(final, old)
                shutil.rmtree(old)
            os.replace(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return final


def _retarget_scripts(staging: Path, final: Path) -> None:
    """Point the environment's scripts at where it will live: console scripts (``vllm``,
    ``speculators``) and activation scripts name the interpreter by the absolute path they
    were installed under, the staging directory, which the rename below makes vanish."""
    old, new = os.fspath(staging).encode(), os.fspath(final).encode()
    for script in sorted((staging / VENV / "bin").iterdir()):
        if script.is_symlink() or not script.is_file() or script.stat().st_size > 1 << 20:
            continue
        data = script.read_bytes()
        if old not in data:
            continue
        tmp = script.with_name(f".{script.name}.tmp")
        tmp.write_bytes(data.replace(old, new))
        os.chmod(tmp, script.stat().st_mode)
        os.replace(tmp, script)


def pinned_lines(freeze: Path, leave_out: Iterable[str] = ()) -> list[str]:
    """The ``name==version`` lines of an environment's freeze file, sorted by name: what a
    constraints file pins. Local packages (``name @ file://…``, editable ones) and the
    distributions ``leave_out`` names are not pinned."""
    skip = {canonicalize_name(n) for n in leave_out}
    lines = []
    for line in freeze.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or " @ " in line or line.startswith("-e "):
            continue
        if canonicalize_name(line.split("==", 1)[0]) not in skip:
            lines.append(line)
    return sorted(lines, key=lambda ln: canonicalize_name(ln.split("==", 1)[0]))
