"""Move the overlay to another upstream release: keep, refresh, drop, or stop.

For each change, in overlay.toml order, in the checkout (a real git work tree):

1. **dropped** when its ``drop_when`` holds for the new version, or when the new tree already
   has it (its patch applies in reverse, or the three-way merge leaves upstream's file
   unchanged). Its ``tests`` then run against the new, pristine upstream (our own test files
   placed under fresh names): if they fail, the rebase stops, since upstream's version does not
   do what ours did.
2. otherwise the change's commit (made by apply on the old pin) is cherry-picked onto the new
   base: a real three-way merge against the old base, with git's rename detection, never a
   copy of our old file. A clean pick is **kept** (the exported patch is byte-identical) or
   **refreshed** (new context).
3. it **stops** on a content conflict (diff3 markers left in the checkout), on a file we add
   that upstream now also has (a collision), or on a touched file upstream deleted or renamed
   (with git's rename candidates). ``--continue`` commits the person's resolution and goes on;
   ``--abort`` restores everything.

Only when every change is settled are ``upstream.lock`` (the new pin and base hashes),
``overlay/`` (exported from the checkout) and ``overlay/overlay.toml`` (dropped changes moved to
``[[dropped]]``, moved paths, revision) written. State lives in ``.work/rebase/`` (JSON plus
byte-exact backups of the lock and ``overlay/``), so a stopped rebase resumes in a new process.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from packaging.version import InvalidVersion, Version

from vllm_overlay.errors import CheckoutError, RebaseError, UsageError
from vllm_overlay.gitrepo import (
    config_get,
    config_set,
    git,
    git_env,
    rev_parse,
    show_bytes,
    status_porcelain,
)
from vllm_overlay.index.client import configured_index_urls, list_files, release_file_kind
from vllm_overlay.overlay import history
from vllm_overlay.overlay.checkout import (
    APPLIED_REF,
    BRANCH,
    TRAILER,
    apply_overlay,
    check_consistency,
    checkout_state,
    is_checkout,
)
from vllm_overlay.overlay.checkout import plan as plan_overlay
from vllm_overlay.overlay.export import DIFF_OPTS, export_overlay
from vllm_overlay.overlay.model import (
    CONFIG_NAME,
    Change,
    Overlay,
    load_overlay,
    overlay_digest,
    parse_overlay,
)
from vllm_overlay.overlay.patches import canonical_diff
from vllm_overlay.overlay.project import Project
from vllm_overlay.pin.lockfile import ABSENT, Lock, base_hash, parse_lock, render_lock, write_lock
from vllm_overlay.pin.pinning import LockPlan, compute_lock
from vllm_overlay.pin.trees import BASE_REF, upstream_repo
from vllm_overlay.testing import proving
from vllm_overlay.util import atomic_write_text, exclusive_lock, info, run

FORMAT = 1
NEW_BASE_REF = "refs/vllm-overlay/rebase/new-base"
OLD_BASE_REF = "refs/vllm-overlay/rebase/old-base"
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")
_MARKER_RE = re.compile(rb"^(<<<<<<<|>>>>>>>)( |$)", re.MULTILINE)

# Settled statuses, and the kinds of stop.
KEPT, REFRESHED, RESOLVED, DROPPED = "kept", "refreshed", "resolved", "dropped"
STOP_CONFLICT, STOP_COLLISION, STOP_MOVED, STOP_TESTS, STOP_COMMIT = (
    "conflict",
    "collision",
    "moved",
    "tests-failed",
    "commit-unknown",
)
STOP_KINDS = (STOP_CONFLICT, STOP_COLLISION, STOP_MOVED, STOP_TESTS)  # stops at a change


class RebaseInProgressError(RebaseError):
    """A rebase is stopped in this project; it must be continued or aborted first."""


class NoRebaseError(RebaseError):
    """--continue or --abort without a rebase in progress."""


# ---------------------------------------------------------------------------------------------
# State


@dataclass
class CheckoutRecord:
    """The checkout before the rebase touched it, so --abort can put it back."""

    path: str
    created: bool
    head: str | None = None
    branch: str | None = None
    base_ref: str | None = None
    applied_ref: str | None = None
    digest: str | None = None


@dataclass
class State:
    from_version: str
    from_commit: str
    new_lock: str  # render_lock text of the new pin ([base] filled in at the end)
    source: str
    index_url: str | None
    git_url: str | None
    test_python: str | None
    checkout: CheckoutRecord
    order: list[str]
    format: int = FORMAT
    status: str = "starting"  # starting | running | stopped | finalizing
    old_base: str = ""
    new_base: str = ""
    commits: dict[str, str] = field(default_factory=dict)  # change id -> its commit on the old pin
    next: int = 0
    step_head: str = ""
    results: list[dict] = field(default_factory=list)  # settled changes, in order
    pending: dict | None = None  # the stop, when stopped
    commit_known: bool = True  # False: the new tag's full commit is still to be given
    sdist_commit: str | None = None  # the abbreviated commit the new sdist records

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str) -> State:
        try:
            data = json.loads(text)
            if data.get("format") != FORMAT:
                raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
            data["checkout"] = CheckoutRecord(**data["checkout"])
            return cls(**data)
        except (ValueError, TypeError, KeyError) as e:
            raise RebaseError(
                f"{source} is not a rebase state this vllm-overlay can read ({e}). Restore "
                "upstream.lock and overlay/ from git, then delete that directory."
            ) from e


@dataclass(frozen=True)
class Paths:
    """Where a project's rebase keeps its state."""

    project: Project

    @property
    def dir(self) -> Path:
        return self.project.work_dir / "rebase"

    @property
    def state(self) -> Path:
        return self.dir / "state.json"

    @property
    def backup_lock(self) -> Path:
        return self.dir / "backup" / "upstream.lock"

    @property
    def backup_overlay(self) -> Path:
        return self.dir / "backup" / "overlay"

    @property
    def lock_file(self) -> Path:
        return self.project.work_dir / "rebase.lock"

    def tests_dir(self, change_id: str) -> Path:
        return self.dir / "tests" / change_id


