"""vllm-overlay rebase: move the overlay to another vLLM release."""

from __future__ import annotations

import argparse
import json
import sys

from vllm_overlay import rebase
from vllm_overlay.commands._options import add_checkout, add_index_url, add_source
from vllm_overlay.errors import UsageError
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay.project import find_project
from vllm_overlay.rebase.reportdata import (
    Aborted,
    ChangeOutcome,
    Noop,
    Outcome,
    Pin,
    RebaseReport,
)

HELP = "move the overlay to a new vLLM release: keep, refresh, drop, or stop on a conflict"
DESCRIPTION = """\
Move the overlay to another release, walking every final release between the pin and the
target (patch releases included; --direct jumps straight to the target). At each release,
each change, in overlay.toml order, in its current form, on the release as the changes
before it leave it:

  dropped    one of four ways, tried in this order for each of the change's files:
               1. its drop_when holds for the release (e.g. ">=0.25.0");
               2. a file the change adds is in the release's tree, byte for byte;
               3. the change's patch of the file applies in reverse to the release;
               4. the three-way merge of our file into upstream's leaves upstream's
                  unchanged (upstream has the change, in other words or context);
             and, after a stop, when the person resolves it to upstream's code. It drops at
             the FIRST release where this holds, proven there: its tests (our test files
             placed beside upstream's) and, for a backport, upstream's own tests of it
             (upstream_tests) run on that release WITHOUT the change. Not proven: a stop.
  kept       it merges, and its exported patch is byte-identical.
  refreshed  it merges cleanly onto the new code; the patch gets the new context.
  stop       a conflict (git's three-way merge leaves diff3 markers), a file we add that
             upstream now also has (a collision), or a touched file upstream deleted or
             renamed (git's rename candidates are listed), where upstream touches our
             lines: at the first such release, or, when upstream touches the same lines
             again before the target, at the last (asked once). Not asked when a
             resolution record resolves it (its tests must pass), or when a later release
             up to the target clears it (drops or merges it): the walk never asks more
             than the direct jump would.
             Resolve in the checkout (it shows that release), then --continue; or --abort.
             --continue first runs the change's tests on that release with your
             resolution: if they fail, nothing is recorded, the stop stays, the checkout is
             as you left it, and the failing tests are named (fix, then --continue again).
             A proven resolution is recorded (overlay/resolutions/), so no walk asks it
             again. --continue --unproven REASON records it though its tests fail, marked
             unproven (who, why, which tests failed): `status` and the outlook show the
             mark, and a later walk applies it only where the change's tests pass with it.

Only when every change is settled are upstream.lock (the new pin: version, tag, commit,
artifact hashes, base hashes), overlay/ (exported from the checkout) and overlay.toml
(dropped changes moved to [[dropped]] with the version and the proof; revision bumped)
written. --abort restores upstream.lock, overlay/ and the checkout as they were. State is
kept in .work/rebase/, so --continue and --abort work from a new shell.

  vllm-overlay rebase --to 0.25.0 [--commit SHA]
  vllm-overlay rebase --to latest
  vllm-overlay rebase --continue
  vllm-overlay rebase --abort

The new pin's full commit comes from the git remote's tag; without network access to it,
pass --commit SHA (checked against the commit the sdist records), with --to or, when the
rebase asks for it before writing the lock, with --continue. --to also takes a full
commit id (its release is found from the remote's tags). Exit status: 0 complete, 1 stopped
(the report says why and what to do), 2 usage error.
"""


