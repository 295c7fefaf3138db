"""vllm-overlay import: start a change from upstream work, by a real three-way merge onto the
series in the checkout.

Sources: a format-patch/mbox file (a pull request's ``.patch``, read by overlay/mbox.py), or
the upstream diff of some paths between the pin and a later release (both trees made from the
release sdists on the index by pin/, so it works offline).

Per file, the change is merged onto the file as the series leaves it (``ours``):

- a patch that applies to ``ours`` as it is (``git apply``: exact context, no fuzz) is applied;
- otherwise a base it applies to is looked for: the file an earlier mail of the same import
  produced, the blob the diff names in its ``index`` line (when the checkout has it), or the
  file in ``--base-release``; ``git merge-file --diff3`` then merges base -> theirs into ours;
- a release import merges pin -> release into ours the same way.

Everything is computed in memory first; a file no base can be found for stops the import with
nothing written. A merge with conflicts writes the files (diff3 markers) into the checkout and
stops; ``--continue`` commits the person's resolution, ``--abort`` puts the checkout back.
Only a finished import writes overlay/ (the new change's directory), upstream.lock ([base]
of new paths) and overlay.toml (the change appended last, revision bumped), after checking
that the strict apply of the whole series gives the checkout's tree.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from vllm_overlay.errors import ChangeImportError, OverlayError
from vllm_overlay.gitrepo import (
    apply_patch,
    blob_bytes,
    config_set,
    git,
    merge_file,
    opened,
    rev_parse,
    show_bytes,
    uncommitted,
)
from vllm_overlay.overlay import history
from vllm_overlay.overlay.checkout import APPLIED_REF, change_message
from vllm_overlay.overlay.export import expected_overlay
from vllm_overlay.overlay.mbox import FileDiff, PatchSeries
from vllm_overlay.overlay.model import CONFIG_NAME, overlay_digest, parse_overlay, safe_join
from vllm_overlay.overlay.project import Project
from vllm_overlay.overlay.series import final_tree, plan_series
from vllm_overlay.pin.lockfile import Lock, base_hash, write_lock
from vllm_overlay.pin.trees import BASE_REF
from vllm_overlay.util import atomic_write_bytes, atomic_write_text, info

FORMAT = 1
_MARKER_RE = re.compile(rb"^(<<<<<<<|>>>>>>>)( |$)", re.MULTILINE)
FETCH_TIMEOUT = 20


@dataclass
class Meta:
    """What the new [[change]] says about itself."""

    id: str
    title: str
    why: str
    origin: str
    drop_when: str
    tests: list[str] | None = None  # None: the test files the change touches
    authors: list[str] = field(default_factory=list)
    # None: the test files (tests/**/test_*.py) the imported upstream diff adds or changes
    upstream_tests: list[str] | None = None


@dataclass
class Merged:
    path: str
    content: bytes
    conflicted: bool
    how: str


@dataclass
class State:
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


def web_url(git_url: str) -> str | None:
    """``https://host/owner/repo`` for an http(s) git URL, else None."""
    if not re.match(r"^https?://", git_url):
        return None
    return git_url.rstrip("/").removesuffix(".git")


def fetch_pr(git_url: str, number: int) -> tuple[str, str]:
    """(the pull request's .patch text, its URL) from the git host; one clear error if it
    cannot be reached."""
    web = web_url(git_url)
    if web is None:
        raise ChangeImportError(
            f"--pr needs an http(s) git URL to find the pull request, and upstream.lock's is "
            f"{git_url}. Pass --git-url https://HOST/OWNER/REPO.git, or download the .patch and "
            "use --patch FILE."
        )
    url = f"{web}/pull/{number}.patch"
    req = urllib.request.Request(url, headers={"User-Agent": "vllm-overlay"})
    try:
        with urllib.request.urlopen(req, timeout=FETCH_TIMEOUT) as resp:
            data = resp.read()
    except urllib.error.HTTPError as e:
        raise ChangeImportError(
            f"{url} answered HTTP {e.code} ({e.reason}): is #{number} a pull request of "
            f"{web}? Nothing was written."
        ) from e
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ChangeImportError(
            f"cannot fetch {url}: {reason}. The git host is not reachable from here; nothing "
            "was written. Download the pull request's .patch where it is reachable and run "
            "`vllm-overlay import --patch FILE`, or pass --git-url for a reachable mirror."
        ) from e
    return data.decode("utf-8", errors="surrogateescape"), url


