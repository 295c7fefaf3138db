"""Cold start: what a new machine spends before `make test` is green, pip beside uv.

On a fresh clone of this repository (``git clone`` into a temporary directory) with empty
caches (VLLM_OVERLAY_CACHE, UV_CACHE_DIR and PIP_CACHE_DIR in temporary directories, and
the tool's venv there too), it times each phase and prints a table:

  venv         the tool's venv: `make venv INSTALLER=pip` vs `make venv INSTALLER=uv`
  testenv      the CPU test environment of the pinned vLLM (0.24.0): pip vs uv
               (`vllm-overlay testenv --tree DIR`, VLLM_OVERLAY_INSTALLER=pip for pip)
  unit         cold `make test-unit` (tests/unit: no network, no test environment), with
               the PYTEST_ARGS below
  test         cold `make test PYTEST_ARGS="-n 3 --dist worksteal"` as CI runs it: its own venv, every
               download and test environment from empty caches
  upstream     then `make test-upstream SUITE_ARGS=--baseline-for-failures`, as CI does next
               (test + upstream is the cold CI run, less CI's chromium install)
  warm         `make test` again with every cache warm

The testenv, unit, test, upstream and warm phases take minutes each: pick them with --phases.
Every phase's output goes to a log file in the work directory (kept with --keep).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from vllm_overlay import process, util  # noqa: E402
from vllm_overlay.envs.childenv import clean_environ  # noqa: E402

PHASES = ("venv", "testenv", "unit", "test", "upstream", "warm")
CI_PYTEST_ARGS = "PYTEST_ARGS=-n 3 --dist worksteal"  # .ci/run's, less its reporting flags
DEFAULT_PHASES = ("venv", "testenv")


class Bench:
    def __init__(self, work: Path, repo: Path) -> None:
        self.work = work
        self.clone = work / "clone"
        self.logs = work / "logs"
        self.logs.mkdir(parents=True)
        self.figures: dict[str, dict[str, float | str]] = {}
        process.run("git", "clone", "-q", "--no-hardlinks", repo, self.clone)
        self.venv = work / "venv-uv"
        self.tree: Path | None = None

    def env(self, tag: str, **extra: str) -> dict[str, str]:
        """The clean environment with empty caches named ``tag`` (made on first use)."""
        env = clean_environ()
        for var, name in (
            ("VLLM_OVERLAY_CACHE", "cache"),
            ("UV_CACHE_DIR", "uv-cache"),
            ("PIP_CACHE_DIR", "pip-cache"),
        ):
            d = self.work / f"{name}-{tag}"
            d.mkdir(exist_ok=True)
            env[var] = str(d)
        env.pop("VLLM_OVERLAY_INSTALLER", None)
        env.update(extra)
        return env

    def timed(self, name: str, argv: list[str | os.PathLike[str]], env: dict[str, str]) -> float:
        util.info(f"bench: {name} ...")
        started = time.monotonic()
        out = process.run(*argv, cwd=self.clone, env=env, check=False)
        seconds = time.monotonic() - started
        log = self.logs / f"{name}.log"
        log.write_text(
            f"$ {' '.join(map(str, argv))}\nexit {out.returncode}\n{out.stdout}\n{out.stderr}"
        )
        status = "ok" if out.returncode == 0 else f"FAILED (exit {out.returncode}, {log})"
        util.info(f"bench: {name}: {seconds:.1f} s {status}")
        self.figures[name] = {"seconds": round(seconds, 1), "status": status}
        return seconds

    def make_venv(self, installer: str, venv: Path, tag: str) -> float:
        return self.timed(
            f"venv-{installer}",
            ["make", "venv", f"VENV={venv}", f"INSTALLER={installer}"],
            self.env(tag),
        )

    def ensure_venv(self) -> None:
        if not (self.venv / ".installed").exists():
            self.make_venv("uv", self.venv, "venv-uv")

    def ensure_tree(self) -> Path:
        """The pristine pinned vLLM tree (untimed: the sdist download is not a build)."""
        if self.tree is None:
            self.ensure_venv()
            self.tree = self.work / "vllm"
            process.run(
                self.venv / "bin" / "vllm-overlay", "apply", "--pristine", "--checkout",
                self.tree, cwd=self.clone, env=self.env("tree"),
            )  # fmt: skip
        return self.tree

    def phase_venv(self) -> None:
        self.make_venv("pip", self.work / "venv-pip", "venv-pip")
        if (self.venv / ".installed").exists():
            shutil.rmtree(self.venv)
        self.make_venv("uv", self.venv, "venv-uv")

    def phase_testenv(self) -> None:
        tree = self.ensure_tree()
        vo = self.venv / "bin" / "vllm-overlay"
        pip = self.env("testenv-pip", VLLM_OVERLAY_INSTALLER="pip")
        self.timed("testenv-pip", [vo, "testenv", "--tree", tree], pip)
        self.timed("testenv-uv", [vo, "testenv", "--tree", tree], self.env("testenv-uv"))

    def phase_unit(self) -> None:
        self.ensure_venv()
        argv = ["make", "test-unit", f"VENV={self.venv}", CI_PYTEST_ARGS]
        self.timed("unit", argv, self.env("suite"))

    def phase_test(self) -> None:
        venv = self.work / "venv-ci"  # made by `make test` itself, as on a CI machine
        self.timed("test", ["make", "test", f"VENV={venv}", CI_PYTEST_ARGS], self.env("ci"))

    def phase_upstream(self) -> None:
        venv = self.work / "venv-ci"
        argv = ["make", "test-upstream", f"VENV={venv}", "SUITE_ARGS=--baseline-for-failures"]
        self.timed("upstream", argv, self.env("ci"))

    def phase_warm(self) -> None:
        venv = self.work / "venv-ci"
        self.timed("warm", ["make", "test", f"VENV={venv}", CI_PYTEST_ARGS], self.env("ci"))


def ratio(a: dict | None, b: dict | None) -> str:
    if not a or not b or not b["seconds"]:
        return ""
    return f"{float(a['seconds']) / float(b['seconds']):.1f}x"


def table(figures: dict[str, dict]) -> str:
    def sec(name: str) -> str:
        f = figures.get(name)
        if f is None:
            return "-"
        return f"{f['seconds']:.1f} s" + ("" if f["status"] == "ok" else " (failed)")

    rows = [f"{'phase':34} {'pip':>12} {'uv':>12} {'pip/uv':>8}"]
    for label, key in (("tool venv (make venv)", "venv"), ("0.24.0 test env", "testenv")):
        if f"{key}-pip" in figures or f"{key}-uv" in figures:
            pip, uv = figures.get(f"{key}-pip"), figures.get(f"{key}-uv")
            rows.append(
                f"{label:34} {sec(key + '-pip'):>12} {sec(key + '-uv'):>12} {ratio(pip, uv):>8}"
            )
    for label, key in (
        ("make test-unit -n 3 (cold)", "unit"),
        ("make test -n 3 (cold, with venv)", "test"),
        ("make test-upstream (then, targeted)", "upstream"),
        ("make test -n 3 (warm)", "warm"),
    ):
        if key in figures:
            rows.append(f"{label:34} {'':>12} {sec(key):>12}")
    if "test" in figures and "upstream" in figures:
        total = float(figures["test"]["seconds"]) + float(figures["upstream"]["seconds"])
        rows.append(f"{'cold CI (test + upstream)':34} {'':>12} {total:>10.1f} s")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--phases",
        default=",".join(DEFAULT_PHASES),
        help=f"comma-separated, in this order: {','.join(PHASES)} (default: "
        f"{','.join(DEFAULT_PHASES)}; 'all' for every phase)",
    )
    ap.add_argument("--repo", type=Path, default=REPO, help="the repository to clone (this one)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory and its logs")
    ap.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args(argv)
    phases = PHASES if args.phases == "all" else tuple(p for p in args.phases.split(",") if p)
    unknown = set(phases) - set(PHASES)
    if unknown:
        ap.error(f"unknown phase(s) {', '.join(sorted(unknown))}; choose from {', '.join(PHASES)}")
    work = Path(tempfile.mkdtemp(prefix="vo-coldstart-"))
    try:
        bench = Bench(work, args.repo)
        for phase in PHASES:
            if phase in phases:
                getattr(bench, f"phase_{phase}")()
        print(f"cold start on a fresh clone of {args.repo} ({os.cpu_count()} CPUs), empty caches")
        print(table(bench.figures))
        if args.json:
            args.json.write_text(json.dumps(bench.figures, indent=2, sort_keys=True) + "\n")
        failed = [n for n, f in bench.figures.items() if f["status"] != "ok"]
        return 1 if failed else 0
    finally:
        if args.keep:
            print(f"work directory kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
