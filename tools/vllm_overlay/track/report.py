"""track-report.md (a pull-request body) and track-report.json, written by rename.

The markdown is one small renderer per section, in the order the page shows them; each
takes the typed report (``track/trackdata.py``) and returns its lines (none: the section
does not apply)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from vllm_overlay.rebase.reportdata import ChangeOutcome, Failed, RebaseReport
from vllm_overlay.track.trackdata import READY, UP_TO_DATE, TrackReport
from vllm_overlay.util import atomic_write_text

MD, JSON = "track-report.md", "track-report.json"


def write(rep: TrackReport, report_dir: Path) -> None:
    """Write both files; ``rep.files`` then says where."""
    report_dir.mkdir(parents=True, exist_ok=True)
    rep.files = None
    atomic_write_text(report_dir / JSON, json.dumps(rep.to_json(), indent=2, sort_keys=True) + "\n")
    atomic_write_text(report_dir / MD, markdown(rep))
    rep.files = {"md": str(report_dir / MD), "json": str(report_dir / JSON)}


def markdown(rep: TrackReport) -> str:
    if rep.status == UP_TO_DATE:
        return "\n".join([*_title(rep), *_up_to_date(rep)]) + "\n"
    return "\n".join(line for section in SECTIONS for line in section(rep)) + "\n"


def _rebase(rep: TrackReport) -> RebaseReport | None:
    return rep.rebase if isinstance(rep.rebase, RebaseReport) else None


def _title(rep: TrackReport) -> list[str]:
    return [f"# Track {rep.name}: {rep.from_} → {rep.to}", ""]


def _up_to_date(rep: TrackReport) -> list[str]:
    return [f"upstream.lock already pins {rep.name} {rep.from_}, the newest usable release. "
            "Nothing to do.", *[f"- note: {n}" for n in rep.notes]]  # fmt: skip


def _verdict(rep: TrackReport) -> list[str]:
    verdict = {
        READY: "**Ready for review**: the rebase completed; the branch carries the new "
        "upstream.lock and overlay/.",
        "needs-person": "**Needs a person**: the rebase did not complete on its own (see below).",
    }[rep.status]
    return [verdict, ""]


def _facts(rep: TrackReport) -> list[str]:
    """The branch, the new pin and its artifacts, the notes."""
    out = [f"- branch: `{rep.branch}` (from {(rep.base_commit or '')[:12]})"]
    r = _rebase(rep)
    if r is not None:
        to = r.to
        commit = to.commit or f"{to.sdist_commit} (abbreviated, unverified)"
        out.append(f"- pin: {rep.name} {rep.from_} → {rep.to} (tag `{to.tag}`, commit `{commit}`)")
        out += [f"- sdist: `{a.filename}` sha256 `{a.sha256}`" for a in to.artifacts
                if a.kind == "sdist"]  # fmt: skip
        out += [f"- {v} wheels: {', '.join(p)}" for v, p in to.variants.items()]
        if to.built_from_source != "none":
            out.append(f"- built from source here: {to.built_from_source}")
    out += [f"- note: {n}" for n in [*rep.notes, *(r.notes if r else ())]]
    out += [f"- note: `{p}` had uncommitted edits in the project; this run used HEAD"
            for p in rep.uncommitted]  # fmt: skip
    return [*out, ""]


def _failed(rep: TrackReport) -> list[str]:
    if not isinstance(rep.rebase, Failed):
        return []
    return ["## The rebase failed", "", "```", rep.rebase.error, "```", ""]


def _changes(rep: TrackReport) -> list[str]:
    r = _rebase(rep)
    if r is None or not r.changes:
        return []
    out = ["## Changes", "", "| change | outcome | why |", "|---|---|---|"]
    for c in r.changes:
        cell = "; ".join(x for x in _why(c) if x).replace("|", "\\|")
        out.append(f"| `{c.id}` | {c.state} | {cell} |")
    return [*out, ""]


def _why(c: ChangeOutcome) -> list[str]:
    """A change's row: why (each file's problem, for a stop), its moves and its walk, or,
    for a failed proof, what failed."""
    out = [c.reason if not c.problems else ""]
    if c.renamed:
        out.append("moved " + ", ".join(f"{a} → {b}" for a, b in c.renamed.items()))
    if c.state == "tests-failed":
        out.append(f"on {c.release}, without it: {c.test_run.text if c.test_run else ''}")
        runs = c.test_run.runs.values() if c.test_run else ()
        out += [f"first error: `{r.first_error}`" for r in runs if r.first_error]
    elif c.releases:
        out.append("walk: " + ", ".join(f"{v} {st}" for v, st in c.releases.items()))
    return out + [f"{p.path}: {p.kind}: {p.detail}" for p in c.problems]


def _dropped(rep: TrackReport) -> list[str]:
    r = _rebase(rep)
    if r is None or not r.dropped:
        return []
    out = ["## Dropped changes and their proof", ""]
    for c in r.dropped:
        out += [f"- `{c.id}`, at {rep.name} {c.release}: {c.reason}", f"  - proof: {c.proof}"]
        if c.pull_request:
            out.append(f"  - came back through {c.pull_request}")
    return [*out, ""]


def _walk(rep: TrackReport) -> list[str]:
    r = _rebase(rep)
    if r is None or not r.path:
        return []
    out = ["## The walk", "", f"Releases walked: {rep.from_} → " + " → ".join(r.path) + ".", ""]
    out += [f"- not asked: `{w.id}` at {w.release} ({w.met}): {w.reason}" for w in r.waited]
    if r.proof_releases:
        out.append("- test environments for the proofs: " + ", ".join(
            f"{v} ({secs:.0f} s)" for v, secs in sorted(r.proof_releases.items())))  # fmt: skip
    if rep.walked_to:
        out.append(f"- this branch carries the walk up to {rep.name} {rep.walked_to} "
                   "(upstream.lock and overlay/ moved there; the stop comes after it)")  # fmt: skip
    return [*out, ""]


def _own_tests(rep: TrackReport) -> list[str]:
    """The carried changes' own tests at the target (``track/changes.py``)."""
    c = rep.changes
    if c is None:
        return []
    out = [f"## The carried changes' own tests at {rep.to}", ""]
    if c.error is not None:
        return [*out, "They could not run:", "", "```", c.error.rstrip(), "```", ""]
    for cid, o in c.changes.items():
        out.append(f"- `{cid}`: {'pass' if o.ok else '**fail**'} ({o.counts})")
        if o.first_error:
            out.append(f"  - first failure: `{o.first_error}`")
    out += [f"- `{cid}`: lists no tests" for cid in c.untested]
    if c.log:
        out.append(f"- log: `{c.log}` ({c.seconds:.0f} s)")
    return [*out, ""]


