"""The rebase report: where it stands as plain data (the CLI renders it, or prints it as
JSON), and what the person does next for each kind of stop.

Each change's verdict is its ``state``, as in the walk's cells (``rebase/walkdata.py``):
under ``changes``, ``stopped_at``, ``stops`` and ``cells`` alike; the report's own
``status`` is the rebase's (running, stopped, complete, ...)."""

from __future__ import annotations

from vllm_overlay.overlay.model import Overlay
from vllm_overlay.rebase.decide import DROPPED, KEPT, REFRESHED
from vllm_overlay.rebase.state import NEW_BASE_REF, STOP_COMMIT, STOP_TESTS, Ctx
from vllm_overlay.rebase.walkdata import RECORD, RESOLVED, WAITING, Cell, Walk, person_stops


def settled(w: Walk, overlay: Overlay) -> list[dict]:
    """Each change's end state over the walk so far: dropped (at which release, why, with
    which proof), or carried (kept, refreshed, resolved by a person or by a record), with its
    files and tests now."""
    out = []
    for cid in w.order:
        change = overlay.change(cid)
        base = {"id": cid, "title": change.title, "origin": change.origin}
        cells = [c for c in w.cells if c.id == cid]
        if cid in w.gone:
            g = w.gone[cid]
            out.append({**base, "state": DROPPED, "release": g["release"],
                        "reason": g["reason"], "proof": g["proof"],
                        "pull_request": change.forwarded.pull_request})  # fmt: skip
            continue
        states = {c.state for c in cells}
        if not w.done and (not cells or cells[-1].release != w.release):
            state = "pending"  # not judged at the release the walk stands at yet
        elif RESOLVED in states:
            state = RESOLVED
        elif RECORD in states:
            state = RECORD
        elif REFRESHED in states:
            state = REFRESHED
        else:
            state = KEPT
        form = w.forms[cid]
        renamed = {k: v for c in cells for k, v in c.renamed.items()}
        unproven = [c.release for c in cells if c.unproven or c.unproven_records]
        out.append({**base, "state": state, "files": list(form.files),
                    "tests": list(form.tests), "renamed": renamed,
                    "releases": {c.release: c.state for c in cells},
                    "unproven": unproven})  # fmt: skip
    return out


def report(ctx: Ctx, w: Walk, timings: dict[str, float] | None = None) -> dict:
    """Where the rebase stands, as plain data (the CLI renders it, or prints it as JSON)."""
    st = ctx.state
    changes = settled(w, ctx.overlay)
    stopped = None
    if w.stop is not None:
        stopped = _public_stop(ctx, w)
        for c in changes:
            if c["id"] == w.stop.id:
                c.update(state=w.stop.state, release=w.stop.release,
                         problems=stopped["problems"], reason=stopped["reason"],
                         test_run=stopped["test_run"], notes=stopped["notes"])  # fmt: skip
    elif st.commit_pending:
        stopped = {"id": "", "state": STOP_COMMIT, "problems": [],
                   "next_steps": next_steps(ctx, {"state": STOP_COMMIT})}  # fmt: skip
    by = {s: [c["id"] for c in changes if c["state"] == s]
          for s in (KEPT, REFRESHED, RESOLVED, RECORD)}  # fmt: skip
    proofs: dict[str, float] = {}
    for c in w.cells:
        secs = (c.test_run or {}).get("seconds")
        if c.state == DROPPED or secs is not None:
            proofs.setdefault(c.release, 0.0)
    for rel, secs in (timings or {}).items():
        proofs[rel] = secs
    return {
        "status": "stopped" if stopped else st.status,
        "from": {"version": st.from_version, "commit": st.from_commit},
        "to": _to(ctx),
        "path": list(w.path),
        "at": w.release,
        "notes": list(st.pin_notes),
        "checkout": st.checkout.path,
        "changes": changes,
        "kept": by[KEPT],
        "refreshed": by[REFRESHED],
        "resolved": by[RESOLVED],
        "by_record": by[RECORD],
        "unproven": [c["id"] for c in changes if c.get("unproven")],  # recorded unproven
        "dropped": [
            {
                "id": c["id"],
                "release": c["release"],
                "reason": c["reason"],
                "proof": c["proof"],
                "pull_request": c["pull_request"],
            }
            for c in changes
            if c["state"] == DROPPED
        ],
        "conflicted": [
            c["id"]
            for c in changes
            if c["state"] in ("conflict", "moved", "collision", RESOLVED, RECORD)
        ],
        "waited": [c.to_json() for c in w.cells if c.state == WAITING and c.met],
        "stops": person_stops(w),
        "proof_releases": proofs,
        "cells": [_brief(c) for c in w.cells],
        "stopped_at": stopped,
    }


def _brief(c: Cell) -> dict:
    """A cell as the report lists it: where, which change, its state, and whether a stop."""
    return {"release": c.release, "id": c.id, "state": c.state} | ({"stop": True} if c.stop else {})


def _to(ctx: Ctx) -> dict:
    """The new pin: the release, its commit (None while unknown) and its artifacts."""
    st, u = ctx.state, ctx.new_lock.upstream
    return {
        "name": u.name,
        "version": u.version,
        "tag": u.tag,
        "commit": u.commit if st.commit_known else None,
        "sdist_commit": st.sdist_commit,
        "artifacts": [
            {
                "kind": a.kind,
                "project": a.project,
                "filename": a.filename,
                "sha256": a.sha256,
                "size": a.size,
            }
            for a in ctx.new_lock.artifacts
        ],  # fmt: skip
        "variants": {v: ctx.new_lock.platforms(v) for v in ctx.new_lock.variants()},
        "built_from_source": ctx.new_lock.source_line(),
    }


