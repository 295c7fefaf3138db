#!/usr/bin/env python3
"""Benchmark the git-heavy verbs: ``apply`` and ``rebase`` (with its ``--abort``).

Everything runs in-process through the CLI's ``main`` (as the console script does), so the
script measures the same thing whatever the git layer underneath:

  apply (new)         `apply --checkout NEW` of this project's overlay on the pinned release
                      (the cached pristine tree; the first, untimed run builds it once) into
                      a fresh directory: clone, checkout, base hashes, one commit per change
  apply (again)       the same into the existing, clean checkout (its status is read, then
                      the branch is reset to the base and the changes recommitted)
  rebase refresh      a synthetic upstream (tests/synthetic.py: real git repo, sdists and
                      wheels on a loopback index): `rebase --to 1.1.0` of a fresh copy of a
                      pinned 1.0.0 project, to completion (refreshed, exported, lock written)
  rebase conflict     `rebase --to 1.2.0` up to its stop at a content conflict
  rebase --abort      putting the lock, overlay/ and the checkout back

Each is run --runs times after one warm-up run; the median (and min, max) wall time and the
median CPU time (this process and the git, pip... processes it waited for) are printed in
milliseconds: on a shared machine the CPU time is the steadier figure. The synthetic runs use a temporary cache; the real apply uses the real one
($VLLM_OVERLAY_CACHE or ~/.cache/vllm-overlay), which must hold the release sdist already
(`vllm-overlay fetch`), or reach the index.

  python bench/bench_git.py [--project DIR] [--runs 7] [--only apply|rebase]
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.util
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import vllm_overlay
from vllm_overlay.main import main

TESTS = Path(__file__).resolve().parent.parent / "tests"
CID = "group-block-size"


def cli(*args: str | os.PathLike[str], cwd: Path, expect: int = 0) -> str:
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main([str(a) for a in args])
    finally:
        os.chdir(old)
    if rc != expect:
        sys.exit(f"vllm-overlay {' '.join(map(str, args))}: exit {rc}, expected {expect}\n"
                 f"{out.getvalue()}{err.getvalue()}")  # fmt: skip
    return out.getvalue()


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def timed(
    setup: Callable[[int], object], fn: Callable[[int], object], runs: int
) -> list[tuple[float, float]]:
    """``fn(i)`` timed ``runs`` times after one warm-up (i = 0), each after an untimed setup:
    (wall seconds, CPU seconds of this process and its finished children)."""
    out = []
    for i in range(runs + 1):
        setup(i)
        t, c = time.perf_counter(), _cpu()
        fn(i)
        if i:
            out.append((time.perf_counter() - t, _cpu() - c))
    return out


def show(name: str, times: list[tuple[float, float]]) -> None:
    ms = [w * 1000 for w, _ in times]
    cpu = [c * 1000 for _, c in times]
    print(
        f"  {name:16} wall median {statistics.median(ms):8.1f} ms (min {min(ms):7.1f}, "
        f"max {max(ms):7.1f})   cpu median {statistics.median(cpu):8.1f} ms   (n={len(ms)})",
        flush=True,
    )


def bench_apply(project: Path, runs: int, work: Path) -> None:
    dests = [work / f"apply-{i}" for i in range(runs + 1)]
    print(f"apply of {project / 'overlay'}:")
    show("apply (new)", timed(lambda i: None, lambda i: cli("apply", "--checkout", dests[i],
                                                            cwd=project), runs))  # fmt: skip
    show("apply (again)", timed(lambda i: None, lambda i: cli("apply", "--checkout", dests[i],
                                                              cwd=project), runs))  # fmt: skip
    for d in dests:
        shutil.rmtree(d, ignore_errors=True)


def _write_overlay(root: Path, release_files: Callable[[str], dict[str, str]],
                   connector: str, added: str) -> None:  # fmt: skip
    """The one-change overlay the unit tests use: a patch of the connector plus a new test."""
    ov = root / "overlay"
    old = release_files("1.0.0")[connector]
    new = old.replace(
        "        self._block_size = cache_config.block_size\n",
        "        self._block_size = getattr(cache_config, 'group_block_size', "
        "cache_config.block_size)\n",
    )
    patch = "".join(
        difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{connector}",
                             f"b/{connector}")
    )  # fmt: skip
    # The series layout (overlay/<change-id>/<path>); a tool from before the series (an A/B
    # run with PYTHONPATH=<old checkout>/tools) reads the older one-change-per-file layout.
    where = f"{CID}/" if importlib.util.find_spec("vllm_overlay.overlay.series") else ""
    for rel, text in {
        where + connector + ".patch": patch,
        where + added: "def test_group_block_size():\n    assert True\n",
        "overlay.toml": (
            f'[[change]]\nid = "{CID}"\ntitle = "Group block size"\nwhy = "benchmark"\n'
            'origin = "https://github.com/vllm-project/vllm/pull/46301"\n'
            'upstream_status = "open"\ndrop_when = "vllm>=9"\n'
            f'files = ["{connector}", "{added}"]\ntests = ["{added}"]\n'
        ),
    }.items():
        (ov / rel).parent.mkdir(parents=True, exist_ok=True)
        (ov / rel).write_text(text)


def bench_rebase(runs: int, work: Path) -> None:
    sys.path.insert(0, str(TESTS))  # the synthetic upstream the unit tests use
    from synthetic import ADDED_TEST, CONNECTOR, IndexServer, make_upstream, release_files

    old_cache = os.environ.get("VLLM_OVERLAY_CACHE")
    os.environ["VLLM_OVERLAY_CACHE"] = str(work / "cache")
    try:
        up = make_upstream(work / "synthetic")
        with IndexServer(up.repo.parent / "dist") as srv:
            template = work / "template"
            _write_overlay(template, release_files, CONNECTOR, ADDED_TEST)
            (template / "upstream.lock").write_text("")
            commit = up.releases["1.0.0"].commit
            cli("lock", "--version", "1.0.0", "--commit", commit, "--index-url", srv.url,
                cwd=template)  # fmt: skip
            proj = work / "project"

            def fresh(_i: int) -> None:
                shutil.rmtree(proj, ignore_errors=True)
                shutil.copytree(template, proj)

            def to(version: str, expect: int) -> Callable[[int], object]:
                c = up.releases[version].commit
                return lambda _i: cli("rebase", "--to", version, "--commit", c, "--index-url",
                                      srv.url, "--json", cwd=proj, expect=expect)  # fmt: skip

            print("synthetic rebase (tests/synthetic.py, one change):")
            show("rebase refresh", timed(fresh, to("1.1.0", 0), runs))
            show("rebase conflict", timed(fresh, to("1.2.0", 1), runs))

            def stopped(i: int) -> None:
                fresh(i)
                to("1.2.0", 1)(i)

            show("rebase --abort", timed(stopped, lambda _i: cli("rebase", "--abort", cwd=proj),
                                         runs))  # fmt: skip
    finally:
        if old_cache is None:
            os.environ.pop("VLLM_OVERLAY_CACHE", None)
        else:
            os.environ["VLLM_OVERLAY_CACHE"] = old_cache


def main_() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--project", type=Path, default=Path(__file__).resolve().parent.parent)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--only", choices=("apply", "rebase"))
    args = ap.parse_args()
    for k in [k for k in os.environ if k.startswith("GIT_")]:
        del os.environ[k]
    print(f"vllm_overlay from {Path(vllm_overlay.__file__).parent}")
    with tempfile.TemporaryDirectory(prefix="bench-git-") as tmp:
        if args.only in (None, "apply"):
            bench_apply(args.project.resolve(), args.runs, Path(tmp))
        if args.only in (None, "rebase"):
            bench_rebase(args.runs, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main_())
