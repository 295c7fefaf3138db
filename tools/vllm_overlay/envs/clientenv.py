"""The client environment: a pipeline that talks to ``vllm serve``, installed on its own.

Our users' training-data pipelines do not import vLLM: speculators' docs put vLLM in a
separate environment and its ``generate-offline-data`` talks to the server over HTTP. The
engine tests run that client as users do, from an environment of its own holding one pinned
requirement (``speculators==0.9.0``) and what it needs, and no vLLM. Built with uv by the one
builder (``envbuild.ensure``), cached under ``cache_dir()/testenv/<recipe hash>``.

What the recipe holds: the requirement, the exact set pinned in the project's
``constraints/client-<name>-<version>.txt`` (``vllm-overlay testenv --client REQ --freeze``
writes it; torch in it is the engine environment's, so uv links it from its cache instead of
downloading another build), Python 3.11 and a format number.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from vllm_overlay import util
from vllm_overlay.envs import envbuild, layout
from vllm_overlay.envs.childenv import CLIENT_TMP_PREFIX, scratch_environ, short_dir
from vllm_overlay.envs.envbuild import CONSTRAINTS_DIR, FREEZE, PYTHON
from vllm_overlay.errors import ClientEnvError, OverlayError

FORMAT = layout.FORMATS["client-env"]  # bumped there (the cache reads it)


@dataclass(frozen=True)
class ClientRecipe(envbuild.RecipeJson):
    format: int
    python: str
    requirement: str  # "speculators==0.9.0"
    constraints_file: str = ""  # constraints/client-speculators-0.9.0.txt; "": resolved freely
    constraints: str = ""

    @property
    def name(self) -> str:
        return str(canonicalize_name(Requirement(self.requirement).name))


@dataclass(frozen=True)
class ClientEnv:
    path: Path
    python: Path
    recipe_hash: str
    version: str  # the requirement's installed version

    def bin(self, command: str) -> Path:
        """A console script of the environment (``speculators``)."""
        return self.python.parent / command

    def environ(self, workdir: Path) -> dict[str, str]:
        """``scratch_environ``'s, the environment's bin first on PATH, the Hugging Face hub
        offline, and temporary files in a short directory (``childenv.short_dir``; the caller
        removes it): the datasets library's worker manager listens on an AF_UNIX socket
        there, whose path may not exceed 107 bytes."""
        env = scratch_environ(Path(workdir).resolve())
        env["PATH"] = os.pathsep.join([os.fspath(self.python.parent), env.get("PATH", "")])
        tmp = os.fspath(short_dir(workdir, CLIENT_TMP_PREFIX))
        env.update({"TMPDIR": tmp, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
        return env


def _pinned_version(requirement: str) -> str:
    spec = list(Requirement(requirement).specifier)
    if len(spec) != 1 or spec[0].operator != "==":
        raise ClientEnvError(f"client {requirement!r}: pin one version (name==version)")
    return spec[0].version


def constraints_path(requirement: str, project: Path | None = None) -> Path | None:
    """The committed constraints file of the client environment for ``requirement``."""
    version = _pinned_version(requirement)
    name = canonicalize_name(Requirement(requirement).name)
    return envbuild.project_constraints(f"client-{name}-{version}.txt", project)


def recipe(requirement: str, *, pinned: bool = True) -> ClientRecipe:
    _pinned_version(requirement)
    cfile, ctext = "", ""
    path = constraints_path(requirement) if pinned else None
    if path is not None and path.is_file():
        cfile, ctext = f"{CONSTRAINTS_DIR}/{path.name}", path.read_text()
    return ClientRecipe(FORMAT, PYTHON, requirement, cfile, ctext)


def load(path: Path) -> ClientEnv | None:
    """The complete environment at ``path``, or None when absent or unfinished."""
    return envbuild.load_env(path, ClientEnv, "version")


def ensure_client_env(
    requirement: str,
    *,
    seed_constraints: str = "",
    rebuild: bool = False,
    pinned: bool = True,
) -> ClientEnv:
    """The client environment of ``requirement``: the cached one, else built now (retiring
    the pipeline's previous one). ``seed_constraints`` (constraints text) applies where no
    constraints file pins the set: what ``--freeze`` resolves against (the engine
    environment's torch)."""
    rec = recipe(requirement, pinned=pinned)
    if not rec.constraints and seed_constraints:
        rec = ClientRecipe(FORMAT, PYTHON, requirement, "(seed)", seed_constraints)
    return envbuild.ensure_env(
        rec,
        f"the client environment {rec.hash} ({rec.requirement})",
        lambda staging: _build(rec, staging),
        load,
        rebuild=rebuild,
        slot=f"client-env {rec.name}"
        + ("" if rec.constraints_file.endswith(".txt") else " unpinned"),
        tag="clientenv",
    )


def _build(rec: ClientRecipe, staging: Path) -> dict:
    util.info(f"clientenv: building {rec.hash} for {rec.requirement} in {staging}")
    if not rec.constraints:
        util.info(
            f"clientenv: no constraints file for {rec.requirement}: resolving freely. Pin it "
            "with `vllm-overlay testenv --client REQ --freeze` and commit the file."
        )
    v = envbuild.build_venv(staging, rec.python)
    args = [*v.constraints_args(rec.constraints), rec.requirement]
    try:
        out = v.installer.install(v.python, args, v.env, hint="")
    except OverlayError as e:
        raise ClientEnvError(
            f"the client environment of {rec.requirement} cannot be built"
            + (f" with the set pinned in {rec.constraints_file}" if rec.constraints_file else "")
            + f": {e}"
        ) from e
    (version,) = envbuild.printed(
        v, f"import importlib.metadata as m; print(m.version({rec.name!r}))"
    )
    return envbuild.finish_venv(
        v, staging, out, rec.to_json(), "clientenv", recipe_hash=rec.hash, version=version
    )


def freeze_constraints(env: ClientEnv, rec: ClientRecipe) -> str:
    """The constraints file text that pins ``env``'s packages (the requirement left out)."""
    lines = envbuild.pinned_lines(env.path / FREEZE, [rec.name])
    head = (
        f"# The client environment of {rec.requirement}: the exact set every build installs\n"
        "# with it. Generated by `vllm-overlay testenv --client REQ --freeze`; regenerate it\n"
        "# the same way (to take newer versions) and commit it.\n"
    )
    return head + "".join(f"{ln}\n" for ln in lines)
