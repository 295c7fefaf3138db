"""The carried changes' own tests at the target, on the rebased series (track's step 3).

The walk proves what it drops (their tests on the pristine release) and what a record or a
person resolved (their tests with the resolution). A change that merged cleanly (kept or
refreshed) is proven by nothing of the walk's, yet upstream's code around it can have moved
so that its own tests no longer hold: at 0.34.0 `hidden-states-connector-cpu-cache` merged
cleanly and its test failed (`NewRequestData.from_request` took a new argument), which only
the suite found. So a completed run takes the rebased checkout (the target plus one commit
per change) and runs every carried change's ``tests`` there in one pytest run (one
interpreter start and collection), each change's results told apart by file.

A change's tests pass here when none fails or errors and pytest finished; a skip is not a
failure (the AMX test skips on a machine without AMX tiles) and is counted in the report.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.overlay.project import Project
from vllm_overlay.testing import proving
from vllm_overlay.track.trackdata import ChangeRun, ChangesProof
from vllm_overlay.util import info


def prove(project: Project, checkout: Path, *, settings: Settings = DEFAULTS) -> ChangesProof:
    """Run each carried change's tests on ``checkout``'s HEAD (with ``settings.test_python``);
    the report's ``changes``."""
    overlay = project.overlay()
    wanted = {c.id: list(c.tests) for c in overlay.changes if c.tests}
    # a build-only change's proof is the build it enables (the engine proof compiles it)
    untested = [c.id for c in overlay.changes if not c.tests and not c.build_only]
    if not wanted:
        return ChangesProof(ok=True, untested=tuple(untested))
    started = time.monotonic()
    scratch = project.work_dir / "track-changes"
    shutil.rmtree(scratch, ignore_errors=True)
    tree = proving.export_tree(checkout, "HEAD", scratch / "tree")
    groups = {cid: proving.stage_tests(tree, tests, {})[0] for cid, tests in wanted.items()}
    info(f"running the carried changes' own tests on the rebased tree ({len(groups)} changes)")
    runs = proving.run_groups(
        proving.runner_for(tree, settings.test_python),
        tree,
        groups,
        scratch / "work",
        scratch / "pytest.log",
    )
    changes = {cid: _outcome(run) for cid, run in runs.items()}
    ok = all(c.ok for c in changes.values())
    if ok:
        shutil.rmtree(tree, ignore_errors=True)
    return ChangesProof(ok, round(time.monotonic() - started, 1), changes, tuple(untested),
                        str(scratch / "pytest.log"))  # fmt: skip


def _outcome(run: proving.TestRun) -> ChangeRun:
    finished = bool(run.junit)
    return ChangeRun(
        ok=finished and not run.failed and not run.errors and run.passed + run.skipped > 0,
        counts=run.counts() if finished else run.summary,
        first_error=run.first_error,
        failing=tuple(run.failing),
    )
