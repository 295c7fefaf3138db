"""Move the overlay to another upstream release, walking every release in between.

The package, as the pipeline runs:

- ``releases``: the one list of upstream's releases (the package index's);
- ``target``: the release to move to, and its pin;
- ``host``: the series at the pin, the releases' files (from their sdists) and the proofs;
- ``decide``: the one decision, for one change at one release: dropped, kept, refreshed,
  conflict, moved, collision;
- ``releasewalk``: the one state machine: every change, every release, one decision per
  step; drops proven where they happen, conflicts asked where they first happen (and only
  when no later release up to the target clears them), resolution records applied. Its
  parts: ``walkdata`` (the walk as plain data: blobs, forms, cells), ``replay`` (resolution
  records applied), ``lookahead`` (where a conflict is taken up) and ``settle`` (a person's
  resolution of a stop);
- ``records``: resolution records (a conflict resolved once is not asked again);
- ``state``, ``workspace``, ``report``, ``driver``: the rebase in a project: its saved state,
  the checkout a person resolves in, the report, and start / continue / abort.

``track`` and ``outlook`` run the same walk; only the rebase writes the project.
"""

from vllm_overlay.errors import NoRebaseError, RebaseInProgressError
from vllm_overlay.rebase.decide import DROPPED, KEPT, REFRESHED
from vllm_overlay.rebase.driver import abort, continue_, start
from vllm_overlay.rebase.report import next_steps, report
from vllm_overlay.rebase.state import STOP_COMMIT, STOP_KINDS, STOP_TESTS, in_progress
from vllm_overlay.rebase.target import latest_release, release_of_commit, resolve_target
from vllm_overlay.rebase.walkdata import RECORD, RESOLVED

__all__ = [
    "DROPPED",
    "KEPT",
    "RECORD",
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
