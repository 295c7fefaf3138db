"""Move the overlay to another upstream release: keep, refresh, drop, or stop.

For each change, in overlay.toml order, in the checkout (a real git work tree):

1. **dropped** when its ``drop_when`` holds for the new version, or when the new tree already
   has it (its patch applies in reverse, or the three-way merge leaves upstream's file
   unchanged). Its ``tests`` then run against the new, pristine upstream (our own test files
   placed under fresh names): if they fail, the rebase stops, since upstream's version does not
   do what ours did.
2. otherwise the change's commit (made by apply on the old pin) is cherry-picked onto the new
   base: a real three-way merge against the old base, with git's rename detection, never a
   copy of our old file. A clean pick is **kept** (the exported patch is byte-identical) or
   **refreshed** (new context).
3. it **stops** on a content conflict (diff3 markers left in the checkout), on a file we add
   that upstream now also has (a collision), or on a touched file upstream deleted or renamed
   (with git's rename candidates). ``--continue`` commits the person's resolution and goes on;
   ``--abort`` restores everything.

The package, by job: ``state`` (the on-disk state, backups, the checkout record, the context a
step works in), ``target`` (the release to move to and its pin), ``steps`` (one change: drop
with proof, carry, stop; settling a stop), ``report`` (the report and the next steps), and
``driver`` (start, continue, abort: the loop and the final write). This module is the public
face the CLI uses.
"""

from vllm_overlay.rebase.driver import abort, continue_, start
from vllm_overlay.rebase.report import next_steps, report
from vllm_overlay.rebase.state import (
    DROPPED,
    KEPT,
    REFRESHED,
    RESOLVED,
    STOP_COMMIT,
    STOP_KINDS,
    STOP_TESTS,
    NoRebaseError,
    RebaseInProgressError,
    in_progress,
)
from vllm_overlay.rebase.target import latest_release, release_of_commit, resolve_target

__all__ = [
    "DROPPED",
    "KEPT",
    "REFRESHED",
    "RESOLVED",
    "STOP_COMMIT",
    "STOP_KINDS",
    "STOP_TESTS",
    "NoRebaseError",
    "RebaseInProgressError",
    "abort",
    "continue_",
    "in_progress",
    "latest_release",
    "next_steps",
    "release_of_commit",
    "report",
    "resolve_target",
    "start",
]
