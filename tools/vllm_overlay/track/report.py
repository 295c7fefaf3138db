"""track-report.md (a pull-request body) and track-report.json, written by rename."""

from __future__ import annotations

import json
from pathlib import Path

from vllm_overlay.track import changes as track_changes
from vllm_overlay.util import atomic_write_text

MD, JSON = "track-report.md", "track-report.json"


def write(rep: dict, report_dir: Path) -> None:
    report_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(report_dir / JSON, json.dumps(rep, indent=2, sort_keys=True) + "\n")
    atomic_write_text(report_dir / MD, markdown(rep))
    rep["report"] = {"md": str(report_dir / MD), "json": str(report_dir / JSON)}


def markdown(rep: dict) -> str:
    name, old, new = rep["name"], rep["from"], rep["to"]
    status = rep["status"]
    out = [f"# Track {name}: {old} → {new}", ""]
    if status == "up-to-date":
        out += [
            f"upstream.lock already pins {name} {old}, the newest usable release. Nothing to do."
        ]
        out += [f"- note: {n}" for n in rep.get("notes", [])]
        return "\n".join(out) + "\n"
    verdict = {
        "ready": "**Ready for review**: the rebase completed; the branch carries the new "
        "upstream.lock and overlay/.",
        "needs-person": "**Needs a person**: the rebase did not complete on its own (see below).",
    }[status]
    out += [verdict, ""]
    out += [f"- branch: `{rep['branch']}` (from {str(rep.get('base_commit', ''))[:12]})"]
    r = rep.get("rebase") or {}
    to = r.get("to") or {}
    if to:
        commit = to.get("commit") or f"{to.get('sdist_commit')} (abbreviated, unverified)"
        out.append(f"- pin: {name} {old} → {new} (tag `{to.get('tag')}`, commit `{commit}`)")
        for a in to.get("artifacts", []):
            if a["kind"] == "sdist":
                out.append(f"- sdist: `{a['filename']}` sha256 `{a['sha256']}`")
        for variant, platforms in to.get("variants", {}).items():
            out.append(f"- {variant} wheels: {', '.join(platforms)}")
        if to.get("built_from_source", "none") != "none":
            out.append(f"- built from source here: {to['built_from_source']}")
    for n in [*rep.get("notes", []), *r.get("notes", [])]:
        out.append(f"- note: {n}")
    for p in rep.get("uncommitted", []):
        out.append(f"- note: `{p}` had uncommitted edits in the project; this run used HEAD")
    out.append("")
    if r.get("status") == "failed":
        out += ["## The rebase failed", "", "```", r["error"], "```", ""]
    if r.get("changes"):
        out += ["## Changes", "", "| change | outcome | why |", "|---|---|---|"]
        for c in r["changes"]:
            why = c.get("reason") or ""
            extra = []
            if c.get("renamed"):
                extra.append("moved " + ", ".join(f"{a} → {b}" for a, b in c["renamed"].items()))
            proof = c.get("test_run") or {}
            if c["state"] == "tests-failed":
                extra.append(f"on {c.get('release')}, without it: {proof.get('text', '')}")
                for run_ in (proof.get("runs") or {}).values():
                    if run_.get("first_error"):
                        extra.append(f"first error: `{run_['first_error']}`")
            elif c.get("releases"):
                steps = ", ".join(f"{v} {st}" for v, st in c["releases"].items())
                extra.append(f"walk: {steps}")
            if c.get("problems"):  # each file's problem: the reason, file by file
                why = ""
                extra += [f"{p['path']}: {p['kind']}: {p['detail']}" for p in c["problems"]]
            cell = "; ".join(x for x in [why, *extra] if x).replace("|", "\\|")
            out.append(f"| `{c['id']}` | {c['state']} | {cell} |")
        out.append("")
    dropped = [c for c in r.get("changes", []) if c["state"] == "dropped"]
    if dropped:
        out += ["## Dropped changes and their proof", ""]
        for c in dropped:
            out.append(f"- `{c['id']}`, at {name} {c['release']}: {c['reason']}")
            out.append(f"  - proof: {c['proof']}")
            if c.get("pull_request"):
                out.append(f"  - came back through {c['pull_request']}")
        out.append("")
    if r.get("path"):
        out += ["## The walk", "",
                f"Releases walked: {old} → " + " → ".join(r["path"]) + ".", ""]  # fmt: skip
        for w in r.get("waited", []):
            out.append(f"- not asked: `{w['id']}` at {w['release']} ({w['met']}): {w['reason']}")
        proofs = r.get("proof_releases") or {}
        if proofs:
            out.append("- test environments for the proofs: " + ", ".join(
                f"{v} ({secs:.0f} s)" for v, secs in sorted(proofs.items())))  # fmt: skip
        if rep.get("walked_to"):
            out.append(f"- this branch carries the walk up to {name} {rep['walked_to']} "
                       "(upstream.lock and overlay/ moved there; the stop comes after it)")  # fmt: skip
        out.append("")
    if "changes" in rep:
        out += track_changes.markdown(rep["changes"], new)
    if "suite" in rep:
        s = rep["suite"]
        out += ["## vLLM's kv_connector suite on the rebased tree", ""]
        if "error" in s:
            out += ["The suite could not run:", "", "```", s["error"], "```", ""]
        else:
            out += [("No regression against pristine upstream." if s["ok"] else
                     "**Regressions** against pristine upstream:"), "", "```",
                    s["text"].rstrip(), "```", ""]  # fmt: skip
    elif status == "ready":
        out += ["The kv_connector suite was not run (`vllm-overlay track --suite` runs it).", ""]
    if "engine" in rep:
        out += _engine(rep["engine"], new)
    out += ["## What a person must do", ""]
    if status == "ready":
        out += [
            "1. Review the diff of `upstream.lock` and `overlay/` on this branch, and each "
            "dropped change's proof above.",
            "2. Merge. CI builds the wheel from the new pin.",
        ]
        if to and not to.get("commit"):
            out.append(
                f"3. The new pin's commit is unverified; where the git host is reachable run "
                f"`vllm-overlay lock --version {new} --commit SHA` to record it."
            )
    elif r.get("status") == "failed":
        out += [
            "The rebase stopped on an error, not on a change: fix its cause (above), then run "
            f"`vllm-overlay track --to {new}` again (it starts clean).",
        ]
    elif r.get("status") == "complete":
        failed = [what for what, key in (("the carried changes' own tests", "changes"),
                                         ("the kv_connector suite", "suite"),
                                         ("the engine proof", "engine"))
                  if not rep.get(key, {}).get("ok", True)]  # fmt: skip
        out += [
            f"The rebase completed and is committed on this branch, but {' and '.join(failed)} "
            "did not pass (above). Find the cause from the output and the log named there; "
            f"fix it on this branch (or in the overlay), then run `vllm-overlay track --to {new}` "
            "again.",
        ]
    else:
        stop = r.get("stopped_at") or {}
        for path, hunk in (rep.get("hunks") or {}).items():
            out += [f"### Conflict in `{path}`", "", "```diff", hunk.rstrip(), "```", ""]
        for step in stop.get("next_steps", []):
            out.append(f"- {step}")
        out += [
            "",
            "To resolve it on your machine, start from this branch: it carries the walk up "
            "to the stop, and your checkout and branch stay as they are:",
            "",
            "```sh",
            f"git fetch origin && git switch -c {rep['branch']} origin/{rep['branch']}",
            f"vllm-overlay rebase --to {new}     # walks on from the branch's pin, stops at "
            "the same place",
            "# resolve in .work/vllm as said above, then:",
            "vllm-overlay rebase --continue",
            "git add upstream.lock overlay && git commit -m "
            f"'Track {name} {new}: rebase the overlay from {old}'",
            f"git push origin HEAD:{rep['branch']}",
            "```",
            "",
            "Your resolution is recorded in overlay/resolutions/ on the branch; the next "
            "tracking run reads it from there and does not ask again.",
        ]
    return "\n".join(out) + "\n"


