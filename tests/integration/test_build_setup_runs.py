"""The precompiled and source drivers running a vLLM-like setup.py for real (a subprocess build
with the synthetic upstream and a stub torch on PYTHONPATH): the wheel, its reproducibility,
and what a CPU result or an empty target device gives. The drivers' checks on their own are
tests/unit/test_build_setup.py; vLLM's own setup.py is test_build_real.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fixtures_build import (
    build_args,
    last_line,
    members,
    reported_version,
    sha256,
)


def test_precompiled_runs_setup_py_with_the_official_kernels(fproject, cli, tmp_path, cuda_torch):
    res = cli(
        *build_args(fproject, tmp_path / "dist", "--strategy", "precompiled"), cwd=fproject.root
    )
    assert res.rc == 0, res.err
    wheel = Path(last_line(res.out))
    assert re.fullmatch(
        r"vllm-1\.0\.0\+ovl\.1\.g[0-9a-f]{8}-cp38-abi3-manylinux_2_28_x86_64\.whl", wheel.name
    )
    assert (
        "verified: zip, names, record, dist-info, metadata, provenance, changes, official, install"
        in res.err
    )
    got = members(wheel)
    official = members(fproject.upstream.releases["1.0.0"].wheel)
    assert got["vllm/_C.abi3.so"] == official["vllm/_C.abi3.so"]
    assert reported_version(wheel) == wheel.name.split("-")[1]
    assert not any(n.startswith("tests/") for n in got)
    doc = json.loads(next(d for n, d in got.items() if n.endswith("vllm_overlay.json")))
    assert doc["strategy"] == "precompiled"
    log = (fproject.root / ".work" / "build" / "logs" / "precompiled.log").read_text()
    assert "export VLLM_USE_PRECOMPILED=1" in log and "export VLLM_TARGET_DEVICE=cuda" in log
    assert "--py-limited-api=cp38" in log
    # vLLM's setup.py with SOURCE_DATE_EPOCH: the same inputs give the same bytes
    again = cli(
        *build_args(fproject, tmp_path / "again", "--strategy", "precompiled"), cwd=fproject.root
    )
    assert again.rc == 0, again.err
    assert sha256(Path(last_line(again.out))) == sha256(wheel)


def test_precompiled_keep_release_version(fproject, cli, tmp_path, cuda_torch):
    args = build_args(
        fproject, tmp_path / "dist", "--strategy", "precompiled", "--keep-release-version"
    )
    res = cli(*args, cwd=fproject.root)
    assert res.rc == 0, res.err
    wheel = Path(last_line(res.out))
    assert reported_version(wheel) == "1.0.0" and "+ovl.1." in wheel.name


def test_precompiled_refuses_a_cpu_result(fproject, cli, tmp_path, cuda_torch, monkeypatch):
    monkeypatch.setenv("FAKE_VLLM_FORCE_CPU", "1")
    res = cli(
        *build_args(fproject, tmp_path / "dist", "--strategy", "precompiled"), cwd=fproject.root
    )
    assert res.rc == 1
    assert "vLLM's setup.py built a CPU wheel" in res.err and "+cpu" in res.err
    assert "Nothing was written to the output directory" in res.err
    assert not (tmp_path / "dist").exists()
    assert not list((fproject.root / ".work" / "build").glob("tmp-*"))


def test_source_driver_with_target_device_empty(fproject, cli, tmp_path, cpu_torch):
    args = build_args(
        fproject, tmp_path / "dist", "--strategy", "source", "--target-device", "empty"
    )
    res = cli(*args, cwd=fproject.root)
    assert res.rc == 0, res.err
    wheel = Path(last_line(res.out))
    assert re.fullmatch(
        r"vllm-1\.0\.0\+ovl\.1\.g[0-9a-f]{8}\.empty-[^-]+-[^-]+-[^-]+\.whl", wheel.name
    )
    assert "vllm/_C.abi3.so" not in members(wheel)  # no kernels: a driver check only
    assert (
        "verified: zip, names, record, dist-info, metadata, provenance, changes, install" in res.err
    )