def in_progress(project: Project) -> bool:
    return Paths(project).state.is_file()


def _save(paths: Paths, state: State) -> None:
    atomic_write_text(paths.state, state.to_json())


def _load(paths: Paths) -> State:
    if not paths.state.is_file():
        raise NoRebaseError(
            f"no rebase is in progress in {paths.project.root} (no {paths.state}). Start one "
            "with `vllm-overlay rebase --to VERSION`."
        )
    return State.from_json(paths.state.read_text(), str(paths.state))


def _guard(paths: Paths):
    return exclusive_lock(paths.lock_file, f"the rebase of {paths.project.root}")


# ---------------------------------------------------------------------------------------------
# Backups: byte-exact copies of upstream.lock and overlay/


def _backup(paths: Paths) -> None:
    project = paths.project
    paths.backup_lock.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(project.lock_path, paths.backup_lock)
    shutil.copytree(project.overlay_dir, paths.backup_overlay, symlinks=True)


def _tree_bytes(root: Path) -> dict[str, tuple[bytes, int]]:
    out: dict[str, tuple[bytes, int]] = {}
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            p = Path(dirpath) / name
            out[p.relative_to(root).as_posix()] = (p.read_bytes(), p.stat().st_mode & 0o7777)
    return out


def _edited_since_start(paths: Paths) -> list[str]:
    """Files of upstream.lock and overlay/ that differ from the backups (edits during a stop)."""
    project = paths.project
    changed = []
    if project.lock_path.read_bytes() != paths.backup_lock.read_bytes():
        changed.append("upstream.lock")
    have = _tree_bytes(project.overlay_dir)
    want = _tree_bytes(paths.backup_overlay)
    for rel in sorted(set(have) | set(want)):
        if have.get(rel, (None,))[0] != want.get(rel, (None,))[0]:
            changed.append(f"overlay/{rel}")
    return changed


def _restore_files(paths: Paths) -> None:
    project = paths.project
    shutil.copy2(paths.backup_lock, project.lock_path)
    staging = project.overlay_dir.with_name(".overlay.restore")
    old = project.overlay_dir.with_name(".overlay.old")
    for leftover in (staging, old):
        shutil.rmtree(leftover, ignore_errors=True)
    shutil.copytree(paths.backup_overlay, staging, symlinks=True)
    if project.overlay_dir.exists():
        os.replace(project.overlay_dir, old)
    os.replace(staging, project.overlay_dir)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# The checkout


