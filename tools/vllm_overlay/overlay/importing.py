"""vllm-overlay import: start a change from upstream work, by a real three-way merge onto the
series in the checkout, as one call (``import_change``; ``continue_`` and ``abort`` after a
stop).

Sources: a format-patch/mbox file (a pull request's ``.patch``, read by overlay/mbox.py), or
the upstream diff of some paths between the pin and a later release (both trees made from the
release sdists on the index by pin/, so it works offline).

``import_change`` checks the request (what to import, the new change's id and fields), brings
the checkout to the series (apply, unless it matches; refused with edits not in overlay/),
merges in memory (``overlay/importmerge.py``: nothing is written when a file has no base),
and writes the merge into the checkout. A merge with conflicts stops there (diff3 markers in
the checkout, the state in ``.work/import/``); ``continue_`` commits the person's resolution,
``abort`` puts the checkout back. Only a finished import writes overlay/ (the new change's
directory), upstream.lock ([base] of new paths) and overlay.toml (the change appended last,
revision bumped), after checking that the strict apply of the whole series gives the
checkout's tree.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_overlay.errors import ChangeImportError, OverlayError, UsageError
from vllm_overlay.gitrepo import config_set, git, opened, rev_parse, show_bytes, uncommitted
from vllm_overlay.overlay import history
from vllm_overlay.overlay.checkout import (
    APPLIED_REF,
    apply_overlay,
    change_message,
    checkout_state,
)
from vllm_overlay.overlay.export import expected_overlay
from vllm_overlay.overlay.importmerge import Merged, merge_patch, merge_release, release_paths
from vllm_overlay.overlay.importsource import (
    Meta,
    Request,
    patch_meta,
    read_series,
    release_meta,
    web_url,
)
from vllm_overlay.overlay.mbox import PatchSeries
from vllm_overlay.overlay.model import (
    CONFIG_NAME,
    ID_RE,
    Overlay,
    check_upstream_tests,
    overlay_digest,
    parse_overlay,
    safe_join,
)
from vllm_overlay.overlay.project import Project
from vllm_overlay.overlay.series import final_tree, plan_series
from vllm_overlay.pin.lockfile import Lock, base_hash, write_lock
from vllm_overlay.pin.pinning import release_tree
from vllm_overlay.pin.trees import BASE_REF
from vllm_overlay.util import atomic_write_bytes, atomic_write_text, info

FORMAT = 1
_MARKER_RE = re.compile(rb"^(<<<<<<<|>>>>>>>)( |$)", re.MULTILINE)


@dataclass(frozen=True)
class Outcome:
    """An import: its files as merged; ``stopped`` on conflicts (the person resolves them in
    ``checkout``, then ``continue_``), else the overlay files written."""

    meta: Meta
    checkout: Path
    merged: tuple[Merged, ...] = ()
    stopped: bool = False
    written: tuple[str, ...] = ()


@dataclass
class State:
    """A stopped import, saved in ``.work/import/state.json``."""

    checkout: str
    pre_head: str
    meta: Meta
    paths: list[str]
    conflicted: list[str]
    format: int = FORMAT


def state_file(project: Project) -> Path:
    return project.work_dir / "import" / "state.json"


def in_progress(project: Project) -> bool:
    return state_file(project).is_file()


def refuse_during_import(project: Project, verb: str) -> None:
    if in_progress(project):
        raise ChangeImportError(
            f"an import is stopped in {project.root} (.work/import/); `vllm-overlay {verb}` "
            "would change what it works on. Finish it with `vllm-overlay import --continue`, "
            "or undo it with `vllm-overlay import --abort`, then run this again."
        )


# ---------------------------------------------------------------------------------------------
# The one call


def import_change(project: Project, req: Request) -> Outcome:
    """Import ``req`` as a new change at the end of the series; stops on conflicts."""
    _check(req)
    refuse_during_import(project, "import")
    lock, overlay = project.lock(), project.overlay()
    git_url = req.settings.git_url or lock.upstream.git
    web = web_url(git_url)
    series = None if req.from_release else read_series(req, git_url)
    meta = release_meta(req, lock, web) if series is None else patch_meta(req, series, web)
    _check_id(meta.id, overlay)
    state = checkout_state(req.checkout, lock, overlay)
    if state.state == "edited":
        raise ChangeImportError(
            f"{req.checkout} has edits that are not in overlay/ (uncommitted changes or new "
            "commits); an import starts from the series as exported. `vllm-overlay export` "
            "them (or discard them), then import again. Nothing was written."
        )
    if state.state != "matches":
        apply_overlay(lock, overlay, req.checkout, settings=req.settings)
    merged = _merge(req, lock, series)
    st = _write(project, req.checkout, meta, merged)
    if st.conflicted:
        return Outcome(meta, req.checkout, tuple(merged), stopped=True)
    return Outcome(meta, req.checkout, tuple(merged), written=tuple(finish(project, lock, st)))


def continue_(project: Project) -> Outcome:
    """Finish a stopped import with the person's resolution."""
    st = load_state(project)
    written = finish(project, project.lock(), st)
    return Outcome(st.meta, Path(st.checkout), written=tuple(written))