def _suite(rep: TrackReport) -> list[str]:
    s = rep.suite
    if s is None:
        if rep.status == READY:
            return [
                "The kv_connector suite was not run (`vllm-overlay track --suite` runs it).",
                "",
            ]
        return []
    out = ["## vLLM's kv_connector suite on the rebased tree", ""]
    if s.error is not None:
        return [*out, "The suite could not run:", "", "```", s.error, "```", ""]
    verdict = "No regression against pristine upstream." if s.ok else (
        "**Regressions** against pristine upstream:")  # fmt: skip
    return [*out, verdict, "", "```", s.text.rstrip(), "```", ""]


def _engine(rep: TrackReport) -> list[str]:
    """The engine proof: the source build (how long it took) and the engine tests."""
    e = rep.engine
    if e is None:
        return []
    builds = "our wheel" if e.source_builds == "none" else e.source_builds
    out, b, t = ["## The engine proof", ""], e.build, e.tests
    if b.ok:
        names = ", ".join(f"`{w.name}`" for w in b.wheels)
        out.append(f"- the test build (this machine's extension, no oneDNN) of {builds} at "
                   f"{rep.to}: compiled in {b.seconds:.0f} s ({names})")  # fmt: skip
    else:
        out += [f"- **the test build of {builds} failed** after {b.seconds:.0f} s:",
                "", "```", str(b.error or "").rstrip(), "```"]  # fmt: skip
    if t is not None and t.error:
        out.append(f"- **engine tests did not run**: {t.error}")
    elif t is not None:
        out.append(f"- engine tests at {rep.to}: {'passed' if t.ok else '**failed**'} in "
                   f"{t.seconds:.0f} s ({t.summary or 'no summary'}; log `{t.log}`)")  # fmt: skip
        if t.tail:
            out += ["", "```", t.tail.rstrip(), "```"]
    return [*out, ""]


