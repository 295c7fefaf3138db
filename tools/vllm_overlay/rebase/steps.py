"""One change of a rebase: drop it (with proof), carry it onto the new base (kept or
refreshed), or stop (conflict, collision, moved file); and settling a stop with the person's
resolution.

Each function takes the context and one ``Change`` and returns ``(result, stop)``: the
settled record for the report and ``overlay.toml``, or the stop to save; exactly one is set.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path

from vllm_overlay.errors import RebaseError
from vllm_overlay.gitrepo import (
    Repo,
    changed_since,
    commit,
    git_env,
    has_staged,
    is_ancestor,
    run_git,
    show_bytes,
    unmerged,
    untracked,
)
from vllm_overlay.overlay.checkout import change_message
from vllm_overlay.overlay.export import DIFF_OPTS, file_diff
from vllm_overlay.overlay.model import Change
from vllm_overlay.rebase.state import (
    DROPPED,
    KEPT,
    NEW_BASE_REF,
    OLD_BASE_REF,
    REFRESHED,
    RESOLVED,
    STOP_COLLISION,
    STOP_CONFLICT,
    STOP_MOVED,
    STOP_TESTS,
    Ctx,
)
from vllm_overlay.testing import proving
from vllm_overlay.util import info

_MARKER_RE = re.compile(rb"^(<<<<<<<|>>>>>>>)( |$)", re.MULTILINE)


def step(ctx: Ctx, change: Change) -> tuple[dict | None, dict | None]:
    """Carry ``change`` from the old base onto HEAD (the new base plus the changes before it):
    dropped (with proof), kept or refreshed (one commit), or a stop."""
    reason = _drop_reason(ctx, change)
    if reason:
        return drop(ctx, change, reason)
    problems = _moved(ctx, change) + _collisions(ctx, change)
    problems += [p for p in _pick(ctx, change) if p["path"] not in {q["path"] for q in problems}]
    if problems:
        return None, _stop(ctx, change, problems)
    if not has_staged(ctx.repo):
        return drop(ctx, change, f"the three-way merge onto {ctx.name} {ctx.new_version} "
                     "changes nothing: upstream already has it")  # fmt: skip
    _commit(ctx, change)
    return _settled(ctx, change, resolved=False), None


def _drop_reason(ctx: Ctx, change: Change) -> str | None:
    if change.dropped_by(ctx.name, ctx.new_version):
        return f"drop_when {change.drop_when} holds for {ctx.name} {ctx.new_version}"
    how = _contained(ctx, change)
    if how:
        return f"{ctx.name} {ctx.new_version} already has it: " + "; ".join(how)
    return None


def _contained(ctx: Ctx, change: Change) -> list[str] | None:
    """How the new tree already holds ``change`` (None if it does not).

    Every file must be there, except test files the change adds and lists in its ``tests``
    (upstream seldom takes our tests as they are; they run against the new tree as the proof).
    """
    how = []
    own_tests = {t.partition("::")[0] for t in change.tests}
    for path in change.files:
        ours, new = ctx.ours(change, path), ctx.new_file(path)
        if ctx.added(path) and path in own_tests and new != ours:
            continue
        if new is None or ours is None:
            return None
        if ctx.added(path):
            if new != ours:
                return None
            how.append(f"upstream's {path} is identical to ours")
        elif _reverse_applies(ctx, change, path):
            how.append(f"our patch of {path} applies in reverse")
        elif _merge_is_noop(ctx, ctx.old_file(path), ours, new):
            how.append(f"the three-way merge of our {path} leaves upstream's unchanged")
        else:
            return None
    return how or None


def _reverse_applies(ctx: Ctx, change: Change, path: str) -> bool:
    """Our patch of ``path`` applies in reverse to the new tree (git apply -R, no fuzz)."""
    ours = ctx.state.commits[change.id]
    g = ctx.repo.git
    diff = run_git(g, "diff", *DIFF_OPTS, OLD_BASE_REF, ours, "--", path)
    if not diff.stdout.strip():
        return False
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-index-") as tmp:
        env = {"GIT_INDEX_FILE": os.path.join(tmp, "index")}  # a scratch index: nothing moves
        run_git(g, "read-tree", NEW_BASE_REF, env=env)
        out = run_git(g, "apply", "-R", "--check", "--cached", "-", input=diff.stdout, env=env,
                      check=False)  # fmt: skip
    return out.returncode == 0


def _merge_is_noop(ctx: Ctx, old: bytes | None, ours: bytes, new: bytes) -> bool:
    """``git merge-file`` of our file into upstream's (over the old base) gives upstream's."""
    if old is None:
        return False
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-merge-") as tmp:
        files = []
        for name, data in (("new", new), ("old", old), ("ours", ours)):
            p = Path(tmp, name)
            p.write_bytes(data)
            files.append(str(p))
        out = run_git(ctx.repo.git, "merge-file", "-p", *files, check=False)
    return out.returncode == 0 and out.stdout == new.decode(errors="surrogateescape")


def _moved(ctx: Ctx, change: Change) -> list[dict]:
    problems = []
    for path in change.files:
        if ctx.added(path) or ctx.new_file(path) is not None:
            continue
        cands = ctx.renames().get(path, [])
        if cands:
            shown = ", ".join(f"{p} ({s}% similar)" for p, s in cands)
            detail = f"upstream {ctx.new_version} renamed it: git's candidates: {shown}"
            kind = "renamed"
        else:
            detail = f"upstream {ctx.new_version} deleted it (git finds no rename candidate)"
            kind = "deleted"
        problems.append(
            {
                "path": path,
                "kind": kind,
                "detail": detail,
                "candidates": [{"path": p, "similarity": s} for p, s in cands],
            }
        )
    return problems


def _collisions(ctx: Ctx, change: Change) -> list[dict]:
    problems = []
    for path in change.files:
        if not ctx.added(path):
            continue
        theirs = ctx.new_file(path)
        if theirs is None:
            continue
        same = theirs == ctx.ours(change, path)
        problems.append(
            {
                "path": path,
                "kind": "collision",
                "detail": f"change {change.id} adds it, and upstream {ctx.new_version} now has "
                + ("an identical file" if same else "its own, different file"),
                "candidates": [],
            }
        )
    return problems


def _pick(ctx: Ctx, change: Change) -> list[dict]:
    """Cherry-pick the change's commit (no commit yet); conflicts as problems."""
    config = {"merge.conflictStyle": "diff3", "rerere.enabled": "false"}
    out = run_git(ctx.repo.git, "cherry-pick", "--no-commit", ctx.state.commits[change.id],
                  env=git_env(config=config), check=False)  # fmt: skip
    text = out.stdout + out.stderr
    lines = [ln.strip() for ln in text.splitlines() if ln.startswith("CONFLICT (")]
    problems = []
    for path in unmerged(ctx.repo):
        said = [ln for ln in lines if path in ln]
        kind = said[0][len("CONFLICT (") :].split(")", 1)[0] if said else "unmerged"
        detail = " ".join(said) or "git left it unmerged"
        if kind == "content":
            detail = (
                f"upstream {ctx.new_version} and our change edit the same lines "
                "(diff3 markers in the checkout)"
            )
        problems.append({"path": path, "kind": kind, "detail": detail, "candidates": []})
    if out.returncode != 0 and not problems:
        raise RebaseError(
            f"cherry-picking change {change.id} failed without a conflict git reports:\n"
            f"{text.strip()}\nRun `vllm-overlay rebase --continue` to retry the step, or "
            "`--abort`."
        )
    return problems


