#!/usr/bin/env python3
"""Benchmark publish's checks of a wheel: members read twice (before) against once (now).

Publish checks every wheel before it writes anything: ``index.wheels.read_wheel`` (file
name against METADATA, the file's sha256) and ``wheel.verify.check_installable`` (names,
RECORD, .dist-info; every member decompressed once, its CRC checked and its RECORD hash
computed in the same read). Before, ``read_wheel`` also ran ``ZipFile.testzip()``, which
decompresses every member a first time; that call is kept here to time the old way:

  before   testzip() + read_wheel + check_installable   (every member decompressed twice)
  now      read_wheel + check_installable               (once)

on each wheel pinned in upstream.lock (the real release's official wheels, fetched and
cached as `vllm-overlay fetch --wheels` does) and on any WHEEL given. Each is run --runs
times after one untimed warm-up read (page cache warm); medians are printed, with the CPU
seconds and the load average, since on a shared machine wall time depends on both.

  python bench/bench_publish_verify.py [--project DIR] [--runs 3] [--index-url URL] [WHEEL…]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from vllm_overlay.index.wheels import read_wheel
from vllm_overlay.overlay.project import Project
from vllm_overlay.pin.artifacts import ensure_artifact
from vllm_overlay.wheel.verify import check_installable


def _cpu_seconds() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def before(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as zf:
        bad = zf.testzip()  # the first decompression of every member (removed from publish)
    if bad is not None:
        return [f"testzip: {bad} fails its CRC check"]
    read_wheel(path)
    return check_installable(path)


def now(path: Path) -> list[str]:
    read_wheel(path)
    return check_installable(path)


def timed(fn: Callable[[Path], list[str]], path: Path, runs: int) -> tuple[list[float], float]:
    """Wall seconds of each run, and the median CPU seconds; the checks must pass."""
    walls, cpus = [], []
    for _ in range(runs):
        cpu0, t = _cpu_seconds(), time.perf_counter()
        problems = fn(path)
        walls.append(time.perf_counter() - t)
        cpus.append(_cpu_seconds() - cpu0)
        if problems:
            raise SystemExit(f"{path.name} failed the checks: {problems[:5]}")
    return walls, statistics.median(cpus)


def line(label: str, walls: list[float], cpu: float) -> str:
    runs = ", ".join(f"{t:.2f}" for t in walls)
    return (
        f"  {label:<8} median {statistics.median(walls):7.2f} s  CPU {cpu:6.2f} s  (runs: {runs})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("wheels", nargs="*", type=Path, metavar="WHEEL", help="more wheels to time")
    ap.add_argument("--project", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--index-url")
    args = ap.parse_args(argv)

    lock = Project(args.project.resolve()).lock()
    paths = [ensure_artifact(a, index_url=args.index_url) for a in lock.wheels()]
    paths += args.wheels
    for path in paths:
        with zipfile.ZipFile(path) as zf:
            count = len(zf.infolist())
        with open(path, "rb") as f:  # warm the page cache; not timed
            while f.read(1 << 24):
                pass
        print(f"{path.name} ({path.stat().st_size / 1e6:.1f} MB, {count} members)")
        old_w, old_cpu = timed(before, path, args.runs)
        new_w, new_cpu = timed(now, path, args.runs)
        print(line("before", old_w, old_cpu))
        print(line("now", new_w, new_cpu))
        ratio = statistics.median(old_w) / statistics.median(new_w)
        print(f"  before / now {ratio:.2f}x")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"machine: {os.cpu_count()} CPUs, load average {load}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
