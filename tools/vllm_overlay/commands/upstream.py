"""vllm-overlay upstream: one change of ours, ready to send upstream, with proof."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vllm_overlay.commands._options import add_index_url
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay.project import find_project
from vllm_overlay.upstream import texts
from vllm_overlay.upstream.ready import upstream

HELP = "prepare a change of ours for upstream: the commit, the patch, the PR body, proven"
DESCRIPTION = """\
Prepare what a person submits to vLLM for one change of ours (origin_kind = "original"),
at the newest release this project knows (the pin in upstream.lock), and prove it first:

  the commit   the change alone, on a clone of the release's tree (its sdist as a git
               repository, as apply and rebase use), on branch upstream/<change>: its code
               change without the earlier changes of our series (three-way merged; an
               overlap is refused), its tests at vLLM's paths without our scaffolding (the
               VLLM_OVERLAY_TREE switch, "Added by vllm-overlay"), a test helper an earlier
               change adds brought along; a title with vLLM's prefix ([Bugfix][KVConnector],
               ... or --prefix), the why (the first paragraph of the change's `why`), the
               reproduction (`reproduction`), then the trailers: Co-authored-by: naming the
               AI assistant (--assisted-by, or git config vllm-overlay.assistedBy; vLLM's
               AGENTS.md asks AI-assisted work to say so) and Signed-off-by: from your git
               identity (git config user.name and user.email; vLLM takes only signed-off
               commits). Either missing: refused, naming the command that sets it
  the hooks    the release's own pre-commit hooks on the commit's files: ruff check and
               ruff format at the version its .pre-commit-config.yaml pins (installed once
               into the cache), and its local Python hooks (SPDX header, forbidden imports,
               ...) in the release's test environment; their fixes go into the commit, then
               each must pass and change nothing
  the proof    the change's tests at the release with the commit (they must pass) and
               without it, the tests alone (they must fail), in the release's test
               environment
  the rules    the release's AGENTS.md and tests/AGENTS.md, item by item (checklist.md):
               the tests fail without and pass with, the hooks, tests in the existing files,
               real objects and no release shims in the added test lines, a regression test
               through LLM or RemoteOpenAIServer, the CI step of .buildkite/test_areas/ that
               selects each test (and whether its triggers cover the changed files), the
               docs, the AI statement and trailer, the duplicate-work section. Static checks
               are heuristics and list their evidence; a "no" is a finding, not a refusal

It refuses, naming what failed, when any of that does not hold (the proof is kept in
<out>.refused.json; nothing else is written). Otherwise it writes, atomically, into --out
(default .work/upstream/<change>/): 0001-<change>.patch (git format-patch), pull-request.md
(the release's pull-request template filled: overview, claims, validation with both pytest
commands and their output, the CI step and the hooks, details with why this duplicates no
open PR and the statement of AI assistance) or, for a change marked `security = true`,
advisory.md (a private report under the release's SECURITY.md) and no pull-request body;
checklist.md; proof.json; vllm/, the clone with the commit. It sends nothing: docs/upstream.md says how to submit, and how to record
the change's standing (`forwarded`) once sent.
"""


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("change", metavar="CHANGE", help="the id of a change of ours in overlay.toml")
    p.add_argument("--out", metavar="DIR", type=Path,
                   help="where to write it (default: .work/upstream/CHANGE)")  # fmt: skip
    p.add_argument("--prefix", metavar="TAGS",
                   help='the title\'s prefix instead of the derived one, e.g. "[Bugfix][CPU]"')  # fmt: skip
    p.add_argument(
        "--test-python",
        metavar="PATH",
        help="run the tests and local hooks with this Python instead of vLLM's CPU test env",
    )
    p.add_argument(
        "--assisted-by",
        metavar='"NAME <EMAIL>"',
        help="the AI assistant the commit's Co-authored-by: trailer and the PR's statement of "
        "AI assistance name (default: git config vllm-overlay.assistedBy; neither: refused)",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    add_index_url(p)


def run(args: argparse.Namespace) -> int:
    report = upstream(find_project(), args.change, out=args.out, prefix=args.prefix,
                      settings=Settings.from_options(args),
                      assisted_by=args.assisted_by)  # fmt: skip
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
        return 0
    w, wo = report["with"], report["without"]
    print(f"{report['change']}: ready for upstream at {report['release']} "
          f"({report['seconds']:.0f} s)")  # fmt: skip
    print(f"  title: {report['title']}")
    print(f"  tests with the commit:    {w['summary']}")
    print(f"  tests without the commit: {wo['summary']}")
    print(f"  {texts.hooks_line(report)}")
    for fix in report["hook_fixes"]:
        print(f"  hook {fix['id']} fixed, in the commit: {', '.join(fix['changed'])}")
    for line in texts.ci_lines(report):
        print(f"  {line.strip()}")
    for note in report["notes"]:
        print(f"  note: {note}")
    print("checklist against the release's AGENTS.md and tests/AGENTS.md (checklist.md):")
    for item in report["checklist"]:
        print(f"  {item['verdict']:<19} {item['rule']}")
    findings = [i for i in report["checklist"] if i["verdict"] == "no"]
    for item in findings:
        print(f"  finding: {item['rule']}:")
        for e in item["evidence"]:
            print(f"    {e.strip()}")
    print("written:")
    for f in report["written"]:
        size = report["sizes"].get(Path(f).name)
        print(f"  {f}" + (f"  ({size} bytes)" if size is not None else ""))
    if report["security"]:
        print("a security fix: report it privately (advisory.md says where); no public PR")
    return 0
