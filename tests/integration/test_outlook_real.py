"""The outlook of the 0.24.0 line's series (the last commit that pins 0.24.0) against the real
vLLM releases 0.25.0 - 0.33.0."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import run_cli, tree_snapshot
from lines import line_project

pytestmark = pytest.mark.network

RELEASES = ["0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0",
            "0.31.0", "0.32.0", "0.33.0"]  # fmt: skip


# The walk's verdict for each change at each release: it drops a change at the first release
# that has it (then "."); a conflict waits ("W") for the release that clears it, or for the
# last release that touches its lines again, where the person is asked once.
EXPECTED = {  # 0.25.0 0.25.1 0.26.0 0.27.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0 0.32.0 0.33.0
    "cpu-spec-decode-fp64-gumbel-keyword": "D..........",
    "cpu-moe-silu-without-config": "D..........",
    # ours: upstream's AMX rule in the same lines from 0.26.0, touched again up to 0.32.0,
    # so a walk to 0.33.0 asks at 0.32.0, once
    "cpu-gdn-ssm-state-float32": "RKWWWWWWWCC",
    "cpu-gdn-decode-state-indices": "KKWWWWWWWCC",  # ours: 0.26.0 rewrites the CPU GDN path
    "cpu-mamba-batch-memcpy": "D..........",
    "cpu-mamba-align-postprocess": "RKRRKKKRCCC",  # ours
    "cpu-zero-new-attention-blocks": "D..........",
    "cli-version-of-any-distribution": "KKKRKKRWCCC",  # ours: 0.30.0 reworks the CLI's main
    "hidden-states-connector-cpu-cache": "RKKKKKRCCCC",  # ours
    "hybrid-hidden-states-block-size": "D..........",
    # #51108: conflicts at 0.26.0-0.27.1, but 0.28.0 has it: nobody is asked on the way
    "hybrid-prefix-caching-hidden-states": "KKWWWD.....",
    "hidden-states-page-size-tp": "KKWWWRRD...",
    "abort-safe-hidden-states-connector": "RKKKKKWWD..",
    # ours, on top of #56841's request_finished: from 0.31.0 on upstream's own
    "hidden-states-connector-aborted-leave-no-files": "RKKKKKWWRKK",
    "hidden-states-connector-confined-paths": "RKKKKKRCCCC",  # ours (vllm#51448 is open)
}


LETTER = {"kept": "K", "refreshed": "R", "dropped": "D", "conflict": "C", "moved": "M",
          "collision": "X", "waiting": "W", "gone": ".", "record": "r",
          "tests-failed": "T"}  # fmt: skip
# The person-stops per target: the walk's, then the direct jump's (counts are equal; the
# walk asks each at the first release where upstream touches our lines).
STOPS = {"0.25.0": 0, "0.25.1": 0, "0.26.0": 4, "0.27.0": 4, "0.27.1": 4, "0.28.0": 2,
         "0.29.0": 4, "0.30.0": 7, "0.31.0": 6, "0.32.0": 6, "0.33.0": 6}  # fmt: skip


def _row(data: dict, change: str) -> list[dict]:
    return [next(o for o in col["outcomes"] if o["id"] == change) for col in data["releases"]]


@pytest.fixture
def real_project(tmp_path) -> Path:
    return line_project(tmp_path / "project", "0.24.0")


def test_series_on_main_against_every_release(real_project):
    before = tree_snapshot(real_project)
    res = run_cli("outlook", "--releases", ",".join(RELEASES), "--json", cwd=real_project)
    assert res.rc == 0, res.err
    data = json.loads(res.out)
    assert data["pin"] == "0.24.0"
    assert [c["version"] for c in data["releases"]] == RELEASES
    ids = [c["id"] for c in data["changes"]]
    for col in data["releases"]:
        assert [o["id"] for o in col["outcomes"]] == ids
        for o in col["outcomes"]:
            assert o["state"] in LETTER and o["reason"]
    # What the real three-way merges and drop_when give for the changes on main
    # (letters: LETTER), release by release 0.25.0 .. 0.33.0.
    got = {c["id"]: "".join(LETTER[o["state"]] for o in _row(data, c["id"]))
           for c in data["changes"]}  # fmt: skip
    assert got == EXPECTED
    # Our own CPU changes conflict from 0.26.0: the newest release every change reaches
    # without a person is 0.25.1.
    assert data["safe_target"] == "0.25.1"
    targets = {t["version"]: t for t in data["targets"]}
    assert {v: len(t["walk"]) for v, t in targets.items()} == STOPS
    for t in data["targets"]:  # the walk never asks more than the direct jump
        assert len(t["walk"]) <= len(t["direct"]), t
    assert tree_snapshot(real_project) == before
    again = run_cli("outlook", "--releases", ",".join(RELEASES), "--json", cwd=real_project)
    assert json.loads(again.out) == data
    assert f"({len(RELEASES)} from the cache)" in again.err


def test_real_classifier_without_drop_when(real_project, tmp_path):
    """With drop_when out of the way the real three-way merges decide: upstream's merged
    version of the fix differs from our backport, so the files conflict or collide."""
    toml = real_project / "overlay" / "overlay.toml"
    toml.write_text(
        re.sub(r'drop_when = "vllm>=[^"]*"', 'drop_when = "vllm>=99"', toml.read_text())
    )
    page = tmp_path / "outlook.html"
    res = run_cli("outlook", "--releases", ",".join(RELEASES), "--json", "--html", page,
                  cwd=real_project)  # fmt: skip
    assert res.rc == 0, res.err
    data = json.loads(res.out)
    stops = [o for c in data["releases"] for o in c["outcomes"] if o["state"] == "conflict"
             or o["state"] == "collision"]  # fmt: skip
    assert stops
    assert all(o["files"] for o in stops)
    assert any(o["hunks"] for o in stops)
    assert 'class="matrix"' in page.read_text()