def _check(req: Request) -> None:
    if req.patch is None and req.pr is None and req.from_release is None:
        raise UsageError(
            "pass --patch FILE, --pr N or --from-release VERSION (or --continue/--abort)"
        )
    if req.paths and not req.from_release:
        raise UsageError("--paths goes with --from-release")
    if req.upstream_tests:
        check_upstream_tests(req.upstream_tests, "--upstream-tests")


def _check_id(cid: str, overlay: Overlay) -> None:
    if not ID_RE.match(cid):
        raise UsageError(f"--id must be kebab-case (lowercase letters, digits, '-'), got {cid!r}")
    if any(c.id == cid for c in overlay.changes):
        raise UsageError(f"overlay.toml already has a change {cid!r}; pass another --id")


def _merge(req: Request, lock: Lock, series: PatchSeries | None) -> list[Merged]:
    """The upstream work merged onto the checkout's HEAD, in memory."""
    name = lock.upstream.name
    if series is None:
        assert req.from_release is not None and req.paths
        _, repo, rev = release_tree(name, req.from_release, settings=req.settings)
        paths = release_paths(req.checkout, repo, rev, req.paths)
        return merge_release(req.checkout, paths, req.from_release, repo, rev)
    base = None
    if req.base_release:
        _, repo, rev = release_tree(name, req.base_release, settings=req.settings)
        base = (req.base_release, repo, rev)
    return merge_patch(series, req.checkout, base)


# ---------------------------------------------------------------------------------------------
# The checkout


