"""vllm-overlay export: write overlay/ back from the checkout (or --check it)."""

from __future__ import annotations

import argparse

from vllm_overlay.commands._options import (
    add_checkout,
    add_index_url,
    checkout_of,
    refuse_during_rebase,
)
from vllm_overlay.errors import ExportMismatchError
from vllm_overlay.overlay.checkout import apply_overlay, is_checkout
from vllm_overlay.overlay.export import export_overlay
from vllm_overlay.overlay.project import find_project

HELP = "write the checkout's changes back into overlay/ (--check: verify it is up to date)"
DESCRIPTION = """\
Write overlay/ from the checkout: for every file a change lists, a patch against upstream
(overlay/<path>.patch) or, for files upstream lacks, the whole file. Output is deterministic:
the same tree gives the same bytes (no dates, no tool versions, stable order). Files in
overlay/ that no change lists any more are removed.

--check writes nothing and exits 1 naming every file that would change. Without a checkout
it first makes a fresh one with apply, so CI and pre-commit check that the committed
overlay is exactly what export writes (a canonical round trip).
"""


def configure(p: argparse.ArgumentParser) -> None:
    add_checkout(p)
    add_index_url(p)
    p.add_argument("--check", action="store_true", help="compare only; exit 1 if overlay/ differs")


def run(args: argparse.Namespace) -> int:
    project = find_project()
    if not args.check:
        refuse_during_rebase(project, "export")
    lock, overlay = project.lock(), project.overlay()
    dest = checkout_of(args, project)
    if args.check and not is_checkout(dest):
        apply_overlay(lock, overlay, dest, index_url=args.index_url)
    res = export_overlay(lock, overlay, dest, check=args.check)
    if args.check:
        if res.differs:
            lines = [f"  would write overlay/{p}" for p in res.written]
            lines += [f"  would remove overlay/{p}" for p in res.removed]
            raise ExportMismatchError(
                "overlay/ is not what export writes from "
                f"{dest}:\n"
                + "\n".join(lines)
                + "\nRun `vllm-overlay export` and commit the result."
            )
        print(f"overlay/ is up to date with {dest} ({len(res.unchanged)} file(s))")
        return 0
    for p in res.written:
        print(f"wrote overlay/{p}")
    for p in res.removed:
        print(f"removed overlay/{p}")
    print(
        f"export: {len(res.written)} written, {len(res.removed)} removed, {len(res.unchanged)} unchanged"
    )
    return 0
