"""The test build of our CPU wheel (``build --test-build``): vllm-cpu compiled with this
machine's one extension and no oneDNN, for the engine tests in CI. Its edits on vLLM's layout
(the synthetic CPU project's, laid out as 0.32.0 to 0.34.0 have them; the real release's in
tests/integration/test_cpu_test_build_real.py), which extension a machine gets, the whole
driver on the synthetic upstream (no compiler runs), and publish refusing what it makes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fixtures_build import members
from fixtures_cpusource import (
    CPU_EXTENSION_CMAKE,
    CPU_TYPES,
    TORCH_BINDINGS,
    built_with,
    cpu_args,
    needs_test_build,
    needs_tools,
)
from vllm_overlay.errors import BuildError
from vllm_overlay.pin.artifacts import cached_path
from vllm_overlay.pin.debian import as_artifact
from vllm_overlay.pin.lockfile import read_lock
from vllm_overlay.wheel import cpuedits
from vllm_overlay.wheel.cpuedits import X86_TARGETS, edit_tree, machine_target
from vllm_overlay.wheel.provenance import read_from_wheel

GCC = "c++ (Debian 12.2.0-14+deb12u1) 12.2.0"
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


def _tree(root: Path) -> Path:
    for rel, text in (("cmake/cpu_extension.cmake", CPU_EXTENSION_CMAKE),
                      ("csrc/cpu/torch_bindings.cpp", TORCH_BINDINGS),
                      ("csrc/cpu/cpu_types.hpp", CPU_TYPES),
                      ("pyproject.toml", '[project]\nname = "vllm"\n'),
                      ("vllm/platforms/__init__.py", _platforms())):  # fmt: skip
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def _platforms() -> str:
    from fixtures_cpusource import PLATFORMS_PY

    return PLATFORMS_PY


@pytest.mark.parametrize("target", X86_TARGETS)
def test_a_test_build_compiles_one_extension_and_no_onednn(tmp_path, target):
    tree = _tree(tmp_path)
    edit_tree(tree, GCC, test_target=target)
    cmake = (tree / "cmake/cpu_extension.cmake").read_text()
    x86 = cmake[
        cmake.index("if (ENABLE_X86_ISA)\n") : cmake.index("else()\n    define_extension_target")
    ]
    assert re.findall(r"define_extension_target\(\s*(\w+)", x86) == [target]
    others = [t for t in X86_TARGETS if t != target]
    for other in others:  # setup.py asks for all three: the others build and install nothing
        assert f"add_custom_target({other})" in x86
    assert "if (FALSE)  # vllm-overlay test build: no oneDNN" in cmake
    assert "dnnl" not in x86 and "FetchContent_MakeAvailable(oneDNN)" in cmake  # inside if (FALSE)
    # AMX's definitions go with _C: on a custom target CMake would refuse them
    assert ("CPU_CAPABILITY_AMXBF16" in cmake) == (target == "_C")
    bindings = (tree / "csrc/cpu/torch_bindings.cpp").read_text()
    assert "#if 0  // vllm-overlay test build: no oneDNN" in bindings
    assert "release_dnnl_matmul_handler" in bindings  # left in place, compiled out
    assert (
        "#include <torch/types.h>\n#include <torch/library.h>\n"
        in (tree / "csrc/cpu/cpu_types.hpp").read_text()
    )
    recorded = cpuedits.tree_edits(GCC, test_target=target)
    assert cpuedits.NO_ONEDNN_EDIT in recorded and cpuedits.one_target_edit(target) in recorded
    assert cpuedits.LIGHT_HEADERS_EDIT in recorded


def test_the_full_build_makes_none_of_the_test_builds_edits(tmp_path):
    tree = _tree(tmp_path)
    edit_tree(tree, GCC)
    assert (tree / "cmake/cpu_extension.cmake").read_text() == CPU_EXTENSION_CMAKE.replace(
        "VERSION_GREATER_EQUAL 12.3", "VERSION_GREATER_EQUAL 12.2"
    )
    assert (tree / "csrc/cpu/torch_bindings.cpp").read_text() == TORCH_BINDINGS
    assert (tree / "csrc/cpu/cpu_types.hpp").read_text() == CPU_TYPES
    assert not set(cpuedits.tree_edits(GCC)) & {
        cpuedits.NO_ONEDNN_EDIT,
        cpuedits.LIGHT_HEADERS_EDIT,
    }


@pytest.mark.parametrize(
    "rel, old, new, said",
    [
        ("cmake/cpu_extension.cmake", "# Build oneDNN for GEMM kernels\n", "", "builds oneDNN"),
        (
            "cmake/cpu_extension.cmake",
            "set(_C_AVX2_LIBS numa dnnl_ext)",
            "set(_C_AVX2_LIBS numa)",
            "do not each link",
        ),
        (
            "cmake/cpu_extension.cmake",
            "        _C_AVX512\n",
            "        _C_AVX512F\n",
            "the first extensions defined are not",
        ),
        (
            "csrc/cpu/torch_bindings.cpp",
            "  // Quantization\n",
            "",
            "the oneDNN ops are not registered",
        ),
    ],
)
def test_a_tree_laid_out_otherwise_is_refused_naming_the_file(tmp_path, rel, old, new, said):
    tree = _tree(tmp_path)
    path = tree / rel
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))
    with pytest.raises(BuildError, match=re.escape(said)) as e:
        edit_tree(tree, GCC, test_target="_C_AVX2")
    assert str(path) in str(e.value) and "without --test-build" in str(e.value)


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
    assert settings["inputs"] == [] and cpuedits.NO_ONEDNN_EDIT in settings["tree_edits"]
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