def _write(project: Project, checkout: Path, meta: Meta, merged: list[Merged]) -> State:
    """Write the merge into the (clean) checkout; on conflicts, save the state to continue."""
    pre = rev_parse(checkout, "HEAD") or ""
    state = State(
        checkout=str(checkout),
        pre_head=pre,
        meta=meta,
        paths=[m.path for m in merged],
        conflicted=[m.path for m in merged if m.conflicted],
    )
    for m in merged:
        target = safe_join(checkout, m.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(m.content)
    if state.conflicted:
        sf = state_file(project)
        data = asdict(state)
        atomic_write_text(sf, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return state


def load_state(project: Project) -> State:
    sf = state_file(project)
    if not sf.is_file():
        raise ChangeImportError(
            f"no import is stopped in {project.root} (no {sf}); start one with "
            "`vllm-overlay import --patch FILE` (or --pr, --from-release)."
        )
    try:
        data = json.loads(sf.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}")
        data["meta"] = Meta(**data["meta"])
        return State(**data)
    except (ValueError, TypeError, KeyError) as e:
        raise ChangeImportError(f"{sf} is not an import state this tool reads ({e}).") from e


def abort(project: Project) -> State:
    st = load_state(project)
    co = Path(st.checkout)
    git("reset", "-q", "--hard", st.pre_head, cwd=co)
    for p in st.paths:
        if show_bytes(co, st.pre_head, p) is None:
            target = safe_join(co, p)
            if target.is_file():
                target.unlink()
    shutil.rmtree(state_file(project).parent)
    return st


def markers_left(checkout: Path, paths: list[str]) -> list[str]:
    left = []
    for p in paths:
        target = safe_join(checkout, p)
        if target.is_file() and _MARKER_RE.search(target.read_bytes()):
            left.append(p)
    return left


def finish(project: Project, lock: Lock, st: State) -> list[str]:
    """Commit the import as the new change and write overlay/, upstream.lock, overlay.toml.
    Returns the overlay-relative files written."""
    co, m = Path(st.checkout), st.meta
    changed = _staged(co, st)
    cfg = project.overlay_dir / CONFIG_NAME
    new_text = history.add_change(cfg.read_text(), _fields(m, lock, changed, st.paths))
    new_overlay = parse_overlay(new_text, project.overlay_dir)
    change = new_overlay.change(m.id)
    new_lock = lock.with_base(
        {
            **lock.base,
            **{p: base_hash(show_bytes(co, BASE_REF, p)) for p in changed if p not in lock.base},
        }
    )
    git("commit", "-q", "--no-verify", "-m", change_message(change), cwd=co)
    try:
        want = expected_overlay(new_lock, new_overlay, co)
        planned = plan_series(
            new_lock, new_overlay, lambda p: show_bytes(co, BASE_REF, p), want.get
        )
        for path, data in final_tree(planned).items():
            if show_bytes(co, "HEAD", path) != data:
                raise ChangeImportError(
                    f"the strict apply of the series with the new change gives another {path} "
                    "than the checkout holds; nothing was written (a bug: please report it)."
                )
    except OverlayError:
        git("reset", "-q", "--soft", "HEAD~1", cwd=co)
        raise
    written = []
    for rel, data in sorted(want.items()):
        if rel.startswith(m.id + "/"):
            atomic_write_bytes(safe_join(project.overlay_dir, rel), data)
            written.append(rel)
    write_lock(project.lock_path, new_lock)
    atomic_write_text(cfg, new_text)
    git("update-ref", APPLIED_REF, rev_parse(co, "HEAD") or "", cwd=co)
    config_set(co, "vllm-overlay.overlay-digest", overlay_digest(project.overlay_dir))
    sf = state_file(project)
    if sf.parent.exists():
        shutil.rmtree(sf.parent)
    info(f"import: change {m.id} recorded as {(rev_parse(co, 'HEAD') or '')[:12]}")
    return written


def _staged(co: Path, st: State) -> list[str]:
    """Stage the person's resolution (their commits folded in) and return the files the
    import changes; refused with markers left, or edits outside the import's files."""
    head = rev_parse(co, "HEAD")
    if head != st.pre_head:
        if git(
            "merge-base", "--is-ancestor", st.pre_head, head or "", cwd=co, check=False
        ).returncode:
            raise ChangeImportError(
                f"HEAD of {co} moved off the import ({(head or '')[:12]}); check out "
                f"{st.pre_head[:12]} plus your resolution again, or `vllm-overlay import --abort`."
            )
        git("reset", "-q", "--soft", st.pre_head, cwd=co)  # fold the person's commits in
    left = markers_left(co, st.paths)
    if left:
        raise ChangeImportError(
            "conflict markers (<<<<<<< or >>>>>>>) are still in:\n"
            + "\n".join("    " + p for p in left)
            + "\nEdit them away, then run `vllm-overlay import --continue` again."
        )
    git("add", "-f", "--", *st.paths, cwd=co)
    with opened(co) as repo:
        other = [e for e in uncommitted(repo) if e[3:] not in st.paths]
    if other:
        raise ChangeImportError(
            f"{co} has changes outside the import's files:\n"
            + "\n".join("    " + e for e in other[:20])
            + "\nRevert them (they belong to no change), then `vllm-overlay import --continue`."
        )
    changed = [
        p for p in git("diff", "--cached", "--name-only", "-z", cwd=co).stdout.split("\0") if p
    ]
    if not changed:
        raise ChangeImportError(
            "the import leaves the checkout's tree as it was: there is nothing to record. "
            "`vllm-overlay import --abort`."
        )
    return changed


def _fields(m: Meta, lock: Lock, changed: list[str], paths: list[str]) -> dict:
    """The new [[change]] of overlay.toml."""
    tests = m.tests if m.tests is not None else [p for p in changed if _is_test(p)]
    return {
        "id": m.id, "title": m.title, "why": m.why, "origin": m.origin, "origin_kind": "backport",
        "authors": m.authors, "drop_when": m.drop_when, "since": lock.upstream.version,
        "files": changed, "tests": tests,
        "upstream_tests": m.upstream_tests if m.upstream_tests is not None
        else upstream_tests(paths),
    }  # fmt: skip


def upstream_tests(paths: list[str]) -> list[str]:
    """The upstream test files among the paths the imported diff adds or changes (upstream's
    names: a pull request's files, or the files that differ between the pin and the release),
    once each, in the diff's order."""
    return list(dict.fromkeys(p for p in paths if _is_test(p)))


def _is_test(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return path.startswith("tests/") and name.startswith("test_") and name.endswith(".py")
