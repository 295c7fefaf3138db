"""Compare the baseline run with the patched run, and render the verdict.

Per test id, with "failing" meaning failed or error and "absent" meaning not in that run's
results (not collected, or collected but never reported: "not run"):

| baseline | patched  | verdict                                                   |
|----------|----------|-----------------------------------------------------------|
| passed   | failing  | new failure (exit 1)                                      |
| passed   | absent   | lost: it passed upstream and no longer runs (exit 1)      |
| passed   | skipped  | lost, likewise (exit 1)                                   |
| failing  | passed   | fixed                                                     |
| failing  | failing  | unchanged failure, grouped by cause; never a pass         |
| absent   | any      | only on patched; failing there is an exit 1               |
| any      | absent   | only on baseline (lost, above, when it passed)            |
| skipped  | failing  | new failure (exit 1)                                      |

The overlay's own tests (the ``tests`` of each change in overlay.toml) must pass on the
patched tree; one that fails or is skipped there is an exit 1 whatever the baseline says.

A targeted baseline (``--baseline-for-failures``) collects everything but runs only what
did not pass on the patched tree; the rest is "not re-run". Every row above that decides
the exit status has a patched side other than "passed", so the verdict is the same; only
"fixed" cannot be known, and the report says so.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from vllm_overlay.testing import causes
from vllm_overlay.testing.junit import OUTCOMES, TestResult

TOTAL_KEYS = ("passed", "failed", "skipped", "errors", "not run")
LIST_LIMIT = 12  # entries shown per list on the screen; --json has them all


@dataclass(frozen=True)
class Entry:
    """One test in a list of the comparison."""

    nodeid: str
    baseline: str  # an outcome, "not run", or "absent"
    patched: str
    message: str = ""
    cause: str = ""
    cpu_test: bool = False

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {
            "nodeid": self.nodeid,
            "baseline": self.baseline,
            "patched": self.patched,
        }
        if self.message:
            doc["message"] = self.message
        if self.cause:
            doc["cause"] = self.cause
        if self.cpu_test:
            doc["cpu_test"] = True
        return doc


@dataclass(frozen=True)
class RunView:
    """What the comparison needs from one side's run."""

    results: dict[str, TestResult]
    collected: tuple[str, ...] = ()
    ran: bool = True  # False with --no-baseline
    deselected: frozenset[str] = frozenset()  # collected, left out on purpose (targeted)

    @property
    def targeted(self) -> bool:
        return bool(self.deselected)

    def outcome(self, nodeid: str) -> str:
        if nodeid in self.results:
            return self.results[nodeid].outcome
        if nodeid in self.deselected:
            return "not re-run"
        return "not run" if nodeid in self.collected else "absent"

    def ids(self) -> set[str]:
        return set(self.results) | set(self.collected)

    def totals(self) -> dict[str, int]:
        counts = Counter(r.outcome for r in self.results.values())
        not_run = sum(
            1 for n in self.collected if n not in self.results and n not in self.deselected
        )
        return {
            "passed": counts["passed"],
            "failed": counts["failed"],
            "skipped": counts["skipped"],
            "errors": counts["error"],
            "not run": not_run,
        }


@dataclass
class Comparison:
    baseline: RunView
    patched: RunView
    new_failures: list[Entry] = field(default_factory=list)
    lost: list[Entry] = field(default_factory=list)
    fixed: list[Entry] = field(default_factory=list)
    unchanged: dict[str, list[Entry]] = field(default_factory=dict)  # cause -> entries
    only_patched: list[Entry] = field(default_factory=list)
    only_baseline: list[Entry] = field(default_factory=list)
    overlay_failing: list[Entry] = field(default_factory=list)
    patched_failures: dict[str, list[Entry]] = field(default_factory=dict)  # no baseline

    @property
    def ok(self) -> bool:
        bad_only = [e for e in self.only_patched if e.patched in ("failed", "error", "not run")]
        return not (self.new_failures or self.lost or self.overlay_failing or bad_only)


def _is_failing(outcome: str) -> bool:
    return outcome in ("failed", "error")


def _entry(nodeid: str, base: RunView, patched: RunView, side: RunView | None = None) -> Entry:
    src = side or patched
    result = src.results.get(nodeid) or base.results.get(nodeid)
    message = result.summary if result is not None else ""
    cause = ""
    if result is not None and result.failing:
        cause = causes.classify(f"{result.message}\n{result.detail}", result.output)
    return Entry(
        nodeid=nodeid,
        baseline=base.outcome(nodeid) if base.ran else "not compared",
        patched=patched.outcome(nodeid),
        message=message,
        cause=cause,
        cpu_test=result is not None and "cpu_test" in result.markers,
    )


