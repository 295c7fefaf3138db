"""The test build of our CPU wheel (``build --test-build``): vllm-cpu compiled with this
machine's one extension and no oneDNN, for the engine tests in CI. Which extension a machine
gets, which of the series' changes each build carries (overlay.toml `builds`: the synthetic
project's build-only changes, laid out as the real series has them; the real series' own in
tests/integration/test_cpu_test_build_real.py), the whole driver on the synthetic upstream (no
compiler runs), and publish refusing what it makes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fixtures_build import build_args, members
from fixtures_cpusource import (
    built_with,
    cpu_args,
    needs_test_build,
    needs_tools,
)
from vllm_overlay.pin.artifacts import cached_path
from vllm_overlay.pin.debian import as_artifact
from vllm_overlay.pin.lockfile import read_lock
from vllm_overlay.wheel.cpufacts import machine_target
from vllm_overlay.wheel.provenance import read_from_wheel

HERE = machine_target()
on_x86 = pytest.mark.skipif(
    HERE is None, reason="this machine shows no AVX2 (not an x86 build machine)"
)


def _flags(*flags: str) -> str:
    return f"processor\t: 0\nflags\t\t: fpu sse2 {' '.join(flags)}\n\nprocessor\t: 1\n"


def test_each_machine_gets_the_extension_vllm_imports_there():
    """CpuPlatform.import_kernels: _C where torch sees AVX512 (F, VL, BW, DQ) and AVX512-BF16,
    _C_AVX512 with AVX512 alone, else _C_AVX2."""
    avx512 = ("avx2", "avx512f", "avx512vl", "avx512bw", "avx512dq")
    assert machine_target(_flags(*avx512, "avx512_bf16", "avx512_vnni", "amx_tile")) == "_C"
    assert machine_target(_flags(*avx512, "avx512_bf16")) == "_C"  # AMD Zen 4: no AMX
    assert machine_target(_flags(*avx512)) == "_C_AVX512"
    assert machine_target(_flags("avx2", "avx512f", "avx512bw", "avx512dq")) == "_C_AVX2"  # no VL
    assert machine_target(_flags("avx", "avx2", "fma")) == "_C_AVX2"
    assert machine_target(_flags("avx")) is None
    assert machine_target("") is None


def test_each_build_carries_the_changes_of_its_scope_and_the_cuda_wheels_stay_repack(
    cpu_project, cli, tmp_path
):
    """The build-only changes are in the series (apply, export and the walk see them) but only
    their builds carry them: the CUDA wheels are still a repack, the full CPU build carries the
    cpu-source changes, the test build those and the cpu-test one."""
    out = tmp_path / "dist"
    cuda = cli(*build_args(cpu_project, out, "--dry-run", variant="vllm"), cwd=cpu_project.root)
    assert cuda.rc == 0, cuda.err
    assert "strategy: repack (every changed path is Python the official wheel carries" in cuda.out
    assert "pyproject.toml" not in cuda.out and "cmake/" not in cuda.out
    full = cli(*cpu_args(cpu_project, out, "--dry-run"), cwd=cpu_project.root)
    assert full.rc == 0, full.err
    said = full.out[full.out.index("changes of the cpu-source build") :]
    said = said[: said.index("cmake arguments:")]
    assert "vllm-cpu-project" in said and "cpu-gcc-12-2" in said and "cpu-test-build" not in said
    assert "-DVLLM_OVERLAY_CPU_EXTENSION" not in full.out
    if HERE is not None:
        test = cli(*cpu_args(cpu_project, out, "--test-build", "--dry-run"), cwd=cpu_project.root)
        assert test.rc == 0, test.err
        assert "  cpu-test-build: The synthetic cpu-test-build" in test.out
        assert f"-DVLLM_OVERLAY_CPU_EXTENSION={HERE}" in test.out


@needs_test_build
@needs_tools
def test_a_test_build_is_this_machines_extension_without_onednn_and_never_published(
    cpu_project, cli, tmp_path
):
    # a test build needs no oneDNN: the cached tarball goes, and the build does not miss it
    onednn = read_lock(cpu_project.lock).sources[0].inputs[0]
    cached_path(as_artifact(onednn)).unlink()
    dry = cli(*cpu_args(cpu_project, tmp_path / "dist", "--test-build", "--dry-run"),
              cwd=cpu_project.root)  # fmt: skip
    assert dry.rc == 0, dry.err
    assert f"compiles: a test build of vllm-cpu: the {HERE} extension only" in dry.out
    assert "  oneDNN:      none (a test build)" in dry.out and "FETCHCONTENT" not in dry.out
    assert re.search(r"^version:  1\.0\.0\+ovl\.1\.g[0-9a-f]{8}\.test ", dry.out, re.M)

    res = cli(*cpu_args(cpu_project, tmp_path / "dist", "--test-build"), cwd=cpu_project.root)
    assert res.rc == 0, res.err
    wheel = Path(res.out.splitlines()[-1])
    assert re.match(r"vllm_cpu-1\.0\.0\+ovl\.1\.g[0-9a-f]{8}\.test-", wheel.name)
    # said before it starts: what it compiles, roughly how long, where the log is
    log = cpu_project.root / ".work" / "build" / "logs" / "source-cpu-test.log"
    assert re.search(rf"compiling a test build of vllm-cpu: the {HERE} extension only .*: about "
                     rf"\d+ min cold on \d+ cores?, .*; log: {re.escape(str(log))}", res.err)  # fmt: skip
    assert "export VLLM_TARGET_DEVICE=cpu" in log.read_text()
    got = members(wheel)
    assert sorted(n for n in got if re.match(r"vllm/_C.*\.so$", n)) == [f"vllm/{HERE}.abi3.so"]
    assert built_with(got[f"vllm/{HERE}.abi3.so"]) == (
        f"{HERE} built with no oneDNN; oneDNN ops: False; torch/all.h: 0"
    )
    assert wheel.name.endswith("-cp38-abi3-linux_x86_64.whl")  # no manylinux claim: not shipped
    settings = read_from_wheel(wheel)["build_settings"]
    assert settings["test_build"] is True and settings["extension"] == HERE
    assert settings["inputs"] == [] and settings["build"] == "cpu-test"
    assert settings["cmake_args"][-1].startswith(f"-DVLLM_OVERLAY_CPU_EXTENSION={HERE}: only ")
    carried = [c["id"] for c in read_from_wheel(wheel)["changes"]]
    assert carried[-3:] == ["vllm-cpu-project", "cpu-gcc-12-2", "cpu-test-build"]
    assert (cpu_project.root / ".work/build/source-cpu-test/vllm").is_dir()
    assert not (cpu_project.root / ".work/build/source-cpu").exists()  # the full build's own

    index = tmp_path / "index"
    pub = cli("publish", wheel, "--to", index, cwd=cpu_project.root)
    assert pub.rc == 1 and "refusing to publish test builds" in pub.err
    assert f"{wheel.name}: its provenance records a test build" in pub.err
    assert "Nothing was published" in pub.err and not index.exists()
    verify = cli("verify", wheel, cwd=cpu_project.root)
    assert verify.rc == 0, verify.err


def test_a_test_build_is_of_vllm_cpu_alone(cpu_project, cli, tmp_path):
    res = cli("build", "--test-build", "--variant", "vllm", "--out", tmp_path / "d",
              "--index-url", cpu_project.index.url, cwd=cpu_project.root)  # fmt: skip
    assert res.rc == 2 and "--test-build compiles vllm-cpu only" in res.err, res.err


def test_the_label_alone_marks_a_test_build(tmp_path):
    """A wheel whose provenance record is gone is still refused by its version's label."""
    import zipfile

    from vllm_overlay.wheel.provenance import test_build_of

    for version, marked in (("1.0.0+ovl.1.gabcdef12.test", True),
                            ("1.0.0+ovl.1.gabcdef12.src", False),
                            ("1.0.0+ovl.1.gtest0000", False)):  # fmt: skip
        path = tmp_path / f"vllm_cpu-{version}-cp38-abi3-linux_x86_64.whl"
        with zipfile.ZipFile(path, "w") as zf:
            zf.writestr(f"vllm_cpu-{version}.dist-info/METADATA", f"Version: {version}\n")
        why = test_build_of(path)
        assert bool(why) == marked, (version, why)
        assert not marked or "local label" in why
