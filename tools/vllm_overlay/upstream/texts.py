"""What a person submits: the commit message, the pull-request body, the advisory.

The commit message: a title with vLLM's prefix (its PR-title rule: ``[Tag]`` prefixes, a
space, the description), the why (the first paragraph of the change's ``why``: the problem
and the fix; the later paragraphs are about our carrying it), the reproduction (the change's
``reproduction``), the tests, then the trailers: the assistant's attribution
(``Co-authored-by:``, vLLM's AGENTS.md's example) before ``Signed-off-by:`` from the user's git
identity (vLLM's DCO).

The pull-request body fills the release's own template (``.github/PULL_REQUEST_TEMPLATE.md``)
section by section, each saying a thing once (vLLM's AGENTS.md, tests/AGENTS.md):

- Overview: the title, and the upstream issues the change records (``bugs``);
- Claims: which tests fail on the release as released and pass with the change;
- Validation: both commands a reviewer runs in vLLM's tree (without the fix, then with it)
  with the relevant output of each as the proof ran them (the failing tests' short summary
  lines with their messages, trimmed; pytest's last line); the CI step that selects the tests
  (``ci.py``) and what its triggers leave out; the hooks in one sentence (what failed or
  fixed files, how many passed, which were not run here);
- Details: the why, the reproduction, why this duplicates no open PR (what the record says,
  and AGENTS.md's ``gh`` searches filled in, left for the person: they need GitHub), and the
  statement of AI assistance. The template's "AI assistance was used" box is ticked; a heading
  we have nothing for keeps its comment.

Without a template: Purpose, Test Plan, Test Result and the same two sections. A security fix
gets no pull-request body: an advisory text for the release's security policy (a private
report), instead.
"""

from __future__ import annotations

import re

from vllm_overlay.overlay.model import Change

TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
SECURITY = "SECURITY.md"
AREAS = ".buildkite/test_areas"
TRAILER = "Co-authored-by"  # vLLM's AGENTS.md's own example of an attribution trailer
PYTEST = ".venv/bin/python -m pytest -v"  # how vLLM's AGENTS.md runs a test file
AI_BOX = re.compile(r"^- \[ \] AI assistance was used", re.I)
# Title prefixes by the paths a change touches, first match wins (vLLM's usual tags).
PREFIXES = (
    ("vllm/distributed/kv_transfer/", "[Bugfix][KVConnector]"),
    ("vllm/platforms/cpu", "[Bugfix][CPU]"),
    ("vllm/v1/worker/cpu", "[Bugfix][CPU]"),
    ("csrc/cpu/", "[Bugfix][CPU]"),
    ("vllm/entrypoints/", "[Bugfix][Frontend]"),
    ("vllm/", "[Bugfix]"),
)


def prefix_for(change: Change) -> str:
    for path in change.files:
        for start, prefix in PREFIXES:
            if path.startswith(start):
                return prefix
    return "[Bugfix]"


def why_for_upstream(change: Change) -> str:
    """The why's first paragraph, as one paragraph per blank line."""
    paras = [p.strip() for p in re.split(r"\n\s*\n", change.why.strip()) if p.strip()]
    return paras[0] if paras else change.title


def _wrap(text: str, width: int = 72) -> str:
    out = []
    for para in re.split(r"\n\s*\n", text.strip()):
        words, line = para.split(), ""
        lines = []
        for w in words:
            if line and len(line) + 1 + len(w) > width:
                lines.append(line)
                line = w
            else:
                line = f"{line} {w}" if line else w
        lines.append(line)
        out.append("\n".join(lines))
    return "\n\n".join(out)


def commit_message(change: Change, title: str, tests: list[str], identity: tuple[str, str],
                   assisted_by: str) -> str:  # fmt: skip
    """The message: the title, the why, the reproduction, the tests; then the trailers, the
    assistant's attribution before the sign-off (vLLM's AGENTS.md, "Commit messages")."""
    body = [_wrap(why_for_upstream(change))]
    if change.reproduction:
        body.append("Reproduction:\n\n" + _wrap(change.reproduction))
    if tests:
        by_file: dict[str, list[str]] = {}
        for t in tests:  # a path, or path::test
            path, _, name = t.partition("::")
            by_file.setdefault(path, []).append(name)
        body.append("Tests: " + "; ".join(
            f"{', '.join(n for n in names if n)} in {p}" if any(names) else p
            for p, names in by_file.items()))  # fmt: skip
    body.append(f"{TRAILER}: {assisted_by}\nSigned-off-by: {identity[0]} <{identity[1]}>")
    return f"{title}\n\n" + "\n\n".join(body) + "\n"


def code_paths(proof: dict) -> list[str]:
    """The commit's files that are not tests (what the run without the fix takes back)."""
    return [p for p in proof["commit_files"] if not p.startswith("tests/")]


def _block(lang: str, lines: list[str]) -> list[str]:
    return [f"```{lang}", *lines, "```"]