def _record_checkout(dest: Path, lock: Lock, overlay: Overlay) -> CheckoutRecord:
    if not dest.exists() or (dest.is_dir() and not any(dest.iterdir())):
        return CheckoutRecord(path=str(dest), created=not dest.exists())
    if not is_checkout(dest):
        raise CheckoutError(
            f"{dest} exists and is not a vllm-overlay checkout (no {BASE_REF}). Pass another "
            "--checkout directory, or remove this one."
        )
    st = checkout_state(dest, lock, overlay)
    if st["state"] == "edited":
        raise RebaseError(
            f"{dest} has edits that are not in overlay/ (uncommitted changes or new commits). "
            "A rebase starts from the overlay as committed: save them with `vllm-overlay "
            "export` (or discard them), then rebase again. Nothing was changed."
        )
    branch = git("symbolic-ref", "-q", "--short", "HEAD", cwd=dest, check=False).stdout.strip()
    return CheckoutRecord(
        path=str(dest),
        created=False,
        head=rev_parse(dest, "HEAD"),
        branch=branch or None,
        base_ref=rev_parse(dest, BASE_REF),
        applied_ref=rev_parse(dest, APPLIED_REF),
        digest=config_get(dest, "vllm-overlay.overlay-digest"),
    )


def _set_ref(repo: Path, ref: str, value: str | None) -> None:
    if value:
        git("update-ref", ref, value, cwd=repo)
    else:
        git("update-ref", "-d", ref, cwd=repo, check=False)


def _restore_checkout(rec: CheckoutRecord) -> None:
    dest = Path(rec.path)
    if rec.created:
        shutil.rmtree(dest, ignore_errors=True)
        return
    if rec.head is None:  # it was an empty directory
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True, exist_ok=True)
        return
    if not dest.exists():
        raise CheckoutError(f"the checkout {dest} is gone; run `vllm-overlay apply` to remake it.")
    git("reset", "-q", "--merge", cwd=dest, check=False)
    if rec.branch:
        git("checkout", "-q", "-f", "-B", rec.branch, rec.head, cwd=dest)
    else:
        git("checkout", "-q", "-f", "--detach", rec.head, cwd=dest)
    git("clean", "-q", "-f", "-d", cwd=dest)
    _set_ref(dest, BASE_REF, rec.base_ref)
    _set_ref(dest, APPLIED_REF, rec.applied_ref)
    if rec.digest:
        config_set(dest, "vllm-overlay.overlay-digest", rec.digest)
    else:
        git("config", "--local", "--unset", "vllm-overlay.overlay-digest", cwd=dest, check=False)
    for ref in (NEW_BASE_REF, OLD_BASE_REF):
        _set_ref(dest, ref, None)


def _head(repo: Path) -> str:
    head = rev_parse(repo, "HEAD")
    if head is None:
        raise CheckoutError(f"{repo} has no HEAD commit; --abort and start again.")
    return head


# ---------------------------------------------------------------------------------------------
# The target


def _is_final(v: str) -> bool:
    try:
        return not Version(v).is_prerelease and not Version(v).is_devrelease
    except InvalidVersion:
        return False


def latest_release(name: str, index_url: str | None) -> str:
    """The newest final release of ``name`` on the package index that has an sdist."""
    versions: set[str] = set()
    for url in configured_index_urls(index_url):
        for f in list_files(name, url):
            if f.yanked or not f.filename.endswith(".tar.gz"):
                continue
            v = f.filename[: -len(".tar.gz")].rpartition("-")[2]
            if _is_final(v) and release_file_kind(f.filename, name, v) == "sdist":
                versions.add(v)
    if not versions:
        raise RebaseError(f"the package index lists no release of {name}; pass --to VERSION.")
    return max(versions, key=Version)


def release_of_commit(git_url: str, commit: str) -> str:
    """The release whose tag (``vX``) points at ``commit`` on the git remote."""
    out = git("ls-remote", "--tags", git_url, check=False)
    if out.returncode != 0:
        raise RebaseError(
            f"cannot list the tags of {git_url} to find which release {commit} is "
            f"({out.stderr.strip()}). Pass the release instead: --to VERSION --commit {commit} "
            "(or --git-url for a reachable mirror)."
        )
    found = []
    for line in out.stdout.splitlines():
        sha, _, ref = line.partition("\t")
        tag = ref.removeprefix("refs/tags/").removesuffix("^{}")
        if sha == commit and tag.startswith("v"):
            try:
                found.append(Version(tag[1:]))
            except InvalidVersion:
                continue
    if not found:
        raise RebaseError(
            f"{commit} is not the commit of a release tag at {git_url}. A rebase pins a "
            "release (its sdist and wheels are what the tool builds from): pass --to VERSION."
        )
    finals = [v for v in found if not v.is_prerelease] or found
    return str(max(finals))


