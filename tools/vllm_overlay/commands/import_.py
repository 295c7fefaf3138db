"""vllm-overlay import: start a change from upstream work (a patch, a pull request, a release)."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_overlay.commands._options import (
    add_checkout,
    add_index_url,
    add_source,
    checkout_of,
    refuse_during_rebase,
)
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay import importing
from vllm_overlay.overlay.project import find_project

HELP = "start a change from upstream work: a patch, a pull request, or a later release"
DESCRIPTION = """\
Add a change to the end of the series from upstream's own work instead of copying it by hand:

  vllm-overlay import --patch FILE [--id ID] --drop-when 'vllm>=X'
  vllm-overlay import --pr N       [--id ID] --drop-when 'vllm>=X'
  vllm-overlay import --from-release VERSION --paths PATH... --id ID
  vllm-overlay import --continue | --abort

--patch reads a git format-patch/mbox file (what a pull request's .patch URL serves): the
commit subject gives the title, the message the why, the From: lines the authors, and
"(#NNNN)" in the subject (or a pull URL in the message) the origin. --pr N fetches
<git host>/<repo>/pull/N.patch from upstream.lock's git URL (or --git-url). --from-release
takes upstream's diff of PATHs (files or directories) between the pin and VERSION, from the
release sdists on the package index (offline). The change's upstream_tests are the test
files (tests/**/test_*.py) that diff adds or changes, as upstream names them (--upstream-tests
overrides them): a rebase that drops the change runs them on the pristine release.

The change is merged onto the series in the checkout (a real three-way merge; never fuzz).
A patch written against other code needs a base: the blob its `index` line names when the
checkout has it, or --base-release VERSION (the release whose file it applies to). Where the
merge conflicts, the files are left with diff3 markers in the checkout and the import stops:
resolve them, then `vllm-overlay import --continue`; `--abort` puts the checkout back. A
finished import commits the change (with its Overlay-Change trailer), appends its [[change]]
to overlay/overlay.toml, records [base] for new paths in upstream.lock, writes overlay/<id>/
and checks the whole series with the strict apply.
"""


def configure(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group()
    src.add_argument("--patch", type=Path, metavar="FILE", help="a format-patch/mbox file")
    src.add_argument("--pr", type=int, metavar="N", help="fetch pull request N's .patch")
    src.add_argument("--from-release", metavar="VERSION", help="upstream's diff pin..VERSION")
    src.add_argument("--continue", dest="cont", action="store_true", help="record the resolution")
    src.add_argument("--abort", action="store_true", help="undo a stopped import")
    p.add_argument("--paths", nargs="+", metavar="PATH", help="with --from-release: what to take")
    p.add_argument("--base-release", metavar="VERSION", help="the release a patch was written on")
    p.add_argument("--id", help="the change's id (kebab-case; default: from the title)")
    p.add_argument("--title", help="default: the commit subject")
    p.add_argument("--why", help="default: the commit message")
    p.add_argument("--origin", help="default: the pull request's URL")
    p.add_argument(
        "--drop-when", help='e.g. "vllm>=0.28.0" (default for --from-release: >=VERSION)'
    )
    p.add_argument("--tests", nargs="*", metavar="TEST", help="default: the test files it touches")
    p.add_argument(
        "--upstream-tests",
        nargs="*",
        metavar="TEST",
        help="upstream's tests of the fix (default: the test files the upstream diff changes)",
    )
    add_checkout(p)
    add_source(p)
    add_index_url(p)


def run(args: argparse.Namespace) -> int:
    project = find_project()
    refuse_during_rebase(project, "import")
    if args.abort:
        st = importing.abort(project)
        print(f"import of {st.meta.id} aborted; {st.checkout} is back at {st.pre_head[:12]}")
        return 0
    if args.cont:
        return _report(importing.continue_(project))
    req = importing.Request(
        checkout=checkout_of(args, project), patch=args.patch, pr=args.pr,
        from_release=args.from_release, paths=args.paths, base_release=args.base_release,
        id=args.id, title=args.title, why=args.why, origin=args.origin,
        drop_when=args.drop_when, tests=args.tests, upstream_tests=args.upstream_tests,
        settings=Settings.from_options(args),
    )  # fmt: skip
    return _report(importing.import_change(project, req))


def _report(out: importing.Outcome) -> int:
    for m in out.merged:
        print(f"{'CONFLICT' if m.conflicted else 'merged':8} {m.path} ({m.how})")
    if out.stopped:
        print(
            f"import of {out.meta.id} stopped: resolve the diff3 markers in {out.checkout} "
            "(between <<<<<<< and ||||||| the series, between ||||||| and ======= the base, "
            "between ======= and >>>>>>> the import), then run `vllm-overlay import --continue`; "
            "or `vllm-overlay import --abort`."
        )
        return 1
    for rel in out.written:
        print(f"wrote overlay/{rel}")
    print(
        f"change {out.meta.id} added last to overlay/overlay.toml; `vllm-overlay apply` checks it"
    )
    return 0
