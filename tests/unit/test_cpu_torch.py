"""The CPU build against the index's torch (its CUDA build): when, and what it changes.

The real torch package and CMake are exercised by tests/integration/test_cpu_torch_real.py;
these are the decisions around it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from vllm_overlay.errors import BuildError
from vllm_overlay.pin.lockfile import SourceBuild, SourceInput
from vllm_overlay.util import sha256_file
from vllm_overlay.wheel import cputorch
from vllm_overlay.wheel.cpusource import CpuSourceBuild

GCC = "c++ (Debian 12.2.0-14+deb12u1) 12.2.0"
# The torch lines of vLLM 0.33.0's requirements/cpu.txt (requirements/build/cpu.txt has the same).
CPU_REQS = (
    'torch==2.14.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x" or '
    'platform_machine == "aarch64"\n'
    'torch==2.14.0; platform_system == "Darwin" or platform_machine == "ppc64le"\n'
    'torchaudio; platform_machine != "s390x"\n'
)
# a pin that is not in the cache: preflight then asks for apt-get, which says nothing of torch
ONEDNN = SourceInput("onednn", "onednn", "3.7.2+ds-2", "trixie", "onednn_3.7.2+ds.orig.tar.xz",
                     "0" * 64, 1)  # fmt: skip


def test_the_index_torch_is_taken_for_the_cuda_build_only_where_constraints_pin_it(tmp_path):
    c = tmp_path / "build.txt"
    c.write_text("# header\ncmake==4.4.5\ntorch==2.14.0\ntriton==3.8.0\n")
    assert cputorch.is_cuda_torch(c)
    c.write_text("cmake==4.4.5\ntorch==2.13.0+cpu\n")
    assert not cputorch.is_cuda_torch(c)
    c.write_text("cmake==4.4.5\ntorchaudio==2.14.0\n")  # no torch pin at all
    assert not cputorch.is_cuda_torch(c)
    assert not cputorch.is_cuda_torch(tmp_path / "missing.txt")


def test_the_requirement_the_index_serves_is_what_preflight_checks():
    """The vllm-cpu-torch-from-the-index change makes the tree ask for torch==X (an overlay
    change: overlay/vllm-cpu-torch-from-the-index/); preflight reads a tree's requirement the
    same way, so a tree with or without the change is judged alike."""
    first = Requirement(cputorch.index_requirement(CPU_REQS).splitlines()[0])
    assert str(first.specifier) == "==2.14.0" and "x86_64" in str(first.marker)
    # the index's CUDA build and PyTorch's +cpu build both satisfy it
    assert first.specifier.contains("2.14.0+cu130") and first.specifier.contains("2.14.0+cpu")
    assert cputorch.index_requirement(str(first)) == str(first)  # already the index's


def _build(tmp_path: Path, pin: str) -> tuple[CpuSourceBuild, Path]:
    (tmp_path / "constraints").mkdir(exist_ok=True)
    c = tmp_path / "constraints" / "build-vllm-cpu-0.33.0.txt"
    c.write_text(f"cmake==4.4.5\n{pin}\n")
    sb = SourceBuild("vllm-cpu", "x86_64", "constraints/build-vllm-cpu-0.33.0.txt",
                     sha256_file(c), (ONEDNN,))  # fmt: skip
    return CpuSourceBuild(sb, GCC, cuda_torch=cputorch.is_cuda_torch(c)), c


def _torch_problems(build: CpuSourceBuild, root: Path, version: str, cuda: str | None) -> list[str]:
    reqs = [Requirement(CPU_REQS.splitlines()[0])]
    out = build.preflight(root=root, platform_tag="manylinux_2_28_x86_64", env={},
                          torch_version=version, torch_cuda=cuda, build_requirements=reqs,
                          machine="x86_64")  # fmt: skip
    return [p for p in out if "torch" in p]


def test_preflight_takes_the_cuda_torch_only_where_the_build_is_made_for_it(tmp_path):
    cuda, _ = _build(tmp_path, "torch==2.14.0")
    assert cuda.cuda_torch
    assert _torch_problems(cuda, tmp_path, "2.14.0+cu130", "13.0") == []
    wrong = _torch_problems(cuda, tmp_path, "2.13.0+cu130", "13.0")
    assert len(wrong) == 1 and "does not satisfy" in wrong[0]
    cpu, _ = _build(tmp_path, "torch==2.14.0+cpu")
    assert not cpu.cuda_torch
    refused = _torch_problems(cpu, tmp_path, "2.14.0+cu130", "13.0")
    assert any("is a CUDA build" in p for p in refused)
    assert _torch_problems(cpu, tmp_path, "2.14.0+cpu", None) == []


def test_the_cmake_run_and_the_record_follow_the_torch_build(tmp_path):
    cuda, _ = _build(tmp_path, "torch==2.14.0")
    root = tmp_path / "root"
    cmd = cuda.command(python="/env/bin/python", tree=tmp_path, dist_dir=tmp_path,
                       version="0.33.0+ovl.1.gabc.src", root=root)  # fmt: skip
    assert cmd.env["CMAKE_ARGS"] == f"-DTorch_DIR={root / cputorch.TORCH_DIR}"
    assert "CMAKE_ARGS" not in cmd.unset
    assert cuda.key_settings()["cmake_args"] == [cputorch.CMAKE_ARG]
    cpu, _ = _build(tmp_path, "torch==2.13.0+cpu")
    cmd = cpu.command(python="/env/bin/python", tree=tmp_path, dist_dir=tmp_path,
                      version="0.32.0+ovl.1.gabc.src", root=root)  # fmt: skip
    assert "CMAKE_ARGS" not in cmd.env and "CMAKE_ARGS" in cmd.unset
    # a +cpu build passes no CMake argument; the build's changes are the overlay's
    assert cpu.key_settings()["cmake_args"] == [] and cpu.key_settings()["build"] == "cpu-source"
    test = replace(cuda, test_target="_C_AVX2")
    cmd = test.command(python="/env/bin/python", tree=tmp_path, dist_dir=tmp_path,
                       version="0.33.0+ovl.1.gabc.test", root=root)  # fmt: skip
    assert cmd.env["CMAKE_ARGS"] == (f"-DTorch_DIR={root / cputorch.TORCH_DIR} "
                                     "-DVLLM_OVERLAY_CPU_EXTENSION=_C_AVX2")  # fmt: skip
    assert test.key_settings()["build"] == "cpu-test"


def test_our_torch_config_includes_torchs_own_through_the_env_link(tmp_path):
    root = tmp_path / "root"
    real = tmp_path / "venv" / "lib" / "python3.11" / "site-packages" / "torch" / "share"
    (real / "cmake" / "Torch").mkdir(parents=True)
    root.mkdir()
    (root / "env").symlink_to(tmp_path / "venv")
    out = cputorch.write_config(root)
    text = (out / "TorchConfig.cmake").read_text()
    want = root / "env/lib/python3.11/site-packages/torch/share/cmake/Torch/TorchConfig.cmake"
    assert f'include("{want}")' in text  # the link's path: the same at every build
    (root / "env").unlink()
    (root / "env").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(BuildError, match="no torch CMake package"):
        cputorch.write_config(root)