def _commit(ctx: Ctx, change: Change) -> None:
    commit(ctx.repo, change_message(change))


def _stop(ctx: Ctx, change: Change, problems: list[dict]) -> dict:
    kinds = {p["kind"] for p in problems}
    if kinds & {"renamed", "deleted"}:
        kind = STOP_MOVED
    elif "collision" in kinds:
        kind = STOP_COLLISION
    else:
        kind = STOP_CONFLICT
    return {
        "id": change.id,
        "kind": kind,
        "pre_head": ctx.state.step_head,
        "problems": problems,
        "renames": {
            p["path"]: p["candidates"][0]["path"] for p in problems if p["kind"] == "renamed"
        },
    }


# ---------------------------------------------------------------------------------------------
# Dropping (and proving it)


def drop(ctx: Ctx, change: Change, reason: str) -> tuple[dict | None, dict | None]:
    """Drop ``change`` after its tests pass against the new upstream without it."""
    _reset_to(ctx, ctx.state.step_head)
    test_run = _prove(ctx, change)
    if test_run is not None and not test_run.ok:
        return None, {
            "id": change.id,
            "kind": STOP_TESTS,
            "pre_head": ctx.state.step_head,
            "reason": reason,
            "problems": [],
            "test_run": test_run.to_json(),
        }
    if test_run is None:
        proof = "not proven: the change lists no tests"
    else:
        proof = (
            f"{', '.join(change.tests)} passed against {ctx.name} {ctx.new_version} without the "
            f"change ({test_run.counts()})"
        )
        if test_run.notes:
            proof += "; " + "; ".join(test_run.notes)
    return {
        "id": change.id,
        "title": change.title,
        "origin": change.origin,
        "status": DROPPED,
        "reason": reason,
        "proof": proof,
        "test_run": test_run.to_json() if test_run else None,
    }, None


def _reset_to(ctx: Ctx, rev: str) -> None:
    g = ctx.repo.git
    run_git(g, "reset", "-q", "--merge", check=False)
    run_git(g, "reset", "-q", "--hard", rev)
    run_git(g, "clean", "-q", "-f", "-d")


