"""The CPU test environment in which vLLM's own tests run from a source tree.

A virtualenv, cached under ``cache_dir()/testenv/<recipe hash>``, that holds what vLLM's
test code imports; vLLM itself is *not* installed in it: it comes from the tree under test
through ``PYTHONPATH``, so the same environment serves the pristine and the patched tree.

Which torch, and why
--------------------
vLLM 0.24.0 pins ``torch==2.11.0``. On the package index we reach, that is the CUDA build:
about 4.7 GB with its NVIDIA libraries, for machines that have no GPU. The environment
installs ``torch==2.13.0`` instead, the CPU build that pip finds through its configuration
(a local wheel directory here; elsewhere point pip at PyTorch's CPU wheel index, or it picks
the CUDA build of 2.13.0 from the index: it still works, only larger). vLLM's Python code
at 0.24.0 runs its kv_connector unit tests under it (no compiled ``vllm._C`` is needed for
them). The exact torch in an environment is recorded as ``TestEnv.torch_version``.

What else goes in
-----------------
- the requirement lines of the tree's ``requirements/common.txt`` (read at build time, so
  a tree whose requirements change gets a new environment);
- the test tooling: pytest, pytest-asyncio, pytest-timeout, pytest-xdist (the suite's
  workers), tblib, and ``ray==2.48.0`` and ``msgpack==1.1.0`` (the pins of vLLM's
  ``requirements/test/cuda.txt``; collecting the kv_connector tests imports both);
- a tiny generated package whose ``vllm.platform_plugins`` entry point names
  ``vllm.platforms.cpu.CpuPlatform``. Without it a source tree resolves no platform and
  vLLM's ``tests/conftest.py`` calls ``torch.accelerator.empty_cache()``, which raises on a
  machine without an accelerator;
- for a tree that refuses x86 without Triton (vLLM 0.34.0 and later: "vLLM on x86 CPUs
  requires Triton (triton-cpu)"; ``needs_triton_cpu``), what its platform detection reads to
  take Triton's CPU backend: the test-only Triton backend named ``cpu``
  (``envs/tritoncpu.py``; every process of the environment then runs under Triton's
  interpreter, ``TRITON_INTERPRET=1``), and a metadata-only distribution named ``vllm`` whose
  version carries ``+cpu`` (``vllm_version_matches_substr("cpu")``: vLLM itself still comes
  from the tree), found first in every process (``put_version_first``: the tree's own
  ``vllm.egg-info`` says no ``+cpu``). Without them every test that builds a config died at
  start;
- a config-only Hugging Face cache for ``facebook/opt-125m`` (the model vLLM's connector
  tests build configs from). The hub is never contacted (``HF_HUB_OFFLINE=1``); without the
  cache every such test fails, and without offline mode each spends ~23 s in DNS retries.

The generated files (the plugin, the metadata-only distribution and its finder, the
Hugging Face cache) are written by ``testfiles.py``.

Everything that decides the environment is in ``Recipe``; its hash names the directory.
It is built and cached by ``envbuild.ensure`` (aside, under a lock, renamed into place with
a marker written last), the one builder the engine environment (``enginenv``) uses too.
"""

from __future__ import annotations

import email.parser
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.utils import canonicalize_name

from vllm_overlay import util
from vllm_overlay.envs import envbuild, installer, layout, testfiles, tritoncpu
from vllm_overlay.envs.childenv import scratch_environ
from vllm_overlay.envs.envbuild import (  # noqa: F401 (re-exported)
    CONSTRAINTS_DIR,
    FREEZE,
    MARKER,
    PYTHON,
    VENV,
    root,
)
from vllm_overlay.errors import OverlayError
from vllm_overlay.wheel import cpufacts

FORMAT = layout.FORMATS["test-env"]  # bumped there (the cache reads it)

TORCH = "torch==2.13.0"
TEST_TOOLS = (
    "pytest==9.2.0",
    "pytest-asyncio==1.5.0",
    "pytest-timeout==2.4.0",
    "pytest-xdist==3.8.0",  # vllm-overlay suite: workers; a crashing test fails alone
    "tblib==3.2.2",
    # Pins of vLLM 0.24.0's requirements/test/cuda.txt; test collection imports both.
    "ray==2.48.0",
    "msgpack==1.1.0",
)
REQUIREMENTS_FILE = "requirements/common.txt"


