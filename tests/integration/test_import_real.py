"""import on the real overlay and real vLLM release sdists (network, cached): upstream's own
0.25.0 version of our backport merged three-way onto the 0.24.0 line's series conflicts where the two
wordings differ, and --abort puts everything back."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import run_cli, tree_snapshot
from lines import line_project

EXTRACT = "vllm/model_executor/models/extract_hidden_states.py"


@pytest.mark.network
@pytest.mark.slow
def test_real_release_import_conflicts_then_aborts(tmp_path: Path):
    root = line_project(tmp_path / "project", "0.24.0")  # the series on 0.24.0 carries #46301
    co = tmp_path / "co"
    assert run_cli("apply", "--checkout", co, cwd=root).rc == 0
    head = subprocess.run(["git", "-C", str(co), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    before = tree_snapshot(root)
    res = run_cli("import", "--from-release", "0.25.0", "--paths", EXTRACT, "--id", "up-025",
                  "--checkout", co, cwd=root)  # fmt: skip
    assert res.rc == 1, res.out + res.err
    assert f"CONFLICT {EXTRACT} (three-way merge pin -> 0.25.0)" in res.out
    text = (co / EXTRACT).read_text()
    assert "<<<<<<< series" in text and "||||||| pin" in text and ">>>>>>> release 0.25.0" in text
    assert "slot_mapping.clamp(min=0)" in text and "slot_mapping.clamp_min(0)" in text
    res = run_cli("import", "--abort", cwd=root)
    assert res.rc == 0, res.err
    assert subprocess.run(["git", "-C", str(co), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout == head  # fmt: skip
    assert (co / EXTRACT).read_text().count("<<<<<<<") == 0
    assert tree_snapshot(root) == before
