"""The on-disk state of a rebase, and the context each step works in.

``.work/rebase/state.json`` (``State``) says where the rebase stands; ``backup/`` holds
byte-exact copies of ``upstream.lock`` and ``overlay/``, and ``CheckoutRecord`` where the
checkout was, so ``--abort`` puts everything back and a stopped rebase resumes in a new
process. ``Ctx`` is one loaded state plus the checkout's repository.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass, field
from functools import cached_property
from pathlib import Path

from vllm_overlay.errors import CheckoutError, NoRebaseError, RebaseError
from vllm_overlay.gitrepo import (
    HeadState,
    Repo,
    config_get,
    config_set,
    current_branch,
    open_repo,
    restore_head,
    rev_parse,
    set_ref,
)
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay.checkout import (
    APPLIED_REF,
    DIGEST_KEY,
    checkout_state,
    is_checkout,
)
from vllm_overlay.overlay.model import Overlay, load_overlay
from vllm_overlay.overlay.project import Project
from vllm_overlay.pin.lockfile import Lock, parse_lock
from vllm_overlay.pin.trees import BASE_REF
from vllm_overlay.util import atomic_write_text, exclusive_lock

FORMAT = 2  # 2: the walk (release by release)
NEW_BASE_REF = "refs/vllm-overlay/rebase/new-base"
OLD_BASE_REF = "refs/vllm-overlay/rebase/old-base"

# Settled states, and the states of a stop (rebase/walkdata.py).
KEPT, REFRESHED, RESOLVED, DROPPED = "kept", "refreshed", "resolved", "dropped"
STOP_CONFLICT, STOP_COLLISION, STOP_MOVED, STOP_TESTS, STOP_COMMIT = (
    "conflict",
    "collision",
    "moved",
    "tests-failed",
    "commit-unknown",
)
STOP_KINDS = (STOP_CONFLICT, STOP_COLLISION, STOP_MOVED, STOP_TESTS)  # stops at a change


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
    source: str  # these four: the Settings the rebase started with (``settings``)
    index_url: str | None
    git_url: str | None
    test_python: str | None
    checkout: CheckoutRecord
    format: int = FORMAT
    status: str = "starting"  # starting | running | stopped | finalizing
    direct: bool = False  # the target alone, not every release in between
    walk: dict = field(default_factory=dict)  # Walk.to_json() (rebase/walkdata.py): where it stands
    step_head: str = ""  # the checkout's commit under a stop's conflict files
    commit_known: bool = True  # False: the new tag's full commit is still to be given
    sdist_commit: str | None = None  # the abbreviated commit the new sdist records
    pin_notes: list[str] = field(default_factory=list)  # e.g. a variant the release lacks
    commit_pending: bool = False  # every change settled; the full commit is asked for

    @property
    def settings(self) -> Settings:
        """The settings the rebase started with: --continue works with them again."""
        return Settings(index_url=self.index_url, source=self.source, git_url=self.git_url,
                        test_python=self.test_python)  # fmt: skip

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

    @property
    def blobs(self) -> Path:
        return self.dir / "blobs"

    @property
    def records(self) -> Path:
        """The resolution records of walks not yet written to overlay/ (they survive --abort)."""
        return self.project.work_dir / "resolutions"


def in_progress(project: Project) -> bool:
    return Paths(project).state.is_file()


def save(paths: Paths, state: State) -> None:
    atomic_write_text(paths.state, state.to_json())


def load(paths: Paths) -> State:
    if not paths.state.is_file():
        raise NoRebaseError(
            f"no rebase is in progress in {paths.project.root} (no {paths.state}). Start one "
            "with `vllm-overlay rebase --to VERSION`."
        )
    return State.from_json(paths.state.read_text(), str(paths.state))


def guard(paths: Paths):
    return exclusive_lock(paths.lock_file, f"the rebase of {paths.project.root}")


# ---------------------------------------------------------------------------------------------
# Backups: byte-exact copies of upstream.lock and overlay/


def backup(paths: Paths) -> None:
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


def edited_since_start(paths: Paths) -> list[str]:
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


def restore_files(paths: Paths) -> None:
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


def record_checkout(dest: Path, lock: Lock, overlay: Overlay) -> CheckoutRecord:
    if not dest.exists() or (dest.is_dir() and not any(dest.iterdir())):
        return CheckoutRecord(path=str(dest), created=not dest.exists())
    if not is_checkout(dest):
        raise CheckoutError(
            f"{dest} exists and is not a vllm-overlay checkout (no {BASE_REF}). Pass another "
            "--checkout directory, or remove this one."
        )
    st = checkout_state(dest, lock, overlay)
    if st.state == "edited":
        raise RebaseError(
            f"{dest} has edits that are not in overlay/ (uncommitted changes or new commits). "
            "A rebase starts from the overlay as committed: save them with `vllm-overlay "
            "export` (or discard them), then rebase again. Nothing was changed."
        )
    with open_repo(dest) as repo:
        return CheckoutRecord(
            path=str(dest),
            created=False,
            head=rev_parse(repo, "HEAD"),
            branch=current_branch(repo),
            base_ref=rev_parse(repo, BASE_REF),
            applied_ref=rev_parse(repo, APPLIED_REF),
            digest=config_get(repo, DIGEST_KEY),
        )


def restore_checkout(rec: CheckoutRecord) -> None:
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
    with open_repo(dest) as repo:
        restore_head(repo, HeadState(commit=rec.head, branch=rec.branch), clean=True)
        set_ref(repo, BASE_REF, rec.base_ref)
        set_ref(repo, APPLIED_REF, rec.applied_ref)
        config_set(repo, DIGEST_KEY, rec.digest)
        for ref in (NEW_BASE_REF, OLD_BASE_REF):
            set_ref(repo, ref, None)


# Context


@dataclass
class Ctx:
    paths: Paths
    state: State
    overlay: Overlay  # the overlay as it was when the rebase started (the backup)
    old_lock: Lock
    new_lock: Lock

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

    @cached_property
    def repo(self) -> Repo:
        """The checkout's repository (opened once the checkout exists; ``close`` ends it)."""
        return open_repo(self.checkout)

    def close(self) -> None:
        if "repo" in self.__dict__:
            self.__dict__.pop("repo").close()

    def __enter__(self) -> Ctx:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def head(self) -> str:
        head = rev_parse(self.repo, "HEAD")
        if head is None:
            raise CheckoutError(f"{self.checkout} has no HEAD commit; --abort and start again.")
        return head

    def save(self) -> None:
        save(self.paths, self.state)


