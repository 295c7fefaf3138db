"""Two engine-test runs side by side: each test's verdict, each session's rows and errors.

    python bench/compare_engine_runs.py A B [--names "official repack" "test build"]

A and B are the base directories of two ``tests/engine`` runs (pytest's ``--basetemp``, or
the ``engine`` directory in it) with ``--junitxml=<dir>/junit.xml`` written beside them, or a
directory holding ``junit.xml``, ``report/`` and ``report-servers/`` (what the run's shared
directory keeps). Prints Markdown: the verdict of every test in either run, then every
session's rows right, NaN and zero rows, worst relative error and proposer equality, then the
servers' files; and exits 1 when a verdict differs or a session's row counts do.

What it is for: showing that the test build of our CPU wheel (one extension, no oneDNN) is a
fair stand-in for the official wheel repacked, at a release where both exist (0.32.0):
`make test-engine` with `--engine-cpu-build auto` (the repack) and `--engine-cpu-build test`.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _dir(path: Path) -> Path:
    for d in (path, path / "engine"):
        if (d / "report").is_dir():
            return d
    raise SystemExit(f"{path}: no report/ directory of an engine-test run")


def verdicts(junit: Path) -> dict[str, str]:
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        kids = {c.tag for c in case}
        skipped = case.find("skipped")
        if "failure" in kids or "error" in kids:
            out[name] = "failed"
        elif skipped is not None:
            out[name] = "xfailed" if skipped.get("type") == "pytest.xfail" else "skipped"
        else:
            out[name] = "passed"
    return out


def reports(d: Path, sub: str) -> dict[str, dict]:
    return {f.stem: json.loads(f.read_text()) for f in sorted((d / sub).glob("*.json"))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("a", type=Path)
    ap.add_argument("b", type=Path)
    ap.add_argument("--names", nargs=2, default=("A", "B"), metavar=("NAME_A", "NAME_B"))
    ap.add_argument("--junit", nargs=2, type=Path, metavar=("JUNIT_A", "JUNIT_B"),
                    help="the runs' JUnit XML files (default: junit.xml in each directory)")  # fmt: skip
    args = ap.parse_args(argv)
    a, b = _dir(args.a), _dir(args.b)
    na, nb = args.names
    junits = args.junit or (a / "junit.xml", b / "junit.xml")
    va, vb = verdicts(junits[0]), verdicts(junits[1])
    differ = 0
    print(f"| test | {na} | {nb} |\n|---|---|---|")
    for name in sorted(set(va) | set(vb)):
        x, y = va.get(name, "-"), vb.get(name, "-")
        differ += x != y
        print(f"| `{name}` | {x} | {y}{'' if x == y else ' **(differs)**'} |")
    print()
    ra, rb = reports(a, "report"), reports(b, "report")
    print(f"| session | ran | rows right ({na}) | rows right ({nb}) | max rel. error ({na}) "
          f"| max rel. error ({nb}) | = proposer ({na}) | = proposer ({nb}) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for s in sorted(set(ra) | set(rb)):
        x, y = ra.get(s, {}), rb.get(s, {})

        def rows(d: dict) -> str:
            return f"{d.get('right_rows', '-')}/{d.get('rows', '-')}" + (
                f" ({d['nan_rows']} NaN, {d['zero_rows']} zero)"
                if d.get("nan_rows") or d.get("zero_rows") else "")  # fmt: skip

        def err(d: dict) -> str:
            return "-" if d.get("max_rel_err") is None else f"{d['max_rel_err']:.4f}"

        def prop(d: dict) -> str:
            return f"{d.get('proposer_equal', '-')}/{d.get('proposer_compared', '-')}"

        differ += rows(x) != rows(y)
        print(f"| `{s}` | {x.get('ran') or y.get('ran', '-')} | {rows(x)} | {rows(y)} | {err(x)} "
              f"| {err(y)} | {prop(x)} | {prop(y)} |")  # fmt: skip
    print()
    sa, sb = reports(a, "report-servers"), reports(b, "report-servers")
    keys = ("spec_files", "spec_right", "spec_err", "escaped", "storm_verified", "storm_left")
    print(f"| server | {' | '.join(f'{k} ({na} / {nb})' for k in keys)} |")
    print("|---|" + "---|" * len(keys))
    for s in sorted(set(sa) | set(sb)):
        x, y = sa.get(s, {}), sb.get(s, {})
        print(f"| `{s}` | " + " | ".join(f"{x.get(k, '-')} / {y.get(k, '-')}" for k in keys) + " |")
    print(f"\n{differ} difference(s) in verdicts or rows")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
