#!/usr/bin/env python3
"""Benchmark the walk: the outlook (first run and warm) and `track` from a fresh clone.

outlook, first run   the outlook's own caches (results, sdist members) emptied, the
                     sdists cached: every release read from its tarball, the walk to
                     every target and every direct jump computed
outlook, warm        again: every walk from the results cache (goal: under 15 s)
track, cold          `vllm-overlay track --to V` in a fresh clone of this repository with
                     an empty cache (VLLM_OVERLAY_CACHE): the sdists downloaded, the walk
                     with its proofs, each proof's test environment built (--track V)

python bench/bench_outlook.py [--project DIR] [--index-url URL] [--track 0.33.0]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vllm_overlay.overlay.project import Project
from vllm_overlay.process import run
from vllm_overlay.rebase.host import load_series
from vllm_overlay.rebase.releases import newer_releases
from vllm_overlay.util import cache_dir

REPO = Path(__file__).resolve().parents[1]


def cli(project: Path, *args: str, check: bool = True, env: dict | None = None):
    return run(sys.executable, "-m", "vllm_overlay", "--project", str(project), *args,
               check=check, env=env)  # fmt: skip


CPU: dict[str, float] = {}


def timed(fn, label: str) -> float:
    """Wall seconds of ``fn``; the CPU seconds its subprocesses used go to CPU[label]."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    fn()
    wall = time.perf_counter() - t
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU[label] = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return wall


def track_cold(version: str, index_url: str | None, tmp: Path) -> tuple[float, dict]:
    """`track --to version` in a fresh clone with an empty cache: (seconds, report)."""
    clone = tmp / "clone"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(clone)], check=True)
    env = {**os.environ, "VLLM_OVERLAY_CACHE": str(tmp / "cache")}
    idx = ["--index-url", index_url] if index_url else []
    reports = tmp / "reports"
    secs = timed(lambda: cli(clone, "track", "--to", version, "--report-dir", str(reports),
                             *idx, check=False, env=env), "track")  # fmt: skip
    return secs, json.loads((reports / "track-report.json").read_text())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", type=Path, default=REPO)
    ap.add_argument("--index-url")
    ap.add_argument("--track", metavar="VERSION", help="also time track --to VERSION, cold")
    args = ap.parse_args()
    src = Project(args.project.resolve())
    idx = ["--index-url", args.index_url] if args.index_url else []
    with tempfile.TemporaryDirectory(prefix="bench-outlook-") as tmp:
        proj = Path(tmp) / "project"
        proj.mkdir()
        shutil.copy2(src.lock_path, proj / "upstream.lock")
        shutil.copytree(src.overlay_dir, proj / "overlay")
        p = Project(proj)
        lock = p.lock()
        series = load_series(lock, p.overlay(), args.index_url)  # the pin's sdist, cached
        rels, _ = newer_releases(lock.upstream.name, lock.upstream.version, args.index_url)
        print(f"series {series.digest[:12]} ({len(series.steps)} change(s)) on "
              f"{lock.upstream.name} {lock.upstream.version}, {len(rels)} releases")  # fmt: skip
        cli(proj, "outlook", *idx)  # sdists into the cache (downloads are not timed)
        for d in ("results", "members"):
            shutil.rmtree(cache_dir() / "outlook" / d, ignore_errors=True)
        first = timed(lambda: cli(proj, "outlook", *idx), "first")
        warm = timed(lambda: cli(proj, "outlook", *idx), "warm")
        print(f"outlook, first run (sdists cached) {first:8.2f} s wall {CPU['first']:7.2f} s CPU")
        print(f"outlook, warm (walks cached)       {warm:8.2f} s wall {CPU['warm']:7.2f} s CPU"
              f"   goal < 15 s: {'met' if warm < 15 else 'MISSED'}")  # fmt: skip
        if args.track:
            secs, rep = track_cold(args.track, args.index_url, Path(tmp))
            stop = (rep.get("rebase") or {}).get("stopped_at") or {}
            proofs = (rep.get("rebase") or {}).get("proof_releases") or {}
            print(f"track --to {args.track}, fresh clone, cold cache {secs:8.2f} s wall "
                  f"{CPU['track']:7.2f} s CPU: {rep['status']}"
                  + (f", stopped at {stop.get('id')} on {stop.get('release')}" if stop else "")
                  + (f", walked to {rep['walked_to']}" if rep.get("walked_to") else ""))  # fmt: skip
            for v, s in sorted(proofs.items()):
                print(f"  proofs on {v}: {s:.0f} s (its test environment built, the tests run)")
    print(f"(cpus: {os.cpu_count()})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
