"""The precompiled and source strategies: the driver around vLLM's setup.py.

The synthetic upstream here carries a vLLM-like setup.py (fixtures_build.FAKE_SETUP_PY) and
the build environment's torch is a stub on PYTHONPATH that reports a CUDA version or none:
the driver's environment, preflight, output checks and post-processing run for real, in
seconds. test_build_real.py runs vLLM's own setup.py.
"""

from __future__ import annotations

import re

from fixtures_build import (
    FAKE_CMAKELISTS,
    build_args,
)
from packaging.requirements import Requirement
from vllm_overlay.wheel.preflight import Probe, check_environment, check_toolchain
from vllm_overlay.wheel.setupbuild import SourceSettings


def test_precompiled_refuses_a_cpu_torch_before_building(fproject, cli, tmp_path, cpu_torch):
    res = cli(
        *build_args(fproject, tmp_path / "dist", "--strategy", "precompiled"), cwd=fproject.root
    )
    assert res.rc == 1
    assert "preflight for --strategy precompiled failed; nothing was built" in res.err
    assert "torch 2.11.0+cpu" in res.err and "is not a CUDA build" in res.err
    assert "+cpu wheel" in res.err and "Traceback" not in res.err
    assert not (tmp_path / "dist").exists()
    assert not (fproject.root / ".work" / "build" / "logs").exists()


def test_source_dry_run_prints_the_exact_environment_and_command(
    fproject, cli, tmp_path, cuda_torch
):
    res = cli(
        *build_args(fproject, tmp_path / "dist", "--strategy", "source", "--dry-run"),
        "--cuda-arch-list", "9.0a 10.0a", "--max-jobs", "8", "--nvcc-threads", "2",
        "--launcher", "ccache", "--src-dir", f"cutlass={tmp_path}", "--src-dir", "msa=/nowhere",
        "--fetchcontent-dir", str(tmp_path / "deps"),
        cwd=fproject.root,
    )  # fmt: skip
    assert res.rc == 0, res.err
    out = res.out
    assert "strategy: source (requested" in out
    tree = fproject.root / ".work" / "build" / "source" / "vllm"
    for line in (
        f"cd {tree}",
        "export TORCH_CUDA_ARCH_LIST='9.0a 10.0a'",
        "export MAX_JOBS=8",
        "export NVCC_THREADS=2",
        "export CMAKE_BUILD_TYPE=Release",
        "export VLLM_DISABLE_SCCACHE=1",
        "export VLLM_TARGET_DEVICE=cuda",
        f"export VLLM_CUTLASS_SRC_DIR={tmp_path}",
        "export FMHA_SM100_SRC_DIR=/nowhere",
        f"export FETCHCONTENT_BASE_DIR={tmp_path / 'deps'}",
        "export SOURCE_DATE_EPOCH=315532800",
    ):
        assert line in out.splitlines(), line
    assert re.search(r"^export VLLM_VERSION_OVERRIDE=1\.0\.0\+ovl\.1\.g[0-9a-f]{8}$", out, re.M)
    assert re.search(r"setup\.py bdist_wheel --dist-dir=\S+ --py-limited-api=cp38$", out, re.M)
    assert "preflight problems:" in out and "--src-dir msa=/nowhere: not a directory." in out
    assert not tree.exists()  # a dry run makes nothing


def test_source_preflight_failure_is_one_clear_error(fproject, cli, tmp_path, cpu_torch):
    res = cli(*build_args(fproject, tmp_path / "dist", "--strategy", "source"), cwd=fproject.root)
    assert res.rc == 1
    assert "preflight for --strategy source failed; nothing was built" in res.err
    assert "is not a CUDA build" in res.err and "Traceback" not in res.err


def _probe(**kw) -> Probe:
    base = dict(
        python="3.11.7",
        include="/nonexistent",
        torch_version="2.11.0+cu130",
        torch_cuda="13.0",
        torch_error=None,
        packages={"setuptools": "77.0.3", "wheel": "0.45.1"},
    )
    return Probe(**{**base, **kw})


REQS = [Requirement("setuptools>=77.0.3,<81"), Requirement("wheel"), Requirement("torch==2.11.0")]


def test_environment_problems_name_the_fix():
    assert check_environment(_probe(), REQS, python="py") == []
    out = check_environment(_probe(torch_cuda=None), REQS, python="py")
    assert any("not a CUDA build" in p for p in out)
    out = check_environment(_probe(torch_version="2.10.0+cu130"), REQS, python="py")
    assert any("does not satisfy the tree's torch==2.11.0" in p for p in out)
    out = check_environment(
        _probe(torch_version=None, torch_error="ModuleNotFoundError"),
        REQS,
        python="py",
    )
    assert any("torch is not importable" in p for p in out)
    out = check_environment(_probe(packages={"setuptools": "81.0.0"}), REQS, python="py")
    assert any("setuptools 81.0.0 in py does not satisfy" in p for p in out)
    assert any("wheel is not installed in py" in p for p in out)
    assert any("pip install -r requirements/build/cuda.txt" in p for p in out)
    empty = check_environment(_probe(torch_cuda=None), REQS, python="py", target_device="empty")
    assert empty == []


def test_toolchain_problems(tmp_path):
    cuda = tmp_path / "cuda"
    (cuda / "include").mkdir(parents=True)
    (cuda / "include" / "cuda_runtime.h").write_text("")
    inc = tmp_path / "py"
    inc.mkdir()
    (inc / "Python.h").write_text("")

    def tools(nvcc: str | None, cmake: str | None):
        def version_of(argv, pattern):
            return nvcc if "nvcc" in argv[0] else cmake

        return version_of

    env = {"CUDA_HOME": str(cuda), "PATH": ""}
    ok = check_toolchain(
        _probe(include=str(inc)), SourceSettings(), cmakelists=FAKE_CMAKELISTS, env=env,
        version_of=tools("13.0", "3.31.6"),
    )  # fmt: skip
    assert ok == []
    bad = check_toolchain(
        _probe(include=str(tmp_path)), SourceSettings(launcher="sccache"),
        cmakelists=FAKE_CMAKELISTS, env={"CUDA_HOME": str(tmp_path), "PATH": ""},
        version_of=tools("12.8", "3.25.1"),
    )  # fmt: skip
    text = "\n".join(bad)
    assert "nvcc" in text and "CUDA 12.8 but torch 2.11.0+cu130 was built for CUDA 13.0" in text
    assert "cuda_runtime.h is missing" in text
    assert "Python.h is missing" in text
    assert "cmake 3.25.1 is older than the 3.26" in text
    assert "--launcher sccache: sccache is not on PATH" in text
    none = check_toolchain(
        _probe(include=str(inc)), SourceSettings(), cmakelists=FAKE_CMAKELISTS, env=env,
        version_of=tools(None, None),
    )  # fmt: skip
    assert any("nvcc was not found" in p for p in none)
    assert any("cmake is not on PATH" in p for p in none)
