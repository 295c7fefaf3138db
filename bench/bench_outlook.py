#!/usr/bin/env python3
"""Benchmark `vllm-overlay outlook` against a loop of `rebase --to V` + `rebase --abort`.

Both run on a scratch copy of the project (upstream.lock and overlay/), as the command line
a person runs, over the same releases (default: every final release newer than the pin
that the index lists), with the release sdists already cached:

  outlook, first run   the outlook's own caches (results, sdist members) emptied: every
                       release's sdist is read from its tarball and classified
  outlook, warm        again: every (series, release) comes from the results cache
  rebase loop          for each release `rebase --to V --test-python PY` then
                       `rebase --abort`, after one untimed loop that builds the release
                       trees, so the loop is warm too. PY is this Python: a dropped change's
                       proof stops at once on import (no CPU test env), which favours the
                       loop: a real rebase also runs the proofs.

The goals: the outlook (first run) under 15 s, and at least 10x faster than the loop.

  python bench/bench_outlook.py [--project DIR] [--releases A,B] [--index-url URL]
                                [--no-warmup]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from vllm_overlay.overlay.project import Project
from vllm_overlay.rebase.releases import newer_releases
from vllm_overlay.track.outlook import load_series
from vllm_overlay.util import cache_dir, run


def cli(project: Path, *args: str, check: bool = True):
    return run(sys.executable, "-m", "vllm_overlay", "--project", str(project), *args,
               check=check)  # fmt: skip


CPU: dict[str, float] = {}


def timed(fn, label: str = "") -> float:
    """Wall seconds of ``fn``; the CPU seconds its subprocesses used go to CPU[label] (on a
    loaded machine the wall figure grows, the CPU figure does not)."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    fn()
    wall = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU[label] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", type=Path, default=Path(__file__).resolve().parents[1])
    ap.add_argument("--releases", help="comma-separated releases (default: all newer ones)")
    ap.add_argument("--index-url")
    ap.add_argument("--no-warmup", action="store_true", help="skip the untimed rebase loop")
    ap.add_argument("--skip-loop", action="store_true", help="time the outlook only")
    args = ap.parse_args()
    src = Project(args.project.resolve())
    with tempfile.TemporaryDirectory(prefix="bench-outlook-") as tmp:
        proj = Path(tmp) / "project"
        proj.mkdir()
        shutil.copy2(src.lock_path, proj / "upstream.lock")
        shutil.copytree(src.overlay_dir, proj / "overlay")
        p = Project(proj)
        lock = p.lock()
        series = load_series(p, args.index_url)  # the pin's sdist, cached
        if args.releases:
            versions = args.releases.split(",")
        else:
            rels, _ = newer_releases(lock.upstream.name, lock.upstream.version, args.index_url)
            versions = [r.version for r in rels]
        idx = ["--index-url", args.index_url] if args.index_url else []
        sel = ["--releases", ",".join(versions)]
        print(f"series {series.digest[:12]} ({len(series.steps)} change(s)) on "
              f"{lock.upstream.name} {lock.upstream.version}, {len(versions)} releases: "
              f"{' '.join(versions)}")  # fmt: skip
        cli(proj, "outlook", *sel, *idx)  # sdists into the cache (downloads are not timed)
        for d in ("results", "members"):
            shutil.rmtree(cache_dir() / "outlook" / d, ignore_errors=True)
        first = timed(lambda: cli(proj, "outlook", *sel, *idx), "first")
        warm = timed(lambda: cli(proj, "outlook", *sel, *idx), "warm")
        out = cli(proj, "outlook", *sel, *idx).stdout
        print(out)

        def loop() -> None:
            for v in versions:
                res = cli(proj, "rebase", "--to", v, "--json", "--test-python", sys.executable,
                          *idx, check=False)  # fmt: skip
                if res.returncode not in (0, 1):
                    raise SystemExit(f"rebase --to {v} failed:\n{res.stderr}")
                status = json.loads(res.stdout)["status"] if res.stdout.strip() else "?"
                if status == "complete":
                    raise SystemExit(f"rebase --to {v} completed; the bench needs a stop")
                cli(proj, "rebase", "--abort")

        if args.skip_loop:
            print(f"outlook, first run (sdists cached) {first:8.2f} s wall, "
                  f"{CPU['first']:6.2f} s CPU")  # fmt: skip
            print(
                f"outlook, warm (results cached)     {warm:8.2f} s wall, {CPU['warm']:6.2f} s CPU"
            )
            return 0
        if not args.no_warmup:
            print("warm-up: one untimed rebase loop (builds each release's tree once)")
            loop()
        loop_s = timed(loop, "loop")
    print(f"outlook, first run (sdists cached) {first:8.2f} s wall {CPU['first']:7.2f} s CPU   "
          f"goal < 15 s: {'met' if first < 15 else 'MISSED'}")  # fmt: skip
    print(f"outlook, warm (results cached)     {warm:8.2f} s wall {CPU['warm']:7.2f} s CPU")
    print(f"rebase + --abort loop              {loop_s:8.2f} s wall {CPU['loop']:7.2f} s CPU   "
          f"({len(versions)} releases)")  # fmt: skip
    ratio = loop_s / first
    print(f"loop / outlook first run           {ratio:8.1f} x   goal >= 10x: "
          f"{'met' if ratio >= 10 else 'MISSED'}")  # fmt: skip
    print(f"loop / outlook warm                {loop_s / warm:8.1f} x")
    print(f"loop / outlook first run, CPU      {CPU['loop'] / CPU['first']:8.1f} x")
    print(f"(cpus: {os.cpu_count()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
