"""What a person submits: the commit message, the pull-request body, the advisory.

The commit message: a title with vLLM's prefix (its PR-title rule: ``[Tag]`` prefixes, a
space, the description), the why (the first paragraph of the change's ``why``: the problem
and the fix; the later paragraphs are about our carrying it), the reproduction (the change's
``reproduction``), the tests, and ``Signed-off-by:`` from the user's git identity (vLLM's DCO).

The pull-request body fills the release's own template (``.github/PULL_REQUEST_TEMPLATE.md``)
section by section: the purpose, the claims, the validation (test plan and results, with and
without the commit, and the hooks), the details; a heading we have nothing for keeps its
comment. Without a template: Purpose, Test Plan, Test Result. A security fix gets no pull-request
body: an advisory text for the release's security policy (a private report), instead.
"""

from __future__ import annotations

import re

from vllm_overlay.overlay.model import Change

TEMPLATE = ".github/PULL_REQUEST_TEMPLATE.md"
SECURITY = "SECURITY.md"
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


def commit_message(change: Change, title: str, tests: list[str], identity: tuple[str, str]) -> str:
    body = [_wrap(why_for_upstream(change))]
    if change.reproduction:
        body.append("Reproduction:\n\n" + _wrap(change.reproduction))
    if tests:
        body.append("Tests: " + ", ".join(tests))
    body.append(f"Signed-off-by: {identity[0]} <{identity[1]}>")
    return f"{title}\n\n" + "\n\n".join(body) + "\n"


def validation(proof: dict) -> str:
    """The test plan and results, with and without the commit, and the hooks' verdicts."""
    lines = ["Test plan:", "", "```", f"pytest {' '.join(proof['targets'])}", "```", ""]
    w, wo = proof["with"], proof["without"]
    lines += [
        f"- with this commit, on {proof['release']}: {w['summary']}",
        f"- without it (the same tests on {proof['release']} as released): {wo['summary']}",
    ]
    if wo.get("failing"):
        lines.append("  - failing there: " + ", ".join(f"`{t}`" for t in wo["failing"]))
    hooks = proof.get("hooks", [])
    ran = [h for h in hooks if h["ran"]]
    if ran:
        lines.append("- pre-commit hooks on the changed files: " + ", ".join(
            f"{h['id']} {'passed' if h['ok'] else 'FAILED'}" for h in ran))  # fmt: skip
    return "\n".join(lines)


def pr_body(change: Change, template: str | None, proof: dict) -> str:
    purpose = why_for_upstream(change)
    repro = change.reproduction.strip()
    details = repro and f"Reproduction:\n\n{repro}"
    sections = {
        "overview": change.title + ".",
        "purpose": purpose,
        "claims": f"- {change.title}.\n- Tests: " + ", ".join(f"`{t}`" for t in proof["targets"]),
        "validation": validation(proof),
        "test plan": "```\npytest " + " ".join(proof["targets"]) + "\n```",
        "test result": validation(proof).split("```\n\n", 1)[-1],
        "details": "\n\n".join(x for x in (purpose, details) if x),
    }
    if template is None:
        return (
            "\n\n".join(
                f"## {h}\n\n{sections[h.lower()]}" for h in ("Purpose", "Test Plan", "Test Result")
            )
            + "\n"
        )
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
        out.append(lines[i])  # a section we have nothing for keeps its hint
        i += 1
    return "\n".join(out) + "\n"


def advisory(change: Change, release: str, name: str, policy: str, proof: dict,
             patch_name: str) -> str:  # fmt: skip
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
        f"`{patch_name}` (one commit on {name} {release}, signed off; `git am` applies it).", "",
        "## Validation", "", validation(proof), "",
    ])  # fmt: skip