def compare(baseline: RunView, patched: RunView, overlay_tests: tuple[str, ...] = ()) -> Comparison:
    cmp = Comparison(baseline=baseline, patched=patched)
    for nodeid in sorted(patched.ids() | (baseline.ids() if baseline.ran else set())):
        _place(cmp, nodeid)
    for nodeid in sorted(patched.ids()):
        if _is_overlay_test(nodeid, overlay_tests) and patched.outcome(nodeid) != "passed":
            cmp.overlay_failing.append(_entry(nodeid, baseline, patched))
    return cmp


def _place(cmp: Comparison, nodeid: str) -> None:
    base, pat = cmp.baseline, cmp.patched
    b, p = base.outcome(nodeid), pat.outcome(nodeid)
    if not base.ran:
        if _is_failing(p):
            e = _entry(nodeid, base, pat)
            cmp.patched_failures.setdefault(e.cause, []).append(e)
        return
    if b == "absent":
        cmp.only_patched.append(_entry(nodeid, base, pat))
    elif p == "absent":
        cmp.only_baseline.append(_entry(nodeid, base, pat, side=base))
        if b == "passed":
            cmp.lost.append(_entry(nodeid, base, pat, side=base))
    elif b == "passed" and p in ("not run", "skipped"):
        cmp.lost.append(_entry(nodeid, base, pat))
    elif _is_failing(p) and not _is_failing(b):
        cmp.new_failures.append(_entry(nodeid, base, pat))
    elif _is_failing(b) and p == "passed":
        cmp.fixed.append(_entry(nodeid, base, pat, side=base))
    elif _is_failing(b) and _is_failing(p):
        e = _entry(nodeid, base, pat)
        cmp.unchanged.setdefault(e.cause, []).append(e)


def _is_overlay_test(nodeid: str, overlay_tests: tuple[str, ...]) -> bool:
    path = nodeid.split("::", 1)[0]
    return any(path == t or path.startswith(t.rstrip("/") + "/") for t in overlay_tests)


# --- rendering ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RunInfo:
    """How a side ran, for the totals table."""

    seconds: float
    cached: bool = False
    junit: str = ""


def render_text(cmp: Comparison, title: str, runs: dict[str, RunInfo]) -> str:
    lines = [title, ""]
    lines += _totals_table(cmp, runs)
    lines.append("")
    if cmp.baseline.ran:
        lines += _section("new failures (pass on baseline, fail on patched)", cmp.new_failures)
        lines += _section(
            "lost (pass on baseline; skipped, absent or not run on patched)", cmp.lost
        )
        if cmp.baseline.targeted:
            lines.append(
                "fixed (fail on baseline, pass on patched): not known: the baseline ran only "
                "the tests that did not pass on patched"
            )
        else:
            lines += _section("fixed (fail on baseline, pass on patched)", cmp.fixed)
        lines += _only_section("only on patched", cmp.only_patched, "patched")
        lines += _only_section("only on baseline", cmp.only_baseline, "baseline")
        lines += _causes_section("unchanged failures (fail on both; not passes)", cmp.unchanged)
    else:
        lines += _causes_section("failures on patched (no baseline run)", cmp.patched_failures)
    lines += _section("overlay tests not passing on patched", cmp.overlay_failing, empty=None)
    junits = [f"{name} {info.junit}" for name, info in runs.items() if info.junit]
    if junits:
        lines.append("JUnit: " + ", ".join(junits))
    lines.append(verdict(cmp))
    return "\n".join(lines) + "\n"


def _totals_table(cmp: Comparison, runs: dict[str, RunInfo]) -> list[str]:
    head = f"{'':10}" + "".join(f"{k:>9}" for k in (*TOTAL_KEYS, "total")) + "   time"
    out = [head]
    for name, view in (("baseline", cmp.baseline), ("patched", cmp.patched)):
        info = runs.get(name)
        if not view.ran or info is None:
            out.append(f"{name:10}   (not run: --no-baseline)")
            continue
        totals = view.totals()
        cells = "".join(f"{totals[k]:>9}" for k in TOTAL_KEYS)
        when = _minutes(info.seconds) + (" (cached)" if info.cached else "")
        out.append(f"{name:10}{cells}{sum(totals.values()):>9}   {when}")
        if view.targeted:
            out.append(
                f"{'':10}(+{len(view.deselected)} collected that passed on patched, "
                "not re-run here)"
            )
    return out


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 60 else f"{seconds / 60:.1f} min"


