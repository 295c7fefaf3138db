"""vllm-overlay export: write overlay/ back from the checkout (or --check it)."""

from __future__ import annotations

import argparse

from vllm_overlay.commands._options import (
    add_checkout,
    add_index_url,
    checkout_of,
    refuse_during_rebase,
)
from vllm_overlay.errors import ExportMismatchError, UsageError
from vllm_overlay.gitrepo import show_bytes
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay import history
from vllm_overlay.overlay.checkout import apply_overlay, export_checked, is_checkout
from vllm_overlay.overlay.importing import refuse_during_import
from vllm_overlay.overlay.model import CONFIG_NAME
from vllm_overlay.overlay.project import Project, find_project
from vllm_overlay.overlay.series import migrate, plan_migration, refuse_legacy
from vllm_overlay.pin.trees import upstream_repo
from vllm_overlay.util import atomic_write_text

HELP = "write the checkout's changes back into overlay/ (--check: verify it is up to date)"
DESCRIPTION = """\
Write overlay/ from the checkout, one change at a time: export walks the commits above
refs/vllm-overlay/base (one per change, each with an `Overlay-Change: <id>` trailer) and
writes, for every file a change lists, its patch against the tree the earlier changes left
(overlay/<change-id>/<path>.patch) or, for a file absent before the change, the whole file
(overlay/<change-id>/<path>). Uncommitted edits, and commits without a trailer on top,
belong to the last change in overlay.toml; an edit of an earlier change goes into that
change's commit (`git rebase -i refs/vllm-overlay/base`, see docs/overlay.md). Output is
deterministic: the same tree gives the same bytes (no dates, no tool versions, stable
order). Files in overlay/ that no change writes any more are removed.

--check writes nothing and exits 1 naming every file that would change. Without a checkout
it first makes a fresh one with apply, so CI and pre-commit check that the committed
overlay is exactly what export writes (a canonical round trip).

--migrate converts the older one-change-per-file layout (overlay/<path>.patch) into the
series layout (overlay/<change-id>/<path>.patch) and bumps the revision; both layouts are
applied in memory first and must give the same tree. No checkout is needed.
"""


def configure(p: argparse.ArgumentParser) -> None:
    add_checkout(p)
    add_index_url(p)
    p.add_argument("--check", action="store_true", help="compare only; exit 1 if overlay/ differs")
    p.add_argument(
        "--migrate",
        action="store_true",
        help="convert the one-change-per-file layout into the series layout (once)",
    )


def run(args: argparse.Namespace) -> int:
    project = find_project()
    if args.migrate:
        if args.check:
            raise UsageError("--migrate writes overlay/; it does not go with --check")
        return _migrate(project, Settings.from_options(args))
    if not args.check:
        refuse_during_rebase(project, "export")
    refuse_during_import(project, "export")
    lock, overlay = project.lock(), project.overlay()
    refuse_legacy(overlay)
    dest = checkout_of(args, project)
    if args.check and not is_checkout(dest):
        apply_overlay(lock, overlay, dest, settings=Settings.from_options(args))
    res = export_checked(lock, overlay, dest, check=args.check)
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


def _migrate(project: Project, settings: Settings) -> int:
    refuse_during_rebase(project, "export --migrate")
    lock, overlay = project.lock(), project.overlay()
    repo, base = upstream_repo(lock, settings=settings)
    mig = plan_migration(lock, overlay, lambda path: show_bytes(repo, base, path))
    cfg = overlay.dir / CONFIG_NAME
    new_text = history.rewrite(cfg.read_text(), bump_revision=True)
    migrate(overlay, mig)
    atomic_write_text(cfg, new_text)
    for old, new in mig.moves:
        print(f"moved overlay/{old} -> overlay/{new}")
    print(
        f"migrated {len(mig.moves)} file(s) into the series layout (same applied tree); "
        f"revision {overlay.revision} -> {overlay.revision + 1}"
    )
    return 0
