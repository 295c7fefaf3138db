"""vllm-overlay edit: give a person the patched checkout to change."""

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
from vllm_overlay.overlay.checkout import apply_overlay, checkout_state
from vllm_overlay.overlay.importing import refuse_during_import
from vllm_overlay.overlay.project import find_project

HELP = "open the patched checkout for editing (then run export)"
DESCRIPTION = """\
Make sure the checkout holds the pinned upstream plus the current overlay (one commit per
change), then say how to change it. Edits in the work tree (committed or not) belong to the
last change in overlay/overlay.toml; to edit an earlier change, edit its commit
(`git rebase -i refs/vllm-overlay/base`, see docs/overlay.md). `vllm-overlay export` writes
each change's patches back into overlay/<change-id>/, and `vllm-overlay export --check`
tells whether overlay/ is up to date.

A checkout that already has edits is left alone, so running edit twice never loses work.
To start a new change, append a [[change]] listing its files to overlay/overlay.toml first
(or use `vllm-overlay import`).
"""


def configure(p: argparse.ArgumentParser) -> None:
    add_checkout(p)
    add_source(p)
    add_index_url(p)


def run(args: argparse.Namespace) -> int:
    project = find_project()
    refuse_during_rebase(project, "edit")
    refuse_during_import(project, "edit")
    overlay = project.overlay()
    dest = checkout_of(args, project)
    lock = project.lock()
    state = checkout_state(dest, lock, overlay)
    if state.state in ("missing", "stale", "matches"):
        apply_overlay(lock, overlay, dest, settings=Settings.from_options(args))
    elif state.state == "edited":
        print(f"{dest} already has edits; leaving them as they are.")
    print(f"checkout: {dest}")
    print("Edit files there, then run `vllm-overlay export` to write overlay/.")
    print("Work tree edits belong to the last change in overlay/overlay.toml; to edit an")
    print("earlier one: `git rebase -i refs/vllm-overlay/base` (docs/overlay.md).")
    return 0
