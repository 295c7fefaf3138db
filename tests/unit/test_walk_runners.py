"""A change that serves only model runners a release deleted drops with them (vLLM 0.34.0
deleted Model Runner V1): on a synthetic upstream history (real git, sdists on an index on
loopback), the walk drops a V1-only change where V1's runner file is gone, the proof being
that tree (its tests are about V1's path and prove nothing there), and keeps a change that
also serves the runner that remains.
"""

from __future__ import annotations

import json

import pytest
from conftest import CID, pinned_project, run_cli
from synthetic import make_upstream, release_files
from vllm_overlay.overlay.model import RUNNER_FILES

V1, V2 = RUNNER_FILES["v1"], RUNNER_FILES["v2"]
RUNNERS = {V1: "class GPUModelRunner: ...\n", V2: "class GPUModelRunner: ...\n"}
HISTORY = {
    "1.0.0": {**release_files("1.0.0"), **RUNNERS},
    "1.0.1": {**release_files("1.0.0"), **RUNNERS, "vllm/other.py": "X = 1\n"},
    "1.1.0": {**release_files("1.0.0"), V2: RUNNERS[V2]},  # V1 deleted
}


@pytest.fixture(scope="module")
def upstream(tmp_path_factory):
    return make_upstream(tmp_path_factory.mktemp("runners"), trees=HISTORY)


def _serving(p, runners: list[str]) -> None:
    toml = p.root / "overlay" / "overlay.toml"
    text = toml.read_text()
    assert "\nrunners" not in text
    toml.write_text(text.rstrip("\n") + f"\nrunners = {json.dumps(runners)}\n")


def _rebase(p, version: str):
    commit = p.upstream.releases[version].commit
    return run_cli("rebase", "--to", version, "--commit", commit, "--index-url", p.index.url,
                   "--json", cwd=p.root)  # fmt: skip


def test_a_v1_only_change_drops_where_v1_is_gone_proven_by_the_tree(upstream, tmp_path):
    with pinned_project(upstream, tmp_path / "project") as p:
        _serving(p, ["v1"])
        res = _rebase(p, "1.1.0")
        assert res.rc == 0, res.err
        rep = json.loads(res.out)
        assert f"  {CID}: kept" in res.err.split("vllm 1.0.1 (1/2)")[1]  # V1 still there
        [d] = rep["dropped"]
        assert d["id"] == CID and d["release"] == "1.1.0"
        assert d["reason"] == (
            f"it serves Model Runner V1 only (runners), and vllm 1.1.0 has none: {V1} deleted"
        )
        assert d["proof"].startswith(f"vllm 1.1.0 has no Model Runner V1 ({V1} deleted)")
        assert "run the series without it on the runner that remains" in d["proof"]
        toml = (p.root / "overlay" / "overlay.toml").read_text()
        assert f'id = "{CID}"' in toml.split("[[dropped]]", 1)[1]  # recorded as dropped
        assert 'dropped_in = "1.1.0"' in toml and "has no Model Runner V1" in toml
        assert not (p.root / "overlay" / CID).exists()


def test_a_change_that_serves_the_runner_that_remains_is_kept(upstream, tmp_path):
    with pinned_project(upstream, tmp_path / "project") as p:
        _serving(p, ["v1", "v2"])
        res = _rebase(p, "1.1.0")
        assert res.rc == 0, res.err
        rep = json.loads(res.out)
        assert rep["dropped"] == [] and rep["stops"] == []
        assert (p.root / "overlay" / CID).is_dir()
