"""One side of a suite run: vLLM's tests of one tree, in one environment, as results.

How one side runs (``run_side``), the same for both sides and both modes:
1. a scratch directory ``<work>/runs/<side>/``, made anew;
2. ``root/``: a copy of the tree's ``tests/``, of what they read by path (``examples/``) and
   of its pytest configuration: the tests run from there, so the tree gets nothing but
   bytecode in its (ignored) ``__pycache__``;
3. the code under test: the tree itself (``tree`` mode), or a wheel installed with
   ``uv pip install --no-deps --target site/`` (pip without uv; ``wheel`` mode, for GPU
   machines); it goes first on PYTHONPATH. This is the only step in which the modes differ;
4. a preflight import of pytest, its plugins and vllm (a missing package is named);
5. pytest with pytest-xdist workers (a crashed test fails alone) and a per-test timeout,
   from ``cwd/``, through the one runner (``runner.run_pytest``: our plugin for markers,
   progress and a hard watchdog, a JUnit report, Ray's sockets in a short path).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay import process, util
from vllm_overlay.envs import childenv, installer, testenv
from vllm_overlay.errors import SuiteError, UsageError
from vllm_overlay.testing import contract, runner
from vllm_overlay.testing.junit import TestResult

DEFAULT_TIMEOUT = 120  # seconds per test; the slowest test at 0.24.0 takes ~7 s here
HARD_TIMEOUT_GRACE = 60  # the watchdog fires this long after the per-test timeout
DEFAULT_WORKERS = 2
RUN_LIMIT = 3 * 3600  # a whole pytest run; only a wedged pytest itself gets near it
PYTEST_CONFIGS = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")
# Directories of the tree that its tests read by path from the root, copied beside tests/
# (0.34.0's mooncake and MoRIIO proxy tests load their proxy scripts from examples/: 19
# tests failed on both sides without it, 4 of them marked cpu_test upstream).
TREE_DATA = ("examples",)


# --- environments ------------------------------------------------------------------------


@dataclass(frozen=True)
class RunEnv:
    """A Python environment the tests run in; vLLM comes from ``code_root`` on PYTHONPATH."""

    python: Path
    recipe: str  # identifies the environment's content (part of the baseline key)
    description: str
    environ: Callable[[Path, Path], dict[str, str]]  # (scratch dir, code root) -> variables


EnvProvider = Callable[[Path], RunEnv]  # the patched tree -> the environment for both sides


def testenv_provider(tree: Path) -> RunEnv:
    """The CPU test environment (vllm_overlay.envs.testenv), built from the tree's requirements."""
    env = testenv.ensure_testenv(tree)
    return RunEnv(
        python=env.python,
        recipe=f"testenv:{env.recipe_hash}",
        description=f"testenv {env.recipe_hash} (torch {env.torch_version})",
        environ=env.environ,
    )


def python_provider(python: Path) -> EnvProvider:
    """An existing environment (on a GPU machine: one with the wheel's CUDA torch)."""

    python = Path(os.path.abspath(python))  # not resolved: a venv's python is a symlink

    def provide(tree: Path) -> RunEnv:
        if not python.exists():
            raise UsageError(f"--python {python}: no such interpreter.")
        listing = process.run(
            python,
            "-c",
            "import importlib.metadata as m, sys; print(sys.version.split()[0]); "
            "print('\\n'.join(sorted(f'{d.metadata[\"Name\"]}=={d.version}' "
            "for d in m.distributions())))",
            env=childenv.clean_environ(),
            hint=f"{python} could not run; pass a working Python interpreter to --python.",
        ).stdout
        digest = util.sha256_bytes(listing.encode())[:16]
        version = listing.splitlines()[0] if listing else "?"
        return RunEnv(
            python=python,
            recipe=f"python:{digest}",
            description=f"{python} (Python {version}, packages {digest})",
            environ=_plain_environ,
        )

    return provide


def _plain_environ(scratch: Path, code_root: Path) -> dict[str, str]:
    env = childenv.scratch_environ(scratch)  # bytecode stays where it is: see testenv
    env["PYTHONPATH"] = os.fspath(code_root)
    return env


# --- running one side --------------------------------------------------------------------


@dataclass(frozen=True)
class RunOptions:
    timeout: int = DEFAULT_TIMEOUT
    workers: int = DEFAULT_WORKERS

    def key(self) -> dict[str, int]:
        return {"timeout": self.timeout, "workers": self.workers}