def _public_stop(ctx: Ctx, w: Walk) -> dict:
    stop = w.stop
    assert stop is not None
    problems = [
        {"path": p, **_problem(stop, p),
         "candidates": [{"path": c[0], "similarity": c[1]}
                        for c in stop.candidates.get(p, [])]}
        for p in stop.files
    ]  # fmt: skip
    pending = {"id": stop.id, "state": stop.state, "release": stop.release,
               "reason": stop.reason, "problems": problems, "test_run": stop.test_run}  # fmt: skip
    return {
        "id": stop.id,
        "state": stop.state,
        "release": stop.release,
        "problems": problems,
        "hunks": dict(stop.hunks),
        "notes": list(stop.notes),
        "reason": stop.reason,
        "test_run": stop.test_run,
        "next_steps": next_steps(ctx, pending),
    }


def _problem(stop: Cell, path: str) -> dict[str, str]:
    """What happened to one file of a stop: its kind (content, renamed, deleted, collision)
    and what upstream did. A stop can mix kinds (0.34.0 deletes one file of
    cpu-mamba-align-postprocess and edits our lines in another); a stop saved before the
    walk kept each file's problem has only the stop's kind and reason."""
    kind, _, detail = stop.problems.get(path, "").partition(": ")
    if not detail:
        kind, detail = stop.state, stop.reason
    if kind == "moved":
        kind = "renamed" if stop.candidates.get(path) else "deleted"
    elif kind == "conflict":
        kind = "content"
    return {"kind": kind, "detail": detail}


def next_steps(ctx: Ctx, pending: dict) -> list[str]:
    """What the person does now, for this kind of stop (``pending["state"]``)."""
    co = ctx.checkout
    old, new = ctx.old_version, pending.get("release") or ctx.new_version
    go_on = "then run `vllm-overlay rebase --continue` (no need to git add or commit)"
    back = (
        "or `vllm-overlay rebase --abort` to put upstream.lock, overlay/ and the checkout back "
        f"at {old}"
    )
    state = pending["state"]
    if state == STOP_COMMIT:
        st = ctx.state
        return [
            f"every change is settled, but the full commit id of {ctx.name} {new} is unknown "
            f"(the sdist records {st.sdist_commit or 'none'}) and upstream.lock needs it.",
            f"Where {ctx.new_lock.upstream.git} is reachable, `git ls-remote "
            f"{ctx.new_lock.upstream.git} refs/tags/{ctx.new_lock.upstream.tag}` prints it; "
            f"then run `vllm-overlay rebase --continue --commit SHA`; {back}.",
        ]
    if state == STOP_TESTS:
        runs = (pending.get("test_run") or {}).get("runs") or {}
        run_ = runs.get("ours") or runs.get("upstream") or {}
        where = f"against {ctx.name} {new} without the change (log: {run_.get('log', '')})"
        if run_.get("failed"):
            why = (
                "upstream's version does not do what ours did: the tests of change "
                f"{pending['id']} fail {where}."
            )
        elif run_.get("errors"):
            why = (
                f"the tests of change {pending['id']} do not run {where}: they error (at "
                "import or setup), so nothing proves upstream's version does what ours did. "
                "Often the tests use an API upstream changed."
            )
        else:
            why = (
                f"no test of change {pending['id']} passed {where} (all skipped, or none "
                "collected): nothing proves upstream's version does what ours did."
            )
        return [
            why,
            "`vllm-overlay rebase --abort`, then either keep the change (raise its drop_when in "
            "overlay/overlay.toml) or fix its tests if they rely on an API upstream changed, and "
            "rebase again; `vllm-overlay rebase --continue` runs the tests again.",
        ]
    steps = []
    kinds = {p["kind"] for p in pending["problems"]}
    if kinds - {"collision", "renamed", "deleted"}:
        steps.append(
            f"The checkout {co} is {ctx.name} {new} with the changes before this one. Resolve "
            f"the conflict markers there: between <<<<<<< and ||||||| is upstream {new}, "
            "between ||||||| and ======= the code our change was last written against, "
            "between ======= and >>>>>>> our change. Keep upstream's new code and redo our "
            "change on top of it; once the change's tests pass with it there, the resolution "
            "is recorded, so no walk asks it again."
        )
    if "collision" in kinds:
        steps.append(
            f"A file the change adds now exists upstream. Decide in {co}: keep ours (edit the "
            "file to what it should be; it becomes a patch of upstream's file) or take "
            f"upstream's (`git -C {co} checkout {NEW_BASE_REF} -- PATH`)."
        )
    if kinds & {"renamed", "deleted"}:
        steps.append(
            "A file the change touches was renamed or deleted upstream. For a rename, check "
            "that our edit landed in the new file (git applies it when it can) and fix it up; "
            "for a deletion, move our edit to where the code went, or `git rm` the file if the "
            "change no longer needs it. The change's files in overlay.toml follow what the "
            "checkout holds."
        )
    steps.append(
        "If upstream's code makes the change unneeded, leave each of the change's files as "
        f"the checkout's HEAD has it ({new} with the changes before this one: `git -C {co} "
        "checkout HEAD -- PATH`; a file the change adds or upstream deleted: removed): the "
        "change drops here once its tests pass without it, and the drop is recorded, so no "
        "walk asks it again."
    )
    steps.append(f"{go_on}; {back}.")
    return steps
