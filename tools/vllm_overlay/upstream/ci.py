"""Which of the release's CI steps run a commit's tests (``.buildkite/test_areas/*.yaml``).

vLLM's tests/AGENTS.md ("Make sure CI runs it"): a test that no step selects never runs, which
looks like passing; the step's ``commands`` and pytest markers must select the test, and its
``source_file_dependencies`` cover the changed files. We read each step as vLLM's pipeline
generator documents it (``.buildkite/test-amd.yaml``'s header): commands run from
``working_dir`` (default ``/vllm-workspace/tests``), and ``source_file_dependencies`` are path
prefixes that opt the step in (a ``!`` prefix opts out; none: the step always runs).

In each command we find the pytest runs (``pytest``, ``python -m pytest``) and read their
paths (a directory selects every test file under it, a glob what it matches, ``file::node``
part of a file), less ``--ignore``s; ``-m`` and ``-k`` are kept and said. A ``-m`` expression
is evaluated against the markers the test file names (``pytest.mark.X``): a heuristic (a
conftest may add markers), reported as such. Mirrors (``mirror:``, other hardware) are not
read: the step itself is what upstream's pull requests trigger.

The YAML is read with the Python that runs the release's hooks (vLLM's test environment has
PyYAML; this tool does not depend on it), all files in one process.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from vllm_overlay.process import run

AREAS = ".buildkite/test_areas"
DEFAULT_WORKDIR = "/vllm-workspace/tests"
WORKSPACE = "/vllm-workspace"
# pytest options that take the next word as their value (the rest are flags or --opt=value)
_VALUED = {"-m", "-k", "-p", "-c", "-o", "-n", "-W", "--ignore", "--ignore-glob", "--deselect",
           "--rootdir", "--durations", "--maxfail", "--timeout", "--junitxml", "--shard-id",
           "--num-shards", "--log-level", "--basetemp", "--dist", "--confcutdir",
           "--import-mode", "--tb", "-r"}  # fmt: skip
_SEPARATORS = {"&&", "||", ";", "|", "&"}


@dataclass
class PytestRun:
    """One pytest invocation of a step, its paths relative to the tree's root."""

    command: str
    paths: list[str]
    ignores: list[str] = field(default_factory=list)
    markers: str = ""  # the -m expression
    keyword: str = ""  # the -k expression

    def selects(self, test: str) -> bool:
        """True when this run's paths take ``test`` (a path from the tree's root)."""
        if any(_covers(i, test) for i in self.ignores):
            return False
        return any(_covers(p.partition("::")[0], test) for p in self.paths)


@dataclass
class Step:
    file: str  # .buildkite/test_areas/misc.yaml
    label: str
    runs: list[PytestRun]
    dependencies: list[str] | None  # None: no source_file_dependencies (always runs)

    def covers(self, path: str) -> tuple[bool, str]:
        """(whether a change to ``path`` triggers the step, the prefix that decides)."""
        if self.dependencies is None:
            return True, "(no source_file_dependencies: always runs)"
        for dep in self.dependencies:
            if dep.startswith("!") and path.startswith(dep[1:]):
                return False, dep
        for dep in self.dependencies:
            if not dep.startswith("!") and path.startswith(dep):
                return True, dep
        return False, ""


@dataclass
class Selection:
    """How CI runs one test file of the commit."""

    test: str
    steps: list[tuple[Step, PytestRun, str]]  # (step, the run that selects it, a marker note)
    suggestion: str = ""  # where no step selects it: the step file to update

    def to_json(self) -> dict:
        return {"test": self.test, "suggestion": self.suggestion, "steps": [
            {"file": s.file, "label": s.label, "command": r.command, "markers": r.markers,
             "note": note} for s, r, note in self.steps]}  # fmt: skip


def _covers(prefix: str, path: str) -> bool:
    prefix = prefix.rstrip("/")
    if any(c in prefix for c in "*?["):
        return fnmatch.fnmatch(path, prefix) or fnmatch.fnmatch(path, prefix + "/*")
    return path == prefix or path.startswith(prefix + "/")


def _root_relative(path: str, workdir: str) -> str | None:
    """``path`` (as a command names it, from ``workdir``) from the tree's root; None where
    it leaves the workspace."""
    full = path if path.startswith("/") else f"{workdir.rstrip('/')}/{path}"
    norm = os.path.normpath(full)
    if norm == WORKSPACE or not norm.startswith(WORKSPACE + "/"):
        return None
    return norm[len(WORKSPACE) + 1 :]


