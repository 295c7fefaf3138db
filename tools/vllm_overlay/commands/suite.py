"""vllm-overlay suite: vLLM's own tests, patched tree vs pristine upstream."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_overlay.commands._options import add_index_url
from vllm_overlay.errors import UsageError
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay.project import find_project
from vllm_overlay.testing import suite

HELP = "run vLLM's kv_connector tests on the patched tree and compare with pristine upstream"
DESCRIPTION = f"""\
Run vLLM's own tests (default: {", ".join(suite.DEFAULT_SELECTION)} plus the tests the
overlay adds) on the patched tree, run the same selection on pristine upstream in the same
environment, and compare. On a machine without a GPU many tests fail on both sides for
reasons unrelated to the overlay; those are grouped by cause and never counted as passes.

Exit 1 when a test that passes upstream fails, is skipped or no longer runs on the patched
tree, or when one of the overlay's own tests does not pass; 0 otherwise.

The environment is the CPU test environment (`vllm-overlay testenv`), or --python. The
baseline is cached by upstream pin, environment, selection and options, so a usual run
costs one suite run. Without a cached baseline, --baseline-for-failures runs pristine
upstream only on the tests that did not pass on the patched tree: the same verdict, but
no "fixed" list (CI uses it). JUnit XML for both sides goes to .work/suite/junit/ (or
--junit).

On a GPU machine, --wheel dist/vllm-….whl runs the same tests against the built wheel's
code (and the baseline against the official release wheel) instead of the source trees;
use --python with an environment that has the wheel's CUDA torch.

Across machines: --shard K/N runs the K-th of N shares of the selection (whole test files,
balanced by suite-durations.json, the same split on every machine) and leaves its results
in --junit DIR (default .work/suite/shards/K-of-N); --merge DIR... reads the N shards'
directories and prints the one verdict of the unsplit run. A shard that is missing or did
not run makes the merge fail, naming it. See docs/suite.md.
"""


def configure(p: argparse.ArgumentParser) -> None:
    _what_to_test(p)
    _baseline_options(p)
    _where_options(p)
    _shard_options(p)
    p.add_argument("--json", action="store_true", help="print the comparison as JSON (for CI)")
    p.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=int,
        default=suite.DEFAULT_TIMEOUT,
        help=f"per-test timeout (default {suite.DEFAULT_TIMEOUT})",
    )
    p.add_argument(
        "--workers",
        metavar="N",
        type=int,
        default=suite.DEFAULT_WORKERS,
        help=f"pytest-xdist workers (default {suite.DEFAULT_WORKERS}); 0 runs without "
        "pytest-xdist, and then a crashing test ends the run",
    )
    add_index_url(p)


def _what_to_test(p: argparse.ArgumentParser) -> None:
    """The tree and the tests in it."""
    p.add_argument(
        "--checkout",
        metavar="DIR",
        type=Path,
        help="test this tree as it is (e.g. your `vllm-overlay edit` work area); default: "
        "a fresh patched tree in .work/suite/trees/patched",
    )
    p.add_argument(
        "--tests",
        metavar="PATH",
        nargs="+",
        default=(),
        help="test paths (or node ids) relative to the vLLM tree, instead of the default",
    )


def _baseline_options(p: argparse.ArgumentParser) -> None:
    """Whether and how pristine upstream runs beside the patched tree."""
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--baseline",
        dest="baseline",
        action="store_const",
        const="rerun",
        default="auto",
        help="run the baseline again even when it is cached (and re-cache it)",
    )
    group.add_argument(
        "--no-baseline",
        dest="baseline",
        action="store_const",
        const="skip",
        help="run the patched tree only: failures grouped by cause, no comparison",
    )
    group.add_argument(
        "--baseline-for-failures",
        dest="baseline",
        action="store_const",
        const="targeted",
        help="without a cached baseline, run pristine upstream only on the tests that do not "
        "pass on the patched tree (all are still collected): the same verdict in a fraction "
        "of the time, but 'fixed' is not known and nothing is cached (CI uses this)",
    )


def _where_options(p: argparse.ArgumentParser) -> None:
    """The code and the environment the tests run in, and where their reports go."""
    p.add_argument(
        "--wheel",
        metavar="WHL",
        type=Path,
        help="test this built wheel's code instead of the tree's (GPU machines; see docs)",
    )
    p.add_argument(
        "--python",
        metavar="PATH",
        type=Path,
        help="run in this Python environment instead of the CPU test environment",
    )
    p.add_argument(
        "--junit", metavar="DIR", type=Path, help="write baseline.xml and patched.xml here"
    )


def _shard_options(p: argparse.ArgumentParser) -> None:
    """One share of the run on each of several machines, and the merge of their results."""
    split = p.add_mutually_exclusive_group()
    split.add_argument(
        "--shard",
        metavar="K/N",
        help="run only the K-th of N shares of the selection's test files (balanced by "
        "--durations) and write the shard's results to --junit DIR for --merge",
    )
    split.add_argument(
        "--merge",
        metavar="DIR",
        type=Path,
        nargs="+",
        help="run nothing: merge the results directories of the N shards into one verdict "
        "(merged JUnit reports and durations.json go to --junit)",
    )
    p.add_argument(
        "--durations",
        metavar="FILE",
        type=Path,
        help="seconds per test file that --shard balances by (default: suite-durations.json "
        "in the project)",
    )


def run(args: argparse.Namespace) -> int:
    if args.timeout < 1:
        raise UsageError(f"--timeout {args.timeout}: give a number of seconds, at least 1.")
    if args.workers < 0:
        raise UsageError(f"--workers {args.workers}: give 0 or more.")
    if args.merge:
        junit = args.junit or find_project().work_dir / "suite" / "junit"
        return _print(suite.merge_shards(args.merge, junit), args.json)
    provider = suite.python_provider(args.python) if args.python else suite.testenv_provider
    req = suite.SuiteRequest(
        checkout=args.checkout,
        tests=tuple(args.tests),
        baseline=args.baseline,
        wheel=args.wheel,
        junit_dir=args.junit,
        options=suite.RunOptions(timeout=args.timeout, workers=args.workers),
        env_provider=provider,
        settings=Settings.from_options(args),
        shard=suite.ShardSpec.parse(args.shard) if args.shard else None,
        durations=args.durations,
    )
    return _print(suite.run_suite(find_project(), req), args.json)


def _print(outcome: suite.SuiteOutcome, as_json: bool) -> int:
    if as_json:
        sys.stdout.write(json.dumps(outcome.json(), indent=2, sort_keys=True) + "\n")
    else:
        sys.stdout.write(outcome.text())
    return 0 if outcome.comparison.ok else 1