def _engine(e: dict, version: str) -> list[str]:
    """The engine proof: the source build (how long it took) and the engine tests."""
    builds = e.get("source_builds", "none")
    builds = "our wheel" if builds == "none" else builds
    out = ["## The engine proof", ""]
    b = e.get("build") or {}
    if b.get("ok"):
        names = ", ".join(f"`{w['name']}`" for w in b.get("wheels", []))
        out.append(f"- the test build (this machine's extension, no oneDNN) of {builds} at "
                   f"{version}: compiled in {b['seconds']:.0f} s ({names})")  # fmt: skip
    else:
        out += [f"- **the test build of {builds} failed** after {b.get('seconds', 0):.0f} s:",
                "", "```", str(b.get("error", "")).rstrip(), "```"]  # fmt: skip
    t = e.get("tests")
    if t is not None:
        if t.get("error"):
            out.append(f"- **engine tests did not run**: {t['error']}")
        else:
            verdict = "passed" if t["ok"] else "**failed**"
            out.append(f"- engine tests at {version}: {verdict} in {t['seconds']:.0f} s "
                       f"({t.get('summary') or 'no summary'}; log `{t['log']}`)")  # fmt: skip
            if t.get("tail"):
                out += ["", "```", t["tail"].rstrip(), "```"]
    out.append("")
    return out