# ---------------------------------------------------------------------------------------------
# Merging (in memory)


def _apply_one(data: bytes | None, fd: FileDiff) -> bytes | None:
    """``fd`` applied to ``data`` by ``git apply`` (exact context, no fuzz), or None."""
    with tempfile.TemporaryDirectory(prefix="vllm-overlay-import-") as tmp:
        root = Path(tmp, "t")
        target = safe_join(root, fd.path)
        target.parent.mkdir(parents=True, exist_ok=True)
        if data is not None:
            target.write_bytes(data)
        patch = fd.text.encode(errors="surrogateescape")  # the mail's bytes, as they came
        if not apply_patch(patch, root, "--whitespace=nowarn") or not target.is_file():
            return None
        return target.read_bytes()


def merge_patch(
    series: PatchSeries, checkout: Path, base_release: tuple[str, Path, str] | None
) -> list[Merged]:
    """Each file diff of ``series`` merged onto the checkout's HEAD, in order."""
    cur: dict[str, bytes | None] = {}
    done: dict[str, Merged] = {}
    prev_theirs: dict[str, bytes] = {}
    for fd in series.files:
        if fd.path not in cur:
            cur[fd.path] = show_bytes(checkout, "HEAD", fd.path)
        ours = cur[fd.path]
        m = _merge_one(fd, ours, checkout, prev_theirs.get(fd.path), base_release)
        if fd.path in done and done[fd.path].conflicted:
            raise ChangeImportError(
                f"{fd.path}: a later commit of the patch changes it again after a conflicted "
                "merge; import the commits one at a time (split the mbox)."
            )
        cur[fd.path] = m.content
        done[fd.path] = m
        theirs = _theirs_after(fd, ours, prev_theirs.get(fd.path))
        if theirs is not None:
            prev_theirs[fd.path] = theirs
    return list(done.values())


def _theirs_after(fd: FileDiff, ours: bytes | None, prev: bytes | None) -> bytes | None:
    for base in (prev, ours):
        if base is not None or fd.new_file:
            got = _apply_one(base, fd)
            if got is not None:
                return got
    return None


def _merge_one(
    fd: FileDiff,
    ours: bytes | None,
    checkout: Path,
    prev: bytes | None,
    base_release: tuple[str, Path, str] | None,
) -> Merged:
    if fd.new_file:
        theirs = _apply_one(None, fd)
        if theirs is None:
            raise ChangeImportError(f"the patch's new file {fd.path} does not apply to nothing.")
        if ours is None:
            return Merged(fd.path, theirs, False, "added")
        content, conflicts = merge_file(ours, b"", theirs, ("series", "absent", "import"))
        return Merged(fd.path, content, conflicts > 0, "added, but the series already has it")
    if ours is None:
        raise ChangeImportError(
            f"the patch changes {fd.path}, which neither the pinned upstream nor the series "
            "has. Nothing was written; check the patch (or the pin)."
        )
    direct = _apply_one(ours, fd)
    if direct is not None:
        return Merged(fd.path, direct, False, "applied")
    bases: list[tuple[str, bytes]] = []
    if prev is not None:
        bases.append(("the previous commit of the patch", prev))
    if fd.pre_blob:
        data = blob_bytes(checkout, fd.pre_blob)
        if data is not None:
            bases.append((f"blob {fd.pre_blob}", data))
    if base_release is not None:
        version, repo, rev = base_release
        data = show_bytes(repo, rev, fd.path)
        if data is not None:
            bases.append((f"{fd.path} of {version}", data))
    for name, base in bases:
        theirs = _apply_one(base, fd)
        if theirs is None:
            continue
        content, conflicts = merge_file(ours, base, theirs, ("series", name, "import"))
        return Merged(fd.path, content, conflicts > 0, f"three-way merge over {name}")
    tried = ", ".join(n for n, _ in bases) or "none"
    blob = (
        "names no blob it was written against"
        if not fd.pre_blob
        else f"was written against blob {fd.pre_blob}, which the checkout "
        + ("has but the patch does not apply to" if any(n.startswith("blob") for n, _ in bases)
           else "does not have")
    )  # fmt: skip
    raise ChangeImportError(
        f"the patch of {fd.path} does not apply to the file as the series leaves it, and no "
        f"base for a three-way merge takes it (bases tried: {tried}; the patch {blob}). "
        "Nothing was written. Pass --base-release VERSION: a release whose "
        f"{fd.path} the patch applies to (its sdist is the merge base)."
    )


