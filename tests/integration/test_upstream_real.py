"""`vllm-overlay upstream` on our own fix at the real pinned release (network, cached): the
commit on vLLM's tree, vLLM's own hooks (ruff at the version its pre-commit configuration pins,
its local Python hooks), and the change's tests in the release's test environment, with the
commit (they pass) and without it (they fail). One to three minutes warm."""

from __future__ import annotations

import json
import re
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
    assistant = "Claude <noreply@anthropic.com>"
    res = run_cli("upstream", CHANGE, "--out", out, "--json", "--assisted-by", assistant, cwd=root)
    assert res.rc == 0, res.err[-4000:]
    rep = json.loads(res.out)
    assert rep["with"]["ok"] and rep["with"]["failed"] == 0
    assert rep["without"]["failed"] >= 1
    ran = {h["id"]: h for h in rep["hooks"] if h["ran"]}
    assert ran["ruff-check"]["ok"] and ran["ruff-format"]["ok"]
    assert "as the release's configuration pins" in ran["ruff-check"]["tool"]
    assert ran["check-spdx-header"]["ok"] and ran["check-forbidden-imports"]["ok"]
    # stacked on the change whose test harness (ConnectorSteps) and CPU copy path it needs
    assert [s["change"] for s in rep["stack"]] == ["hidden-states-connector-cpu-cache"]
    below = (out / "0001-hidden-states-connector-cpu-cache.patch").read_text()
    assert "+class ConnectorSteps:" in below and "Signed-off-by: Ada Lovelace" in below
    patch = (out / f"0002-{CHANGE}.patch").read_text()
    assert "+class ConnectorSteps:" not in patch  # its own commit alone
    assert "Subject: [PATCH] [Bugfix][KVConnector]" in patch
    assert "Signed-off-by: Ada Lovelace <ada@example.org>" in patch
    assert "vllm-overlay" not in patch.lower() and "VLLM_OVERLAY_TREE" not in patch
    assert f"Co-authored-by: {assistant}\nSigned-off-by: Ada Lovelace" in patch
    body = (out / "pull-request.md").read_text()
    assert "## Validation" in body and "## Overview" in body  # the release's own template
    # both commands and the output of each, from the proof
    test = "tests/v1/kv_connector/unit/test_hidden_states_connector.py"
    code = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
    docs = "docs/features/speculative_decoding/extract_hidden_states.md"
    assert f"git diff HEAD~1 -- {docs} {code} | git apply -R\n" in body
    assert f".venv/bin/python -m pytest -v {test}::test_request_aborted_during_its_prefill" in body
    assert "Stacked on [Bugfix][KVConnector] Hidden-states connector copies" in body
    assert "test_extraction.py::test_aborted_request_keeps_its_file_only_once" in body
    for failing in rep["without"]["failing"]:
        assert f"FAILED {failing} - " in body
    # pytest's last line; past a minute it adds the time as H:MM:SS ("in 75.32s (0:01:15)")
    took = r" in [\d.]+s( \(\d+:\d\d:\d\d\))?$"
    assert re.search(r"^\d+ failed, \d+ passed.*" + took, body, re.M)
    assert re.search(r"^\d+ passed.*" + took, body, re.M)
    # the CI step, as 0.34.0's misc.yaml has it, and what its triggers leave out
    assert ("`.buildkite/test_areas/misc.yaml`, step \":nvidia: (H200 MIG 35GB) V1 KV Connectors\" "
            "(`pytest -v -s -m 'not cpu_test' v1/kv_connector/unit`)") in body  # fmt: skip
    assert f"do not cover `{code}` (excluded by `!vllm/distributed/kv_transfer/`)" in body
    assert "### Not a duplicate" in body and "gh pr list --repo vllm-project/vllm" in body
    assert "AI assistance was used to prepare this change (Claude," in body
    assert "- [x] AI assistance was used during the creation of this PR." in body
    assert "vllm-overlay" not in body.lower()
    listed = (out / "checklist.md").read_text()
    verdict = {i["rule"]: i["verdict"] for i in rep["checklist"]}
    assert len(verdict) >= 14 and set(verdict.values()) <= {"yes", "no", "left for the person",
                                                            "n/a"}  # fmt: skip
    assert verdict["a CI step's commands and markers select each test"] == "yes"
    for rule, want in verdict.items():  # what the rework of its tests made true
        if rule.startswith(("tests extend the existing", "real objects", "no shims",
                            "a regression test through", "the docs of")):  # fmt: skip
            assert want == "yes", rule
    assert "docs/features/speculative_decoding/extract_hidden_states.md" in listed
    assert "heuristic" in listed and "## 1. tests pass with the commit" in listed