def context(paths: Paths, state: State) -> Ctx:
    return Ctx(
        paths=paths,
        state=state,
        overlay=load_overlay(paths.backup_overlay),
        old_lock=parse_lock(paths.backup_lock.read_text(), "the backed-up upstream.lock"),
        new_lock=parse_lock(state.new_lock, "the rebase's new pin"),
    )


def undo(paths: Paths, state: State) -> None:
    restore_files(paths)
    restore_checkout(state.checkout)
    shutil.rmtree(paths.dir)


def refuse_edits(paths: Paths) -> None:
    changed = edited_since_start(paths)
    if changed:
        shown = "\n".join("    " + c for c in changed[:20])
        raise RebaseError(
            "these files changed since the rebase started:\n"
            f"{shown}\nThe rebase writes upstream.lock and overlay/ itself when it finishes; "
            "resolve conflicts in the checkout only. Save your edits elsewhere and put the files "
            "back (`git checkout -- upstream.lock overlay/`), or `vllm-overlay rebase --abort`."
        )


def where(state: State) -> str:
    stop = state.walk.get("stop")
    if stop:  # a saved walk's stop (rebase/walkdata.py): its state; before, its "kind"
        what = stop.get("kind", stop["state"])
        return f"stopped at change {stop['id']} on {stop['release']} ({what})"
    return f"state {state.status}"