def pytest_runs(command: str, workdir: str = DEFAULT_WORKDIR) -> list[PytestRun]:
    """The pytest invocations in one step command (a shell line, perhaps several)."""
    try:
        words = shlex.split(command.replace("\n", " ; "), posix=True)
    except ValueError:
        return []
    runs = []
    i = 0
    while i < len(words):
        w = words[i]
        start = None
        if PurePosixPath(w).name == "pytest":
            start = i + 1
        elif re.fullmatch(r"(\S*/)?python(3(\.\d+)?)?", w) and words[i + 1 : i + 3] == [
            "-m",
            "pytest",
        ]:
            start = i + 3
        if start is None:
            i += 1
            continue
        j = start
        run_ = PytestRun(command.strip(), [])
        while j < len(words) and words[j] not in _SEPARATORS:
            a = words[j]
            opt, eq, val = a.partition("=")
            if a.startswith("-") and not eq and a in _VALUED and j + 1 < len(words):
                opt, val, j = a, words[j + 1], j + 1
            elif not a.startswith("-"):
                rel = _root_relative(a, workdir)
                if rel is not None:
                    run_.paths.append(rel)
                j += 1
                continue
            if opt in ("--ignore", "--ignore-glob", "--deselect"):
                rel = _root_relative(val, workdir)
                if rel is not None:
                    run_.ignores.append(rel)
            elif opt == "-m":
                run_.markers = val
            elif opt == "-k":
                run_.keyword = val
            j += 1
        runs.append(run_)
        i = j
    return runs


def marker_names(test_text: str) -> set[str]:
    """The marker names a test file applies (``pytest.mark.X``, ``mark.X``)."""
    return set(re.findall(r"\bmark\.([A-Za-z_]\w*)", test_text))


def markers_select(expression: str, names: set[str]) -> bool | None:
    """Whether ``-m expression`` keeps a test marked with ``names``; None where the
    expression is not one we read (only names, and, or, not, parentheses)."""
    if not expression.strip():
        return True
    if not re.fullmatch(r"[\w\s()]+", expression):
        return None
    words = re.findall(r"\w+", expression)
    scope = {w: w in names for w in words if w not in ("and", "or", "not")}
    try:
        return bool(eval(compile(expression, "<-m>", "eval"), {"__builtins__": {}}, scope))  # noqa: S307
    except SyntaxError:
        return None


def load_steps(tree: Path, python: str) -> list[Step]:
    """Every step of the tree's ``.buildkite/test_areas/*.yaml`` (none where it has none)."""
    area = tree / AREAS
    files = sorted(area.glob("*.yaml")) if area.is_dir() else []
    if not files:
        return []
    code = ("import json, sys, yaml\n"
            "json.dump({p: yaml.safe_load(open(p)) for p in sys.argv[1:]}, sys.stdout)")  # fmt: skip
    out = run(python, "-c", code, *map(os.fspath, files),
              hint=f"{area} could not be read as YAML (it needs PyYAML in {python})")  # fmt: skip
    data = json.loads(out.stdout)
    steps = []
    for path in files:
        doc = data.get(os.fspath(path)) or {}
        rel = f"{AREAS}/{path.name}"
        for step in doc.get("steps") or [] if isinstance(doc, dict) else []:
            if not isinstance(step, dict):
                continue
            workdir = str(step.get("working_dir") or DEFAULT_WORKDIR)
            commands = step.get("commands") or step.get("command") or []
            if isinstance(commands, str):
                commands = [commands]
            runs = [r for c in commands if isinstance(c, str) for r in pytest_runs(c, workdir)]
            deps = step.get("source_file_dependencies")
            steps.append(Step(rel, str(step.get("label", step.get("key", "?"))), runs,
                              [str(d) for d in deps] if deps else None))  # fmt: skip
    return steps


def select(steps: list[Step], tests: dict[str, str]) -> list[Selection]:
    """For each test file (path -> its text), the steps whose commands select it."""
    out = []
    for test, text in sorted(tests.items()):
        names = marker_names(text)
        found: list[tuple[Step, PytestRun, str]] = []
        for step in steps:
            for r in step.runs:
                if not r.selects(test):
                    continue
                keeps = markers_select(r.markers, names)
                if keeps is False:
                    continue
                notes = []
                if r.markers:
                    notes.append(f"-m '{r.markers}'" + (
                        "" if keeps else ": an expression we do not read; check it"))  # fmt: skip
                if r.keyword:
                    notes.append(f"-k '{r.keyword}': check that it keeps these tests")
                found.append((step, r, "; ".join(notes)))
                break
        sel = Selection(test, found)
        if not found:
            sel.suggestion = _nearest(steps, test)
        out.append(sel)
    return out


def _nearest(steps: list[Step], test: str) -> str:
    """The step file whose pytest paths share the longest directory prefix with ``test``."""
    best, depth = "", 0
    parts = PurePosixPath(test).parts
    for step in steps:
        for r in step.runs:
            for p in r.paths:
                q = PurePosixPath(p.partition("::")[0]).parts
                n = next((k for k, (a, b) in enumerate(zip(parts, q, strict=False)) if a != b),
                         min(len(parts), len(q)))  # fmt: skip
                if n > depth and n >= 2:
                    best, depth = f"{step.file} (its step {step.label!r} runs {p})", n
    return best


def uncovered(step: Step, paths: list[str]) -> list[tuple[str, str]]:
    """The changed ``paths`` whose change does not trigger ``step``, with the opt-out that
    excludes each ('' where no prefix takes it)."""
    out = []
    for p in paths:
        ok, why = step.covers(p)
        if not ok:
            out.append((p, why))
    return out
