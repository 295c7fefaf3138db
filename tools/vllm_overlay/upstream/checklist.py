"""The prepared commit against the release's own rules (its ``AGENTS.md``, ``tests/AGENTS.md``).

One item per rule, each with a verdict (``yes``, ``no``, ``left for the person``, ``n/a``) and
its evidence: the proof (the tests with and without the commit, the hooks), the CI step
(``ci.py``), the commit's files, its message and the pull-request body. The static checks
read only the lines the commit adds to its tests (patched methods, stand-in objects, private
attributes, release shims, the entry point a regression test goes through) and the release's
tree beside them (an existing test file of the same module, a docs page that names the changed
module). They are heuristics: each lists the lines it found, as ``file:line: text``, for a
person to judge. What needs GitHub or a person's judgement is left for the person, named.

``checklist.md`` (beside ``pull-request.md``), ``proof.json``'s ``checklist`` and the report
carry the same items.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

YES, NO, PERSON, NA = "yes", "no", "left for the person", "n/a"

# (what it is, the pattern) over the added test lines; a heuristic each
STAND_INS = (
    ("patches an attribute or method", re.compile(
        r"monkeypatch\.setattr|\bmock\.patch\b|\bpatch\.object\(|(?<![\w.])patch\(")),
    ("builds an object without its constructor", re.compile(r"__new__\(")),
    ("a stand-in object", re.compile(r"\bSimpleNamespace\b|\bMagicMock\b|\bMock\(")),
    ("reaches a private attribute", re.compile(
        r"(?<![\w.])(?!self\.|cls\.)[A-Za-z_]\w*(?:\.\w+)*\._(?!_)\w+")),
    ("imports a private name", re.compile(r"^\s*from\s+\S+\s+import\s+.*\b_(?!_)\w+")),
)  # fmt: skip
SHIMS = (
    ("hasattr", re.compile(r"\bhasattr\(")),
    ("a version", re.compile(r"__version__|\bVersion\(|version\.parse|parse_version|"
                             r"metadata\.version\(|\bvllm\s*[<>]=?\s*v?\d+\.\d+", re.I)),
)  # fmt: skip
ENTRY = re.compile(r"\bLLM\(|\bvllm_runner\b|\bRemoteOpenAIServer\b")
DUP_PLACEHOLDERS = ("<issue_number>", "<short area keywords>")


@dataclass
class Item:
    rule: str
    source: str  # where the rule is written
    verdict: str
    evidence: list[str] = field(default_factory=list)
    heuristic: bool = False

    def to_json(self) -> dict:
        return {k: v for k, v in self.__dict__.items()}


def added_lines(old: bytes | None, new: bytes) -> list[tuple[int, str]]:
    """(line number, text) of each line ``new`` adds to ``old`` (all of them where new)."""
    b = new.decode(errors="replace").splitlines()
    if old is None:
        return list(enumerate(b, 1))
    a = old.decode(errors="replace").splitlines()
    out = []
    for tag, _i1, _i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag in ("insert", "replace"):
            out += [(j + 1, b[j]) for j in range(j1, j2)]
    return out


def scan(files: dict[str, bytes], base: dict[str, bytes | None],
         patterns: tuple[tuple[str, re.Pattern], ...]) -> list[str]:  # fmt: skip
    """``file:line: text (what)`` for each added test line a pattern finds."""
    hits = []
    for path in sorted(p for p in files if p.startswith("tests/") and p.endswith(".py")):
        for n, text in added_lines(base.get(path), files[path]):
            code = text.split("#", 1)[0] if not text.lstrip().startswith("#") else text
            found = [what for what, pat in patterns if pat.search(code)]
            if found:
                hits.append(f"{path}:{n}: {text.strip()[:140]} ({', '.join(found)})")
    return hits


def module_stems(files: dict[str, bytes]) -> list[str]:
    """The module names of the commit's code files (``vllm/.../x.py`` -> ``x``)."""
    return sorted({PurePosixPath(p).stem for p in files
                   if p.startswith("vllm/") and p.endswith(".py") and
                   PurePosixPath(p).stem != "__init__"})  # fmt: skip


def existing_tests(tree: Path, files: dict[str, bytes], base: dict[str, bytes | None]
                   ) -> list[str]:  # fmt: skip
    """Each new test file (and helper) of the commit beside a release test file that already
    names one of the changed modules: where the tests belong."""
    stems = module_stems(files)
    out = []
    for path in sorted(p for p in files if p.startswith("tests/") and base.get(p) is None):
        lines = files[path].count(b"\n")
        name = PurePosixPath(path).name
        if not name.startswith("test_"):
            out.append(f"{path}: a new helper module ({lines} lines)")
            continue
        here = tree / PurePosixPath(path).parent
        for other in sorted(here.glob("test_*.py")) if here.is_dir() else []:
            rel = f"{PurePosixPath(path).parent}/{other.name}"
            if rel in files and base.get(rel) is None:
                continue
            text = other.read_text(errors="replace")
            named = [s for s in stems if re.search(rf"\b{re.escape(s)}\b", text)]
            if named:
                out.append(f"{path}: a new file ({lines} lines), where {rel} already tests "
                           f"{', '.join(named)}")  # fmt: skip
                break
    return out


