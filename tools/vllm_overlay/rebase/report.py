"""The rebase report: where it stands as plain data (the CLI renders it, or prints it as
JSON), and what the person does next for each kind of stop."""

from __future__ import annotations

from vllm_overlay.rebase.state import (
    DROPPED,
    KEPT,
    NEW_BASE_REF,
    REFRESHED,
    RESOLVED,
    STOP_COMMIT,
    STOP_KINDS,
    STOP_TESTS,
    Ctx,
)


def report(ctx: Ctx) -> dict:
    """Where the rebase stands, as plain data (the CLI renders it, or prints it as JSON)."""
    st = ctx.state
    u = ctx.new_lock.upstream
    changes = [_public(r) for r in st.results]
    stopped = None
    if st.pending:
        stopped = _public_stop(ctx, st.pending)
        if st.pending["kind"] != STOP_COMMIT:
            changes.append(stopped)
    done = {c["id"] for c in changes}
    changes += [{"id": cid, "status": "pending"} for cid in st.order if cid not in done]
    by = {s: [c["id"] for c in changes if c["status"] == s] for s in (KEPT, REFRESHED, RESOLVED)}
    return {
        "status": "stopped" if st.pending else st.status,
        "from": {"version": st.from_version, "commit": st.from_commit},
        "to": {
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
        },
        "notes": list(st.pin_notes),
        "checkout": st.checkout.path,
        "changes": changes,
        "kept": by[KEPT],
        "refreshed": by[REFRESHED],
        "resolved": by[RESOLVED],
        "dropped": [
            {"id": c["id"], "reason": c["reason"], "proof": c["proof"]}
            for c in changes
            if c["status"] == DROPPED
        ],
        "conflicted": [c["id"] for c in changes if c["status"] in STOP_KINDS] + by[RESOLVED],
        "stopped_at": stopped,
    }


def _public(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "commit"}


def _public_stop(ctx: Ctx, pending: dict) -> dict:
    return {
        "id": pending["id"],
        "status": pending["kind"],
        "problems": pending["problems"],
        "reason": pending.get("reason"),
        "test_run": pending.get("test_run"),
        "next_steps": next_steps(ctx, pending),
    }


def next_steps(ctx: Ctx, pending: dict) -> list[str]:
    """What the person does now, for this kind of stop."""
    co = ctx.checkout
    old, new = ctx.old_version, ctx.new_version
    go_on = "then run `vllm-overlay rebase --continue` (no need to git add or commit)"
    back = (
        "or `vllm-overlay rebase --abort` to put upstream.lock, overlay/ and the checkout back "
        f"at {old}"
    )
    kind = pending["kind"]
    if kind == STOP_COMMIT:
        st = ctx.state
        return [
            f"every change is settled, but the full commit id of {ctx.name} {new} is unknown "
            f"(the sdist records {st.sdist_commit or 'none'}) and upstream.lock needs it.",
            f"Where {ctx.new_lock.upstream.git} is reachable, `git ls-remote "
            f"{ctx.new_lock.upstream.git} refs/tags/{ctx.new_lock.upstream.tag}` prints it; "
            f"then run `vllm-overlay rebase --continue --commit SHA`; {back}.",
        ]
    if kind == STOP_TESTS:
        run_ = pending.get("test_run") or {}
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
            f"Resolve the conflict markers in {co}: between <<<<<<< HEAD and ||||||| is "
            f"upstream {new}, between ||||||| and ======= upstream {old} (what our change was "
            "written against), between ======= and >>>>>>> our change. Keep upstream's new code "
            "and redo our change on top of it."
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
    steps.append(f"{go_on}; {back}.")
    return steps
