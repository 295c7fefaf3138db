"""The pieces under `build`: raw zip copying, versions, metadata edits, strategy choice."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from vllm_overlay.errors import BuildError, LockFileError
from vllm_overlay.pin.lockfile import Artifact
from vllm_overlay.wheel.metadata import (
    local_label,
    overlay_version,
    set_metadata_version,
    set_version_py,
    version_py_version,
)
from vllm_overlay.wheel.provenance import ChangedFile
from vllm_overlay.wheel.strategy import choose_strategy, classify
from vllm_overlay.wheel.zipcopy import ZipWriter
from vllm_overlay.wheel.zipread import locate_members

DT = (2026, 1, 1, 0, 0, 0)


def _source_zip(path: Path) -> dict[str, bytes]:
    """A zip with deflated, stored, UTF-8-named and data-descriptor members."""
    content = {
        "a/deflated.py": b"print('hello')\n" * 200,
        "a/stored.bin": bytes(range(256)) * 4,
        "a/naïve.txt": "ünïcode name\n".encode(),
    }
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(
            zipfile.ZipInfo("a/deflated.py", DT), content["a/deflated.py"], zipfile.ZIP_DEFLATED
        )
        zf.writestr(
            zipfile.ZipInfo("a/stored.bin", DT), content["a/stored.bin"], zipfile.ZIP_STORED
        )
        zf.writestr(
            zipfile.ZipInfo("a/naïve.txt", DT), content["a/naïve.txt"], zipfile.ZIP_DEFLATED
        )
    # zipfile writing to an unseekable stream uses data descriptors (flag bit 3)
    buf = io.BytesIO()

    class Unseekable(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            return buf.write(b)

    with zipfile.ZipFile(Unseekable(), "w", zipfile.ZIP_DEFLATED) as zf:
        with zf.open(zipfile.ZipInfo("b/streamed.txt", DT), "w") as f:
            f.write(b"streamed " * 100)
    content["b/streamed.txt"] = b"streamed " * 100
    streamed = path.with_suffix(".streamed.zip")
    streamed.write_bytes(buf.getvalue())
    return content


@pytest.mark.parametrize("force_zip64", [False, True])
def test_copied_members_read_back_identically(tmp_path, force_zip64):
    src = tmp_path / "src.zip"
    content = _source_zip(src)
    streamed = src.with_suffix(".streamed.zip")
    out = tmp_path / "out.zip"
    with open(src, "rb") as fa, open(streamed, "rb") as fb, open(out, "wb") as fo:
        with ZipWriter(fo, force_zip64=force_zip64) as zw:
            for m in locate_members(src):
                zw.copy(fa, m)
            (dd,) = locate_members(streamed)
            assert dd.info.flag_bits & 0x8 and not dd.raw_header_ok
            zw.copy(fb, dd)
            zw.copy(fa, locate_members(src)[0], rename="c/renamed.py")
            zw.add("c/new.txt", b"new\n", date_time=DT, mode=0o100755)
    with zipfile.ZipFile(out) as zf:
        assert zf.testzip() is None
        assert zf.namelist() == [*content, "c/renamed.py", "c/new.txt"]
        for name, data in content.items():
            assert zf.read(name) == data
        assert zf.read("c/renamed.py") == content["a/deflated.py"]
        assert zf.getinfo("c/new.txt").external_attr >> 16 == 0o100755
        assert zf.getinfo("a/stored.bin").compress_type == zipfile.ZIP_STORED
    # the copies are the source's compressed bytes
    got = {m.name: m for m in locate_members(out)}
    with open(src, "rb") as fa, open(out, "rb") as fo:
        for m in locate_members(src):
            fa.seek(m.data_offset)
            fo.seek(got[m.name].data_offset)
            assert fa.read(m.info.compress_size) == fo.read(got[m.name].info.compress_size)
    assert (out.read_bytes()[-22:-20] == b"PK") and (
        b"PK\x06\x06" in out.read_bytes()
    ) == force_zip64


def test_writer_is_deterministic_and_refuses_duplicates(tmp_path):
    def write(path: Path) -> bytes:
        with open(path, "wb") as f, ZipWriter(f) as zw:
            zw.add("x.py", b"x = 1\n", date_time=DT)
            zw.add("y.py", b"y = 2\n", date_time=DT)
        return path.read_bytes()

    assert write(tmp_path / "1.zip") == write(tmp_path / "2.zip")
    with open(tmp_path / "3.zip", "wb") as f, pytest.raises(BuildError, match="written twice"):
        with ZipWriter(f) as zw:
            zw.add("x.py", b"", date_time=DT)
            zw.add("x.py", b"", date_time=DT)


def test_version_label_orders_by_revision_and_keeps_the_release():
    v9 = Version(overlay_version("0.24.0", local_label(9, "ffffffff" * 8)))
    v10 = Version(overlay_version("0.24.0", local_label(10, "00000000" * 8)))
    assert str(v10) == "0.24.0+ovl.10.g00000000"  # written as given, no digits dropped
    assert Version("0.24.0") < v9 < v10
    assert all(v in SpecifierSet("==0.24.0") for v in (v9, v10))
    assert overlay_version("0.24.0+cu130", "ovl.1.gabcdef01") == "0.24.0+cu130.ovl.1.gabcdef01"
    with pytest.raises(BuildError):
        local_label(0, "ab" * 32)


def test_metadata_edit_changes_only_the_version():
    meta = (
        b"Metadata-Version: 2.4\nName: vllm\nVersion: 1.0.0\nRequires-Dist: torch==2.11.0\n"
        b"Description-Content-Type: text/markdown\n\n# vLLM\nVersion: 1.0.0 in the body stays\n"
    )
    out = set_metadata_version(meta, "1.0.0+ovl.1.gabcdef01", "METADATA")
    assert out == meta.replace(
        b"Version: 1.0.0\nRequires", b"Version: 1.0.0+ovl.1.gabcdef01\nRequires"
    )
    with pytest.raises(BuildError, match="one 'Version:' header"):
        set_metadata_version(b"Name: vllm\n\n", "1", "METADATA")


def test_version_py_keeps_its_other_lines():
    src = (
        b"# file generated by vcs-versioning\n__version__ = version = '0.24.0'\n"
        b"__version_tuple__ = version_tuple = (0, 24, 0)\n\n__commit_id__ = commit_id = 'gee0da84ab'\n"
    )
    out = set_version_py(src, "0.24.0+ovl.3.gabcdef01")
    assert out == (
        b"# file generated by vcs-versioning\n__version__ = version = '0.24.0+ovl.3.gabcdef01'\n"
        b"__version_tuple__ = version_tuple = (0, 24, 0, 'ovl.3.gabcdef01')\n\n"
        b"__commit_id__ = commit_id = 'gee0da84ab'\n"
    )
    assert version_py_version(out) == "0.24.0+ovl.3.gabcdef01"
    assert set_version_py(out, "0.24.0") == src
    with pytest.raises(BuildError, match="expected one"):
        set_version_py(b"VERSION = '1'\n", "2")


def _files(*paths: tuple[str, str]) -> tuple[list[ChangedFile], dict[str, str]]:
    files = [
        ChangedFile("c", p, kind, "0" * 64, "0" * 64, b"", p.startswith("vllm/"))
        for p, kind in paths
    ]
    return files, {f.path: classify(f.path, "vllm", added=f.kind == "added") for f in files}


WHEEL = Artifact("wheel", "vllm-1.0.0-cp38-abi3-manylinux_2_28_x86_64.whl", "0" * 64, 1, "vllm")


def test_classify_paths():
    assert classify("vllm/a.py", "vllm", added=False) == "package"
    assert classify("vllm/configs/x.json", "vllm", added=False) == "package"
    assert classify("vllm/configs/x.json", "vllm", added=True) == "package-data"
    assert classify("tests/test_x.py", "vllm", added=True) == "not-shipped"
    for p in ("csrc/attention.cu", "cmake/utils.cmake", "CMakeLists.txt", "rust/src/lib.rs"):
        assert classify(p, "vllm", added=False) == "compiled"
    for p in ("setup.py", "pyproject.toml", "requirements/cuda.txt", "README.md"):
        assert classify(p, "vllm", added=False) == "build"


def test_auto_picks_repack_precompiled_or_source_and_says_why():
    files, cls = _files(("vllm/a.py", "patch"), ("tests/t.py", "added"))
    c = choose_strategy("auto", files, cls, WHEEL, "manylinux_2_28_x86_64")
    assert c.strategy == "repack" and "vllm/a.py" in c.reason and "tests/t.py" in c.reason
    files, cls = _files(("vllm/a.py", "patch"), ("requirements/cuda.txt", "patch"))
    c = choose_strategy("auto", files, cls, WHEEL, "manylinux_2_28_x86_64")
    assert c.strategy == "precompiled" and "requirements/cuda.txt" in c.reason
    files, cls = _files(("vllm/a.py", "patch"), ("csrc/ops.cu", "patch"))
    c = choose_strategy("auto", files, cls, WHEEL, "manylinux_2_28_x86_64")
    assert c.strategy == "source" and "csrc/ops.cu" in c.reason
    files, cls = _files(("vllm/a.py", "patch"))
    c = choose_strategy("auto", files, cls, None, "manylinux_2_28_aarch64")
    assert c.strategy == "source" and "manylinux_2_28_aarch64" in c.reason


def test_explicit_strategies_refuse_what_they_cannot_carry():
    files, cls = _files(("csrc/ops.cu", "patch"))
    for s in ("repack", "precompiled"):
        with pytest.raises(BuildError, match="compiled code"):
            choose_strategy(s, files, cls, WHEEL, "x")
    assert choose_strategy("source", files, cls, WHEEL, "x").strategy == "source"
    files, cls = _files(("setup.py", "patch"))
    with pytest.raises(BuildError, match="Use --strategy precompiled"):
        choose_strategy("repack", files, cls, WHEEL, "x")
    files, cls = _files(("vllm/a.py", "patch"))
    with pytest.raises(LockFileError, match="pins no official wheel"):
        choose_strategy("repack", files, cls, None, "x")


def test_place_links_copies_across_devices_and_never_replaces(tmp_path, monkeypatch):
    import errno
    import os

    from vllm_overlay.wheel import output as wheelbuild

    plan = {"build_key": "k"}  # the provenance of the wheel being placed
    src = tmp_path / "src.whl"
    src.write_bytes(b"wheel bytes")
    dest = tmp_path / "dist" / "x.whl"
    assert wheelbuild.place(src, dest, plan) is True
    assert os.stat(dest).st_ino == os.stat(src).st_ino  # same filesystem: a hard link
    assert wheelbuild.place(src, dest, plan) is False  # identical: nothing to do

    real_link = os.link
    calls = []

    def cross_device(a, b):
        calls.append(a)
        if len(calls) == 1:
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_link(a, b)

    monkeypatch.setattr(os, "link", cross_device)  # util.link_new, under place
    other = tmp_path / "other" / "x.whl"
    assert wheelbuild.place(src, other, plan) is True
    assert other.read_bytes() == b"wheel bytes" and os.stat(other).st_ino != os.stat(src).st_ino
    assert sorted(p.name for p in other.parent.iterdir()) == ["x.whl"]  # no .partial left

    dest.unlink()
    dest.write_bytes(b"another wheel")
    with pytest.raises(BuildError, match="never overwritten"):
        wheelbuild.place(src, dest, plan)
    assert dest.read_bytes() == b"another wheel"
