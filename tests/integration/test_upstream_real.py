"""`vllm-overlay upstream` on our own fix at the real pinned release (network, cached): the
commit on vLLM's tree, vLLM's own hooks (ruff at the version its pre-commit configuration pins,
its local Python hooks), and the change's tests in the release's test environment, with the
commit (they pass) and without it (they fail). One to three minutes warm."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import run_cli

REPO = Path(__file__).resolve().parents[2]
CHANGE = "hidden-states-connector-aborted-leave-no-files"

pytestmark = [pytest.mark.network, pytest.mark.slow]


def test_our_fix_is_ready_for_upstream_at_the_pin(tmp_path, real_testenv):
    root = tmp_path / "project"
    root.mkdir()
    for name in ("overlay", "constraints"):
        shutil.copytree(REPO / name, root / name)
    shutil.copy(REPO / "upstream.lock", root / "upstream.lock")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    for key, val in (("user.name", "Ada Lovelace"), ("user.email", "ada@example.org")):
        subprocess.run(["git", "config", key, val], cwd=root, check=True)
    out = tmp_path / "out"
    res = run_cli("upstream", CHANGE, "--out", out, "--json", cwd=root)
    assert res.rc == 0, res.err[-4000:]
    rep = json.loads(res.out)
    assert rep["with"]["ok"] and rep["with"]["failed"] == 0
    assert rep["without"]["failed"] >= 1
    ran = {h["id"]: h for h in rep["hooks"] if h["ran"]}
    assert ran["ruff-check"]["ok"] and ran["ruff-format"]["ok"]
    assert "as the release's configuration pins" in ran["ruff-check"]["tool"]
    assert ran["check-spdx-header"]["ok"] and ran["check-forbidden-imports"]["ok"]
    patch = (out / f"0001-{CHANGE}.patch").read_text()
    assert "Subject: [PATCH] [Bugfix][KVConnector]" in patch
    assert "Signed-off-by: Ada Lovelace <ada@example.org>" in patch
    assert "vllm-overlay" not in patch.lower() and "VLLM_OVERLAY_TREE" not in patch
    body = (out / "pull-request.md").read_text()
    assert "## Validation" in body and "## Overview" in body  # the release's own template
