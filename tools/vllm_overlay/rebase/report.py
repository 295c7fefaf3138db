"""The rebase report: where it stands (typed: ``rebase/reportdata.py``; the CLI renders it,
or prints its JSON), and what the person does next for each kind of stop.

Each change's verdict is its ``state``, as in the walk's cells (``rebase/walkdata.py``):
under ``changes``, ``stopped_at``, ``stops`` and ``cells`` alike; the report's own
``status`` is the rebase's (running, stopped, complete, ...)."""

from __future__ import annotations

from dataclasses import replace

from vllm_overlay.overlay.model import Overlay
from vllm_overlay.rebase.decide import DROPPED, KEPT, REFRESHED
from vllm_overlay.rebase.reportdata import (
    Artifact,
    Brief,
    ChangeOutcome,
    Pin,
    Problem,
    RebaseReport,
    Run,
    Stop,
    TestRun,
)
from vllm_overlay.rebase.state import NEW_BASE_REF, STOP_COMMIT, STOP_TESTS, Ctx
from vllm_overlay.rebase.walkdata import RECORD, RESOLVED, WAITING, Cell, Walk, person_stops


def settled(w: Walk, overlay: Overlay) -> list[ChangeOutcome]:
    """Each change's end state over the walk so far: dropped (at which release, why, with
    which proof), or carried (kept, refreshed, resolved by a person or by a record), with its
    files and tests now."""
    out = []
    for cid in w.order:
        change = overlay.change(cid)
        cells = [c for c in w.cells if c.id == cid]
        if cid in w.gone:
            g = w.gone[cid]
            out.append(ChangeOutcome(cid, change.title, change.origin, DROPPED,
                                     release=g["release"], reason=g["reason"], proof=g["proof"],
                                     pull_request=change.forwarded.pull_request))  # fmt: skip
            continue
        form = w.forms[cid]
        out.append(ChangeOutcome(
            cid, change.title, change.origin, _carried(w, cells), files=tuple(form.files),
            tests=tuple(form.tests), renamed={k: v for c in cells for k, v in c.renamed.items()},
            releases={c.release: c.state for c in cells},
            unproven=tuple(c.release for c in cells if c.unproven or c.unproven_records),
        ))  # fmt: skip
    return out


def _carried(w: Walk, cells: list[Cell]) -> str:
    """A carried change's state: the strongest of its cells', or pending (not judged at the
    release the walk stands at yet)."""
    states = {c.state for c in cells}
    if not w.done and (not cells or cells[-1].release != w.release):
        return "pending"
    return next((s for s in (RESOLVED, RECORD, REFRESHED) if s in states), KEPT)


def report(ctx: Ctx, w: Walk, timings: dict[str, float] | None = None) -> RebaseReport:
    """Where the rebase stands (the CLI renders it, or prints its JSON)."""
    st = ctx.state
    changes = settled(w, ctx.overlay)
    stopped = None
    if w.stop is not None:
        stopped = _public_stop(ctx, w)
        changes = [c if c.id != w.stop.id else replace(
            c, state=w.stop.state, release=w.stop.release, stopped=True,
            problems=stopped.problems, reason=stopped.reason, test_run=stopped.test_run,
            notes=stopped.notes) for c in changes]  # fmt: skip
    elif st.commit_pending:
        stopped = Stop("", STOP_COMMIT, tuple(next_steps(ctx, STOP_COMMIT)))
    proofs: dict[str, float] = {}
    for c in w.cells:
        if c.state == DROPPED or (c.test_run or {}).get("seconds") is not None:
            proofs.setdefault(c.release, 0.0)
    proofs |= timings or {}
    return RebaseReport(
        status="stopped" if stopped else st.status,
        from_version=st.from_version,
        from_commit=st.from_commit,
        to=_to(ctx),
        path=tuple(w.path),
        at=w.release,
        checkout=st.checkout.path,
        changes=tuple(changes),
        notes=tuple(st.pin_notes),
        waited=tuple(c for c in w.cells if c.state == WAITING and c.met),
        stops=tuple(Brief(**s) for s in person_stops(w)),
        cells=tuple(Brief(c.release, c.id, c.state, c.stop) for c in w.cells),
        proof_releases=proofs,
        stopped_at=stopped,
    )


