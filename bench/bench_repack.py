#!/usr/bin/env python3
"""Benchmark the repack strategy against `wheel unpack` + `wheel pack` and a plain copy.

All three start from the official wheel pinned in upstream.lock (fetched and cached like a
build does) and the overlay's changed files:

  plain copy          copy the official wheel file (the floor: the bytes must be written)
  repack              vllm_overlay.wheel.repack.repack: copy unchanged members' compressed bytes,
                      write the changed files, METADATA, provenance and RECORD
  wheel unpack+pack   `python -m wheel unpack`, put the changed files in, `wheel pack`
                      (recompresses every member; names the file from WHEEL's Tag)

Each is run --runs times (the slow one --slow-runs times) after one warm-up copy, so the
official wheel is in the page cache ("warm"); medians and ratios are printed, with the
goals: repack within 3x the plain copy and at least 50x faster than unpack + pack. The
whole `build` (plan, repack and every verify check including the real install, into a
fresh output directory each time) is run --build-runs times; its median is compared with
the plain copy (goal: within 3x), with the CPU seconds it used (this process and its
children) and the load average, since on a shared machine the wall time depends on both.

  python bench/bench_repack.py [--project DIR] [--runs 5] [--slow-runs 3] [--build-runs 3]
                               [--index-url URL] [--skip-unpack]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from vllm_overlay.overlay.project import Project
from vllm_overlay.pin.artifacts import ensure_artifact
from vllm_overlay.process import run
from vllm_overlay.util import find_uv
from vllm_overlay.wheel.build import DEFAULT_PLATFORM, BuildOptions, build, plan_build
from vllm_overlay.wheel.provenance import render
from vllm_overlay.wheel.repack import RepackInput, repack

REPACK_GOAL = 3.0  # repack time / plain copy time, at most
BUILD_GOAL = 3.0  # whole build time / plain copy time, at most
UNPACK_GOAL = 50.0  # unpack+pack time / repack time, at least


def _cpu_seconds() -> float:
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _installer() -> str:
    uv = find_uv()
    return f"uv ({uv})" if uv else "pip (uv is not installed)"


def timed(fn: Callable[[], object], runs: int) -> list[float]:
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def fresh(root: Path, name: str) -> Path:
    d = root / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def unpack_pack(official: Path, files: dict[str, bytes], work: Path) -> Path:
    d = fresh(work, "unpacked")
    run(sys.executable, "-m", "wheel", "unpack", "--dest", d, official)
    (tree,) = d.iterdir()
    for path, data in files.items():
        (tree / path).write_bytes(data)
    out = fresh(work, "packed")
    run(sys.executable, "-m", "wheel", "pack", "--dest-dir", out, tree)
    (wheel,) = out.iterdir()
    return wheel


def line(label: str, times: list[float]) -> str:
    runs = ", ".join(f"{t:.3f}" for t in times)
    return f"{label:<22} median {statistics.median(times):8.3f} s   (runs: {runs})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--project", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--slow-runs", type=int, default=3)
    ap.add_argument("--build-runs", type=int, default=3)
    ap.add_argument("--index-url")
    ap.add_argument("--skip-unpack", action="store_true", help="leave out wheel unpack + pack")
    args = ap.parse_args(argv)

    project = Project(args.project.resolve())
    one = {"variants": ("vllm",), "platforms": (DEFAULT_PLATFORM,)}  # the CUDA x86_64 wheel
    plan = plan_build(project, BuildOptions(strategy="repack", index_url=args.index_url, **one))
    assert plan.official is not None
    official = ensure_artifact(plan.official, index_url=args.index_url)
    replace = {f.path: f.content for f in plan.files if f.in_wheel and f.kind == "patch"}
    add = {f.path: f.content for f in plan.files if f.in_wheel and f.kind == "added"}
    inp = RepackInput(
        official=official,
        version=plan.version,
        replace=replace,
        add=add,
        version_py=plan.version,
        provenance=render(plan.provenance),
    )
    with zipfile.ZipFile(official) as zf:
        count = len(zf.infolist())
    size = official.stat().st_size
    print(
        f"official wheel: {official.name} ({size / 1e6:.1f} MB, {count} members); "
        f"changed files: {', '.join(replace) or 'none'}"
    )

    with tempfile.TemporaryDirectory(prefix="bench-repack-") as tmp:
        work = Path(tmp)
        shutil.copyfile(official, work / "warmup.whl")  # page cache: the "warm" case

        copy_t = timed(lambda: shutil.copyfile(official, work / "copy.whl"), args.runs)
        digests = set()
        repack(inp, fresh(work, "repack"))  # warm-up
        repack_t = []
        for _ in range(args.runs):
            out_dir = fresh(work, "repack")  # like the copy, each run replaces the last output
            t = time.perf_counter()
            out = repack(inp, out_dir)
            repack_t.append(time.perf_counter() - t)
            digests.add(hashlib.sha256(out.read_bytes()).hexdigest())  # not timed
        print(line("plain copy", copy_t))
        print(line("repack (warm)", repack_t))
        print(f"{'':<22} all {args.runs} repacks wrote the same bytes: {len(digests) == 1}")
        ratio_copy = statistics.median(repack_t) / statistics.median(copy_t)
        print(f"repack / plain copy    {ratio_copy:6.2f}x  (goal <= {REPACK_GOAL:g}x: "
              f"{'met' if ratio_copy <= REPACK_GOAL else 'NOT met'})")  # fmt: skip
        if not args.skip_unpack:
            packed: list[Path] = []
            slow_t = timed(
                lambda: packed.append(unpack_pack(official, replace, work)), args.slow_runs
            )
            print(line("wheel unpack + pack", slow_t))
            print(f"{'':<22} (wheel pack named it {packed[-1].name})")
            ratio = statistics.median(slow_t) / statistics.median(repack_t)
            print(f"unpack+pack / repack   {ratio:6.1f}x  (goal >= {UNPACK_GOAL:g}x: "
                  f"{'met' if ratio >= UNPACK_GOAL else 'NOT met'})")  # fmt: skip

        build_t, cpu_t = [], []
        name = "?"
        for _ in range(args.build_runs):
            opts = BuildOptions(
                strategy="repack", out=fresh(work, "dist"), index_url=args.index_url, **one
            )
            cpu0 = _cpu_seconds()
            t = time.perf_counter()
            res = build(project, opts)
            build_t.append(time.perf_counter() - t)
            cpu_t.append(_cpu_seconds() - cpu0)
            name = res.path.name if res.path else "?"
        print(line("whole build", build_t))
        print(f"{'':<22} -> {name}; installer: {_installer()}")
        print(f"{'':<22} CPU seconds (with children): {', '.join(f'{c:.2f}' for c in cpu_t)}")
        ratio_build = statistics.median(build_t) / statistics.median(copy_t)
        print(f"build / plain copy     {ratio_build:6.2f}x  (goal <= {BUILD_GOAL:g}x: "
              f"{'met' if ratio_build <= BUILD_GOAL else 'NOT met'})")  # fmt: skip
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        print(f"machine: {os.cpu_count()} CPUs, load average {load}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
