"""The checkout's series: which commits (and which uncommitted work) belong to which change.

The checkout holds ``refs/vllm-overlay/base`` and on top of it one commit per change, each
with an ``Overlay-Change: <id>`` trailer (apply makes them). People edit that history with
git; export walks it back into per-change segments:

- a commit with the trailer belongs to the change it names; several adjacent commits may
  name the same change;
- a commit without the trailer belongs to the change of the commit below it (a plain
  ``git commit`` while editing a change in ``git rebase -i``);
- the work on top (commits without a trailer after the last change's commit, uncommitted
  edits and untracked files) belongs to the **last change in overlay.toml**: that is how a
  new change is started (add its [[change]] last, edit, export) and how the last change is
  edited;
- ``fixup!``/``squash!``/``amend!`` commits that are not squashed yet, merges, trailers that
  name no change, changes in the wrong order and changes with no commit (other than the
  last) are refused with what to run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from vllm_overlay.errors import CheckoutError, OverlayError
from vllm_overlay.gitrepo import git, rev_parse
from vllm_overlay.overlay.model import CONFIG_NAME, Change, Overlay
from vllm_overlay.pin.trees import BASE_REF

TRAILER = "Overlay-Change"  # the trailer that names a commit's change (checkout writes it)

WORKTREE = None  # a segment's end when it is the work tree (the top of the series)
_UNSQUASHED = ("fixup! ", "squash! ", "amend! ")


@dataclass
class Segment:
    change: Change
    commits: list[str] = field(default_factory=list)
    before: str = ""  # the commit the change starts from
    after: str | None = WORKTREE  # its last commit; WORKTREE for the top of the series

    @property
    def top(self) -> bool:
        return self.after is WORKTREE


@dataclass(frozen=True)
class _Commit:
    id: str
    subject: str
    trailers: tuple[str, ...]


def _commits(checkout: Path, base: str) -> list[_Commit]:
    """The commits from ``base`` (excluded) up to HEAD, oldest first.

    Walked down from HEAD one commit at a time, never below ``base``: a checkout made from a
    shallow source has no parents of the base to traverse."""
    fmt = f"%H%x1f%P%x1f%s%x1f%(trailers:key={TRAILER},valueonly,separator=%x1f)"
    out: list[_Commit] = []
    rev = rev_parse(checkout, "HEAD")
    while rev is not None and rev != base:
        rec = git("log", "-1", f"--format={fmt}", rev, cwd=checkout).stdout.rstrip("\n")
        cid, parents, subject, *trailers = rec.split("\x1f")
        if len(parents.split()) > 1:
            raise CheckoutError(
                f"{checkout} has a merge commit above the base ({cid[:12]}); the series is a "
                f"straight line of one commit per change. Rebase it away (`git rebase -i "
                f"{BASE_REF}`), then export."
            )
        out.append(_Commit(cid, subject, tuple(t.strip() for t in trailers if t.strip())))
        rev = parents.split()[0] if parents.split() else None
        if len(out) > 10000:
            rev = None
    if rev is None:
        raise CheckoutError(
            f"HEAD of {checkout} is not on top of {BASE_REF} (the pinned upstream); export "
            "reads the changes as the commits above it. Check out branch `overlay` again, or "
            "make the checkout afresh with `vllm-overlay apply --force`."
        )
    return out[::-1]


def walk_series(checkout: Path, overlay: Overlay) -> tuple[str, list[Segment]]:
    """(base, one segment per change in overlay.toml order); raises with what to do."""
    base = rev_parse(checkout, BASE_REF)
    if base is None:
        raise CheckoutError(
            f"{checkout} is not a vllm-overlay checkout (no {BASE_REF}). Create one with "
            "`vllm-overlay apply --checkout DIR` or `vllm-overlay edit`."
        )
    segments = _group(checkout, overlay, base)
    _check_order(checkout, overlay, segments)
    _start_last(checkout, overlay, segments)
    seen = {s.change.id for s in segments}
    missing = [c.id for c in overlay.changes if c.id not in seen]
    if missing:
        raise OverlayError(
            f"overlay/{CONFIG_NAME} lists change(s) {missing} that have no commit in "
            f"{checkout}. Only the last change may be started from uncommitted work. Make the "
            "checkout from the overlay again (`vllm-overlay apply --force` stashes your edits), "
            "or move the new change last in overlay.toml."
        )
    prev_end = base
    for s in segments:
        s.before = prev_end
        s.after = s.commits[-1] if s.commits else prev_end
        prev_end = s.after
    if segments:
        segments[-1].after = WORKTREE
    return base, segments


def _group(checkout: Path, overlay: Overlay, base: str) -> list[Segment]:
    """The commits above ``base``, grouped by the change each belongs to (its trailer, else the
    change of the commit below it), in the checkout's order."""
    ids = [c.id for c in overlay.changes]
    segments: list[Segment] = []
    seen: set[str] = set()
    for c in _commits(checkout, base):
        _check_commit(checkout, c)
        if not c.trailers:
            if not segments:
                raise OverlayError(
                    f"commit {c.id[:12]} ({c.subject!r}) sits directly on the base and names "
                    f"no change (no `{TRAILER}:` trailer). Give it the trailer of the change it "
                    f"belongs to (`git commit --amend --trailer '{TRAILER}: ID'` in a "
                    f"`git rebase -i {BASE_REF}`), or squash it into that change's commit."
                )
            segments[-1].commits.append(c.id)
            continue
        cid = c.trailers[0]
        if cid not in ids:
            raise OverlayError(
                f"commit {c.id[:12]} carries `{TRAILER}: {cid}`, but overlay/{CONFIG_NAME} has "
                f"no change {cid!r}. Add its [[change]], or fix the trailer."
            )
        if segments and segments[-1].change.id == cid:
            segments[-1].commits.append(c.id)
            continue
        if cid in seen:
            raise OverlayError(
                f"change {cid!r} has commits in two places of {checkout}'s history, with other "
                f"changes between them. Move them together (`git -C {checkout} rebase -i "
                f"{BASE_REF}`), then export."
            )
        seen.add(cid)
        segments.append(Segment(overlay.change(cid), [c.id]))
    return segments


