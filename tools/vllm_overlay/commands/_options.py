"""Options several commands share, so they read the same everywhere."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_overlay.overlay.project import Project


def add_index_url(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--index-url",
        metavar="URL",
        help="package index to fetch release files from (default: pip's configured index)",
    )


def add_source(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--source",
        choices=("sdist", "git"),
        default="sdist",
        help="where the pinned tree comes from: the release sdist on the index (default) or "
        "the git remote in upstream.lock (only the pinned commit is fetched)",
    )
    p.add_argument("--git-url", metavar="URL", help="a mirror of the upstream git repository")


def add_checkout(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--checkout",
        metavar="DIR",
        type=Path,
        help="the work tree (default: .work/vllm in the project)",
    )


def checkout_of(args: argparse.Namespace, project: Project) -> Path:
    return args.checkout if args.checkout else project.default_checkout


def refuse_during_rebase(project: Project, verb: str) -> None:
    """Commands that write the lock, overlay/ or the checkout wait for a rebase to settle."""
    from vllm_overlay.errors import RebaseError
    from vllm_overlay.rebase.state import in_progress

    if in_progress(project):
        raise RebaseError(
            f"a rebase is in progress in {project.root} (.work/rebase/); `vllm-overlay {verb}` "
            "would change what it is working on. Finish it with `vllm-overlay rebase "
            "--continue`, or go back with `vllm-overlay rebase --abort`, then run this again."
        )