def needs_triton_cpu(tree: Path) -> bool:
    """Whether vLLM at ``tree`` refuses to start on x86 without Triton's CPU backend."""
    path = Path(tree) / cpufacts.CPU_PLATFORM
    return path.is_file() and cpufacts.refuses_x86_without_triton(path.read_text(errors="replace"))


@dataclass(frozen=True)
class Recipe(envbuild.RecipeJson):
    """Everything that decides the environment's content; ``hash`` names it."""

    format: int
    python: str
    torch: str
    requirements: tuple[str, ...]
    test_tools: tuple[str, ...]
    plugin_files: tuple[tuple[str, str], ...]
    hf_models: tuple[tuple[str, str], ...]  # (repo id, config.json text)
    upstream: str = ""  # "vllm 0.24.0", from the tree's PKG-INFO; "" when it has none
    constraints_file: str = ""  # e.g. constraints/testenv-vllm-0.24.0.txt; "": resolved freely
    constraints: str = ""  # that file's text: the exact set every build installs
    # A tree that requires Triton on x86: the test-only backend's files and the version the
    # metadata-only vllm distribution says ("0.34.0+cpu"); empty for other trees.
    triton_files: tuple[tuple[str, str], ...] = ()
    cpu_version: str = ""

    def install_args(
        self, plugin_dir: Path, requirements_file: Path, constraints_file: Path | None = None,
        local: Sequence[Path] = (),
    ) -> list[str]:  # fmt: skip
        return [
            *(["-c", os.fspath(constraints_file)] if constraints_file else []),
            self.torch,
            "-r",
            os.fspath(requirements_file),
            *self.test_tools,
            os.fspath(plugin_dir),
            *(("triton",) if self.cpu_version else ()),  # the backend's own Triton (pinned)
            *map(os.fspath, local),
        ]


@dataclass(frozen=True)
class TestEnv:
    """A built, complete test environment."""

    __test__ = False  # not a pytest test class

    path: Path
    python: Path
    recipe_hash: str
    torch_version: str
    triton_interpret: bool = False  # holds the test-only Triton backend: TRITON_INTERPRET=1

    def environ(self, workdir: Path, tree: Path) -> dict[str, str]:
        """The environment for running vLLM's pytest from ``tree`` with this env.

        Based on ``scratch_environ``: no variable that would leak another Python setup into
        the run; temporary files and compile caches under ``workdir`` (created here), Ray's
        session files in a short directory (its socket paths); the Hugging Face hub is offline and reads the
        config-only cache in the environment. Bytecode is cached as usual, in the tree's
        ``__pycache__`` directories (ignored by vLLM's .gitignore): a bytecode prefix would
        also move torch's, and recompiling it costs about a minute a run.
        """
        workdir = Path(workdir).resolve()
        tree = Path(tree).resolve()
        env = scratch_environ(workdir)
        dirs = {
            "TORCHINDUCTOR_CACHE_DIR": workdir / "inductor",
            "TRITON_CACHE_DIR": workdir / "triton",
            "VLLM_CACHE_ROOT": workdir / "vllm-cache",
        }
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        env.update({k: os.fspath(v) for k, v in dirs.items()})
        env.update(
            {
                "PYTHONPATH": os.fspath(tree),
                "PATH": os.pathsep.join([os.fspath(self.python.parent), env.get("PATH", "")]),
                "HF_HOME": os.fspath(self.path / testfiles.HF_HOME),
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "HF_HUB_DISABLE_TELEMETRY": "1",
                "VLLM_TARGET_DEVICE": "cpu",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "RAY_USAGE_STATS_ENABLED": "0",
            }
        )
        if self.triton_interpret:  # the "cpu" backend is there: its processes interpret
            env[tritoncpu.INTERPRET[0]] = tritoncpu.INTERPRET[1]
        return env


