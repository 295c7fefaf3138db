"""The typed rebase and tracking reports against reports the untyped code wrote.

``data_track_reports/`` holds track-report.json and track-report.md as the tool wrote them
before the reports were typed (real runs of tests/unit/test_track*.py, and synthesized
variants of them for sections those runs do not reach, rendered by the old code), and the
rebase's text report of each (``rebase.txt``). Each loads, writes the same JSON back, and
renders the same markdown and text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm_overlay.commands.rebase import render
from vllm_overlay.rebase.reportdata import Aborted, Noop, RebaseReport, outcome_from_json
from vllm_overlay.track.report import markdown, write
from vllm_overlay.track.trackdata import TrackReport

DATA = Path(__file__).parent / "data_track_reports"
SAVED = sorted(d.name for d in DATA.iterdir())


def _saved(name: str) -> dict:
    return json.loads((DATA / name / "track-report.json").read_text())


def test_every_kind_of_run_is_saved():
    kinds = {(r["status"], (r.get("rebase") or {}).get("status")) for r in map(_saved, SAVED)}
    assert kinds == {("up-to-date", None), ("ready", "complete"), ("needs-person", "complete"),
                     ("needs-person", "stopped"), ("needs-person", "failed")}  # fmt: skip


@pytest.mark.parametrize("name", SAVED)
def test_a_saved_report_loads_and_writes_the_same_json(name: str):
    saved = _saved(name)
    assert TrackReport.from_json(saved).to_json() == saved


@pytest.mark.parametrize("name", SAVED)
def test_a_saved_report_renders_the_same_markdown(name: str, tmp_path: Path):
    rep = TrackReport.from_json(_saved(name))
    assert markdown(rep) == (DATA / name / "track-report.md").read_text()
    write(rep, tmp_path)
    assert (tmp_path / "track-report.md").read_bytes() == (
        DATA / name / "track-report.md"
    ).read_bytes()
    assert json.loads((tmp_path / "track-report.json").read_text()) == _saved(name)
    assert rep.to_json()["report"] == {"md": str(tmp_path / "track-report.md"),
                                       "json": str(tmp_path / "track-report.json")}  # fmt: skip


@pytest.mark.parametrize("name", [n for n in SAVED if (DATA / n / "rebase.txt").exists()])
def test_a_saved_rebase_report_renders_the_same_text(name: str):
    rebase = _saved(name)["rebase"]
    rep = outcome_from_json(rebase)
    assert isinstance(rep, RebaseReport) and rep.to_json() == rebase
    assert render(rep) + "\n" == (DATA / name / "rebase.txt").read_text()


def test_a_report_from_before_the_walk_loads():
    """A rebase report saved before the walk (no path, cells, stops, waited or proofs; its
    problems without kinds) and a track report without the copy's keys still load."""
    saved = _saved("conflict_stop")
    rebase = saved["rebase"]
    for key in ("path", "cells", "stops", "waited", "proof_releases", "notes", "at"):
        rebase.pop(key)
    for p in rebase["stopped_at"]["problems"]:
        p.pop("kind"), p.pop("candidates")
    for key in ("uncommitted", "walked_to", "hunks"):
        saved.pop(key)
    rep = TrackReport.from_json(saved)
    assert rep.rebase.stopped_at.problems[0].kind == ""
    text = markdown(rep)
    assert "## The walk" not in text and "### Conflict in" in text
    assert render(rep.rebase).startswith("rebase vllm 1.0.0 -> 1.2.0: STOPPED at change")


def test_noop_and_aborted_round_trip():
    noop = {"status": "noop", "message": "upstream.lock already pins vllm 1.0.0."}
    aborted = {"status": "aborted", "checkout": "/c", "from": {"version": "1.0.0", "commit": "ab"}}
    assert (
        outcome_from_json(noop) == Noop(noop["message"]) and Noop(noop["message"]).to_json() == noop
    )
    assert outcome_from_json(aborted).to_json() == aborted
    assert render(Aborted("1.0.0", "ab", "/c")) == (
        "rebase aborted: upstream.lock, overlay/ and /c are back at 1.0.0."
    )
