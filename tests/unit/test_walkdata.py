"""The walk as plain data (rebase/walkdata.py): typed cells with one name for their state, and
walks saved before the cells were typed still load and go on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from synthetic import BlobHost
from vllm_overlay.overlay.model import Change
from vllm_overlay.rebase import decide, releasewalk
from vllm_overlay.rebase.walkdata import Blobs, Cell, Walk, person_stops, start

# Written by the walk before cells were typed (main at 6394247), on the releases below: a
# rebase stopped at 3.0 ("state": "stopped" beside "kind"; "unresolved" and "records_used" in
# the walk), and the outlook's cells of the same walk ("unresolved").
SAVED = json.loads((Path(__file__).parent / "data_walk_saved_before_cells_typed.json").read_text())

OLD = b"".join(b"line %d\n" % i for i in range(40))
ONE = OLD.replace(b"line 5\n", b"line 5 first\n")
TWO = ONE.replace(b"line 30\n", b"line 30 second\n")
SHIFTED = b"new top\n" + OLD
REWRITTEN = SHIFTED.replace(b"line 5\n", b"line 5 upstream\n")


def _steps() -> list[decide.Step]:
    def ch(cid: str) -> Change:
        return Change(cid, "t", "w", "https://x", "s", "vllm>=9", ("f.py",), ())

    return [decide.Step(ch("a"), {"f.py": OLD}, {"f.py": ONE}),
            decide.Step(ch("b"), {"f.py": ONE}, {"f.py": TWO})]  # fmt: skip


def _walker(w: Walk, blobs: Blobs, **kw) -> releasewalk.Walker:
    changes = {s.change.id: s.change for s in _steps()}
    return releasewalk.Walker(
        w,
        blobs,
        BlobHost({"1.0": {"f.py": OLD}, "2.0": {"f.py": SHIFTED}, "3.0": {"f.py": REWRITTEN}}),
        changes,
        {},
        report=None,
        **kw,
    )


def test_a_stop_is_a_cell_whose_state_is_what_the_walk_met():
    blobs = Blobs()
    w = _walker(start("vllm", "1.0", ["2.0", "3.0"], _steps(), blobs), blobs).run()
    assert [(c.release, c.id, c.state, c.stop) for c in w.cells] == [
        ("2.0", "a", "refreshed", False), ("2.0", "b", "refreshed", False),
        ("3.0", "a", "conflict", True),
    ]  # fmt: skip
    assert w.stop is w.cells[-1]
    assert person_stops(w) == [{"release": "3.0", "id": "a", "state": "conflict"}]
    saved = w.to_json()
    assert saved["stop"]["state"] == "conflict" and "kind" not in saved["stop"]
    assert "unresolved" not in saved and "records_used" not in saved
    assert Walk.from_json(json.loads(json.dumps(saved))) == w


def test_a_cell_state_outside_the_set_is_refused():
    with pytest.raises(ValueError, match="not 'stopped'"):
        Cell("3.0", "a", "stopped", "why")  # type: ignore[arg-type]


def test_a_walk_saved_before_cells_were_typed_loads_as_todays_and_goes_on():
    """The old rebase state loads as exactly what today's walk of the same releases saves; a
    person then settles its stop and the walk goes on to the end."""
    blobs = Blobs()
    today = _walker(start("vllm", "1.0", ["2.0", "3.0"], _steps(), blobs), blobs).run()
    loaded = Walk.from_json(SAVED["rebase_walk"])
    assert loaded.to_json() == today.to_json()
    assert loaded.stop is not None and (loaded.stop.state, loaded.stop.stop) == ("conflict", True)

    walker = _walker(loaded, blobs)
    resolved = REWRITTEN.replace(b"line 5 upstream\n", b"line 5 upstream first\n")
    assert walker.settle({"f.py": resolved}, {}) is None  # no proofs here
    w = walker.run()
    assert w.done and w.stop is None
    assert [(c.id, c.state, c.stop) for c in w.cells if c.release == "3.0"] == [
        ("a", "conflict", True), ("a", "resolved", False), ("b", "kept", False)]  # fmt: skip
    assert len(walker.made) == 1  # the person's resolution, recorded


def test_the_outlook_cells_saved_before_cells_were_typed_load():
    blobs = Blobs()
    w = _walker(start("vllm", "1.0", ["2.0", "3.0"], _steps(), blobs), blobs,
                stop_at_conflicts=False).run()  # fmt: skip
    loaded = [Cell.from_json(c) for c in SAVED["outlook_cells"]]
    assert loaded == w.cells[-2:]
    assert (loaded[0].state, loaded[0].stop) == ("conflict", True)