def _requirement_lines(path: Path, seen: tuple[Path, ...] = ()) -> list[str]:
    """Requirement lines of a pip requirements file: comments and blanks dropped,
    ``-r`` includes followed; any other pip option is refused."""
    if path in seen:
        chain = " -> ".join(map(str, (*seen, path)))
        raise OverlayError(f"requirements files include each other: {chain}")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise OverlayError(
            f"{path} not found: a vLLM source tree has {REQUIREMENTS_FILE}. "
            "Pass the root of an unpacked vLLM tree (--tree DIR)."
        ) from None
    lines: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        # pip's rule: '#' starts a comment at the line start or after whitespace.
        if line.startswith("#"):
            continue
        for sep in (" #", "\t#"):
            if sep in line:
                line = line.split(sep, 1)[0].rstrip()
        if not line:
            continue
        if line.startswith(("-r ", "--requirement ")):
            include = line.split(None, 1)[1].strip()
            lines.extend(_requirement_lines(path.parent / include, (*seen, path)))
        elif line.startswith("-"):
            raise OverlayError(
                f"{path}: unsupported pip option line {line!r}; the test environment "
                "only follows plain requirements and -r includes."
            )
        else:
            lines.append(" ".join(line.split()))
    return lines


def tree_release(tree: Path) -> tuple[str, str] | None:
    """(name, version) of a vLLM source tree, from the PKG-INFO its sdist has; None without."""
    try:
        meta = email.parser.Parser().parsestr((Path(tree) / "PKG-INFO").read_text(errors="replace"))
    except (FileNotFoundError, NotADirectoryError):
        return None
    name, version = meta.get("Name"), meta.get("Version")
    return (canonicalize_name(name), version) if name and version else None


def constraints_path(name: str, version: str, project: Path | None = None) -> Path | None:
    """The committed constraints file of the test environment for ``name`` ``version``,
    in the overlay project's constraints/ directory (None outside a project)."""
    return envbuild.project_constraints(f"testenv-{name}-{version}.txt", project)


def recipe(tree: Path, *, pinned: bool = True) -> Recipe:
    """The recipe of the test environment for the vLLM source tree ``tree``.

    ``pinned``: install exactly the set in the project's constraints file for the tree's
    release, when there is one (else, or with ``pinned=False``, resolve freely).
    """
    tree = Path(tree)
    release = tree_release(tree)
    upstream, cfile, ctext = "", "", ""
    if release is not None:
        upstream = " ".join(release)
        path = constraints_path(*release) if pinned else None
        if path is not None and path.is_file():
            cfile, ctext = f"{CONSTRAINTS_DIR}/{path.name}", path.read_text()
    triton = needs_triton_cpu(tree)
    version = release[1] if release is not None else "0"
    return Recipe(
        triton_files=tritoncpu.FILES if triton else (),
        cpu_version=f"{version}+cpu" if triton else "",
        format=FORMAT,
        python=PYTHON,
        torch=TORCH,
        requirements=tuple(_requirement_lines(tree / REQUIREMENTS_FILE)),
        test_tools=TEST_TOOLS,
        plugin_files=testfiles.PLUGIN_FILES,
        hf_models=tuple(
            (repo, json.dumps(config, indent=2, sort_keys=True) + "\n")
            for repo, config in testfiles.HF_MODELS
        ),
        upstream=upstream,
        constraints_file=cfile,
        constraints=ctext,
    )


def lock_path(rec: Recipe) -> Path:
    """One lock per recipe: builds of different environments do not wait for each other."""
    return envbuild.lock_path(rec.hash)


def load(path: Path) -> TestEnv | None:
    """The complete environment at ``path``, or None when absent or unfinished."""
    return envbuild.load_env(path, TestEnv, "torch_version", "triton_interpret")


def slot(rec: Recipe) -> str:
    """A new recipe for the same release (new constraints, a new format) supersedes the old
    one; a tree without a release is a slot of its own, and so is the freely resolved
    environment (`--freeze`) beside the pinned one."""
    return f"test-env {rec.upstream or rec.hash}" + ("" if rec.constraints_file else " unpinned")


