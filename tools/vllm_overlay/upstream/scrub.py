"""Our overlay's scaffolding, taken out of a change's tests before they go upstream.

Our test files carry two things upstream has no use for: the sentence that says which change
added them ("Added by vllm-overlay ..."), and the switch that lets the same file run on an
unpatched tree (``VLLM_OVERLAY_TREE=pristine`` turns the tests that need the change into
strict xfails: a ``_TREE`` read from the environment, a marker such as ``needs_change``, its
paragraph in the docstring and the decorators). ``scrub`` removes both, by the syntax tree
(statements and decorators) and by sentence (the docstring), and ``leftovers`` finds any
mention of the overlay that remains, which `upstream` refuses to send: the fix is in the
overlay's own test file (say it without naming the overlay).

The imports the removed code used (``os``, ``pytest``) are left to the release's own hooks:
ruff's fix (``--fix`` in vLLM's pre-commit configuration) removes the unused ones.
"""

from __future__ import annotations

import ast
import re

ENV = "VLLM_OVERLAY_TREE"
_ADDED_BY = re.compile(r"Added by vllm-overlay\b[^.]*(?:\([^)]*\))?[^.]*\.[ \t]*\n?")
_RUNNING = re.compile(r"\n[ \t]*Running on an unpatched tree:.*?(?=\n[ \t]*\n|\n?\Z)", re.S)
MENTION = re.compile(r"vllm[-_]overlay|Overlay-Change", re.I)


def scrub(text: str) -> str:
    """``text`` (a Python test file) without our scaffolding."""
    if ENV not in text and not _ADDED_BY.search(text):
        return text
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return text
    lines = text.splitlines(keepends=True)
    drop: set[int] = set()  # 0-based line numbers
    names = {"_TREE"}
    for node in tree.body:
        src = ast.get_source_segment(text, node) or ""
        targets = {t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)}
        if ENV in src or any(re.search(rf"\b{n}\b", src) for n in names):
            if isinstance(node, ast.Assign | ast.If):
                names |= targets
                drop.update(range(node.lineno - 1, (node.end_lineno or node.lineno)))
    for node in ast.walk(tree):
        for dec in getattr(node, "decorator_list", []):
            if isinstance(dec, ast.Name) and dec.id in names:
                drop.update(range(dec.lineno - 1, (dec.end_lineno or dec.lineno)))
    kept = [ln for i, ln in enumerate(lines) if i not in drop]
    out = _collapse_blank(kept)
    doc = ast.get_docstring(tree, clean=False)
    if doc is not None:
        new_doc = _RUNNING.sub("", _ADDED_BY.sub("", doc))
        new_doc = re.sub(r"\n[ \t]*\n([ \t]*\n)+", "\n\n", new_doc)
        out = out.replace(doc, new_doc, 1)
    return out


def _collapse_blank(lines: list[str]) -> str:
    """Join ``lines``, with no more than two blank lines in a row (what removal leaves)."""
    out: list[str] = []
    blank = 0
    for ln in lines:
        blank = blank + 1 if not ln.strip() else 0
        if blank <= 2:
            out.append(ln)
    return "".join(out)


def leftovers(path: str, text: str) -> list[str]:
    """``path:line: text`` for each line that still names our overlay."""
    return [
        f"{path}:{n}: {ln.strip()}"
        for n, ln in enumerate(text.splitlines(), 1)
        if MENTION.search(ln) or ENV in ln
    ]