@dataclass(frozen=True)
class Side:
    name: str  # "baseline" | "patched"
    tree: Path  # the tests come from here (and the code, unless a wheel is given)
    selection: tuple[str, ...]
    wheel: Path | None = None
    deselect: tuple[str, ...] = ()  # collect these but do not run them (a targeted baseline)


@dataclass
class SideRun:
    """The outcome of one side: per-test results, what was collected, the JUnit text."""

    name: str
    results: dict[str, TestResult]
    collected: tuple[str, ...]
    junit_xml: str
    seconds: float
    cached: bool = False
    returncode: int = 0
    log: Path | None = None
    selection: tuple[str, ...] = ()
    deselected: tuple[str, ...] = ()  # collected but not run, as asked (Side.deselect)

    @property
    def not_run(self) -> tuple[str, ...]:
        return tuple(n for n in self.collected if n not in self.results)


@dataclass(frozen=True)
class Scratch:
    """The directories of one side's run."""

    base: Path

    @property
    def root(self) -> Path:  # the copy of tests/ and the pytest configuration
        return self.base / "root"

    @property
    def cwd(self) -> Path:
        return self.base / "cwd"

    @property
    def files(self) -> runner.RunFiles:  # the JUnit report, the log, the plugin and its output
        return runner.RunFiles(self.base)

    @property
    def site(self) -> Path:  # wheel mode: the installed wheel
        return self.base / "site"

    @property
    def env(self) -> Path:  # TMPDIR and the caches
        return self.base / "env"

    def make(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)
        for d in (self.root, self.cwd, self.env):
            d.mkdir(parents=True)


def empty_run(name: str) -> SideRun:
    return SideRun(name=name, results={}, collected=(), junit_xml=_EMPTY_JUNIT, seconds=0.0)


_EMPTY_JUNIT = '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="0"/></testsuites>\n'


def run_side(side: Side, env: RunEnv, scratch: Scratch, opts: RunOptions) -> SideRun:
    """Run ``side``'s selection in ``env``; a failing test is a result, not an exception."""
    if not side.selection:
        return empty_run(side.name)
    scratch.make()
    config = copy_tests(side.tree, scratch.root)
    code_root = side.tree if side.wheel is None else install_wheel(env, side.wheel, scratch)
    environ = env.environ(scratch.env, code_root)
    preflight(env, environ, scratch, code_root, opts)
    if side.deselect:
        listed = scratch.base / "deselect.txt"
        util.atomic_write_text(listed, "".join(f"{n}\n" for n in side.deselect))
        environ[contract.DESELECT_ENV] = os.fspath(listed)
    run = runner.run_pytest(
        env.python,
        pytest_args(side, scratch, config, opts),
        cwd=scratch.cwd,
        environ=environ,
        files=scratch.files,
        label=f"suite: {side.name}",
        limit=RUN_LIMIT,
        hard_timeout=opts.timeout + HARD_TIMEOUT_GRACE,
    )
    # pytest's exit 5 (no tests ran) is a result when it collected tests and we deselected all.
    finished = (0, 1, 5) if run.deselected else (0, 1)
    if run.returncode not in finished or run.junit is None:
        raise SuiteError(
            f"pytest on the {side.name} tree did not finish (exit code {run.returncode}, "
            f"{'no' if run.junit is None else 'a'} JUnit report). The end of its "
            f"log ({run.log}):\n{runner.tail(run.log)}\nFix the cause and run it again."
        )
    return SideRun(
        name=side.name,
        results=run.results,
        collected=run.collected,
        junit_xml=run.junit.read_text(errors="replace"),
        seconds=run.seconds,
        returncode=run.returncode,
        log=run.log,
        selection=side.selection,
        deselected=run.deselected,
    )


def copy_tests(tree: Path, root: Path) -> Path:
    """Copy the tree's tests/, what they read from the tree by path (``TREE_DATA``) and its
    pytest configuration into ``root``; returns the config."""
    if not (tree / "tests").is_dir():
        raise UsageError(f"{tree} has no tests/ directory: pass the root of a vLLM tree.")
    for name in ("tests", *TREE_DATA):
        if (tree / name).is_dir():
            shutil.copytree(
                tree / name, root / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
            )
    for name in PYTEST_CONFIGS:
        if (tree / name).is_file():
            shutil.copy2(tree / name, root / name)
    for name in PYTEST_CONFIGS:
        if _has_pytest_config(root / name):
            return root / name
    util.atomic_write_text(root / "pytest.ini", "[pytest]\n")  # so no config above is used
    return root / "pytest.ini"


