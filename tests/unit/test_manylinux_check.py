"""verify's manylinux check reads `auditwheel show`, which knows nothing of what repair chose:
it said linux_x86_64 for the full build at 0.34.0 (the grafted libnuma's versioned symbols,
and torch's libraries left outside), whose symbols allow manylinux_2_34. Anything else outside
the policy still fails the check. The text is auditwheel 6.8.2's on that wheel."""

from __future__ import annotations

from pathlib import Path

from vllm_overlay.wheel import manylinux

REAL = (Path(__file__).parent / "data_auditwheel_show.txt").read_text()
GRAFTED = {"libnuma-bb2bb925.so.1.0.0"}
REQUIRED = "\nThe following external shared libraries are required by the wheel:\n{{\n    {}\n}}\n"


def test_the_real_repaired_wheel_has_the_tag_its_symbols_allow():
    assert manylinux.as_repaired("linux_x86_64", REAL, GRAFTED) == "manylinux_2_34_x86_64"


def test_torch_libraries_outside_keep_that_tag():
    text = REAL + REQUIRED.format('"libc10.so": null,\n    "libtorch_cpu.so": null')
    assert manylinux.as_repaired("linux_x86_64", text, GRAFTED) == "manylinux_2_34_x86_64"


def test_a_library_neither_grafted_nor_torchs_keeps_linux():
    assert manylinux.as_repaired("linux_x86_64", REAL, set()) == "linux_x86_64"  # libnuma's own
    text = REAL + REQUIRED.format('"libfoo.so.1": "/usr/lib/libfoo.so.1"')
    assert manylinux.as_repaired("linux_x86_64", text, GRAFTED) == "linux_x86_64"


def test_a_consistent_tag_is_what_auditwheel_said():
    assert manylinux.as_repaired("manylinux_2_28_x86_64", REAL, set()) == "manylinux_2_28_x86_64"


def test_the_policy_libraries_are_auditwheels_own():
    libs = manylinux.policy_libs("manylinux_2_34_x86_64")
    assert {"libc.so.6", "libstdc++.so.6", "ld-linux-x86-64.so.2"} <= libs
    assert "libnuma.so.1" not in libs
    assert manylinux.policy_libs("manylinux2014_x86_64") >= {"libc.so.6"}  # an alias
    assert manylinux.policy_libs("linux_x86_64") == frozenset()