def resolve_target(
    to: str, *, name: str, git_url: str, index_url: str | None, commit: str | None
) -> tuple[str, str | None]:
    """(version, commit or None) for ``--to`` (a version, ``latest``, or a full commit id)."""
    if to == "latest":
        return latest_release(name, index_url), commit
    if _COMMIT_RE.match(to):
        if commit and commit != to:
            raise UsageError(f"--to {to} and --commit {commit} name different commits.")
        return release_of_commit(git_url, to), to
    try:
        Version(to)
    except InvalidVersion:
        raise UsageError(
            f"--to {to!r} is neither a version (like 0.25.0), `latest`, nor a full 40-hex "
            "commit id."
        ) from None
    return to, commit


def _pin(
    overlay: Overlay, *, name: str, version: str, commit: str | None, remote: str,
    index_url: str | None,
) -> LockPlan:  # fmt: skip
    """The new pin ([base] is filled in at the end; an unresolvable commit is asked for then)."""
    plan = compute_lock(
        [], version=version, name=name, commit=commit, git_url=remote,
        index_url=index_url, unresolved_ok=True,
    )  # fmt: skip
    for note in plan.notes:
        info(note)
    if not plan.commit_resolved:
        info(
            f"the full commit id of {name} {version} is unknown (the sdist records "
            f"{plan.sdist_commit or 'none'}); the rebase goes on and asks for it before "
            "writing anything"
        )
    return plan


def with_commit(state: State, commit: str) -> None:
    """Record the new pin's full commit in ``state`` after checking it against the sdist."""
    if not _COMMIT_RE.match(commit):
        raise UsageError(f"--commit must be a full 40-hex commit id, got {commit!r}.")
    if state.sdist_commit and not commit.startswith(state.sdist_commit):
        raise RebaseError(
            f"commit {commit} does not match the new release's sdist, which records commit "
            f"{state.sdist_commit}. Check --commit."
        )
    lock = parse_lock(state.new_lock, "the rebase's new pin")
    lock = replace(lock, upstream=replace(lock.upstream, commit=commit))
    state.new_lock = render_lock(lock)
    state.commit_known = True


# ---------------------------------------------------------------------------------------------
# Context


@dataclass
class Ctx:
    paths: Paths
    state: State
    overlay: Overlay  # the overlay as it was when the rebase started (the backup)
    old_lock: Lock
    new_lock: Lock
    _renames: dict[str, list[tuple[str, int]]] | None = None

    @property
    def checkout(self) -> Path:
        return Path(self.state.checkout.path)

    @property
    def name(self) -> str:
        return self.new_lock.upstream.name

    @property
    def old_version(self) -> str:
        return self.old_lock.upstream.version

    @property
    def new_version(self) -> str:
        return self.new_lock.upstream.version

    def save(self) -> None:
        _save(self.paths, self.state)

    def old_file(self, path: str) -> bytes | None:
        return show_bytes(self.checkout, OLD_BASE_REF, path)

    def new_file(self, path: str) -> bytes | None:
        return show_bytes(self.checkout, NEW_BASE_REF, path)

    def ours(self, change: Change, path: str) -> bytes | None:
        return show_bytes(self.checkout, self.state.commits[change.id], path)

    def added(self, path: str) -> bool:
        return self.old_lock.base.get(path) == ABSENT

    def renames(self) -> dict[str, list[tuple[str, int]]]:
        """old path -> [(new path, similarity %)] that git detects between the two bases."""
        if self._renames is None:
            out = git(
                "diff", "-z", "--name-status", "--find-renames", "-l0", "--diff-filter=R",
                OLD_BASE_REF, NEW_BASE_REF, cwd=self.checkout,
            )  # fmt: skip
            parts = [p for p in out.stdout.split("\0") if p]
            renames: dict[str, list[tuple[str, int]]] = {}
            for i in range(0, len(parts) - 2, 3):
                status, src, dst = parts[i : i + 3]
                renames.setdefault(src, []).append((dst, int(status[1:] or 0)))
            self._renames = renames
        return self._renames