def run_commands(proof: dict) -> tuple[list[str], list[str]]:
    """The commands a reviewer runs in vLLM's tree on this commit: without the fix (the
    release's code, this commit's tests), then with it."""
    code = " ".join(code_paths(proof))
    pytest = f"{PYTEST} {' '.join(proof['targets'])}"
    without = [f"git diff HEAD~1 -- {code} | git apply -R", pytest] if code else [pytest]
    with_ = ([f"git checkout HEAD -- {code}"] if code else []) + [pytest]
    return without, with_


def hooks_line(proof: dict) -> str:
    """The hooks in one sentence: what failed or fixed files, then how many passed, and
    which were not run here (named briefly)."""
    hooks = proof.get("hooks", [])
    ran = [h for h in hooks if h["ran"]]
    failed = [h["id"] for h in ran if not h["ok"]]
    fixed = [f["id"] for f in proof.get("hook_fixes", [])]
    skipped = [h["id"] for h in hooks if not h["ran"]]
    parts = [f"{len(ran) - len(failed)} of the hooks that select the changed files pass on "
             "this commit"]  # fmt: skip
    if failed:
        parts.append("FAILED: " + ", ".join(failed))
    if fixed:
        parts.append(f"{', '.join(fixed)} fixed the files first (the fixes are in the commit)")
    if skipped:
        parts.append(f"{len(skipped)} not run here ({', '.join(skipped)})")
    return "pre-commit (the release's `.pre-commit-config.yaml`): " + "; ".join(parts) + "."


def ci_lines(proof: dict) -> list[str]:
    """Which CI step runs each test file, and what its triggers leave out."""
    ci = proof.get("ci") or {}
    if not ci.get("steps_read"):
        return [f"CI: no step file under `{AREAS}/` in this tree; say where the tests run."]
    out = []
    for sel in ci["tests"]:
        if not sel["steps"]:
            where = sel["suggestion"] or f"a step in `{AREAS}/`"
            out.append(f"CI: no step in `{AREAS}/` selects `{sel['test']}`; it needs adding "
                       f"to {where}.")  # fmt: skip
            continue
        for st in sel["steps"]:
            note = f" ({st['note']})" if st["note"] else ""
            out.append(f"CI: `{st['file']}`, step \"{st['label']}\" (`{st['command']}`) "
                       f"selects `{sel['test']}`{note}.")  # fmt: skip
            for path, why in st["uncovered"]:
                by = f"excluded by `{why}`" if why else "no prefix takes it"
                out.append(f"  Its `source_file_dependencies` do not cover `{path}` ({by}): "
                           "a later change to that file alone does not run it.")  # fmt: skip
    return out


def validation(proof: dict) -> str:
    """Both commands and their relevant output, the CI step, the hooks."""
    without_cmd, with_cmd = run_commands(proof)
    w, wo = proof["with"], proof["without"]
    base = (
        "the code as released"
        if not proof.get("stack")
        else "the code of the commit's parent, the pull request it is stacked on"
    )
    lines = [f"From the root of vLLM's tree on this commit, in a {proof['release']} CPU test "
             "environment:", "", f"Without the fix ({base}, this commit's tests):",
             ""]  # fmt: skip
    lines += _block("bash", without_cmd) + [""] + _block("text", wo.get("output") or
                                                          [wo["summary"]]) + [""]  # fmt: skip
    lines += ["With the fix:", ""] + _block("bash", with_cmd) + [""]
    lines += _block("text", w.get("output") or [w["summary"]]) + [""]
    if proof.get("engine_tests"):
        lines += [
            "The regression test through `LLM` starts the engine, so it is not in the "
            "runs above (a source tree, without vLLM's compiled extension); run it on a "
            "build of this tree, without the fix and with it:",
            "",
        ]
        lines += _block("bash", [f"{PYTEST} {' '.join(proof['engine_tests'])}"]) + [""]
    lines += [f"- {x}" if not x.startswith("  ") else x for x in ci_lines(proof)]
    lines.append(f"- {hooks_line(proof)}")
    return "\n".join(lines)


def claims(proof: dict) -> str:
    """What the change accomplishes, each with the evidence Validation shows."""
    failing = set(proof["without"].get("failing", []))
    by_file: dict[str, list[str]] = {}
    for t in failing:
        path, _, name = t.partition("::")
        by_file.setdefault(path, []).append(name)
    out = []
    for path, names in sorted(by_file.items()):
        listed = ", ".join(f"`{n}`" for n in sorted(names))
        where = (
            f"on {proof['release']} as released"
            if not proof.get("stack")
            else "without this change (on the pull request it is stacked on)"
        )
        out.append(f"- {listed} (`{path}`) fail {where} and pass with this change.")
    both = proof["with"]["passed"] - len(failing)
    if both > 0:
        out.append(f"- {both} more test(s) of the same files pass on both: the behaviour the "
                   "fix keeps.")  # fmt: skip
    docs = [p for p in proof["commit_files"] if p.startswith("docs/")]
    if docs:
        out.append("- The docs say it: " + ", ".join(f"`{p}`" for p in docs) + ".")
    return "\n".join(out)