def ensure_testenv(tree: Path, *, rebuild: bool = False, pinned: bool = True) -> TestEnv:
    """The test environment for ``tree``: the cached one, else built now (half a minute with
    uv, a minute or two with pip).

    Returns at once, without calling an installer, when the environment for this recipe
    exists and is complete. ``rebuild`` builds it anew and replaces the cached one;
    ``pinned=False`` ignores the constraints file (see ``recipe``).
    """
    rec = recipe(tree, pinned=pinned)
    env = envbuild.ensure_env(
        rec, f"the test environment {rec.hash}", lambda staging: _build(rec, staging), load,
        rebuild=rebuild, slot=slot(rec), tag="testenv",
    )  # fmt: skip
    util.info(f"testenv: torch {env.torch_version}")
    return env


def _build(rec: Recipe, staging: Path) -> dict:
    """Build the environment of ``rec`` in ``staging``; returns its marker."""
    how = "uv, half a minute" if installer.installer().uv else "pip, a minute or two"
    util.info(f"testenv: building {rec.hash} in {staging} ({how})")
    if rec.constraints_file:
        util.info(f"testenv: installing exactly the set pinned in {rec.constraints_file}")
    elif rec.upstream:
        util.info(
            f"testenv: no constraints file for {rec.upstream}: resolving freely (other "
            "machines may get other versions). Pin it with `vllm-overlay testenv --tree DIR "
            "--freeze` and commit the file."
        )
    else:
        util.info("testenv: the tree has no PKG-INFO (no release): resolving freely")
    v = envbuild.build_venv(staging, rec.python, uv_cache=False)
    plugin_dir = v.src / testfiles.PLUGIN_DIST
    for name, text in rec.plugin_files:
        util.atomic_write_text(plugin_dir / name, text)
    local: list[Path] = []
    if rec.cpu_version:  # Triton's CPU backend (test-only) and what vLLM reads to take it
        util.info(f"testenv: the tree requires Triton on x86: the test-only Triton backend "
                  f"and a metadata-only {testfiles.MARKER_DIST}=={rec.cpu_version}, under "
                  f"{'='.join(tritoncpu.INTERPRET)}")  # fmt: skip
        for rel, text in rec.triton_files:
            util.atomic_write_text(v.src / tritoncpu.NAME / rel, text)
        for rel, text in testfiles.version_marker_files(rec.cpu_version):
            util.atomic_write_text(v.src / "vllm-version-marker" / rel, text)
        local = [v.src / tritoncpu.NAME, v.src / "vllm-version-marker"]
    requirements_file = v.src / "requirements.txt"
    util.atomic_write_text(requirements_file, "".join(f"{r}\n" for r in rec.requirements))
    constraints = v.constraints_args(rec.constraints)
    constraints_file = Path(constraints[1]) if constraints else None

    n = len(rec.requirements) + len(rec.test_tools) + 2
    util.info(f"testenv: {v.installer.name} install {rec.torch} and {n - 1} other requirements")
    out = v.installer.install(
        v.python,
        rec.install_args(plugin_dir, requirements_file, constraints_file, local),
        v.env,
        hint=f"{v.installer.name} could not install the test environment; see its output "
        "above. Nothing was kept; run it again once the cause is fixed.",
    )
    if rec.cpu_version:
        (site,) = envbuild.printed(v, "import sysconfig; print(sysconfig.get_paths()['purelib'])")
        testfiles.put_version_first(Path(site))
    (torch_version,) = envbuild.printed(v, "import torch; print(torch.__version__)")
    testfiles.write_hf_cache(staging / testfiles.HF_HOME, rec.hf_models)
    return envbuild.finish_venv(
        v, staging, out, rec.to_json(), "testenv", recipe_hash=rec.hash,
        torch_version=torch_version, triton_interpret=bool(rec.cpu_version),
    )  # fmt: skip


def freeze_constraints(env: TestEnv, rec: Recipe) -> str:
    """The constraints file text that pins ``env``'s packages (the generated plugin left out)."""
    lines = envbuild.pinned_lines(
        env.path / FREEZE, [testfiles.PLUGIN_DIST, tritoncpu.DIST, testfiles.MARKER_DIST]
    )
    head = (
        f"# The CPU test environment of {rec.upstream}: the exact set every build installs.\n"
        "# Generated by `vllm-overlay testenv --tree DIR --freeze`; regenerate it the same way\n"
        "# (after a rebase, or to take newer versions) and commit it. See docs/testenv.md.\n"
    )
    return head + "".join(f"{ln}\n" for ln in lines)
