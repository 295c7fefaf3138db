"""The real overlay and lock rebased onto real vLLM releases (network, cached)."""

from __future__ import annotations

import json
import os
import shutil
import tomllib
from pathlib import Path

import pytest
from conftest import (
    run_cli,
)


@pytest.mark.network
@pytest.mark.slow
def test_real_rebase_0_24_to_0_25(tmp_path: Path):
    """The real overlay and lock, moved to vLLM 0.25.0 on the real sdists: upstream's own
    version of the hidden-states fix drops ours, and our tests pass on 0.25.0 without it."""
    repo_root = Path(__file__).resolve().parents[2]
    root = tmp_path / "project"
    root.mkdir()
    shutil.copy2(repo_root / "upstream.lock", root / "upstream.lock")
    shutil.copytree(repo_root / "overlay", root / "overlay")
    shutil.copytree(repo_root / "constraints", root / "constraints")  # the pinned test envs
    old = tomllib.loads((root / "upstream.lock").read_text())
    assert old["upstream"]["version"] == "0.24.0"
    commit = "dd10e03f95f94edbea1975c67ace3a35ec9a8a40"
    res = run_cli("rebase", "--to", "0.25.0", "--commit", commit, "--json", cwd=root)
    assert res.rc == 0, res.out + res.err
    rep = json.loads(res.out)
    [dropped] = rep["dropped"]
    assert dropped["id"] == "hybrid-hidden-states-block-size"
    assert dropped["reason"] == "drop_when vllm>=0.25.0 holds for vllm 0.25.0"
    assert "passed against vllm 0.25.0 without the change" in dropped["proof"]
    lock = tomllib.loads((root / "upstream.lock").read_text())
    assert lock["upstream"]["version"] == "0.25.0" and lock["upstream"]["commit"] == commit
    arts = {a["filename"]: a["sha256"] for a in lock["artifact"]}
    assert arts["vllm-0.25.0.tar.gz"] == (
        "7e04e2b37164de8c4012f27f75af6c4768039b32610865e9b6fb8c49c34a84aa"
    )
    doc = tomllib.loads((root / "overlay" / "overlay.toml").read_text())
    assert "change" not in doc and doc["dropped"][0]["dropped_in"] == "0.25.0"
    assert os.listdir(root / "overlay") == ["overlay.toml"]