def _prove(ctx: Ctx, change: Change) -> proving.TestRun | None:
    if not change.tests:
        return None
    ours = {}
    for entry in change.tests:
        path = entry.partition("::")[0]
        data = ctx.ours(change, path) if path in change.files else None
        if data is not None:
            ours[path] = data
    scratch = ctx.paths.tests_dir(change.id)
    shutil.rmtree(scratch, ignore_errors=True)
    info(f"change {change.id}: running its tests against {ctx.name} {ctx.new_version} without it")
    tree = proving.export_tree(ctx.checkout, NEW_BASE_REF, scratch / "tree")
    targets, notes = proving.stage_tests(tree, change.tests, ours)
    runner = proving.runner_for(tree, ctx.state.test_python)
    result = proving.run_tests(runner, tree, targets, scratch / "work", scratch / "pytest.log")
    result.notes = notes
    if result.ok:
        shutil.rmtree(tree, ignore_errors=True)
    return result


# ---------------------------------------------------------------------------------------------
# Settling a stopped change


def settle_resolution(ctx: Ctx, change: Change) -> tuple[dict | None, dict | None]:
    co, repo = ctx.checkout, ctx.repo
    pre = ctx.state.pending["pre_head"]  # type: ignore[index]
    head = ctx.head()
    if head != pre:
        if not is_ancestor(repo, pre, head):
            raise RebaseError(
                f"HEAD of {co} moved off the rebase (it is {head[:12]}, expected {pre[:12]} or a "
                "commit on top of it). Check out the rebase's work again, or `--abort`."
            )
        run_git(repo.git, "reset", "-q", "--soft", pre)  # fold the person's commits into one
    left = _markers_left(ctx, pre)
    if left:
        shown = "\n".join("    " + p for p in left)
        raise RebaseError(
            f"conflict markers (<<<<<<< or >>>>>>>) are still in:\n{shown}\nEdit them away, "
            "then run `vllm-overlay rebase --continue` again."
        )
    run_git(repo.git, "add", "-A")
    if not has_staged(repo):
        return drop(ctx, change, "the conflict was resolved to upstream's code: upstream's "
                     f"{ctx.new_version} replaces the change")  # fmt: skip
    _commit(ctx, change)
    return _settled(ctx, change, resolved=True), None


def _markers_left(ctx: Ctx, pre: str) -> list[str]:
    changed = changed_since(ctx.repo, pre) + untracked(ctx.repo)
    left = []
    for rel in sorted(set(changed)):
        p = ctx.checkout / rel
        if p.is_file() and not p.is_symlink() and _MARKER_RE.search(p.read_bytes()):
            left.append(rel)
    return left


def _settled(ctx: Ctx, change: Change, *, resolved: bool) -> dict:
    """The result of a change that now sits as one commit on the new base."""
    repo = ctx.repo
    changed = changed_since(repo, ctx.state.step_head, "HEAD")
    renames = dict((ctx.state.pending or {}).get("renames", {}))
    files, removed, added = _new_files(list(change.files), changed, renames)
    tests = [_renamed_test(t, renames) for t in change.tests]
    old_commit = ctx.state.commits[change.id]
    same = files == list(change.files) and all(
        _as_exported(repo, OLD_BASE_REF, old_commit, p)
        == _as_exported(repo, NEW_BASE_REF, "HEAD", p)
        for p in files
    )
    status = RESOLVED if resolved else (KEPT if same else REFRESHED)
    return {
        "id": change.id,
        "title": change.title,
        "origin": change.origin,
        "status": status,
        "files": files,
        "tests": tests,
        "removed_files": removed,
        "added_files": added,
        "renamed": {k: v for k, v in renames.items() if v in files},
        "commit": ctx.head(),
    }


def _new_files(
    old: list[str], changed: list[str], renames: dict[str, str]
) -> tuple[list[str], list[str], list[str]]:
    """(the change's files now, files it no longer touches, files it now also touches)."""
    now: list[str] = []
    removed: list[str] = []
    for path in old:
        target = renames.get(path, path)
        if target in changed:
            now.append(target)
        elif path in changed:
            now.append(path)
        else:
            removed.append(path)
    extra = [p for p in changed if p not in now]
    return now + extra, removed, [p for p in extra if p not in renames.values()]


def _renamed_test(entry: str, renames: dict[str, str]) -> str:
    path, sep, node = entry.partition("::")
    return renames.get(path, path) + sep + node


def _as_exported(repo: Repo, base: str, rev: str, path: str) -> bytes | None:
    """What export writes for ``path`` at ``rev`` over ``base``: the patch, or the whole file."""
    if show_bytes(repo, base, path) is None:
        return show_bytes(repo, rev, path)
    return file_diff(repo, base, path, rev).encode()
