"""vLLM's own tests on the patched tree, compared with the same run on pristine upstream.

On a machine without a GPU many of vLLM's tests fail for reasons unrelated to the
overlay, so the verdict is a comparison: the same selection, in the same environment, on
pristine upstream (the baseline) and on the patched tree. See docs/suite.md.

This module chooses what runs (the selection) and puts the comparison together. How one
side runs is ``vllm_overlay.testing.side``; the cached baseline is
``vllm_overlay.testing.baseline``; pytest itself runs through ``vllm_overlay.testing.runner``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay import util
from vllm_overlay.errors import CorruptBaseline, UsageError
from vllm_overlay.gitrepo import git
from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.overlay.checkout import apply_overlay
from vllm_overlay.overlay.model import Overlay
from vllm_overlay.overlay.project import Project
from vllm_overlay.pin.artifacts import ensure_artifact
from vllm_overlay.pin.lockfile import Lock
from vllm_overlay.pin.trees import upstream_repo
from vllm_overlay.testing import shards
from vllm_overlay.testing.baseline import baseline_key, baseline_path, load_baseline, store_baseline
from vllm_overlay.testing.report import Comparison, RunInfo, RunView, compare, render_text, to_json
from vllm_overlay.testing.shards import ShardSpec
from vllm_overlay.testing.side import (
    DEFAULT_TIMEOUT,
    DEFAULT_WORKERS,
    EnvProvider,
    RunEnv,
    RunOptions,
    Scratch,
    Side,
    SideRun,
    empty_run,
    python_provider,
    run_side,
    testenv_provider,
)

__all__ = [  # what `vllm-overlay suite` uses from here, wherever it is defined
    "DEFAULT_SELECTION",
    "DEFAULT_TIMEOUT",
    "DEFAULT_WORKERS",
    "RunOptions",
    "ShardSpec",
    "SuiteOutcome",
    "SuiteRequest",
    "merge_shards",
    "python_provider",
    "run_suite",
    "testenv_provider",
]

DEFAULT_SELECTION = ("tests/v1/kv_connector/unit",)
FORMAT = 1  # of the JSON report's meta


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


# --- the whole comparison ----------------------------------------------------------------

# auto: cached, else run; rerun: run and re-cache; skip: none; targeted: cached, else run
# pristine upstream only on what did not pass on the patched tree (not cached).
BASELINE_MODES = ("auto", "rerun", "skip", "targeted")


@dataclass(frozen=True)
class SuiteRequest:
    """What `vllm-overlay suite` was asked to do."""

    checkout: Path | None = None  # test this tree as it is; None: make the patched tree
    tests: tuple[str, ...] = ()  # empty: the default selection
    baseline: str = "auto"  # one of BASELINE_MODES
    wheel: Path | None = None  # wheel mode: vLLM's code from this built wheel
    junit_dir: Path | None = None
    options: RunOptions = RunOptions()
    env_provider: EnvProvider = testenv_provider
    settings: Settings = DEFAULTS  # the index (release files), its credentials and TLS
    shard: ShardSpec | None = None  # run only this shard's files (docs/suite.md, "Shards")
    durations: Path | None = None  # the split's durations; None: the project's


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
    """Both sides (the baseline from the cache when it can), compared. A shard runs its part
    of the selection and leaves its results in the JUnit directory for ``merge_shards``."""
    if req.baseline not in BASELINE_MODES:
        raise UsageError(f"baseline mode {req.baseline!r}: use one of {BASELINE_MODES}")
    _check_wheel(req.wheel)
    work = project.work_dir / "suite"
    junit_dir = req.junit_dir or work / "junit"
    if req.shard is None:
        return _run_suite(project, req, work, junit_dir)
    junit_dir = req.junit_dir or work / "shards" / f"{req.shard.index}-of-{req.shard.total}"
    with shards.recording(junit_dir, req.shard):
        return _run_suite(project, req, work, junit_dir)


def _run_suite(project: Project, req: SuiteRequest, work: Path, junit_dir: Path) -> SuiteOutcome:
    lock, overlay = project.lock(), project.overlay()
    with util.exclusive_lock(work / ".lock", f"the suite work area {work}"):
        patched_tree = _patched_tree(lock, overlay, work, req)
        overlay_tests = tuple(t for c in overlay.changes for t in c.tests)
        whole = check_selection(patched_tree, req.tests or default_selection(overlay_tests))
        selection, part = whole, None
        if req.shard is not None:
            durations = shards.load_durations(req.durations or project.root / shards.DURATIONS_FILE)
            part = shards.shard_selection(patched_tree, whole, req.shard, durations)
            selection = part.selection
            util.info(
                f"suite: shard {req.shard.label}: {len(part.files)} test files (split {part.digest})"
            )
        env = req.env_provider(patched_tree)
        base_sel = _pristine_selection(lock, selection, req.settings)
        baseline = _baseline(lock, work, req, env, base_sel)
        patched = run_side(
            Side("patched", patched_tree, selection, req.wheel),
            env,
            Scratch(work / "runs" / "patched"),
            req.options,
        )
        if baseline is None:  # targeted, nothing cached: only what did not pass on patched
            passed = sorted(n for n, r in patched.results.items() if r.outcome == "passed")
            baseline = _run_baseline(lock, work, req, env, base_sel, deselect=tuple(passed))
        junit = _write_junit(junit_dir, baseline, patched)
    views = {
        "baseline": RunView(
            baseline.results,
            (*baseline.collected, *baseline.deselected),
            ran=req.baseline != "skip",
            deselected=frozenset(baseline.deselected),
        ),
        "patched": RunView(patched.results, patched.collected),
    }
    runs = {
        name: RunInfo(run.seconds, run.cached, junit.get(name, ""))
        for name, run in (("baseline", baseline), ("patched", patched))
        if views[name].ran
    }
    cmp = compare(views["baseline"], views["patched"], overlay_tests)
    meta = _meta(lock, whole, base_sel, env, req, patched_tree)
    title = _title(lock, whole, overlay_tests, env, req)
    if part is None:
        _write_durations(junit_dir, lock, patched.results)
        return SuiteOutcome(cmp, runs, meta, title)
    shards.write_done(junit_dir, part, views, runs, meta, title, overlay_tests)
    meta = {**meta, **part.to_json(), "files": list(part.files)}
    title += f"\nshard {req.shard.label}: {len(part.files)} test files (split {part.digest})"
    return SuiteOutcome(cmp, runs, meta, title)


def merge_shards(dirs: list[Path], junit_dir: Path) -> SuiteOutcome:
    """One verdict from the shards' results directories: the unsplit run's comparison and
    report; the merged JUnit reports and durations.json go to ``junit_dir``."""
    merged = shards.merge(dirs)
    junit = {}
    for side, text in merged.junit.items():
        util.atomic_write_text(junit_dir / f"{side}.xml", text)
        junit[side] = os.fspath(junit_dir / f"{side}.xml")
    shards.write_durations(
        junit_dir / "durations.json",
        shards.durations_of(merged.views["patched"].results),
        _upstream_label(merged.meta["upstream"]),
    )
    runs = {n: RunInfo(i.seconds, i.cached, junit[n]) for n, i in merged.runs.items()}
    cmp = compare(merged.views["baseline"], merged.views["patched"], merged.overlay_tests)
    return SuiteOutcome(cmp, runs, merged.meta, merged.title)


def _upstream_label(upstream: dict) -> str:
    return f"{upstream['name']} {upstream['version']}"


def _write_durations(junit_dir: Path, lock: Lock, results: dict) -> None:
    """durations.json beside the JUnit reports: copy it to suite-durations.json to refresh
    the split (docs/suite.md, "Shards")."""
    shards.write_durations(
        junit_dir / "durations.json",
        shards.durations_of(results),
        f"{lock.upstream.name} {lock.upstream.version}",
    )


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
    apply_overlay(lock, overlay, dest, force=True, settings=req.settings)
    return dest


def _pristine_selection(
    lock: Lock, selection: tuple[str, ...], settings: Settings
) -> tuple[str, ...]:
    """The selection less the paths pristine upstream lacks (asked of its git repo)."""
    repo, base = upstream_repo(lock, settings=settings)
    exists = [
        e
        for e in selection
        if git("cat-file", "-e", f"{base}:{_file_part(e)}", cwd=repo, check=False).returncode == 0
    ]
    return tuple(exists)


def _baseline(
    lock: Lock, work: Path, req: SuiteRequest, env: RunEnv, selection: tuple[str, ...]
) -> SideRun | None:
    """The whole baseline, from the cache or run (and cached); None: targeted, to run after
    the patched side."""
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
    if req.baseline in ("auto", "targeted"):
        try:
            cached = load_baseline(key)
        except CorruptBaseline as e:
            util.info(f"suite: the cached baseline is unusable: {e}. Running the baseline again.")
            cached = None
        if cached is not None:
            util.info(f"suite: baseline from the cache ({baseline_path(key)})")
            return cached
    if req.baseline == "targeted":
        util.info(
            "suite: no cached baseline; pristine upstream runs after the patched tree, only "
            "the tests that do not pass there (--baseline-for-failures)"
        )
        return None
    util.info(f"suite: running the baseline on pristine upstream (cache key {key.digest})")
    run = _run_baseline(lock, work, req, env, selection)
    util.info(f"suite: baseline cached as {store_baseline(key, run)}")
    return run


def _run_baseline(
    lock: Lock,
    work: Path,
    req: SuiteRequest,
    env: RunEnv,
    selection: tuple[str, ...],
    deselect: tuple[str, ...] = (),
) -> SideRun:
    """Pristine upstream's run of ``selection``, less the ``deselect`` ids (collected only)."""
    if deselect:
        util.info(
            f"suite: running the baseline on pristine upstream, leaving out the {len(deselect)} "
            "tests that passed on the patched tree"
        )
    pristine = work / "trees" / "pristine"
    apply_overlay(lock, None, pristine, force=True, settings=req.settings)
    wheel = None if req.wheel is None else ensure_artifact(lock.wheel(), settings=req.settings)
    return run_side(
        Side("baseline", pristine, selection, wheel, deselect),
        env,
        Scratch(work / "runs" / "baseline"),
        req.options,
    )


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
        "baseline_mode": req.baseline,
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