def _line(e: Entry, show: str = "patched") -> str:
    flag = " [cpu_test]" if e.cpu_test else ""
    outcome = getattr(e, show)
    msg = f": {e.message}" if e.message else ""
    return f"    {e.nodeid} ({outcome}){flag}{msg}"


def _limited(entries: list[str]) -> list[str]:
    if len(entries) <= LIST_LIMIT:
        return entries
    return [
        *entries[:LIST_LIMIT],
        f"    ... and {len(entries) - LIST_LIMIT} more (--json lists all)",
    ]


def _section(title: str, entries: list[Entry], empty: str | None = "none") -> list[str]:
    if not entries:
        return [] if empty is None else [f"{title}: {empty}"]
    return [f"{title}: {len(entries)}", *_limited([_line(e) for e in entries])]


def _only_section(title: str, entries: list[Entry], side: str) -> list[str]:
    """Tests on one side only, grouped by file with their outcomes; failing ones listed."""
    if not entries:
        return [f"{title}: none"]
    by_file: dict[str, Counter[str]] = {}
    for e in entries:
        by_file.setdefault(e.nodeid.split("::", 1)[0], Counter())[getattr(e, side)] += 1
    out = [f"{title}: {len(entries)}"]
    for path, counts in by_file.items():
        summary = ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
        out.append(f"    {path}: {summary}")
    failing = [e for e in entries if getattr(e, side) not in ("passed", "skipped")]
    out += _limited([_line(e, side) for e in failing])
    return out


def _causes_section(title: str, groups: dict[str, list[Entry]]) -> list[str]:
    n = sum(len(v) for v in groups.values())
    if not n:
        return [f"{title}: none"]
    out = [f"{title}: {n}"]
    for cause, label in causes.TITLES.items():
        entries = groups.get(cause, [])
        if not entries:
            continue
        marked = sum(e.cpu_test for e in entries)
        note = f" ({marked} marked cpu_test upstream)" if marked else ""
        out.append(f"    {label + ' ':.<32} {len(entries):>4}{note}")
        if cause == causes.OTHER:
            out += ["  " + s for s in _limited([_line(e) for e in entries])]
    return out


def verdict(cmp: Comparison) -> str:
    if not cmp.baseline.ran:
        bad = len(cmp.overlay_failing)
        if bad:
            return f"verdict: FAIL: {bad} of the overlay's own tests do not pass (no baseline run)."
        return "verdict: no comparison (--no-baseline); the overlay's own tests pass."
    if cmp.ok:
        return "verdict: OK: no new failures, nothing lost; the overlay's own tests pass."
    bad_only = [e for e in cmp.only_patched if e.patched in ("failed", "error", "not run")]
    parts = [
        f"{len(cmp.new_failures)} new failure(s)" if cmp.new_failures else "",
        f"{len(cmp.lost)} lost test(s)" if cmp.lost else "",
        f"{len(cmp.overlay_failing)} overlay test(s) not passing" if cmp.overlay_failing else "",
        f"{len(bad_only)} patched-only test(s) failing" if bad_only else "",
    ]
    return "verdict: FAIL: " + ", ".join(p for p in parts if p) + "."


def to_json(cmp: Comparison, meta: dict[str, object], runs: dict[str, RunInfo]) -> dict:
    def side(name: str, view: RunView) -> dict[str, object]:
        info = runs.get(name)
        if not view.ran or info is None:
            return {"ran": False}
        totals = view.totals()
        return {
            "ran": True,
            "totals": totals,
            "total": sum(totals.values()),
            "seconds": round(info.seconds, 1),
            "cached": info.cached,
            "junit": info.junit,
            "not_rerun": len(view.deselected),
        }

    def entries(es: list[Entry]) -> list[dict[str, object]]:
        return [e.to_json() for e in es]

    return {
        **meta,
        "ok": cmp.ok,
        "runs": {
            "baseline": side("baseline", cmp.baseline),
            "patched": side("patched", cmp.patched),
        },
        "new_failures": entries(cmp.new_failures),
        "lost": entries(cmp.lost),
        "fixed": None if cmp.baseline.targeted else entries(cmp.fixed),
        "only_patched": entries(cmp.only_patched),
        "only_baseline": entries(cmp.only_baseline),
        "unchanged_failures": {k: entries(v) for k, v in sorted(cmp.unchanged.items())},
        "patched_failures": {k: entries(v) for k, v in sorted(cmp.patched_failures.items())},
        "overlay_failing": entries(cmp.overlay_failing),
        "outcomes": list(OUTCOMES),
        "verdict": verdict(cmp),
    }