def _check_commit(checkout: Path, c: _Commit) -> None:
    """Refuse a commit that is not squashed yet or that names several changes."""
    if c.subject.startswith(_UNSQUASHED):
        raise OverlayError(
            f"commit {c.id[:12]} ({c.subject!r}) is not squashed into its change yet. "
            f"Run `git -C {checkout} rebase -i --autosquash {BASE_REF}`, then export again."
        )
    if len(set(c.trailers)) > 1:
        raise OverlayError(
            f"commit {c.id[:12]} names several changes ({', '.join(c.trailers)}); a commit "
            f"belongs to one change. Split it (`git -C {checkout} rebase -i {BASE_REF}`)."
        )


def _check_order(checkout: Path, overlay: Overlay, segments: list[Segment]) -> None:
    """Refuse a checkout whose changes are in another order than overlay.toml's."""
    order = [s.change.id for s in segments]
    expected = [c.id for c in overlay.changes if c.id in order]
    if order != expected:
        raise OverlayError(
            f"the checkout has the changes in the order {order}, overlay/{CONFIG_NAME} in the "
            f"order {expected}. A patch applies to the tree the changes "
            "before it leave, so the two must agree: reorder the [[change]] tables or the "
            f"commits (`git -C {checkout} rebase -i {BASE_REF}`)."
        )


def _start_last(checkout: Path, overlay: Overlay, segments: list[Segment]) -> None:
    """Where the last change in overlay.toml has no commit yet: its segment, from the commits
    without a trailer after the last change commit (and the work tree)."""
    last = overlay.changes[-1] if overlay.changes else None
    if last is None or any(s.change.id == last.id for s in segments):
        return
    tail: list[str] = []
    if segments:
        prev = segments[-1]
        trailed = [i for i, cid in enumerate(prev.commits) if _has_trailer(checkout, cid)]
        cut = trailed[-1] + 1 if trailed else len(prev.commits)
        prev.commits, tail = prev.commits[:cut], prev.commits[cut:]
    segments.append(Segment(last, tail))


def _has_trailer(checkout: Path, commit: str) -> bool:
    out = git("log", "-1", f"--format=%(trailers:key={TRAILER},valueonly)", commit, cwd=checkout)
    return bool(out.stdout.strip())
