"""The walk's look-ahead: where to take up a change that does not go through a release.

At a conflict that no resolution record settles (``Walker._conflict``), the walk looks ahead
to the target before it asks anyone: a later release may clear the conflict, or upstream may
touch the same lines again, so that the person would be asked twice.
"""

from __future__ import annotations

from vllm_overlay.rebase import decide, records
from vllm_overlay.rebase.walkdata import Walking


def ahead(walker: Walking, cid: str, here: decide.Outcome) -> tuple[str, str] | None:
    """Where to take up a change that does not go through here, looking ahead to the
    target, in its current form, on each release as the changes before it leave it:

    - the first later release that clears it (it drops there, or merges cleanly):
      nobody is asked at all;
    - else the last release where upstream touches the conflicting lines again (the
      conflict's hunks differ from the release before): a resolution made earlier would
      be asked again there, so the person is asked once, there.

    None: stop here (the conflict stays as it is up to the target)."""
    w = walker.walk
    earlier = w.order[: w.order.index(cid)]
    last, at = hunks_of(here), None
    for rel in w.path[w.pos + 1 :]:
        tree = walker.host.files(rel, walker.paths())
        for other in earlier:
            if other in w.gone or w.waiting.get(other, rel) != rel:
                continue
            o = walker.decision(other, rel, tree)
            if o.state in (decide.KEPT, decide.REFRESHED):
                tree.update(o.merged)
        o = walker.decision(cid, rel, tree)
        if o.state in decide.CLEAN:
            how = "it drops there" if o.state == decide.DROPPED else "it merges there"
            return rel, f"{w.name} {rel} clears it ({how})"
        hunks = hunks_of(o)
        if hunks != last:
            last, at = hunks, rel
    if at is None:
        return None
    return at, (f"upstream touches these lines again up to {w.name} {at}: the person is "
                "asked there, once")  # fmt: skip


def hunks_of(o: decide.Outcome) -> tuple:
    """What a conflict is, release names aside: its kind, files and the three sides of each
    hunk (a resolution of one applies to the other only when these are equal)."""
    out = []
    for path in sorted(o.files):
        merged = o.conflicted.get(path)
        split = records.split_diff3(merged.decode(errors="surrogateescape")) if merged else None
        out.append((path, tuple(split[1]) if split else None))
    return (o.state, tuple(out))