def configure(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument(
        "--to",
        metavar="VERSION|COMMIT",
        help="the release to move to (e.g. 0.25.0), `latest` (newest on the index), "
        "or the full commit id of a release",
    )
    g.add_argument("--continue", dest="cont", action="store_true", help="go on after resolving")
    g.add_argument("--abort", action="store_true", help="put everything back as it was")
    p.add_argument(
        "--commit",
        help="the new release's full commit id, where the git remote is unreachable (with "
        "--to, or later with --continue)",
    )
    add_source(p)
    add_index_url(p)
    add_checkout(p)
    p.add_argument(
        "--test-python",
        metavar="PATH",
        help="run dropped changes' tests with this Python (it needs pytest; the tree goes on "
        "PYTHONPATH) instead of vLLM's CPU test environment",
    )
    p.add_argument(
        "--direct",
        action="store_true",
        help="jump straight to the target instead of walking every release in between",
    )
    p.add_argument(
        "--unproven",
        metavar="REASON",
        help="with --continue: record your resolution even though the change's tests fail "
        "with it at the stop's release, marked unproven with REASON and your git user name "
        "(e.g. --unproven 'the test needs a GPU'); without it, a resolution whose tests fail "
        "is refused and the stop stays",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")


def _options_only_with_to(args: argparse.Namespace) -> None:
    if args.unproven is not None and not args.cont:
        raise UsageError(
            "--unproven REASON goes with --continue (a resolution you record "
            "though its tests fail)."
        )
    if args.to:
        return
    names = ("git_url", "index_url", "checkout", "test_python", "direct")
    if args.abort:
        names = ("commit", *names)
    given = [f"--{name.replace('_', '-')}" for name in names if getattr(args, name)]
    if args.source != "sdist":
        given.append("--source")
    if given:
        raise UsageError(
            f"{', '.join(given)} go(es) with --to; --continue and --abort use what the rebase "
            "started with (--continue takes only --commit, the new release's commit id, and "
            "--unproven)."
        )


def run(args: argparse.Namespace) -> int:
    _options_only_with_to(args)
    project = find_project()
    if args.abort:
        rep = rebase.abort(project)
    elif args.cont:
        rep = rebase.continue_(project, commit=args.commit, unproven=args.unproven)
    else:
        rep = rebase.start(
            project,
            args.to,
            settings=Settings.from_options(args),
            commit=args.commit,
            checkout=args.checkout,
            direct=args.direct,
        )
    if args.json:
        print(json.dumps(rep.to_json(), indent=2, sort_keys=True))
    else:
        print(render(rep))
    if isinstance(rep, RebaseReport) and rep.stopped_at is not None:
        s = rep.stopped_at
        print(
            f"vllm-overlay rebase: stopped ({s.state}"
            + (f" at change {s.id}" if s.id else "")
            + "); see above for what to do.",
            file=sys.stderr,
        )
        return 1
    return 0


def render(rep: Outcome) -> str:
    """The report for people: one screen."""
    if isinstance(rep, Noop):
        return rep.message
    if isinstance(rep, Aborted):
        return (
            f"rebase aborted: upstream.lock, overlay/ and {rep.checkout} are back at "
            f"{rep.from_version}."
        )
    assert isinstance(rep, RebaseReport)
    to, stop = rep.to, rep.stopped_at
    head = f"rebase {to.name} {rep.from_version} -> {to.version}"
    if len(rep.path) > 1:
        head += f" (walked {' -> '.join(rep.path)})"
    if stop is None:
        lines = [f"{head}: complete"]
    elif stop.state == rebase.STOP_COMMIT:
        lines = [f"{head}: STOPPED before writing the new pin (commit-unknown)"]
    else:
        lines = [f"{head}: STOPPED at change {stop.id} on {to.name} {stop.release} "
                 f"({stop.state})"]  # fmt: skip
    for c in rep.changes:
        lines += _render_change(c)
    for w in rep.waited:
        lines.append(f"  not asked: {w.id} at {w.release} ({w.met}): {w.reason}")
    if rep.proof_releases:
        lines.append("test environments (proofs): " + ", ".join(
            f"{r} {s:.0f} s" for r, s in sorted(rep.proof_releases.items())))  # fmt: skip
    lines += [f"note: {n}" for n in rep.notes]
    if stop is None:
        lines += _render_pin(to)
        if rep.revision and rep.revision[0] != rep.revision[1]:
            lines.append(f"overlay revision {rep.revision[0]} -> {rep.revision[1]}")
        wrote = ", ".join([*(rep.written or ()), *[f"removed {p}" for p in rep.removed]])
        lines.append(f"wrote {wrote}")
        lines.append(f"checkout {rep.checkout}: {to.version} + the overlay")
    else:
        lines.append(f"checkout: {rep.checkout}")
        lines += ["next: " + s for s in stop.next_steps]
    return "\n".join(lines)


def _render_change(c: ChangeOutcome) -> list[str]:
    state = c.state
    out = [f"  {state:11} {c.id}"]
    if state == rebase.DROPPED:
        out[0] += f" at {c.release}: {c.reason}"
        out.append(f"              proof: {c.proof}")
        if c.pull_request:
            out.append(f"              came back through {c.pull_request}")
    elif state in (rebase.KEPT, rebase.REFRESHED, rebase.RESOLVED, rebase.RECORD):
        if c.renamed:
            out[0] += " (moved " + ", ".join(f"{a} -> {b}" for a, b in c.renamed.items()) + ")"
        if c.unproven:
            out.append(
                f"              UNPROVEN at {', '.join(c.unproven)}: its resolution "
                "was recorded though the change's tests failed with it (--unproven)"
            )
    elif state == rebase.STOP_TESTS:
        out[0] += f" at {c.release}: {c.reason}"
        out.append("              its tests did not prove the drop: "
                   + (c.test_run.text if c.test_run else ""))  # fmt: skip
        runs = c.test_run.runs.values() if c.test_run else ()
        out += [f"              first error: {r.first_error}" for r in runs if r.first_error]
    elif state in rebase.STOP_KINDS:
        out += [f"              {p.path}: {p.kind}: {p.detail}" for p in c.problems]
        out += [f"              note: {n}" for n in c.notes]
    return out


def _render_pin(to: Pin) -> list[str]:
    lines = [f"new pin: {to.name} {to.version} (tag {to.tag}, commit {to.commit})"]
    for a in to.artifacts:
        lines.append(f"  {a.kind:5} {a.filename} sha256 {a.sha256} ({a.size} bytes)")
    variants = "; ".join(f"{v} ({', '.join(p)})" for v, p in to.variants.items())
    lines.append(f"  official wheels: {variants or 'none'}")
    lines.append(f"  built from source here: {to.built_from_source}")
    return lines
