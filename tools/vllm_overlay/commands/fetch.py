"""vllm-overlay fetch: the pinned tree (and optionally the official wheels) into the cache."""

from __future__ import annotations

import argparse

from vllm_overlay.commands._options import add_index_url, add_source
from vllm_overlay.envs import cache
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay.project import find_project
from vllm_overlay.pin.artifacts import ensure_artifact
from vllm_overlay.pin.trees import upstream_repo

HELP = "download and verify the pinned upstream (cached; offline once cached)"
DESCRIPTION = """\
Fetch the upstream pinned in upstream.lock into the cache and build its base git repository.

  --source sdist (default): the release sdist from the package index pip is configured with
      (PIP_INDEX_URL, pip.conf, or --index-url); sha256 and size are checked before use, the
      download goes to a temporary file and is renamed into the cache.
  --source git: only the pinned commit, fetched from the git remote (or --git-url), its id
      checked.

The same sdist always gives the same base commit id. A second run makes no network request.
Prints the base commit id on the last line.
"""


def configure(p: argparse.ArgumentParser) -> None:
    add_source(p)
    add_index_url(p)
    p.add_argument(
        "--wheels",
        action="store_true",
        help="also fetch every official wheel pinned in upstream.lock",
    )


def run(args: argparse.Namespace) -> int:
    project = find_project()
    lock = project.lock()
    settings = Settings.from_options(args)
    repo, base = upstream_repo(lock, settings=settings)
    if args.wheels:
        for a in lock.wheels():
            print(f"{a.filename}: {ensure_artifact(a, settings=settings)}")
    print(f"{lock.upstream.name} {lock.upstream.version} ({args.source}) base {base}")
    cache.enforce_cap(keep=[repo])  # what was fetched is held in use: never removed here
    return 0
