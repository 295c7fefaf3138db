"""vllm-overlay outlook: where the series stands against every newer vLLM release."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vllm_overlay.commands._options import add_index_url
from vllm_overlay.errors import UsageError
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay.project import find_project
from vllm_overlay.track import render
from vllm_overlay.track.outlook import outlook
from vllm_overlay.util import atomic_write_text, info

HELP = "the rebase's walk over every newer vLLM release, as a matrix, with the stops per target"
DESCRIPTION = """\
The walk a rebase makes (docs/rebasing.md), over every final release newer than the pin on
the package index (or --to V: those up to V; --releases A,B: exactly those), without
writing anything: each cell is the walk's verdict for a change at a release.

  kept       merges unchanged          refreshed  merges with new context
  dropped    the first release that has it, or where its drop_when holds
  ·          dropped at an earlier release
  waiting    conflicts here, but a later release clears it (nobody is asked), or touches
             its lines again (it is asked there, once)
  record     conflicts, and a resolution record resolves it (overlay/resolutions/)
  conflict   the three-way merge leaves markers (the files and hunks are shown)
  moved      a file it patches was renamed (git's candidates) or deleted upstream
  collision  a file it adds now exists upstream
  tests-failed  (--tests) upstream has it, but the proof fails there

A stop is noted and the walk goes on (the change is tried again at the next release). For
each release as a target, the stops a person would be asked about are counted for the walk
and for the direct jump. It reads only the touched files, straight from each release's
sdist (downloaded once into the cache, checked against the index's sha256); the walks are
cached per (series, records, releases). It never writes upstream.lock, overlay/ or the
checkout. With --tests, the proofs run as in a rebase: at each drop, the change's tests and
its upstream_tests on the pristine release; for a record, the change's tests with it.

The safe target is the newest release the walk reaches without asking a person. Exit
status: 0 (the outlook was made, whatever it says), 1 an expected failure (the index is
down, a bad sdist), 2 usage.
"""


def configure(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--to", metavar="VERSION", help="only the releases up to VERSION")
    g.add_argument("--releases", metavar="A,B", help="exactly these releases (comma-separated)")
    p.add_argument("--tests", action="store_true", help="also run the proofs a rebase runs")
    p.add_argument(
        "--test-python",
        metavar="PATH",
        help="run the tests with this Python (it needs pytest) instead of vLLM's CPU test env",
    )
    p.add_argument("--json", action="store_true", help="print the outlook as JSON on stdout")
    p.add_argument("--html", metavar="FILE", type=Path, help="also write a self-contained page")
    add_index_url(p)


def run(args: argparse.Namespace) -> int:
    only = None
    if args.releases is not None:
        only = [v.strip() for v in args.releases.split(",") if v.strip()]
        if not only:
            raise UsageError("--releases needs at least one version, like 0.25.0,0.26.0.")
    if args.test_python and not args.tests:
        raise UsageError("--test-python goes with --tests.")
    started = time.monotonic()
    result = outlook(
        find_project(),
        settings=Settings.from_options(args),
        to=args.to,
        releases=only,
        tests=args.tests,
    )
    data = result.to_json()
    if args.html:
        atomic_write_text(args.html, render.page(data))
        info(f"wrote {args.html}")
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(render.terminal(data, colour=sys.stdout.isatty()))
    cached = sum(c.from_cache for c in result.columns)
    info(
        f"outlook: {len(result.columns)} release(s) in {time.monotonic() - started:.1f} s "
        f"({cached} from the cache)"
    )
    return 0
