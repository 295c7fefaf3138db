"""vllm-overlay import: start a change from upstream work (a patch, a pull request, a release)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from vllm_overlay.commands._options import (
    add_checkout,
    add_index_url,
    add_source,
    checkout_of,
    refuse_during_rebase,
)
from vllm_overlay.errors import ChangeImportError, UsageError
from vllm_overlay.overlay import importing
from vllm_overlay.overlay.checkout import apply_overlay, checkout_state
from vllm_overlay.overlay.mbox import parse_mbox
from vllm_overlay.overlay.model import ID_RE, check_upstream_tests
from vllm_overlay.overlay.project import Project, find_project
from vllm_overlay.pin.pinning import release_tree

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


def slug(title: str) -> str:
    words = re.sub(r"[^a-z0-9]+", " ", title.lower()).split()
    out = ""
    for w in words:
        if len(out) + len(w) + 1 > 48:
            break
        out = f"{out}-{w}" if out else w
    return out


def run(args: argparse.Namespace) -> int:
    project = find_project()
    refuse_during_rebase(project, "import")
    if args.abort:
        st = importing.abort(project)
        print(f"import of {st.meta.id} aborted; {st.checkout} is back at {st.pre_head[:12]}")
        return 0
    if args.cont:
        st = importing.load_state(project)
        return _finish(project, st)
    if args.patch is None and args.pr is None and args.from_release is None:
        raise UsageError(
            "pass --patch FILE, --pr N or --from-release VERSION (or --continue/--abort)"
        )
    if args.paths and not args.from_release:
        raise UsageError("--paths goes with --from-release")
    if args.upstream_tests:
        check_upstream_tests(args.upstream_tests, "--upstream-tests")
    importing.refuse_during_import(project, "import")
    lock, overlay = project.lock(), project.overlay()
    git_url = args.git_url or lock.upstream.git
    web = importing.web_url(git_url)
    if args.from_release:
        meta = _release_meta(args, lock, web)
    else:
        if args.patch is not None:
            if not args.patch.is_file():
                raise UsageError(f"{args.patch}: no such file")
            text, source = args.patch.read_text(errors="surrogateescape"), str(args.patch)
        else:
            text, source = importing.fetch_pr(git_url, args.pr)
        series = parse_mbox(text, source)
        meta = _patch_meta(args, series, web)
    if not ID_RE.match(meta.id):
        raise UsageError(
            f"--id must be kebab-case (lowercase letters, digits, '-'), got {meta.id!r}"
        )
    if any(c.id == meta.id for c in overlay.changes):
        raise UsageError(f"overlay.toml already has a change {meta.id!r}; pass another --id")
    dest = checkout_of(args, project)
    state = checkout_state(dest, lock, overlay)
    if state["state"] == "edited":
        raise ChangeImportError(
            f"{dest} has edits that are not in overlay/ (uncommitted changes or new commits); "
            "an import starts from the series as exported. `vllm-overlay export` them (or "
            "discard them), then import again. Nothing was written."
        )
    opts = {"index_url": args.index_url}
    if state["state"] != "matches":
        apply_overlay(lock, overlay, dest, source=args.source, git_url=args.git_url, **opts)
    if args.from_release:
        _, repo, rev = release_tree(lock.upstream.name, args.from_release, **opts)
        paths = importing.release_paths(dest, repo, rev, args.paths)
        merged = importing.merge_release(dest, paths, args.from_release, repo, rev)
    else:
        base = None
        if args.base_release:
            _, repo, rev = release_tree(lock.upstream.name, args.base_release, **opts)
            base = (args.base_release, repo, rev)
        merged = importing.merge_patch(series, dest, base)
    st = importing.start(project, dest, meta, merged)
    for m in merged:
        print(f"{'CONFLICT' if m.conflicted else 'merged':8} {m.path} ({m.how})")
    if st.conflicted:
        print(
            f"import of {meta.id} stopped: resolve the diff3 markers in {dest} (between <<<<<<< "
            "and ||||||| the series, between ||||||| and ======= the base, between ======= and "
            ">>>>>>> the import), then run `vllm-overlay import --continue`; or "
            "`vllm-overlay import --abort`."
        )
        return 1
    return _finish(project, st)


def _finish(project: Project, st: importing.State) -> int:
    written = importing.finish(project, project.lock(), st)
    for rel in written:
        print(f"wrote overlay/{rel}")
    print(f"change {st.meta.id} added last to overlay/overlay.toml; `vllm-overlay apply` checks it")
    return 0


def _patch_meta(args: argparse.Namespace, series, web: str | None) -> importing.Meta:
    title = args.title or series.title
    if not title:
        raise UsageError("the patch has no commit subject; pass --title")
    pr = series.pr
    origin = args.origin or (f"{web}/pull/{pr}" if pr and web else None)
    if origin is None:
        raise UsageError('no pull request number found in the patch ("(#NNNN)"); pass --origin URL')
    if not args.drop_when:
        raise UsageError('pass --drop-when, e.g. "vllm>=0.28.0" (the first release with the fix)')
    return importing.Meta(
        id=args.id or slug(title),
        title=title,
        why=args.why or series.why or title,
        origin=origin,
        drop_when=args.drop_when,
        tests=args.tests,
        authors=series.authors,
        upstream_tests=args.upstream_tests,
    )


def _release_meta(args: argparse.Namespace, lock, web: str | None) -> importing.Meta:
    if not args.paths:
        raise UsageError("--from-release needs --paths PATH... (what to take from the release)")
    if not args.id:
        raise UsageError("--from-release needs --id (there is no commit subject to derive it from)")
    v, name = args.from_release, lock.upstream.name
    origin = args.origin or (f"{web}/compare/{lock.upstream.tag}...v{v}" if web else None)
    if origin is None:
        raise UsageError("pass --origin URL (upstream.lock's git URL is not http(s))")
    paths = ", ".join(args.paths)
    return importing.Meta(
        id=args.id,
        title=args.title or f"{paths} as in {name} {v}",
        why=args.why
        or f"Upstream's changes to {paths} between {name} {lock.upstream.version} and {v}.",
        origin=origin,
        drop_when=args.drop_when or f"{name}>={v}",
        tests=args.tests,
        upstream_tests=args.upstream_tests,
    )
