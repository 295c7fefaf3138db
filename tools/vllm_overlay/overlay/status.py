"""What ``vllm-overlay status`` shows of the overlay, as plain data: the pin, each change in
series order, the checkout's state and an import in progress. (The resolution records a
rebase reuses are the rebase's: ``rebase/records.py`` ``listing``.)"""

from __future__ import annotations

from pathlib import Path

from vllm_overlay.overlay import importing
from vllm_overlay.overlay.checkout import checkout_state
from vllm_overlay.overlay.model import Change, Overlay
from vllm_overlay.overlay.project import Project
from vllm_overlay.pin.lockfile import Lock


def status(project: Project, checkout: Path) -> dict:
    """The project's pin and changes, and how ``checkout`` relates to them."""
    lock, overlay = project.lock(), project.overlay()
    u = lock.upstream
    return {
        "upstream": u.as_dict(),
        "artifacts": [a.__dict__ for a in lock.artifacts],
        "variants": {v: lock.platforms(v) for v in lock.variants()},
        "built_from_source": {
            v: sorted(s.machine for s in lock.sources if s.project == v)
            for v in sorted({s.project for s in lock.sources})
        },
        "changes": [_change(c, lock, overlay) for c in overlay.changes],
        "checkout": {"path": str(checkout), **checkout_state(checkout, lock, overlay).to_json()},
        "import": _import_state(project),
    }


def _change(c: Change, lock: Lock, overlay: Overlay) -> dict:
    u = lock.upstream
    return {
        "id": c.id,
        "title": c.title,
        "origin": c.origin,
        "origin_kind": c.origin_kind,
        "forwarded": c.forwarded.to_json(),
        "since": c.since,
        "security": c.security,
        "drop_when": c.drop_when,
        "drop_condition": c.drop_condition,
        "drop_rule": c.drop_rule,
        "drop_now": c.dropped_by(u.name, u.version),
        "files": [_file(c, f, lock, overlay) for f in c.files],
        "tests": list(c.tests),
        "builds": list(c.builds),
        "proof": c.proof,
        "upstream_tests": list(c.upstream_tests),
    }


def _file(c: Change, path: str, lock: Lock, overlay: Overlay) -> dict:
    """One file of a change: added (absent at the pin, and this is the first change to touch
    it) or patched, and the earlier changes of the same file."""
    base = lock.base.get(path, "?")
    owners = [o.id for o in overlay.owners(path)]
    added = base == "absent" and owners[0] == c.id
    return {
        "path": path,
        "base": base,
        "kind": "added" if added else "patched",
        "after": owners[: owners.index(c.id)],
    }


def _import_state(project: Project) -> dict | None:
    if not importing.in_progress(project):
        return None
    st = importing.load_state(project)
    return {"id": st.meta.id, "checkout": st.checkout, "conflicted": st.conflicted}
