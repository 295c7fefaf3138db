"""vllm-overlay apply: the pinned upstream plus the overlay, one commit per change."""

from __future__ import annotations

import argparse

from vllm_overlay.commands._options import (
    add_checkout,
    add_index_url,
    add_source,
    checkout_of,
    refuse_during_rebase,
)
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay.checkout import apply_overlay
from vllm_overlay.overlay.importing import refuse_during_import
from vllm_overlay.overlay.project import find_project

HELP = "make a checkout: pinned upstream + the overlay, strictly (no fuzz, no offsets)"
DESCRIPTION = """\
Create or update a checkout (a git work tree) of the pinned upstream with every change in
overlay/overlay.toml applied as one commit, in order.

First every upstream file the overlay touches is checked against its sha256 in
upstream.lock, and every patch is applied in memory with no fuzz and no offsets; only when
all of that succeeds is the checkout touched. A failure names the change, the file, the
hunk and the first line that did not match, and leaves the checkout as it was.

An existing checkout with uncommitted changes is refused; --force stashes them first
(`git stash list` in the checkout shows them), so no work is ever destroyed.
--pristine makes the unpatched upstream tree instead (for baselines).
"""


def configure(p: argparse.ArgumentParser) -> None:
    add_checkout(p)
    add_source(p)
    add_index_url(p)
    p.add_argument("--force", action="store_true", help="stash uncommitted changes, then apply")
    p.add_argument("--pristine", action="store_true", help="upstream only, without the overlay")


def run(args: argparse.Namespace) -> int:
    project = find_project()
    refuse_during_rebase(project, "apply")
    refuse_during_import(project, "apply")
    lock = project.lock()
    overlay = None if args.pristine else project.overlay()
    dest = checkout_of(args, project)
    res = apply_overlay(
        lock,
        overlay,
        dest,
        force=args.force,
        settings=Settings.from_options(args),
    )
    if res.stash:
        print(f"stashed uncommitted changes as {res.stash} (`git -C {dest} stash list`)")
    for cid, commit in res.commits:
        print(f"applied {cid} as {commit[:12]}")
    what = "pristine upstream" if args.pristine else f"{len(res.commits)} change(s)"
    print(f"{res.checkout}: {lock.upstream.name} {lock.upstream.version} + {what}, HEAD {res.head}")
    return 0
