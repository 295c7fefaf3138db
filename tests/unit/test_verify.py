"""`vllm-overlay verify` and `vllm-overlay inspect` on built, tampered and stock wheels."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

from conftest import pip_install_target
from fixtures_build import build_args, last_line, members, rewrite_wheel
from synthetic import CONNECTOR
from vllm_overlay.wheel.provenance import read_from_wheel
from vllm_overlay.wheel.repack import RepackInput, repack


def build(project, cli, out: Path) -> Path:
    res = cli(*build_args(project, out), cwd=project.root)
    assert res.rc == 0, res.err
    return Path(last_line(res.out))


def verify(project, cli, wheel: Path, *extra: str):
    return cli("verify", str(wheel), "--index-url", project.index.url, *extra, cwd=project.root)


def test_verify_passes_on_a_built_wheel(project, cli, tmp_path):
    wheel = build(project, cli, tmp_path / "dist")
    res = verify(project, cli, wheel)
    assert res.rc == 0, res.err
    for check in ("zip", "record", "dist-info", "metadata", "provenance", "changes", "official"):
        assert f"ok  {check}\n" in res.out
    assert "ok  install" in res.out
    assert last_line(res.out) == f"{wheel}: verified ({wheel.name.split('-')[1]})"


def test_member_that_disagrees_with_record_is_named(project, cli, tmp_path):
    wheel = build(project, cli, tmp_path / "dist")
    bad = tmp_path / "bad" / wheel.name
    bad.parent.mkdir()
    rewrite_wheel(wheel, bad, replace={"vllm/__init__.py": b"import os\n"})
    res = verify(project, cli, bad)
    assert res.rc == 1
    assert "record: vllm/__init__.py: RECORD says sha256=" in res.err
    assert "the member has sha256=" in res.err and "size 10" in res.err
    assert "official: vllm/__init__.py: not byte-identical" in res.err
    assert "Traceback" not in res.err


def test_member_consistent_with_record_but_not_the_official_one_is_named(project, cli, tmp_path):
    wheel = build(project, cli, tmp_path / "dist")
    doc = read_from_wheel(wheel)
    official = project.upstream.releases["1.0.0"].wheel
    got = members(wheel)
    out = tmp_path / "bad"
    out.mkdir()
    forged = repack(
        RepackInput(
            official=official,
            version=doc["version"],
            replace={CONNECTOR: got[CONNECTOR], "vllm/__init__.py": b"# changed\n"},
            version_py=doc["version"],
            provenance=got[next(n for n in got if n.endswith("vllm_overlay.json"))],
        ),
        out,
    )
    res = verify(project, cli, forged, "--no-install")
    assert res.rc == 1
    assert (
        "official: vllm/__init__.py: not byte-identical to the official wheel's member" in res.err
    )
    assert "record:" not in res.err  # RECORD is consistent: only the identity check sees it


def test_changed_file_that_is_not_the_patched_trees_is_named(project, cli, tmp_path):
    wheel = build(project, cli, tmp_path / "dist")
    doc = read_from_wheel(wheel)
    got = members(wheel)
    out = tmp_path / "bad"
    out.mkdir()
    forged = repack(
        RepackInput(
            official=project.upstream.releases["1.0.0"].wheel,
            version=doc["version"],
            replace={CONNECTOR: b"# the wrong fix\n"},
            version_py=doc["version"],
            provenance=got[next(n for n in got if n.endswith("vllm_overlay.json"))],
        ),
        out,
    )
    res = verify(project, cli, forged, "--no-install")
    assert res.rc == 1
    assert f"changes: {CONNECTOR}: differs from the patched tree's file" in res.err


def test_file_name_version_must_match_metadata(project, cli, tmp_path):
    wheel = build(project, cli, tmp_path / "dist")
    renamed = tmp_path / "renamed" / wheel.name.replace("+ovl.1.", "+ovl.2.")
    renamed.parent.mkdir()
    shutil.copy(wheel, renamed)
    res = verify(project, cli, renamed, "--no-install")
    assert res.rc == 1
    assert "dist-info: vllm-1.0.0+ovl.1." in res.err and "expected vllm-1.0.0+ovl.2." in res.err


def test_wheel_of_an_older_overlay_is_reported(project, cli, tmp_path):
    wheel = build(project, cli, tmp_path / "dist")
    toml = project.overlay / "overlay.toml"
    toml.write_text("revision = 2\n" + toml.read_text())
    res = verify(project, cli, wheel, "--no-install")
    assert res.rc == 1
    assert "built from overlay digest" in res.err and "rebuild the wheel" in res.err


def test_not_a_zip_and_stock_wheels(project, cli, tmp_path):
    junk = tmp_path / "vllm-1.0.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    junk.write_bytes(b"not a zip")
    res = verify(project, cli, junk)
    assert res.rc == 1 and "zip: the archive cannot be read" in res.err
    stock = project.upstream.releases["1.0.0"].wheel
    res = verify(project, cli, stock, "--standalone")
    assert res.rc == 1
    assert "vllm_overlay.json is missing: this wheel was not built by vllm-overlay" in res.err


def test_verify_outside_a_project_checks_the_wheel_alone(project, cli, tmp_path):
    wheel = build(project, cli, tmp_path / "dist")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    res = cli("verify", str(wheel), "--no-install", cwd=elsewhere)
    assert res.rc == 0, res.err
    assert "checking the wheel on its own" in res.err
    assert "ok  changes" not in res.out and "ok  record" in res.out


def test_inspect_wheel_json_diff_and_installed(project, cli, tmp_path):
    wheel = build(project, cli, tmp_path / "dist")
    commit = project.upstream.releases["1.0.0"].commit
    res = cli("inspect", str(wheel), cwd=project.root)
    assert res.rc == 0, res.err
    assert f"commit {commit}" in res.out
    assert "group-block-size: Read the hidden-states block size" in res.out
    assert "strategy   repack" in res.out and f"patch {CONNECTOR}  (in wheel;" in res.out

    js = cli("inspect", str(wheel), "--json", cwd=project.root)
    assert js.rc == 0 and json.loads(js.out) == read_from_wheel(wheel)

    diff = cli("inspect", str(wheel), "--diff", "--index-url", project.index.url, cwd=project.root)
    assert diff.rc == 0, diff.err
    di = f"vllm-{wheel.name.split('-')[1]}.dist-info"
    for line in (
        f"changed  {CONNECTOR}",
        "changed  vllm/_version.py",
        f"changed  {di}/METADATA",
        f"added    {di}/vllm_overlay.json",
        f"renamed  vllm-1.0.0.dist-info/WHEEL -> {di}/WHEEL",
    ):
        assert line in diff.out

    target = tmp_path / "site"
    pip_install_target(wheel, target)
    inst = cli("inspect", "--installed", "--path", str(target), cwd=project.root)
    assert inst.rc == 0, inst.err
    assert inst.out == res.out


def test_inspect_refuses_stock_and_missing_installs(project, cli, tmp_path):
    stock = project.upstream.releases["1.0.0"].wheel
    res = cli("inspect", str(stock), cwd=project.root)
    assert res.rc == 1 and "not built by vllm-overlay" in res.err
    (tmp_path / "empty").mkdir()
    res = cli("inspect", "--installed", "--path", str(tmp_path / "empty"), cwd=project.root)
    assert res.rc == 1 and "no vLLM is installed in" in res.err
    res = cli("inspect", cwd=project.root)
    assert res.rc == 2


def test_verify_reads_every_crc(tmp_path):
    """A flipped byte inside a stored member's data is caught by the zip check."""
    from vllm_overlay.wheel.verify import member_hashes

    path = tmp_path / "x.zip"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("a.txt", b"hello world" * 10)
    data = bytearray(path.read_bytes())
    data[data.index(b"hello")] ^= 1
    path.write_bytes(bytes(data))
    (_, _, err) = member_hashes(path)["a.txt"]
    assert "CRC-32" in err