def _to_do(rep: TrackReport) -> list[str]:
    """What a person must do: review and merge, fix a failure, or resolve the stop."""
    out = ["## What a person must do", ""]
    r = rep.rebase
    if rep.status == READY:
        out += ["1. Review the diff of `upstream.lock` and `overlay/` on this branch, and each "
                "dropped change's proof above.", "2. Merge. CI builds the wheel from the new pin."]  # fmt: skip
        if isinstance(r, RebaseReport) and not r.to.commit:
            out.append(f"3. The new pin's commit is unverified; where the git host is reachable "
                       f"run `vllm-overlay lock --version {rep.to} --commit SHA` to record it.")  # fmt: skip
        return out
    if isinstance(r, Failed):
        return [*out, "The rebase stopped on an error, not on a change: fix its cause (above), "
                f"then run `vllm-overlay track --to {rep.to}` again (it starts clean)."]  # fmt: skip
    if rep.stopped is None:
        return [*out, *_proofs_failed(rep)]
    return [*out, *_resolve(rep)]


def _proofs_failed(rep: TrackReport) -> list[str]:
    failed = [what for what, p in (("the carried changes' own tests", rep.changes),
                                   ("the kv_connector suite", rep.suite),
                                   ("the engine proof", rep.engine))
              if p is not None and not p.ok]  # fmt: skip
    return [
        f"The rebase completed and is committed on this branch, but {' and '.join(failed)} "
        "did not pass (above). Find the cause from the output and the log named there; "
        f"fix it on this branch (or in the overlay), then run `vllm-overlay track --to {rep.to}` "
        "again.",
    ]


def _resolve(rep: TrackReport) -> list[str]:
    """The stop's conflicts, its next steps, and how to pick the branch up elsewhere."""
    out = []
    for path, hunk in rep.hunks.items():
        out += [f"### Conflict in `{path}`", "", "```diff", hunk.rstrip(), "```", ""]
    r = rep.stopped
    steps = r.stopped_at.next_steps if r is not None and r.stopped_at else ()
    out += [f"- {step}" for step in steps]
    return [
        *out,
        "",
        "To resolve it on your machine, start from this branch: it carries the walk up "
        "to the stop, and your checkout and branch stay as they are:",
        "",
        "```sh",
        f"git fetch origin && git switch -c {rep.branch} origin/{rep.branch}",
        f"vllm-overlay rebase --to {rep.to}     # walks on from the branch's pin, stops at "
        "the same place",
        "# resolve in .work/vllm as said above, then:",
        "vllm-overlay rebase --continue",
        "git add upstream.lock overlay && git commit -m "
        f"'Track {rep.name} {rep.to}: rebase the overlay from {rep.from_}'",
        f"git push origin HEAD:{rep.branch}",
        "```",
        "",
        "Your resolution is recorded in overlay/resolutions/ on the branch; the next "
        "tracking run reads it from there and does not ask again.",
    ]


SECTIONS: tuple[Callable[[TrackReport], list[str]], ...] = (
    _title, _verdict, _facts, _failed, _changes, _dropped, _walk, _own_tests, _suite,
    _engine, _to_do,
)  # fmt: skip