def overview(change: Change) -> str:
    links = list(change.bugs)
    text = change.title.rstrip(".") + "."
    return text + ("\n\nRelated: " + ", ".join(links) if links else "")


def duplicate_section(change: Change, proof: dict) -> str:
    """Why this is not another open PR's work: what the change's record says, and the
    searches vLLM's AGENTS.md asks for, filled in, left for the person (they need GitHub)."""
    dup = proof.get("duplicate") or {}
    known = [f"- Upstream issue: {b}" for b in change.bugs]
    if change.forwarded.to:
        known.append(f"- Sent before: {change.forwarded.to}")
    if not known:
        known = ["- No upstream issue or pull request is known for this fix; it has not been "
                 "offered upstream before."]  # fmt: skip
    cmds = dup.get("commands") or []
    lines = known
    if cmds:
        lines.append("")
        lines += [
            "To run before submitting (they need GitHub, which the machine that prepared "
            "this patch could not reach), and to replace with what they found:",
            "",
        ]
        lines += _block("bash", cmds)
    return "\n".join(lines)


def ai_statement(assisted_by: str) -> str:
    name = re.sub(r"\s*<[^>]*>", "", assisted_by).strip() or assisted_by
    return (f"AI assistance was used to prepare this change ({name}, credited in the commit's "
            f"`{TRAILER}:` trailer). The person submitting it must review every changed line "
            "and run the tests above before submitting, and answers for it (vLLM's AGENTS.md, "
            "\"Accountability\").")  # fmt: skip


def stacked_on(proof: dict) -> str:
    """Where the change goes upstream after others of ours: which, to send (and link) first."""
    stack = proof.get("stack") or []
    if not stack:
        return ""
    first = "; ".join(f"{s['title']} (`{k + 1:04d}-{s['change']}.patch`)"
                      for k, s in enumerate(stack))  # fmt: skip
    return (
        f"\n\nStacked on {first}: its tests use what that pull request adds. Send it "
        "first and link it here; this pull request's diff is its own commit alone."
    )


def pr_body(change: Change, template: str | None, proof: dict, assisted_by: str) -> str:
    purpose = why_for_upstream(change)
    repro = change.reproduction.strip()
    details = "\n\n".join(x for x in (purpose, repro and f"Reproduction:\n\n{repro}") if x)
    extra = [("Not a duplicate", duplicate_section(change, proof)),
             ("AI assistance", ai_statement(assisted_by))]  # fmt: skip
    sections = {
        "overview": overview(change) + stacked_on(proof),
        "purpose": purpose,
        "claims": claims(proof),
        "validation": validation(proof),
        "test plan": "The tests, on the release without the fix (they fail) and with it (they "
        "pass): " + ", ".join(f"`{t}`" for t in proof["targets"]),
        "test result": validation(proof),
        "details": details + "".join(f"\n\n### {h}\n\n{t}" for h, t in extra),
    }
    if template is None:
        heads = ("Purpose", "Test Plan", "Test Result")
        text = "\n\n".join(f"## {h}\n\n{sections[h.lower()]}" for h in heads)
        return text + "".join(f"\n\n## {h}\n\n{t}" for h, t in extra) + "\n"
    lines = template.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        key = lines[i][3:].strip().lower() if lines[i].startswith("## ") else ""
        if key in sections:  # our text replaces the section's hint, up to the next one
            out += [lines[i], "", sections[key], ""]
            i += 1
            while i < len(lines) and not lines[i].startswith("## ") and lines[i] != "---":
                i += 1
            continue
        line = lines[i]
        if AI_BOX.match(line):  # the template's own box: true, so ticked
            line = line.replace("[ ]", "[x]", 1)
        out.append(line)  # a section we have nothing for keeps its hint
        i += 1
    return "\n".join(out) + "\n"


def advisory(change: Change, release: str, name: str, policy: str, proof: dict,
             patch_name: str, assisted_by: str) -> str:  # fmt: skip
    """The text of a private report under the release's security policy."""
    where = re.search(r"\((https?://[^)]*security/advisories/new)\)", policy)
    url = where.group(1) if where else "the address the release's SECURITY.md gives"
    return "\n".join([
        f"# Security advisory draft: {change.title}",
        "",
        f"Report privately, through {url} (vLLM's SECURITY.md); not as a public issue or pull "
        f"request. Attach `{patch_name}` to it (or push the commit to its private fork).",
        "",
        f"**Affected:** {name} {release}"
        + (f" (and every release since {change.since}, where we found and carried it)"
           if change.since else "") + ": "
        + ", ".join(f"`{p}`" for p in change.files if not p.startswith("tests/")),
        "",
        "## Summary", "", why_for_upstream(change), "",
        "## Reproduction", "", change.reproduction.strip() or "(see the tests)", "",
        "## Fix", "",
        f"`{patch_name}` (one commit on {name} {release}, signed off; `git am` applies it)."
        + stacked_on(proof), "",
        "## Validation", "", validation(proof), "",
        "## AI assistance", "", ai_statement(assisted_by), "",
    ])  # fmt: skip
