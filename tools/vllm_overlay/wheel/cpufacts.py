"""What our CPU source build reads of the machine and of vLLM's tree; it edits nothing.

Every edit of vLLM's files the CPU build needs is an overlay change scoped to the builds it
applies to (``builds`` in overlay/overlay.toml, docs/overlay.md): ``vllm-cpu-project``,
``vllm-cpu-torch-from-the-index`` and ``cpu-gcc-12-2`` for every vllm-cpu source build,
``cpu-test-build-no-onednn``, ``cpu-test-build-light-headers`` and
``cpu-test-build-one-extension`` for the test build. What stays here is what is not an edit:

- ``machine_target``: the extension vLLM imports on this machine (the test build passes it to
  CMake as ``-DVLLM_OVERLAY_CPU_EXTENSION=<target>``, a variable the one-extension change adds);
- ``outside_requirements``: what the tree names by URL in ``requirements/cpu.txt`` (the
  ``vllm-cpu-project`` change drops those lines; a user installs them beside the wheel);
- ``refuses_x86_without_triton``: whether vLLM stops on x86 without Triton's CPU backend;
- ``gnu_version``: the GCC version of a compiler's ``--version`` line.
"""

from __future__ import annotations

import re
from pathlib import Path

from packaging.version import InvalidVersion, Version

CPU_REQUIREMENTS = "requirements/cpu.txt"
URL_REQ = re.compile(r"^\s*[A-Za-z0-9_.\-\[\],\s]+@\s*\S+://")

# What CpuPlatform.import_kernels imports on x86, by the CPU's features (torch.cpu's
# _is_avx512_supported, then _is_avx512_bf16_supported): AVX512F+BF16 (VNNI and AMX code in
# it too), AVX512F, else AVX2.
X86_TARGETS = ("_C", "_C_AVX512", "_C_AVX2")
# The CMake cache variable the cpu-test-build-one-extension change adds: the one x86
# extension to compile (the test build passes it through CMAKE_ARGS).
EXTENSION_VAR = "VLLM_OVERLAY_CPU_EXTENSION"


# vLLM 0.34.0's CpuPlatform.check_and_update_config, on x86 without Triton's CPU backend.
TRITON_REFUSAL = "vLLM on x86 CPUs requires Triton (triton-cpu)."
CPU_PLATFORM = "vllm/platforms/cpu.py"


def refuses_x86_without_triton(cpu_platform: str | None) -> bool:
    """Whether vLLM's ``vllm/platforms/cpu.py`` (its text) stops on x86 without Triton."""
    return bool(cpu_platform) and TRITON_REFUSAL.rstrip(".") in (cpu_platform or "")


def outside_requirements(cpu_requirements: str | None) -> list[str]:
    """The requirements of ``requirements/cpu.txt`` that name a URL (the ``vllm-cpu-project``
    change drops them), as ``name==version`` where the URL names a wheel (vLLM's triton-cpu:
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