def _context(paths: Paths, state: State) -> Ctx:
    return Ctx(
        paths=paths,
        state=state,
        overlay=load_overlay(paths.backup_overlay),
        old_lock=parse_lock(paths.backup_lock.read_text(), "the backed-up upstream.lock"),
        new_lock=parse_lock(state.new_lock, "the rebase's new pin"),
    )


# ---------------------------------------------------------------------------------------------
# Start, continue, abort


def start(
    project: Project,
    to: str,
    *,
    commit: str | None = None,
    source: str = "sdist",
    index_url: str | None = None,
    git_url: str | None = None,
    checkout: Path | None = None,
    test_python: str | None = None,
) -> dict:
    """Begin a rebase onto ``to``; returns the report (complete, or stopped)."""
    paths = Paths(project)
    with _guard(paths):
        if paths.state.is_file():
            st = _load(paths)
            raise RebaseInProgressError(
                f"a rebase from {st.from_version} is in progress ({_where(st)}). Finish it with "
                "`vllm-overlay rebase --continue`, or undo it with `vllm-overlay rebase --abort`."
            )
        old_lock, overlay = project.lock(), project.overlay()
        check_consistency(old_lock, overlay)
        name = old_lock.upstream.name
        remote = git_url or old_lock.upstream.git
        version, commit = resolve_target(
            to, name=name, git_url=remote, index_url=index_url, commit=commit
        )
        if version == old_lock.upstream.version and commit in (None, old_lock.upstream.commit):
            return {"status": "noop", "message": f"upstream.lock already pins {name} {version}."}
        info(f"pinning {name} {version}")
        lock_plan = _pin(overlay, name=name, version=version, commit=commit, remote=remote,
                         index_url=index_url)  # fmt: skip
        dest = (checkout or project.default_checkout).absolute()
        state = State(
            from_version=old_lock.upstream.version,
            from_commit=old_lock.upstream.commit,
            new_lock=render_lock(lock_plan.lock),
            source=source,
            index_url=index_url,
            git_url=git_url,
            test_python=test_python,
            checkout=_record_checkout(dest, old_lock, overlay),
            order=[c.id for c in overlay.changes],
            commit_known=lock_plan.commit_resolved,
            sdist_commit=lock_plan.sdist_commit,
        )
        if paths.dir.exists():
            shutil.rmtree(paths.dir)  # a leftover without state.json: nothing to resume
        _backup(paths)
        _save(paths, state)
        try:
            ctx = _context(paths, state)
            _prepare(ctx)
        except BaseException:
            _undo(paths, state)
            raise
        return _advance(ctx)


def _prepare(ctx: Ctx) -> None:
    """The checkout at the old pin plus the overlay (one commit per change), then moved to
    the new base with both bases at fixed refs."""
    st = ctx.state
    opts = {"source": st.source, "index_url": st.index_url, "git_url": st.git_url}
    res = apply_overlay(ctx.old_lock, ctx.overlay, ctx.checkout, **opts)
    st.commits = dict(res.commits)
    st.old_base = res.base
    new_repo, new_base = upstream_repo(ctx.new_lock, **opts)
    co = ctx.checkout
    if not rev_parse(co, new_base):
        git("fetch", "-q", "--no-tags", str(new_repo), f"+{BASE_REF}:{NEW_BASE_REF}", cwd=co)
    _set_ref(co, NEW_BASE_REF, new_base)
    _set_ref(co, OLD_BASE_REF, res.base)
    _set_ref(co, BASE_REF, new_base)
    git("checkout", "-q", "-f", "-B", BRANCH, new_base, cwd=co)
    st.new_base = new_base
    st.status = "running"
    ctx.save()


