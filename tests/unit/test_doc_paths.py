"""Every path of ours that README.md and docs/*.md cite resolves in the repository, and every
``make`` target and ``vllm-overlay`` verb they cite exists.

What counts as a path (``cited_paths``):

- a markdown link's target that is not a URL or an anchor, resolved from the page's folder;
- a backticked word (or a word in a fenced block) with a ``/`` whose first component is one
  of our top-level folders (``TOP``: ``tools/``, ``tests/``, ``docs/``, ``overlay/`` …): it
  must exist from the repository's root. ``tests/`` and ``docs/`` are vLLM's folders too: such
  a path also resolves as a file (or its ``.patch``) or folder under an overlay change, which
  holds our changes at vLLM's paths;
- a module reference relative to ``tools/vllm_overlay`` (``wheel/verify.py``, ``rebase/``):
  a word whose first component is one of its packages, ending in ``.py`` or ``/``.

A ``::name`` after a file of ours must name a function, class or constant in it. Words with
a placeholder (``<id>``, ``…``, ``*``, ``$``, ``{``) are patterns, not paths, and words under any
other first component (``vllm/``, ``csrc/``, ``.work/``, ``~/``) are vLLM's or made at run
time: neither is checked. ``VLLM_OWNED`` lists the few vLLM paths that begin like ours.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from vllm_overlay.main import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "tools" / "vllm_overlay"
TOP = ("tools", "tests", "docs", "overlay", "constraints", "bench", ".ci", ".github")
SHARED_WITH_VLLM = ("tests", "docs")
VLLM_OWNED = ("tests/AGENTS.md", ".github/PULL_REQUEST_TEMPLATE.md")
PLACEHOLDER = re.compile(r"[<>…*${}?]")
WORD = re.compile(r"^[\w.\-/]+(::[\w.\[\]-]+)?$")
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def packages(package: Path = PACKAGE) -> set[str]:
    return {p.name for p in package.iterdir() if (p / "__init__.py").is_file()}


def pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def words(text: str) -> list[str]:
    """The words in backticks and in fenced blocks, trailing punctuation off."""
    spans = [m.group(0) for m in FENCE.finditer(text)]
    spans += SPAN.findall(FENCE.sub("", text))
    return [w.rstrip(".,;:)") for span in spans for w in span.replace("`", " ").split()]


def names_in(path: Path, name: str) -> bool:
    """Whether ``path`` defines ``name`` (a function, class or module-level constant)."""
    base = re.escape(re.split(r"[\[.]", name)[0])
    definition = rf"^\s*(async def|def|class)\s+{base}\b|^{base}\b\s*[:=]"
    return re.search(definition, path.read_text(), re.M) is not None


def under_overlay(rel: str, root: Path) -> bool:
    rel = rel.rstrip("/")
    return any(
        (change / rel).exists() or (change / f"{rel}.patch").is_file()
        for change in (root / "overlay").iterdir()
        if change.is_dir()
    )


def check_word(word: str, root: Path, pkgs: set[str]) -> str | None:
    """Why ``word`` is a path of ours that does not resolve, or None."""
    if "/" not in word or PLACEHOLDER.search(word) or not WORD.match(word):
        return None
    rel, _, name = word.partition("::")
    first = rel.split("/")[0]
    if rel in VLLM_OWNED:
        return None
    bases = [root] if first in TOP else []
    if first in pkgs and rel.endswith((".py", "/")):
        bases.append(root / "tools" / "vllm_overlay")
    if not bases:
        return None
    for target in (base / rel for base in bases):
        if target.exists():
            if name and target.is_file() and not names_in(target, name):
                return f"{word}: {rel} has no {name}"
            return None
    if first in SHARED_WITH_VLLM and under_overlay(rel, root):
        return None
    return f"{word}: no such file or folder"


def check_link(page: Path, target: str) -> str | None:
    if re.match(r"^[a-z][a-z+.-]*:", target) or target.startswith("#"):
        return None
    rel = target.split("#")[0]
    if not (page.parent / rel).exists():
        return f"link {target}: no such file or folder"
    return None


def unresolved(page: Path, text: str, root: Path = ROOT) -> list[str]:
    """Every path ``text`` (the page at ``page``) cites that does not resolve."""
    pkgs = packages(root / "tools" / "vllm_overlay")
    found = [check_word(w, root, pkgs) for w in words(text)]
    found += [check_link(page, t) for t in LINK.findall(FENCE.sub("", text))]
    return sorted({f for f in found if f})


def unknown_commands(text: str, makefile: Path = ROOT / "Makefile") -> list[str]:
    """Every ``make TARGET`` and ``vllm-overlay VERB`` in backticks or fenced blocks of ``text``
    that the Makefile or the command line does not have."""
    targets = set(re.findall(r"^([\w-]+):(?!=)", makefile.read_text(), re.M))
    spans = [m.group(0) for m in FENCE.finditer(text)] + SPAN.findall(FENCE.sub("", text))
    found = []
    for span in spans:
        found += [
            f"make {t}" for t in re.findall(r"\bmake ([a-z][\w-]*)", span) if t not in targets
        ]
        found += [
            f"vllm-overlay {v}"
            for v in re.findall(r"\bvllm-overlay ([a-z][\w-]*)", span)
            if v not in COMMANDS
        ]
    return sorted(set(found))


PAGE_IDS = {"ids": lambda p: p.relative_to(ROOT).as_posix()}


@pytest.mark.parametrize("page", pages(), **PAGE_IDS)
def test_every_path_a_page_cites_resolves(page):
    assert unresolved(page, page.read_text()) == []


@pytest.mark.parametrize("page", pages(), **PAGE_IDS)
def test_every_command_a_page_cites_exists(page):
    assert unknown_commands(page.read_text()) == []


def test_a_page_with_unknown_commands_fails():
    text = "`make test`, `make tests`, `vllm-overlay status`, `vllm-overlay statuses --json`\n"
    assert unknown_commands(text) == ["make tests", "vllm-overlay statuses"]


BAD_PAGE = """\
# A page

The copy is `tools/vllm_overlay/zipcopy.py` (moved), `wheel/zipcopy.py` is right, and
`wheel/nosuch.py` is not; `tests/test_build_real.py` moved to `tests/integration/`.
`wheel/verify.py::check_installable` is there, `wheel/verify.py::no_such_check` is not.
vLLM's `tests/v1/kv_connector/unit` and `vllm/v1/worker/gpu/` are not ours; `tests/v1/nope.py`
is neither ours nor under a change; `overlay/<change-id>/`, `.work/vllm` and
`track/vllm-0.34.0` are not paths of ours. See [building](building.md) and [gone](gone.md),
and `../shared/design.md`.

```
bench/bench_git.py       there
bench/bench_gone.py      not
```
"""


def test_a_page_with_bad_paths_fails():
    assert unresolved(ROOT / "docs" / "page.md", BAD_PAGE) == [
        "bench/bench_gone.py: no such file or folder",
        "link gone.md: no such file or folder",
        "tests/test_build_real.py: no such file or folder",
        "tests/v1/nope.py: no such file or folder",
        "tools/vllm_overlay/zipcopy.py: no such file or folder",
        "wheel/nosuch.py: no such file or folder",
        "wheel/verify.py::no_such_check: wheel/verify.py has no no_such_check",
    ]


def test_a_page_outside_the_repository_is_not_cited():
    """A page outside the repository (``../shared/design.md``) is not ours to cite: the
    pages say what they need themselves."""
    cited = [w for p in pages() for w in words(p.read_text()) + LINK.findall(p.read_text())]
    assert [w for w in cited if w.startswith("../") and w.endswith(".md")] == []