def docs_pages(tree: Path, files: dict[str, bytes]) -> list[str]:
    """The release's docs pages that name a changed module (where its behaviour is told)."""
    stems = module_stems(files)
    docs = tree / "docs"
    if not stems or not docs.is_dir():
        return []
    camel = {s: "".join(w.title() for w in s.split("_")) for s in stems}
    out = []
    for page in sorted(docs.rglob("*.md")):
        text = page.read_text(errors="replace")
        if any(s in text or camel[s] in text for s in stems):
            out.append(page.relative_to(tree).as_posix())
    return out


def duplicate_commands(agents: str | None, urls: list[str], keywords: str) -> list[str]:
    """AGENTS.md's duplicate-work ``gh`` commands, filled with the numbers of the change's
    issues and pull requests in the command's ``--repo`` and its area keywords (a command
    whose placeholder has nothing to fill is left out)."""
    cmds = [ln.strip() for ln in (agents or "").splitlines()
            if ln.strip().startswith("gh ") and any(p in ln for p in DUP_PLACEHOLDERS)]  # fmt: skip
    out = []
    for cmd in cmds:
        if DUP_PLACEHOLDERS[0] in cmd:
            repo = re.search(r"--repo\s+(\S+)", cmd)
            mine = [u for u in urls if not repo or f"github.com/{repo.group(1)}/" in u]
            out += [cmd.replace(DUP_PLACEHOLDERS[0], n) for n in issue_numbers(mine)]
        elif keywords:
            out.append(cmd.replace(DUP_PLACEHOLDERS[1], keywords))
    return out


def issue_numbers(urls: list[str]) -> list[str]:
    return [m.group(1) for u in urls if (m := re.search(r"/(?:issues|pull)/(\d+)", u))]


def area_keywords(files: dict[str, bytes]) -> str:
    """Short area keywords: the changed modules' names, as words."""
    stems = module_stems(files)
    return " ".join(dict.fromkeys(w for s in stems for w in s.split("_")))


def repeated_sentences(body: str) -> list[str]:
    """Sentences (of 20 characters or more) that the body says twice, outside code blocks
    and comments."""
    text = re.sub(r"```.*?```|<!--.*?-->|<details>.*?</details>", " ", body, flags=re.S)
    seen: dict[str, int] = {}
    for sentence in re.split(r"(?<=[.!?])\s+|\n\s*\n|\n[-#]+\s*", text):
        s = " ".join(sentence.strip(" -*#").split()).rstrip(".").lower()
        if len(s) >= 20:
            seen[s] = seen.get(s, 0) + 1
    return [s for s, n in seen.items() if n > 1]


def items(proof: dict, files: dict[str, bytes], base: dict[str, bytes | None], tree: Path,
          message: str, body: str | None) -> list[Item]:  # fmt: skip
    """The checklist: the commit against the release's AGENTS.md and tests/AGENTS.md."""
    code = [p for p in files if not p.startswith("tests/")]
    user_visible = any(p.startswith("vllm/") for p in code)
    return [
        _proof_item(proof, body),
        _hooks_item(proof),
        _reuse_item(tree, files, base),
        _real_objects_item(files, base),
        _shims_item(files, base),
        _entry_point_item(files, base, user_visible),
        _minimal_item(proof),
        *_ci_items(proof),
        _docs_item(proof, files, user_visible),
        _attribution_item(message, body),
        _not_duplicate_item(proof, body),
        _duplicate_searches_item(proof),
        _said_once_item(body),
        Item(
            "a person reviewed every changed line, ran the tests, and ran the pr-checklist skill",
            'AGENTS.md, "Accountability"',
            PERSON,
            ["the tool proves the tests; it cannot review for the person"],
        ),
    ]


def _proof_item(proof: dict, body: str | None) -> Item:
    w, wo = proof["with"], proof["without"]
    failed_without = not wo["ok"] and wo["failed"] + wo["errors"] > 0
    pasted = body is not None and all(ln in body for ln in (wo.get("output") or [])[:1])
    return Item(
        "tests pass with the commit and fail without it; both commands and their output in "
        "the PR body", "tests/AGENTS.md, \"Show the failure before the fix\"",
        YES if w["ok"] and failed_without and (pasted or body is None) else NO,
        [f"with: {w['summary']}", f"without: {wo['summary']}",
         *[f"  {ln}" for ln in (wo.get("output") or [])[:-1]],
         "pasted in pull-request.md's Validation" if pasted else
         "not in a pull-request body (an advisory)" if body is None else "NOT in the PR body"],
    )  # fmt: skip