def continue_(project: Project, *, commit: str | None = None) -> dict:
    """Settle the stopped change with the person's resolution, then go on.

    ``commit``: the new pin's full commit id, when the rebase could not resolve it.
    """
    paths = Paths(project)
    with _guard(paths):
        state = _load(paths)
        if commit is not None:
            with_commit(state, commit)
            if state.pending and state.pending["kind"] == STOP_COMMIT:
                state.pending = None
            _save(paths, state)
        if state.status == "starting":
            raise RebaseError(
                "the rebase was interrupted while it started; run `vllm-overlay rebase --abort`, "
                "then start it again."
            )
        ctx = _context(paths, state)
        if state.status == "finalizing":  # interrupted while writing: write it all again
            return _finish(ctx)
        _refuse_edits(paths)
        if state.pending is None:
            if state.next < len(state.order):
                _reset_step(ctx)  # interrupted mid-step: redo that step
            return _advance(ctx)
        if state.pending["kind"] == STOP_COMMIT:
            return report(ctx)  # still unknown: the report says how to give it
        change = ctx.overlay.change(state.pending["id"])
        if state.pending["kind"] == STOP_TESTS:
            result, pending = _drop(ctx, change, state.pending["reason"])
        else:
            result, pending = _settle_resolution(ctx, change)
        if pending is not None:
            state.pending = pending
            ctx.save()
            return report(ctx)
        _record(ctx, result)
        return _advance(ctx)


def abort(project: Project) -> dict:
    """Put upstream.lock, overlay/ and the checkout back as they were before the rebase."""
    paths = Paths(project)
    with _guard(paths):
        state = _load(paths)
        _undo(paths, state)
    return {
        "status": "aborted",
        "from": {"version": state.from_version, "commit": state.from_commit},
        "checkout": state.checkout.path,
    }


def _undo(paths: Paths, state: State) -> None:
    _restore_files(paths)
    _restore_checkout(state.checkout)
    shutil.rmtree(paths.dir)


def _refuse_edits(paths: Paths) -> None:
    changed = _edited_since_start(paths)
    if changed:
        shown = "\n".join("    " + c for c in changed[:20])
        raise RebaseError(
            "these files changed since the rebase started:\n"
            f"{shown}\nThe rebase writes upstream.lock and overlay/ itself when it finishes; "
            "resolve conflicts in the checkout only. Save your edits elsewhere and put the files "
            "back (`git checkout -- upstream.lock overlay/`), or `vllm-overlay rebase --abort`."
        )


def _where(state: State) -> str:
    if state.pending:
        return f"stopped at change {state.pending['id']} ({state.pending['kind']})"
    return f"state {state.status}"


# ---------------------------------------------------------------------------------------------
# Steps


def _advance(ctx: Ctx) -> dict:
    st = ctx.state
    while st.next < len(st.order):
        change = ctx.overlay.change(st.order[st.next])
        st.step_head = _head(ctx.checkout)
        st.pending = None
        st.status = "running"
        ctx.save()
        result, pending = _step(ctx, change)
        if pending is not None:
            st.pending = pending
            st.status = "stopped"
            ctx.save()
            return report(ctx)
        _record(ctx, result)
    if not st.commit_known:
        st.pending = {"id": "", "kind": STOP_COMMIT, "problems": []}
        st.status = "stopped"
        ctx.save()
        return report(ctx)
    st.status = "finalizing"
    ctx.save()
    return _finish(ctx)


def _record(ctx: Ctx, result: dict) -> None:
    st = ctx.state
    st.results.append(result)
    st.pending = None
    st.next += 1
    st.status = "running"
    ctx.save()


def _reset_step(ctx: Ctx) -> None:
    co = ctx.checkout
    git("reset", "-q", "--merge", cwd=co, check=False)
    git("checkout", "-q", "-f", "-B", BRANCH, ctx.state.step_head, cwd=co)
    git("clean", "-q", "-f", "-d", cwd=co)