def _has_pytest_config(path: Path) -> bool:
    if not path.is_file():
        return False
    if path.name in ("pytest.ini", ".pytest.ini"):
        return True
    text = path.read_text(errors="replace")
    heading = {
        "pyproject.toml": "[tool.pytest.ini_options]",
        "tox.ini": "[pytest]",
        "setup.cfg": "[tool:pytest]",
    }[path.name]
    return heading in text


def install_wheel(env: RunEnv, wheel: Path, scratch: Scratch) -> Path:
    """Install the wheel's files (not its dependencies) into ``scratch.site``."""
    util.info(f"suite: installing {wheel.name} into {scratch.site}")
    inst = installer.installer()
    args = ["--quiet", "--no-deps", "--target", os.fspath(scratch.site), os.fspath(wheel)]
    inst.install(
        env.python,
        args if inst.uv else ["--no-compile", *args],
        inst.env(childenv.clean_environ()),
        hint=f"{inst.name} could not install {wheel} for the test environment ({env.python}).",
    )
    return scratch.site


_PREFLIGHT = """\
import importlib, json, sys
for name in sys.argv[1:]:
    try:
        mod = importlib.import_module(name)
    except BaseException as e:
        missing = getattr(e, "name", None) if isinstance(e, ImportError) else None
        print(json.dumps({"failed": name, "missing": missing, "error": f"{type(e).__name__}: {e}"}))
        sys.exit(3)
import vllm
print(json.dumps({"vllm": vllm.__file__, "version": getattr(vllm, "__version__", "?")}))
"""


def preflight(
    env: RunEnv, environ: dict, scratch: Scratch, code_root: Path, opts: RunOptions
) -> None:
    """Import what the run needs; say exactly what is missing before minutes are spent."""
    modules = ["pytest", "pytest_timeout", *(["xdist"] if opts.workers else []), "vllm"]
    out = process.run(
        env.python, "-c", _PREFLIGHT, *modules, cwd=scratch.cwd, env=environ, check=False
    )
    try:
        doc = json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise SuiteError(
            f"the test environment ({env.description}) could not even start Python:\n"
            f"{out.stderr.strip()[-2000:]}"
        ) from None
    if "failed" in doc:
        raise SuiteError(_preflight_message(env, doc))
    imported = Path(doc["vllm"]).resolve()
    if not imported.is_relative_to(code_root.resolve()):
        raise SuiteError(
            f"the test environment imports vllm from {imported}, not from the code under test "
            f"({code_root}). Remove vllm from that environment (pip uninstall vllm) or use "
            "another one."
        )


def _preflight_message(env: RunEnv, doc: dict) -> str:
    name, missing, error = doc["failed"], doc.get("missing"), doc["error"]
    what = f"the package that provides {missing!r} is missing" if missing else error
    if name == "vllm":
        return (
            f"the test environment ({env.description}) cannot import vllm: {error}. "
            f"Missing: {missing or 'see the error'}. Rebuild it (`vllm-overlay testenv --tree "
            "DIR --rebuild`), or with --python, install vLLM's requirements into it."
        )
    package = {"pytest_timeout": "pytest-timeout", "xdist": "pytest-xdist"}.get(name, name)
    return (
        f"the test environment ({env.description}) cannot import {name}: {what}. "
        f"Install {package} into it, or pass --workers 0 to run without pytest-xdist."
        if name == "xdist"
        else f"the test environment ({env.description}) cannot import {name}: {what}. "
        f"Install {package} into it."
    )


def pytest_args(side: Side, scratch: Scratch, config: Path, opts: RunOptions) -> list[str]:
    """The suite's own pytest arguments (the runner adds the plugin and the JUnit report)."""
    args = [
        *(os.fspath(scratch.root / e) for e in side.selection),
        "-c",
        os.fspath(config),
        "--rootdir",
        os.fspath(scratch.root),
        "--continue-on-collection-errors",
        "--timeout",
        str(opts.timeout),
        "--timeout-method",
        "signal",
    ]
    if opts.workers:
        args += ["-n", str(opts.workers)]
    return args