def _hooks_item(proof: dict) -> Item:
    ran = [h for h in proof.get("hooks", []) if h["ran"]]
    not_run = [h["id"] for h in proof.get("hooks", []) if not h["ran"]]
    hooks_ok = bool(ran) and all(h["ok"] for h in ran)
    return Item(
        "the release's pre-commit hooks pass on the commit's files", "AGENTS.md, \"Running linters\"",
        YES if hooks_ok else NO,
        [f"{len(ran)} ran: " + ", ".join(f"{h['id']} {'passed' if h['ok'] else 'FAILED'}"
                                          for h in ran)]
        + ([f"not run here ({len(not_run)}): {', '.join(not_run)}: `pre-commit run --files` "
            "with the commit's files runs them"] if not_run else []),
    )  # fmt: skip


def _reuse_item(tree: Path, files: dict[str, bytes], base: dict[str, bytes | None]) -> Item:
    new_files = existing_tests(tree, files, base)
    return Item(
        "tests extend the existing test files and helpers (a new file only where none fits)",
        "AGENTS.md, \"Reuse before create\"",
        NO if any("already tests" in e for e in new_files) else YES,
        new_files or ["no new test file beside an existing test of the changed modules"],
        heuristic=True,
    )  # fmt: skip


def _real_objects_item(files: dict[str, bytes], base: dict[str, bytes | None]) -> Item:
    stand_ins = scan(files, base, STAND_INS)
    return Item(
        "real objects: no patched methods, stand-ins (SimpleNamespace, MagicMock), objects "
        "built around their constructor, or private attributes in the added test lines",
        "tests/AGENTS.md, \"Test real objects on the lightest real path\"",
        NO if stand_ins else YES, stand_ins or ["none found in the added test lines"],
        heuristic=True)  # fmt: skip


def _shims_item(files: dict[str, bytes], base: dict[str, bytes | None]) -> Item:
    shims = scan(files, base, SHIMS)
    return Item(
        "no shims for other releases (hasattr, version checks) in the added test lines",
        'AGENTS.md, "Keep it minimal" (code for another release is dead in upstream\'s tree)',
        NO if shims else YES,
        shims or ["none found in the added test lines"],
        heuristic=True,
    )


def _entry_point_item(files: dict[str, bytes], base: dict[str, bytes | None],
                      user_visible: bool) -> Item:  # fmt: skip
    entry = scan(files, base, (("entry point", ENTRY),))
    return Item(
        "a regression test through `LLM` (`vllm_runner`) or `RemoteOpenAIServer`",
        "tests/AGENTS.md, \"Test real objects\" (a fix to user-visible behavior)",
        (YES if entry else NO) if user_visible else NA,
        entry or (["no added test line calls LLM(, vllm_runner or RemoteOpenAIServer"]
                  if user_visible else ["the commit changes nothing under vllm/"]),
        heuristic=True)  # fmt: skip


def _minimal_item(proof: dict) -> Item:
    size = proof.get("size") or {}
    tests_n, code_n = size.get("test_lines_added", 0), size.get("code_lines_added", 0)
    return Item(
        "minimal: the test diff does not dwarf the code change",
        "AGENTS.md, \"Keep it minimal\"; pr-checklist 1.3 (complexity)",
        NO if tests_n > 100 and tests_n > 3 * max(code_n, 1) else YES,
        [f"code: +{code_n} -{size.get('code_lines_removed', 0)} lines; tests: +{tests_n} "
         "lines (NO where the tests add over 100 lines and over three times the code's)"],
        heuristic=True)  # fmt: skip


def _docs_item(proof: dict, files: dict[str, bytes], user_visible: bool) -> Item:
    docs = [p for p in files if p.startswith("docs/")]
    pages = proof.get("docs_pages", [])
    return Item(
        "the docs of a user-visible change, in the same PR",
        "AGENTS.md, \"Accountability\" (user-visible changes update the rendered docs)",
        (YES if docs else NO) if user_visible else NA,
        [f"in the commit: {', '.join(docs)}"] if docs else
        (["docs not updated; the release's pages that name the changed module: "
          + (", ".join(pages) or "none")] if user_visible else ["nothing under vllm/"]))  # fmt: skip