def merge_release(
    checkout: Path, paths: list[str], version: str, repo: Path, rev: str
) -> list[Merged]:
    """pin -> ``version`` of each path, merged onto the checkout's HEAD."""
    out = []
    for path in paths:
        pinned = show_bytes(checkout, BASE_REF, path)
        theirs = show_bytes(repo, rev, path)
        ours = show_bytes(checkout, "HEAD", path)
        if theirs is None:
            what = "deletes" if pinned is not None else "does not have"
            raise ChangeImportError(
                f"release {version} {what} {path}; an overlay change patches and adds files "
                "only. Leave it out of --paths; nothing was written."
            )
        if pinned == theirs:
            continue
        if ours is None:
            out.append(Merged(path, theirs, False, f"added from {version}"))
            continue
        content, conflicts = merge_file(
            ours, pinned or b"", theirs, ("series", "pin", f"release {version}")
        )
        out.append(Merged(path, content, conflicts > 0, f"three-way merge pin -> {version}"))
    if not out:
        raise ChangeImportError(
            f"{', '.join(paths)}: the same in the pin and in {version}; nothing to import."
        )
    return out


def release_paths(checkout: Path, repo: Path, rev: str, paths: list[str]) -> list[str]:
    """Files under each of ``paths`` (a file or a directory) in the pin or the release."""
    found: list[str] = []
    for p in paths:
        here = git("ls-tree", "-r", "-z", "--name-only", BASE_REF, "--", p, cwd=checkout)
        there = git("ls-tree", "-r", "-z", "--name-only", rev, "--", p, cwd=repo)
        names = {n for n in (here.stdout + "\0" + there.stdout).split("\0") if n}
        if not names:
            raise ChangeImportError(f"{p} is in neither the pinned tree nor the release.")
        found += sorted(n for n in names if n not in found)
    return found


# ---------------------------------------------------------------------------------------------
# The checkout


def start(project: Project, checkout: Path, meta: Meta, merged: list[Merged]) -> State:
    """Write the merge into the (clean) checkout; commit and finish when it is clean."""
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
    co = Path(st.checkout)
    head = rev_parse(co, "HEAD")
    if head != st.pre_head:
        if git("merge-base", "--is-ancestor", st.pre_head, head or "", cwd=co, check=False).returncode:
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
    changed = [p for p in git("diff", "--cached", "--name-only", "-z", cwd=co).stdout.split("\0") if p]
    if not changed:
        raise ChangeImportError(
            "the import leaves the checkout's tree as it was: there is nothing to record. "
            "`vllm-overlay import --abort`."
        )
    m = st.meta
    tests = m.tests if m.tests is not None else [p for p in changed if _is_test(p)]
    fields = {
        "id": m.id, "title": m.title, "why": m.why, "origin": m.origin, "origin_kind": "backport",
        "authors": m.authors, "drop_when": m.drop_when, "since": lock.upstream.version,
        "files": changed, "tests": tests,
        "upstream_tests": m.upstream_tests if m.upstream_tests is not None
        else upstream_tests(st.paths),
    }  # fmt: skip
    cfg = project.overlay_dir / CONFIG_NAME
    new_text = history.add_change(cfg.read_text(), fields)
    new_overlay = parse_overlay(new_text, project.overlay_dir)
    change = new_overlay.change(m.id)
    new_lock = lock.with_base(
        {**lock.base, **{p: base_hash(show_bytes(co, BASE_REF, p)) for p in changed if p not in lock.base}}
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


def upstream_tests(paths: list[str]) -> list[str]:
    """The upstream test files among the paths the imported diff adds or changes (upstream's
    names: a pull request's files, or the files that differ between the pin and the release),
    once each, in the diff's order."""
    return list(dict.fromkeys(p for p in paths if _is_test(p)))


def _is_test(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return path.startswith("tests/") and name.startswith("test_") and name.endswith(".py")
