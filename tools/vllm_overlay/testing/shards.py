"""The suite split across machines (``suite --shard K/N``) and the shards merged (``--merge``).

The split is by test file: the selection's directories become their test files (pytest's
default patterns, ``test_*.py`` and ``*_test.py``), node ids stay with their file, and the
files are dealt to N shards by the durations of earlier runs (``suite-durations.json`` at
the project's root: seconds per test file, from the patched side's JUnit report; a file it
does not know counts as the median of those it knows). Longest first, each to the shard
with the least time so far, ties to the lower shard; the files are sorted by path first, so
the same inputs give the same split on every machine (no hash order, no machine order). The
split's digest goes into every shard's results; the merge refuses shards that split
differently.

A shard writes its results to a directory: ``baseline.xml``, ``patched.xml`` and
``shard.json`` (written "running" when it starts, "done" with what the merge needs when it
ends, "failed" with the error when it could not run). The merge reads one directory per
shard and rebuilds both sides' views, so the comparison and its report are the unsplit
run's (``report.compare``); a shard that is missing, still "running" or "failed" makes the
merge an error that names it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import statistics
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from vllm_overlay import util
from vllm_overlay.errors import JunitError, OverlayError, SuiteError, UsageError
from vllm_overlay.testing.junit import TestResult, parse_junit_file
from vllm_overlay.testing.report import RunInfo, RunView

DURATIONS_FILE = "suite-durations.json"
FALLBACK_SECONDS = 10.0  # per file, when no duration at all is known
FORMAT = 1  # of shard.json and of the durations file
MANIFEST = "shard.json"
SIDES = ("baseline", "patched")
# What every shard of one split must agree on (meta keys of the suite's report).
SAME = ("upstream", "mode", "selection", "baseline_mode", "environment", "options")


@dataclass(frozen=True)
class ShardSpec:
    index: int  # 1-based
    total: int

    @classmethod
    def parse(cls, text: str) -> ShardSpec:
        k, sep, n = text.partition("/")
        if not (sep and k.isdigit() and n.isdigit()) or not 1 <= int(k) <= int(n):
            raise UsageError(
                f"--shard {text!r}: give K/N with 1 <= K <= N, e.g. --shard 2/3 for the second "
                "of three shards."
            )
        return cls(int(k), int(n))

    @property
    def label(self) -> str:
        return f"{self.index}/{self.total}"


# --- the split -----------------------------------------------------------------------------


def _is_test_file(name: str) -> bool:
    return name.endswith(".py") and (name.startswith("test_") or name.endswith("_test.py"))


def expand(tree: Path, selection: tuple[str, ...]) -> dict[str, tuple[str, ...]]:
    """Each test file of the selection -> the selection entries that name it (the file
    itself, or node ids inside it); a file selected whole is run whole."""
    out: dict[str, list[str]] = {}
    for entry in selection:
        path = entry.split("::", 1)[0]
        if (tree / path).is_dir():
            for dirpath, dirs, files in os.walk(tree / path):
                dirs[:] = [d for d in dirs if d != "__pycache__"]
                for name in files:
                    if _is_test_file(name):
                        rel = (Path(dirpath) / name).relative_to(tree).as_posix()
                        out[rel] = [rel]
        elif path == entry:
            out[path] = [path]
        elif out.get(path) != [path]:
            out.setdefault(path, []).append(entry)
    return {f: tuple(out[f]) for f in sorted(out)}


def load_durations(path: Path) -> dict[str, float]:
    """Seconds per test file; an absent file is no durations (every file gets the default)."""
    try:
        doc = json.loads(path.read_text())
        files = doc["files"]
        return {str(f): float(s) for f, s in files.items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise UsageError(
            f"{path} is not a durations file ({e}). Restore it from git, or replace it with "
            "the durations.json an unsplit or merged run writes beside its JUnit reports."
        ) from None


def split(files: list[str], durations: dict[str, float], total: int) -> list[list[str]]:
    """The files dealt to ``total`` shards, balanced by duration (module docstring)."""
    known = [durations[f] for f in files if f in durations]
    default = statistics.median(known) if known else FALLBACK_SECONDS
    weight = {f: durations.get(f, default) for f in files}
    shards: list[list[str]] = [[] for _ in range(total)]
    loads = [0.0] * total
    for f in sorted(sorted(files), key=lambda f: -weight[f]):
        i = min(range(total), key=lambda i: (loads[i], i))
        shards[i].append(f)
        loads[i] += weight[f]
    return [sorted(s) for s in shards]


@dataclass(frozen=True)
class Split:
    spec: ShardSpec
    files: tuple[str, ...]  # this shard's test files
    selection: tuple[str, ...]  # its selection entries (files, or node ids in them)
    digest: str  # of the whole split: every shard of one split has the same

    def to_json(self) -> dict:
        return {"shard": self.spec.index, "of": self.spec.total, "split": self.digest}


def shard_selection(
    tree: Path, selection: tuple[str, ...], spec: ShardSpec, durations: dict[str, float]
) -> Split:
    by_file = expand(tree, selection)
    parts = split(list(by_file), durations, spec.total)
    text = json.dumps([[by_file[f] for f in part] for part in parts], separators=(",", ":"))
    mine = parts[spec.index - 1]
    return Split(
        spec=spec,
        files=tuple(mine),
        selection=tuple(e for f in mine for e in by_file[f]),
        digest=hashlib.sha256(text.encode()).hexdigest()[:16],
    )


def durations_of(results: dict[str, TestResult]) -> dict[str, float]:
    """Seconds per test file, summed over its tests (the patched side's JUnit report)."""
    out: dict[str, float] = {}
    for nodeid, r in results.items():
        path = nodeid.split("::", 1)[0]
        if path.endswith(".py"):
            out[path] = out.get(path, 0.0) + r.seconds
    return out


def write_durations(path: Path, durations: dict[str, float], upstream: str) -> None:
    doc = {
        "format": FORMAT,
        "upstream": upstream,
        "files": {f: round(s, 1) for f, s in sorted(durations.items())},
    }
    util.atomic_write_text(path, json.dumps(doc, indent=1) + "\n")


# --- a shard's results ---------------------------------------------------------------------


@contextlib.contextmanager
def recording(dest: Path, spec: ShardSpec) -> Iterator[None]:
    """shard.json says "running" from the start and "failed" (with why) if the run raises;
    the run writes "done" itself (``write_done``)."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in (MANIFEST, *(f"{s}.xml" for s in SIDES)):
        (dest / name).unlink(missing_ok=True)
    head = {"format": FORMAT, "shard": spec.index, "of": spec.total}
    util.atomic_write_text(dest / MANIFEST, json.dumps({**head, "status": "running"}) + "\n")
    try:
        yield
    except (OverlayError, KeyboardInterrupt) as e:
        why = str(e) or type(e).__name__
        doc = {**head, "status": "failed", "error": why}
        util.atomic_write_text(dest / MANIFEST, json.dumps(doc, indent=1) + "\n")
        raise


def write_done(
    dest: Path,
    part: Split,
    views: dict[str, RunView],
    runs: dict[str, RunInfo],
    meta: dict,
    title: str,
    overlay_tests: tuple[str, ...],
) -> None:
    sides = {}
    for name, view in views.items():
        info = runs.get(name)
        sides[name] = {
            "ran": view.ran,
            "seconds": round(info.seconds, 1) if info else 0.0,
            "cached": info.cached if info else False,
            "collected": sorted(set(view.collected) - view.deselected),
            "deselected": sorted(view.deselected),
        }
    doc = {
        "format": FORMAT,
        **part.to_json(),
        "status": "done",
        "files": list(part.files),
        "meta": meta,
        "title": title,
        "overlay_tests": list(overlay_tests),
        "runs": sides,
    }
    util.atomic_write_text(dest / MANIFEST, json.dumps(doc, indent=1, sort_keys=True) + "\n")


# --- the merge -----------------------------------------------------------------------------


@dataclass
class Merged:
    views: dict[str, RunView]
    runs: dict[str, RunInfo]
    meta: dict
    title: str
    overlay_tests: tuple[str, ...]
    junit: dict[str, str]  # side -> the merged JUnit XML text


def _read_manifest(d: Path) -> dict:
    try:
        doc = json.loads((d / MANIFEST).read_text())
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError("not a shard.json of this version")
        int(doc["shard"]), int(doc["of"])
        return doc
    except FileNotFoundError:
        raise SuiteError(
            f"{d}: no {MANIFEST}: this is not a shard's results directory, or its shard never "
            "started. Pass the directories that `vllm-overlay suite --shard K/N --junit DIR` "
            "wrote."
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SuiteError(f"{d / MANIFEST} is unreadable ({e}); run that shard again.") from None


def merge(dirs: list[Path]) -> Merged:
    """The shards' results as one run; a missing, unfinished or failed shard is an error."""
    if not dirs:
        raise UsageError("--merge: give the shards' results directories.")
    docs = [(d, _read_manifest(d)) for d in dirs]
    totals = {int(doc["of"]) for _, doc in docs}
    if len(totals) != 1:
        raise SuiteError(f"the shards come from different splits (of {sorted(totals)}).")
    total = totals.pop()
    by_index: dict[int, tuple[Path, dict]] = {}
    for d, doc in docs:
        k = int(doc["shard"])
        if k in by_index:
            raise SuiteError(f"shard {k}/{total} is given twice: {by_index[k][0]} and {d}.")
        by_index[k] = (d, doc)
    problems = [f"shard {k}/{total}: missing" for k in range(1, total + 1) if k not in by_index]
    for k, (d, doc) in sorted(by_index.items()):
        if doc.get("status") == "failed":
            problems.append(f"shard {k}/{total}: failed to run ({d}): {doc.get('error', '?')}")
        elif doc.get("status") != "done":
            problems.append(f"shard {k}/{total}: did not finish ({d}: {doc.get('status')!r})")
    if problems:
        raise SuiteError(
            "the shards cannot be merged, so there is no verdict:\n  "
            + "\n  ".join(problems)
            + "\nRun the missing or failed shards again (the same --shard K/N), then merge."
        )
    ordered = [by_index[k] for k in range(1, total + 1)]
    first = ordered[0][1]
    for k, (d, doc) in enumerate(ordered, 1):
        if doc["split"] != first["split"]:
            raise SuiteError(
                f"shard {k}/{total} ({d}) split the suite differently from shard 1 (split "
                f"{doc['split']} vs {first['split']}): were they run on different commits or "
                f"durations files? Run every shard from the same commit."
            )
        for key in SAME:
            if doc["meta"].get(key) != first["meta"].get(key):
                raise SuiteError(
                    f"shard {k}/{total} ({d}) differs from shard 1 in its {key}: "
                    f"{doc['meta'].get(key)!r} vs {first['meta'].get(key)!r}."
                )
    return _combine(ordered, total)


def _combine(ordered: list[tuple[Path, dict]], total: int) -> Merged:
    first = ordered[0][1]
    views, runs, junit = {}, {}, {}
    for side in SIDES:
        results: dict[str, TestResult] = {}
        collected: list[str] = []
        deselected: set[str] = set()
        seconds, cached = 0.0, True
        root = ET.Element("testsuites")
        for d, doc in ordered:
            run = doc["runs"][side]
            collected += run["collected"]
            deselected |= set(run["deselected"])
            seconds += run["seconds"]
            cached = cached and run["cached"]
            if not run["ran"]:
                continue
            try:
                results.update(parse_junit_file(d / f"{side}.xml"))
                root.extend(ET.parse(d / f"{side}.xml").getroot().iter("testsuite"))
            except (JunitError, ET.ParseError, OSError) as e:
                raise SuiteError(f"{d}: its {side} JUnit report is unusable ({e}).") from None
        ran = first["runs"][side]["ran"]
        views[side] = RunView(
            results,
            (*collected, *sorted(deselected)),
            ran=ran,
            deselected=frozenset(deselected),
        )
        if ran:
            runs[side] = RunInfo(seconds, cached)
        junit[side] = ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
    meta = dict(first["meta"])
    meta["baseline_selection"] = [
        e for _, doc in ordered for e in doc["meta"]["baseline_selection"]
    ]
    meta["shards"] = [
        {"shard": int(doc["shard"]), "files": len(doc["files"]), "dir": os.fspath(d)}
        for d, doc in ordered
    ]
    times = ", ".join(
        f"{doc['shard']}/{total} {doc['runs']['patched']['seconds']:.0f} s" for _, doc in ordered
    )
    title = first["title"] + f"\nmerged from {total} shards (patched side: {times})"
    return Merged(views, runs, meta, title, tuple(first["overlay_tests"]), junit)