def _attribution_item(message: str, body: str | None) -> Item:
    trailer = re.search(r"^(Co-authored-by|Assisted-by|Generated-by): .+$", message, re.M)
    statement = body is None or "AI assistance was used" in body
    return Item(
        "the statement of AI assistance, and an attribution trailer before Signed-off-by",
        'AGENTS.md, "Accountability", "Commit messages"',
        YES if trailer and statement and _trailer_first(message) else NO,
        [
            f"trailer: {trailer.group(0)}" if trailer else "no attribution trailer",
            "the PR body states it"
            if body and statement
            else "advisory.md states it"
            if body is None
            else "the PR body does not state it",
        ],
    )


def _not_duplicate_item(proof: dict, body: str | None) -> Item:
    dup = proof.get("duplicate") or {}
    return Item(
        "why this duplicates no open PR (a section in the body)",
        "AGENTS.md, \"Duplicate-work checks\", \"Accountability\"",
        YES if body is None or "### Not a duplicate" in body or "## Not a duplicate" in body
        else NO, [f"recorded: {dup.get('recorded', '')}"])  # fmt: skip


def _duplicate_searches_item(proof: dict) -> Item:
    dup = proof.get("duplicate") or {}
    return Item(
        "the duplicate-work searches themselves (they need GitHub)",
        'AGENTS.md, "Duplicate-work checks"',
        PERSON,
        dup.get("commands") or ["AGENTS.md names no gh command: search open PRs by hand"],
    )


def _said_once_item(body: str | None) -> Item:
    repeated = repeated_sentences(body or "")
    return Item(
        "a PR body that says each thing once",
        "pr-checklist 4.1, 4.2",
        NA if body is None else NO if repeated else YES,
        [f"said twice: {s}" for s in repeated] or ["no sentence repeated"],
        heuristic=True,
    )


def _trailer_first(message: str) -> bool:
    lines = message.rstrip().splitlines()
    idx = {k: i for i, ln in enumerate(lines) for k in ("attr", "sob")
           if (k == "sob" and ln.startswith("Signed-off-by:")) or
           (k == "attr" and re.match(r"(Co-authored-by|Assisted-by|Generated-by):", ln))}  # fmt: skip
    return "attr" in idx and "sob" in idx and idx["attr"] < idx["sob"]


def _ci_items(proof: dict) -> list[Item]:
    ci = proof.get("ci") or {}
    source = 'tests/AGENTS.md, "Make sure CI runs it"'
    if not ci.get("steps_read"):
        return [
            Item(
                "a CI step selects each test",
                source,
                PERSON,
                [f"no {'.buildkite/test_areas'}/*.yaml in the tree: say where they run"],
            )
        ]
    selected, covered = [], []
    sel_ok = cov_ok = True
    for sel in ci["tests"]:
        if not sel["steps"]:
            sel_ok = False
            selected.append(
                f"{sel['test']}: no step selects it; update "
                f"{sel['suggestion'] or 'a step of .buildkite/test_areas/'}"
            )
        for st in sel["steps"]:
            note = f" ({st['note']})" if st["note"] else ""
            selected.append(f"{sel['test']}: {st['file']}, \"{st['label']}\": "
                            f"{st['command']}{note}")  # fmt: skip
            for path, why in st["uncovered"]:
                cov_ok = False
                covered.append(f"\"{st['label']}\" does not trigger on {path}"
                               + (f" (excluded by {why})" if why else ""))  # fmt: skip
    return [
        Item("a CI step's commands and markers select each test", source,
             YES if sel_ok else NO, selected, heuristic=True),
        Item("that step's source_file_dependencies cover the changed files", source,
             YES if cov_ok else NO, covered or ["every changed file triggers it"],
             heuristic=True),
    ]  # fmt: skip


def render(change_id: str, release: str, found: list[Item]) -> str:
    """checklist.md: the verdicts, then each item's evidence."""
    lines = [
        f"# {change_id} against {release}'s AGENTS.md and tests/AGENTS.md",
        "",
        "Each rule as the release's own files write it, with a verdict and its evidence. Items "
        "marked *heuristic* are static checks of the commit's added lines and of the release's "
        "tree: they list what they found (`file:line: text`) for a person to judge, and can "
        'miss or mistake. "left for the person" needs GitHub or a person\'s judgement.',
        "",
        "| # | rule | verdict |",
        "|---|---|---|",
    ]
    for n, it in enumerate(found, 1):
        mark = " *(heuristic)*" if it.heuristic else ""
        lines.append(f"| {n} | {it.rule}{mark} | **{it.verdict}** |")
    for n, it in enumerate(found, 1):
        lines += ["", f"## {n}. {it.rule}: {it.verdict}", "", f"Rule: {it.source}.", ""]
        lines += [f"- {e}" if not e.startswith("  ") else f"  - {e.strip()}" for e in it.evidence]
    return "\n".join(lines) + "\n"