def _step(ctx: Ctx, change: Change) -> tuple[dict | None, dict | None]:
    reason = _drop_reason(ctx, change)
    if reason:
        return _drop(ctx, change, reason)
    problems = _moved(ctx, change) + _collisions(ctx, change)
    problems += [p for p in _pick(ctx, change) if p["path"] not in {q["path"] for q in problems}]
    if problems:
        return None, _stop(ctx, change, problems)
    if not _has_staged(ctx.checkout):
        return _drop(ctx, change, f"the three-way merge onto {ctx.name} {ctx.new_version} "
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
        elif _merge_is_noop(ctx.old_file(path), ours, new):
            how.append(f"the three-way merge of our {path} leaves upstream's unchanged")
        else:
            return None
    return how or None


def _reverse_applies(ctx: Ctx, change: Change, path: str) -> bool:
    """Our patch of ``path`` applies in reverse to the new tree (git apply -R, no fuzz)."""
    ours = ctx.state.commits[change.id]
    diff = git("diff", *DIFF_OPTS, OLD_BASE_REF, ours, "--", path, cwd=ctx.checkout)
    if not diff.stdout.strip():
        return False
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-index-") as tmp:
        env = {**git_env(), "GIT_INDEX_FILE": os.path.join(tmp, "index")}
        run("git", "read-tree", NEW_BASE_REF, cwd=ctx.checkout, env=env)
        out = run(
            "git", "apply", "-R", "--check", "--cached", "-",
            cwd=ctx.checkout, env=env, input=diff.stdout, check=False,
        )  # fmt: skip
    return out.returncode == 0


def _merge_is_noop(old: bytes | None, ours: bytes, new: bytes) -> bool:
    """``git merge-file`` of our file into upstream's (over the old base) gives upstream's."""
    if old is None:
        return False
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-merge-") as tmp:
        files = []
        for name, data in (("new", new), ("old", old), ("ours", ours)):
            p = Path(tmp, name)
            p.write_bytes(data)
            files.append(str(p))
        out = run("git", "merge-file", "-p", *files, env=git_env(), check=False)
    return out.returncode == 0 and out.stdout == new.decode(errors="replace")


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
    co = ctx.checkout
    out = git(
        "-c", "merge.conflictStyle=diff3", "-c", "rerere.enabled=false",
        "cherry-pick", "--no-commit", ctx.state.commits[change.id], cwd=co, check=False,
    )  # fmt: skip
    text = out.stdout + out.stderr
    lines = [ln.strip() for ln in text.splitlines() if ln.startswith("CONFLICT (")]
    unmerged = git("diff", "--name-only", "-z", "--diff-filter=U", cwd=co).stdout.split("\0")
    problems = []
    for path in sorted(p for p in unmerged if p):
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


def _has_staged(repo: Path) -> bool:
    return git("diff", "--cached", "--quiet", cwd=repo, check=False).returncode != 0


def _message(change: Change) -> str:
    return f"{change.id}: {change.title}\n\n{change.origin}\n\n{TRAILER}: {change.id}\n"


def _commit(ctx: Ctx, change: Change) -> None:
    git("commit", "-q", "--no-verify", "-m", _message(change), cwd=ctx.checkout)


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


def _drop(ctx: Ctx, change: Change, reason: str) -> tuple[dict | None, dict | None]:
    """Drop ``change`` after its tests pass against the new upstream without it."""
    _reset_to(ctx.checkout, ctx.state.step_head)
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


def _reset_to(repo: Path, rev: str) -> None:
    git("reset", "-q", "--merge", cwd=repo, check=False)
    git("reset", "-q", "--hard", rev, cwd=repo)
    git("clean", "-q", "-f", "-d", cwd=repo)


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


def _settle_resolution(ctx: Ctx, change: Change) -> tuple[dict | None, dict | None]:
    co = ctx.checkout
    pre = ctx.state.pending["pre_head"]  # type: ignore[index]
    head = _head(co)
    if head != pre:
        if git("merge-base", "--is-ancestor", pre, head, cwd=co, check=False).returncode != 0:
            raise RebaseError(
                f"HEAD of {co} moved off the rebase (it is {head[:12]}, expected {pre[:12]} or a "
                "commit on top of it). Check out the rebase's work again, or `--abort`."
            )
        git("reset", "-q", "--soft", pre, cwd=co)  # fold the person's commits into one
    left = _markers_left(co, pre)
    if left:
        shown = "\n".join("    " + p for p in left)
        raise RebaseError(
            f"conflict markers (<<<<<<< or >>>>>>>) are still in:\n{shown}\nEdit them away, "
            "then run `vllm-overlay rebase --continue` again."
        )
    git("add", "-A", cwd=co)
    if not _has_staged(co):
        return _drop(ctx, change, "the conflict was resolved to upstream's code: upstream's "
                     f"{ctx.new_version} replaces the change")  # fmt: skip
    _commit(ctx, change)
    return _settled(ctx, change, resolved=True), None


def _markers_left(repo: Path, pre: str) -> list[str]:
    changed = git("diff", "--name-only", "-z", pre, cwd=repo).stdout.split("\0")
    changed += git("ls-files", "-z", "--others", "--exclude-standard", cwd=repo).stdout.split("\0")
    left = []
    for rel in sorted({p for p in changed if p}):
        p = repo / rel
        if p.is_file() and not p.is_symlink() and _MARKER_RE.search(p.read_bytes()):
            left.append(rel)
    return left


def _settled(ctx: Ctx, change: Change, *, resolved: bool) -> dict:
    """The result of a change that now sits as one commit on the new base."""
    co = ctx.checkout
    pre = ctx.state.step_head
    out = git("diff", "--name-only", "-z", "--no-renames", pre, "HEAD", cwd=co)
    changed = [p for p in out.stdout.split("\0") if p]
    renames = dict((ctx.state.pending or {}).get("renames", {}))
    files, removed, added = _new_files(list(change.files), changed, renames)
    tests = [_renamed_test(t, renames) for t in change.tests]
    old_commit = ctx.state.commits[change.id]
    same = files == list(change.files) and all(
        _as_exported(co, OLD_BASE_REF, old_commit, p) == _as_exported(co, NEW_BASE_REF, "HEAD", p)
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
        "commit": _head(co),
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


def _as_exported(repo: Path, base: str, rev: str, path: str) -> bytes | None:
    """What export writes for ``path`` at ``rev`` over ``base``: the patch, or the whole file."""
    if show_bytes(repo, base, path) is None:
        return show_bytes(repo, rev, path)
    out = git("diff", *DIFF_OPTS, base, rev, "--", path, cwd=repo)
    return canonical_diff(out.stdout).encode()


# ---------------------------------------------------------------------------------------------
# Finishing: the lock, overlay.toml and overlay/ are written only here


def _finish(ctx: Ctx) -> dict:
    st, project, co = ctx.state, ctx.paths.project, ctx.checkout
    dirty = status_porcelain(co)
    if dirty:
        raise RebaseError(
            f"{co} has uncommitted changes after every change was settled:\n"
            + "\n".join("    " + d for d in dirty[:20])
            + "\nDiscard them (`git -C CHECKOUT checkout -- .`) or `--abort`; then --continue."
        )
    dropped = [r for r in st.results if r["status"] == DROPPED]
    kept = [r for r in st.results if r["status"] != DROPPED]
    old_text = (ctx.paths.backup_overlay / CONFIG_NAME).read_text()
    bump = any(r["status"] != KEPT for r in st.results)
    new_text = history.rewrite(
        old_text,
        dropped=[
            history.DroppedRecord(
                id=r["id"],
                title=r["title"],
                origin=r["origin"],
                dropped_in=ctx.new_version,
                reason=r["reason"],
                proof=r["proof"],
            )  # fmt: skip
            for r in dropped
        ],
        files={r["id"]: r["files"] for r in kept},
        tests={r["id"]: r["tests"] for r in kept},
        bump_revision=bump,
    )
    new_overlay = parse_overlay(new_text, project.overlay_dir)  # validate before writing
    new_lock = ctx.new_lock.with_base(
        {p: base_hash(ctx.new_file(p)) for p in new_overlay.all_files()}
    )
    atomic_write_text(project.overlay_dir / CONFIG_NAME, new_text)
    exported = export_overlay(new_lock, new_overlay, co)
    repo, base = upstream_repo(
        new_lock, source=st.source, index_url=st.index_url, git_url=st.git_url
    )
    plan_overlay(new_lock, load_overlay(project.overlay_dir), repo, base)  # strict re-apply
    write_lock(project.lock_path, new_lock)
    git("update-ref", APPLIED_REF, _head(co), cwd=co)
    config_set(co, "vllm-overlay.overlay-digest", overlay_digest(project.overlay_dir))
    for ref in (NEW_BASE_REF, OLD_BASE_REF):
        _set_ref(co, ref, None)
    result = report(ctx)
    result.update(
        status="complete",
        written=["upstream.lock", f"overlay/{CONFIG_NAME}"]
        + [f"overlay/{p}" for p in exported.written],
        removed=[f"overlay/{p}" for p in exported.removed],
        revision={"from": ctx.overlay.revision, "to": new_overlay.revision},
    )
    shutil.rmtree(ctx.paths.dir)
    return result


# ---------------------------------------------------------------------------------------------
# The report


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
                {"kind": a.kind, "filename": a.filename, "sha256": a.sha256, "size": a.size}
                for a in ctx.new_lock.artifacts
            ],
        },
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
