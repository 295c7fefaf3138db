"""verify's install check: uv (or pip) really installs the wheel into a temporary directory,
and a wheel the installer refuses fails the check with the installer's reason."""

from __future__ import annotations

import base64
import hashlib
import os
import zipfile
from pathlib import Path

from fixtures_publish import make_wheel
from vllm_overlay.util import find_uv
from vllm_overlay.wheel.hashes import hashes_reusing_official, member_hashes
from vllm_overlay.wheel.installcheck import check_installed, install_command, installing
from vllm_overlay.wheel.metadata import parse_name


def _rewrite(wheel: Path, member: str, old: bytes, new: bytes) -> None:
    """Change one member and keep RECORD right, so only the installer can object."""
    with zipfile.ZipFile(wheel) as zf:
        members = {i.filename: zf.read(i) for i in zf.infolist()}
    members[member] = members[member].replace(old, new)
    record = next(n for n in members if n.endswith(".dist-info/RECORD"))

    def row(name: str, data: bytes) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return f"{name},sha256={digest},{len(data)}"

    rows = [row(n, d) for n, d in members.items() if n != record] + [f"{record},,"]
    members[record] = ("\n".join(rows) + "\n").encode()
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for n, d in members.items():
            zf.writestr(n, d)


def test_the_installer_is_uv_and_the_wheel_is_installed(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, version="1.0+ovl.1.a")
    name = parse_name(wheel.name)
    assert find_uv() is not None  # a dependency of the tool
    cmd = install_command(wheel, name, tmp_path, tmp_path / "site")
    assert cmd[0] == find_uv() and cmd[1:3] == ["pip", "install"] and "--target" in cmd
    with installing(wheel, name) as installed:
        target, problems = installed()
        assert problems == [] and target is not None
        assert (target / "vllm" / "__init__.py").read_text().startswith("__version__ = '1.0+ovl")
        assert check_installed(target, name, None, ()) == []
    assert not target.exists()  # removed on leaving


def test_a_wheel_the_installer_refuses_fails_the_check(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, version="1.0")
    _rewrite(wheel, "vllm-1.0.dist-info/WHEEL", b"Wheel-Version: 1.0", b"Wheel-Version: 2.0")
    with installing(wheel, parse_name(wheel.name)) as installed:
        target, problems = installed()
    assert target is None
    assert len(problems) == 1 and "uv install --no-deps --target failed" in problems[0]
    assert "Unsupported wheel major version" in problems[0]


def test_a_wheel_for_another_platform_is_installed_by_pip(tmp_path: Path) -> None:
    wheel = make_wheel(tmp_path, version="1.0", tag="cp38-abi3-macosx_11_0_arm64")
    name = parse_name(wheel.name)
    cmd = install_command(wheel, name, tmp_path, tmp_path / "site")
    assert cmd[1:3] == ["-m", "pip"] and "--platform" in cmd
    with installing(wheel, name) as installed:
        target, problems = installed()
        assert problems == [] and target is not None
        assert check_installed(target, name, None, ()) == []


def test_hashes_reused_from_the_official_wheel_equal_a_full_read(tmp_path: Path) -> None:
    """verify of a repack takes the official member's hash only for members whose
    compressed bytes are identical, and the result is what decompressing everything gives."""
    official = make_wheel(tmp_path / "official", version="1.0")
    repacked = make_wheel(tmp_path / "repacked", version="1.0", payload="fixed = True\n")
    hashes, same = hashes_reusing_official(repacked, official)
    assert same == {"vllm-1.0.dist-info/METADATA", "vllm-1.0.dist-info/WHEEL"}
    assert hashes == member_hashes(repacked)
    assert len(list((Path(os.environ["VLLM_OVERLAY_CACHE"]) / "member-hashes").iterdir())) == 1
    assert hashes_reusing_official(repacked, official) == (hashes, same)  # from the cache