def _to(ctx: Ctx) -> Pin:
    """The new pin: the release, its commit (None while unknown) and its artifacts."""
    st, lock = ctx.state, ctx.new_lock
    u = lock.upstream
    return Pin(
        u.name, u.version, u.tag, u.commit if st.commit_known else None, st.sdist_commit,
        tuple(Artifact(a.kind, a.project, a.filename, a.sha256, a.size) for a in lock.artifacts),
        {v: lock.platforms(v) for v in lock.variants()}, lock.source_line(),
    )  # fmt: skip


def _public_stop(ctx: Ctx, w: Walk) -> Stop:
    stop = w.stop
    assert stop is not None
    problems = tuple(
        Problem(p, *_problem(stop, p), tuple((c[0], c[1]) for c in stop.candidates.get(p, [])))
        for p in stop.files
    )
    test_run = TestRun.from_json(stop.test_run)
    steps = next_steps(ctx, stop.state, cid=stop.id, release=stop.release, test_run=test_run,
                       kinds={p.kind for p in problems})  # fmt: skip
    return Stop(stop.id, stop.state, tuple(steps), problems, stop.release, stop.reason,
                dict(stop.hunks), tuple(stop.notes), test_run)  # fmt: skip


def _problem(stop: Cell, path: str) -> tuple[str, str]:
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
    return kind, detail


def next_steps(
    ctx: Ctx, state: str, *, cid: str = "", release: str | None = None,
    test_run: TestRun | None = None, kinds: set[str] = frozenset(),
) -> list[str]:  # fmt: skip
    """What the person does now, for this kind of stop (``state``; at change ``cid`` on
    ``release``, with its failed proof, its files' kinds of problem)."""
    new = release or ctx.new_version
    back = (
        "or `vllm-overlay rebase --abort` to put upstream.lock, overlay/ and the checkout back "
        f"at {ctx.old_version}"
    )
    if state == STOP_COMMIT:
        st, u = ctx.state, ctx.new_lock.upstream
        return [
            f"every change is settled, but the full commit id of {ctx.name} {new} is unknown "
            f"(the sdist records {st.sdist_commit or 'none'}) and upstream.lock needs it.",
            f"Where {u.git} is reachable, `git ls-remote {u.git} refs/tags/{u.tag}` prints it; "
            f"then run `vllm-overlay rebase --continue --commit SHA`; {back}.",
        ]
    if state == STOP_TESTS:
        return _tests_steps(ctx, cid, new, test_run)
    go_on = "then run `vllm-overlay rebase --continue` (no need to git add or commit)"
    return [*_resolve_steps(ctx, new, kinds), f"{go_on}; {back}."]


def _tests_steps(ctx: Ctx, cid: str, new: str, test_run: TestRun | None) -> list[str]:
    """A drop whose tests did not prove it: why, and what to do."""
    runs = test_run.runs if test_run else {}
    run_ = runs.get("ours") or runs.get("upstream") or Run()
    where = f"against {ctx.name} {new} without the change (log: {run_.log})"
    if run_.failed:
        why = (
            f"upstream's version does not do what ours did: the tests of change {cid} fail {where}."
        )
    elif run_.errors:
        why = (
            f"the tests of change {cid} do not run {where}: they error (at "
            "import or setup), so nothing proves upstream's version does what ours did. "
            "Often the tests use an API upstream changed."
        )
    else:
        why = (
            f"no test of change {cid} passed {where} (all skipped, or none "
            "collected): nothing proves upstream's version does what ours did."
        )
    return [
        why,
        "`vllm-overlay rebase --abort`, then either keep the change (raise its drop_when in "
        "overlay/overlay.toml) or fix its tests if they rely on an API upstream changed, and "
        "rebase again; `vllm-overlay rebase --continue` runs the tests again.",
    ]


def _resolve_steps(ctx: Ctx, new: str, kinds: set[str]) -> list[str]:
    """A stop at a change's files: how to resolve each kind of problem, or to drop it."""
    co = ctx.checkout
    steps = []
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
    return steps
