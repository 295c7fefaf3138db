"""vLLM's own tests on the patched tree, compared with the same run on pristine upstream.

On a machine without a GPU many of vLLM's tests fail for reasons unrelated to the
overlay, so the verdict is a comparison: the same selection, in the same environment, on
pristine upstream (the baseline) and on the patched tree. See docs/suite.md.

How one side runs (``run_side``), the same for both sides and both modes:
1. a scratch directory ``<work>/runs/<side>/``, made anew;
2. ``root/``: a copy of the tree's ``tests/`` and its pytest configuration: the tests run
   from there, so the tree gets nothing but bytecode in its (ignored) ``__pycache__``;
3. the code under test: the tree itself (``tree`` mode), or a wheel installed with
   ``uv pip install --no-deps --target site/`` (pip without uv; ``wheel`` mode, for GPU machines); it goes
   first on PYTHONPATH. This is the only step in which the modes differ;
4. a preflight import of pytest, its plugins and vllm (a missing package is named);
5. pytest with pytest-xdist workers (a crashed test fails alone) and a per-test timeout,
   from ``cwd/``, through the one runner (``runner.run_pytest``: our plugin for markers,
   progress and a hard watchdog, a JUnit report, Ray's sockets in a short path).

The baseline is cached under ``cache_dir()/suite-baselines/<key>.json``, keyed by the
upstream pin, the environment's recipe, the selection, the run options and the source of
this module and the plugin (a change to how a side runs invalidates cached baselines).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay import util
from vllm_overlay.errors import SuiteError, UsageError
from vllm_overlay.gitrepo import git
from vllm_overlay.overlay.checkout import apply_overlay
from vllm_overlay.overlay.model import Overlay
from vllm_overlay.overlay.project import Project
from vllm_overlay.pin.artifacts import ensure_artifact
from vllm_overlay.pin.lockfile import Lock
from vllm_overlay.pin.trees import upstream_repo
from vllm_overlay.testing import installer, runner, testenv
from vllm_overlay.testing import plugin as suite_plugin
from vllm_overlay.testing.junit import JunitError, TestResult, parse_junit
from vllm_overlay.testing.report import Comparison, RunInfo, RunView, compare, render_text, to_json

DEFAULT_SELECTION = ("tests/v1/kv_connector/unit",)
DEFAULT_TIMEOUT = 120  # seconds per test; the slowest test at 0.24.0 takes ~7 s here
HARD_TIMEOUT_GRACE = 60  # the watchdog fires this long after the per-test timeout
DEFAULT_WORKERS = 2
RUN_LIMIT = 3 * 3600  # a whole pytest run; only a wedged pytest itself gets near it
FORMAT = 1  # of the cached baseline entry
PYTEST_CONFIGS = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")

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
    """The CPU test environment (vllm_overlay.testing.testenv), built from the tree's requirements."""
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
        listing = util.run(
            python,
            "-c",
            "import importlib.metadata as m, sys; print(sys.version.split()[0]); "
            "print('\\n'.join(sorted(f'{d.metadata[\"Name\"]}=={d.version}' "
            "for d in m.distributions())))",
            env=testenv.clean_environ(),
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
    env = testenv.scratch_environ(scratch)  # bytecode stays where it is: see testenv
    env["PYTHONPATH"] = os.fspath(code_root)
    return env


# --- selection ---------------------------------------------------------------------------


def default_selection(overlay_tests: tuple[str, ...]) -> tuple[str, ...]:
    """vLLM's kv_connector unit tests plus the overlay's tests that are not inside them."""
    extra = [t for t in overlay_tests if not any(_inside(t, d) for d in DEFAULT_SELECTION)]
    return (*DEFAULT_SELECTION, *dict.fromkeys(extra))


def _inside(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _file_part(entry: str) -> str:
    return entry.split("::", 1)[0]


def check_selection(tree: Path, selection: tuple[str, ...]) -> tuple[str, ...]:
    """The selection, normalised; a path that the tree under test lacks is a usage error."""
    out = []
    for entry in selection:
        file_part = _file_part(entry).strip().rstrip("/")
        rel = Path(file_part)
        if not file_part or rel.is_absolute() or ".." in rel.parts:
            raise UsageError(
                f"--tests {entry!r}: give a path inside the vLLM tree, relative to its root "
                "(e.g. tests/v1/kv_connector/unit)."
            )
        if not (tree / rel).exists():
            raise UsageError(
                f"--tests {entry!r}: {tree / rel} does not exist in the tree under test. "
                "Paths are relative to the vLLM tree's root (e.g. tests/v1/kv_connector/unit)."
            )
        out.append(rel.as_posix() + entry[len(_file_part(entry)) :])
    return tuple(dict.fromkeys(out))


def baseline_selection(pristine: Path, selection: tuple[str, ...]) -> tuple[str, ...]:
    """The selection without the paths pristine upstream does not have (files we add)."""
    return tuple(e for e in selection if (pristine / _file_part(e)).exists())


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
    if run.returncode not in (0, 1) or run.junit is None:
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
    )


def copy_tests(tree: Path, root: Path) -> Path:
    """Copy the tree's tests/ and pytest configuration into ``root``; returns the config."""
    if not (tree / "tests").is_dir():
        raise UsageError(f"{tree} has no tests/ directory: pass the root of a vLLM tree.")
    shutil.copytree(
        tree / "tests", root / "tests", ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
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
        inst.env(testenv.clean_environ()),
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
    out = util.run(
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


# --- the baseline cache ------------------------------------------------------------------


@dataclass(frozen=True)
class BaselineKey:
    inputs: dict = field(hash=False)

    @property
    def digest(self) -> str:
        text = json.dumps(self.inputs, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:24]


def baseline_key(
    upstream: dict, code: str, env: RunEnv, selection: tuple[str, ...], opts: RunOptions
) -> BaselineKey:
    return BaselineKey(
        {
            "format": FORMAT,
            "upstream": upstream,
            "code": code,
            "environment": env.recipe,
            "selection": list(selection),
            "options": opts.key(),
            "runner": _runner_digest(),
        }
    )


def _runner_digest() -> str:
    """This module, the runner and the plugin: a change to how a side runs invalidates
    baselines."""
    h = hashlib.sha256()
    for path in (__file__, runner.__file__, suite_plugin.__file__):
        h.update(Path(path).read_bytes())
    return h.hexdigest()[:16]


def baseline_path(key: BaselineKey) -> Path:
    return util.cache_dir() / "suite-baselines" / f"{key.digest}.json"


def store_baseline(key: BaselineKey, run: SideRun) -> Path:
    path = baseline_path(key)
    doc = {
        "format": FORMAT,
        "key": key.digest,
        "inputs": key.inputs,
        "seconds": round(run.seconds, 1),
        "returncode": run.returncode,
        "collected": list(run.collected),
        "junit_sha256": util.sha256_bytes(run.junit_xml.encode()),
        "junit": run.junit_xml,
    }
    util.atomic_write_text(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return path


class CorruptBaseline(SuiteError):
    """A cached baseline that cannot be trusted; it is rebuilt."""


def load_baseline(key: BaselineKey) -> SideRun | None:
    """The cached baseline for ``key``; None if there is none; CorruptBaseline if unusable."""
    path = baseline_path(key)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise CorruptBaseline(f"{path} cannot be read ({e})") from None
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        if doc.get("format") != FORMAT or doc.get("key") != key.digest:
            raise ValueError("written for another format or key")
        junit_xml, collected = doc["junit"], doc["collected"]
        if util.sha256_bytes(junit_xml.encode()) != doc["junit_sha256"]:
            raise ValueError("its JUnit report does not match its recorded sha256")
        if not all(isinstance(c, str) for c in collected):
            raise ValueError("its list of collected tests is malformed")
        results = parse_junit(junit_xml, f"the JUnit report cached in {path}")
        seconds = float(doc["seconds"])
    except (ValueError, KeyError, TypeError, AttributeError, JunitError) as e:
        raise CorruptBaseline(f"{path} is corrupt ({e})") from None
    return SideRun(
        name="baseline",
        results=results,
        collected=tuple(collected),
        junit_xml=junit_xml,
        seconds=seconds,
        cached=True,
        returncode=int(doc.get("returncode", 0)),
        selection=tuple(key.inputs["selection"]),
    )


# --- the whole comparison ----------------------------------------------------------------

BASELINE_MODES = ("auto", "rerun", "skip")


@dataclass(frozen=True)
class SuiteRequest:
    """What `vllm-overlay suite` was asked to do."""

    checkout: Path | None = None  # test this tree as it is; None: make the patched tree
    tests: tuple[str, ...] = ()  # empty: the default selection
    baseline: str = "auto"  # auto: cached or run; rerun: run and re-cache; skip: none
    wheel: Path | None = None  # wheel mode: vLLM's code from this built wheel
    junit_dir: Path | None = None
    options: RunOptions = RunOptions()
    env_provider: EnvProvider = testenv_provider
    index_url: str | None = None


@dataclass
class SuiteOutcome:
    comparison: Comparison
    runs: dict[str, RunInfo]
    meta: dict
    title: str

    def text(self) -> str:
        return render_text(self.comparison, self.title, self.runs)

    def json(self) -> dict:
        return to_json(self.comparison, self.meta, self.runs)


def run_suite(project: Project, req: SuiteRequest) -> SuiteOutcome:
    """Both sides (the baseline from the cache when it can), compared."""
    if req.baseline not in BASELINE_MODES:
        raise UsageError(f"baseline mode {req.baseline!r}: use one of {BASELINE_MODES}")
    _check_wheel(req.wheel)
    lock, overlay = project.lock(), project.overlay()
    work = project.work_dir / "suite"
    with util.exclusive_lock(work / ".lock", f"the suite work area {work}"):
        patched_tree = _patched_tree(lock, overlay, work, req)
        overlay_tests = tuple(t for c in overlay.changes for t in c.tests)
        selection = check_selection(patched_tree, req.tests or default_selection(overlay_tests))
        env = req.env_provider(patched_tree)
        base_sel = _pristine_selection(lock, selection, req.index_url)
        baseline = _baseline(lock, work, req, env, base_sel)
        patched = run_side(
            Side("patched", patched_tree, selection, req.wheel),
            env,
            Scratch(work / "runs" / "patched"),
            req.options,
        )
        junit = _write_junit(req.junit_dir or work / "junit", baseline, patched)
    views = {
        "baseline": RunView(baseline.results, baseline.collected, ran=req.baseline != "skip"),
        "patched": RunView(patched.results, patched.collected),
    }
    runs = {
        name: RunInfo(run.seconds, run.cached, junit.get(name, ""))
        for name, run in (("baseline", baseline), ("patched", patched))
        if views[name].ran
    }
    cmp = compare(views["baseline"], views["patched"], overlay_tests)
    meta = _meta(lock, selection, base_sel, env, req, patched_tree)
    return SuiteOutcome(cmp, runs, meta, _title(lock, selection, overlay_tests, env, req))


def _check_wheel(wheel: Path | None) -> None:
    if wheel is None:
        return
    if not wheel.is_file() or wheel.suffix != ".whl":
        raise UsageError(
            f"--wheel {wheel}: not a wheel file. Build one with `make build-wheel` "
            "(dist/vllm-…whl) and pass its path."
        )


def _patched_tree(lock: Lock, overlay: Overlay, work: Path, req: SuiteRequest) -> Path:
    if req.checkout is not None:
        if not req.checkout.is_dir():
            raise UsageError(f"--checkout {req.checkout}: not a directory.")
        return req.checkout.resolve()
    dest = work / "trees" / "patched"
    util.info(f"suite: making the patched tree in {dest}")
    apply_overlay(lock, overlay, dest, force=True, index_url=req.index_url)
    return dest


def _pristine_selection(
    lock: Lock, selection: tuple[str, ...], index_url: str | None
) -> tuple[str, ...]:
    """The selection less the paths pristine upstream lacks (asked of its git repo)."""
    repo, base = upstream_repo(lock, index_url=index_url)
    exists = [
        e
        for e in selection
        if git("cat-file", "-e", f"{base}:{_file_part(e)}", cwd=repo, check=False).returncode == 0
    ]
    return tuple(exists)


def _baseline(
    lock: Lock, work: Path, req: SuiteRequest, env: RunEnv, selection: tuple[str, ...]
) -> SideRun:
    if req.baseline == "skip":
        return empty_run("baseline")
    code = "tree" if req.wheel is None else f"wheel:{lock.wheel().sha256}"
    upstream = {
        "name": lock.upstream.name,
        "version": lock.upstream.version,
        "commit": lock.upstream.commit,
        "sdist": lock.sdist().sha256,
    }
    key = baseline_key(upstream, code, env, selection, req.options)
    if req.baseline == "auto":
        try:
            cached = load_baseline(key)
        except CorruptBaseline as e:
            util.info(f"suite: the cached baseline is unusable: {e}. Running the baseline again.")
            cached = None
        if cached is not None:
            util.info(f"suite: baseline from the cache ({baseline_path(key)})")
            return cached
    util.info(f"suite: running the baseline on pristine upstream (cache key {key.digest})")
    pristine = work / "trees" / "pristine"
    apply_overlay(lock, None, pristine, force=True, index_url=req.index_url)
    wheel = None if req.wheel is None else ensure_artifact(lock.wheel(), index_url=req.index_url)
    run = run_side(
        Side("baseline", pristine, selection, wheel),
        env,
        Scratch(work / "runs" / "baseline"),
        req.options,
    )
    util.info(f"suite: baseline cached as {store_baseline(key, run)}")
    return run


def _write_junit(dest: Path, baseline: SideRun, patched: SideRun) -> dict[str, str]:
    out = {}
    for run in (baseline, patched):
        path = dest / f"{run.name}.xml"
        util.atomic_write_text(path, run.junit_xml)
        out[run.name] = os.fspath(path)
    return out


def _meta(
    lock: Lock,
    selection: tuple[str, ...],
    base_sel: tuple[str, ...],
    env: RunEnv,
    req: SuiteRequest,
    tree: Path,
) -> dict:
    return {
        "format": FORMAT,
        "upstream": {
            "name": lock.upstream.name,
            "version": lock.upstream.version,
            "commit": lock.upstream.commit,
        },
        "mode": "tree" if req.wheel is None else "wheel",
        "wheel": os.fspath(req.wheel) if req.wheel else None,
        "tree": os.fspath(tree),
        "selection": list(selection),
        "baseline_selection": list(base_sel),
        "environment": env.description,
        "options": req.options.key(),
    }


def _title(
    lock: Lock,
    selection: tuple[str, ...],
    overlay_tests: tuple[str, ...],
    env: RunEnv,
    req: SuiteRequest,
) -> str:
    shown = [s for s in selection if s not in overlay_tests]
    added = len(selection) - len(shown)
    what = ", ".join(shown) + (f" (+{added} overlay test path)" if added else "")
    code = "trees" if req.wheel is None else f"wheels ({req.wheel.name} vs the official wheel)"
    workers = f"{req.options.workers} workers" if req.options.workers else "no xdist"
    return (
        f"{lock.upstream.name} {lock.upstream.version} suite: {what}\n"
        f"patched vs pristine upstream {code}; {env.description}; {workers}, "
        f"timeout {req.options.timeout} s per test"
    )
