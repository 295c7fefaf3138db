"""verify's manylinux check reads `auditwheel show`, which knows nothing of repair's --exclude:
the wheel's torch libraries (from the torch it requires) made it say linux_x86_64 for the
full build at 0.34.0, whose symbols allow manylinux_2_34. Any other library outside the
policy still fails the check."""

from __future__ import annotations

from vllm_overlay.wheel import manylinux

SHOW = """\
vllm_cpu-0.34.0+ovl.15.g48c27d65.src-cp38-abi3-manylinux_2_34_x86_64.whl is
consistent with the following platform tag: "linux_x86_64".

The wheel references external versioned symbols in these
system-provided shared libraries: libc.so.6 with versions {{'GLIBC_2.34'}}

This constrains the platform tag to "manylinux_2_34_x86_64". In order
to achieve a more compatible tag, you would need to recompile a new
wheel from source on a system with earlier versions of these
libraries, such as a recent manylinux image.

The following external shared libraries are required by the wheel:
{{
    {libs}
}}
"""


def test_torch_libraries_alone_keep_the_tag_the_symbols_allow():
    libs = '"libc10.so": null,\n    "libtorch.so": null,\n    "libtorch_cpu.so": null'
    assert manylinux._with_torch_outside("linux_x86_64", SHOW.format(libs=libs)) == (
        "manylinux_2_34_x86_64"
    )


def test_another_outside_library_keeps_linux():
    libs = '"libc10.so": null,\n    "libnuma.so.1": "/usr/lib/x86_64-linux-gnu/libnuma.so.1"'
    assert manylinux._with_torch_outside("linux_x86_64", SHOW.format(libs=libs)) == "linux_x86_64"


def test_a_consistent_tag_is_what_auditwheel_said():
    assert (
        manylinux._with_torch_outside("manylinux_2_28_x86_64", SHOW.format(libs=""))
        == "manylinux_2_28_x86_64"
    )
