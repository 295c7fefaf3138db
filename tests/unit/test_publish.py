"""vllm-overlay publish: what it writes to a static index and what it refuses, in process.
Real installers (pip, uv) and a real pypiserver reading what it publishes are
tests/integration/test_publish_servers.py. Nothing is written outside tmp_path."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
from fixtures_publish import (
    PASSWORD,
    PY3_WHEEL,
    REAL_TAG,
    USER,
    free_port,
    make_wheel,
    sha256_of,
    tree,
)
from vllm_overlay.errors import CommandError
from vllm_overlay.index.upload import ServerIndex
from vllm_overlay.util import exclusive_lock

pytestmark = pytest.mark.usefixtures("publish_env")


# --------------------------------------------------------------------------- static index


def test_static_index_pages_carry_pep_503_658_691_700_714(
    tmp_path: Path, wheels: Path, publish_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    wheel = make_wheel(wheels)
    index = tmp_path / "index"
    assert publish_cli(wheel, "--to", index).rc == 0
    with zipfile.ZipFile(wheel) as zf:
        metadata = zf.read("vllm-0.24.0+ovl.1.abc.dist-info/METADATA")
    metadata_file = index / "packages" / f"{PY3_WHEEL}.metadata"
    assert metadata_file.read_bytes() == metadata
    meta_hash = sha256_of(metadata_file)

    page = (index / "simple" / "vllm" / "index.html").read_text()
    href = f"../../packages/vllm-0.24.0%2Bovl.1.abc-py3-none-any.whl#sha256={sha256_of(wheel)}"
    assert f'href="{href}"' in page
    assert 'data-requires-python="&gt;=3.10"' in page
    assert f'data-core-metadata="sha256={meta_hash}"' in page
    assert f'data-dist-info-metadata="sha256={meta_hash}"' in page
    assert '<a href="vllm/">vllm</a>' in (index / "simple" / "index.html").read_text()

    root = json.loads((index / "simple" / "index.json").read_text())
    assert root == {"meta": {"api-version": "1.1"}, "projects": [{"name": "vllm"}]}
    doc = json.loads((index / "simple" / "vllm" / "index.json").read_text())
    assert doc["meta"]["api-version"] == "1.1"
    assert doc["name"] == "vllm"
    assert doc["versions"] == ["0.24.0+ovl.1.abc"]
    (f,) = doc["files"]
    assert f["filename"] == PY3_WHEEL
    assert f["hashes"] == {"sha256": sha256_of(wheel)}
    assert f["size"] == wheel.stat().st_size
    assert f["upload-time"] == "2023-11-14T22:13:20Z"
    assert f["requires-python"] == ">=3.10"
    assert f["core-metadata"] == f["dist-info-metadata"] == {"sha256": meta_hash}
    assert (index / "simple" / "vllm" / f["url"].replace("%2B", "+")).resolve() == (
        index / "packages" / PY3_WHEEL
    ).resolve()


def test_static_index_adding_a_version_keeps_the_first_and_its_upload_time(
    tmp_path: Path, wheels: Path, publish_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = tmp_path / "index"
    first = make_wheel(wheels)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1000000000")
    assert publish_cli(first, "--to", index).rc == 0
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "2000000000")
    second = make_wheel(wheels, version="0.24.0+ovl.2.def")
    r = publish_cli(first, second, "--to", index)
    assert r.rc == 0, r.err
    assert r.out.splitlines()[-1] == f"1 published, 1 skipped: {index}"
    assert (index / "packages" / first.name).read_bytes() == first.read_bytes()
    doc = json.loads((index / "simple" / "vllm" / "index.json").read_text())
    assert doc["versions"] == ["0.24.0+ovl.1.abc", "0.24.0+ovl.2.def"]
    times = {f["filename"]: f["upload-time"] for f in doc["files"]}
    assert times == {first.name: "2001-09-09T01:46:40Z", second.name: "2033-05-18T03:33:20Z"}


def test_static_index_same_file_again_is_a_no_op(tmp_path: Path, wheels: Path, publish_cli) -> None:
    wheel = make_wheel(wheels)
    index = tmp_path / "index"
    assert publish_cli(wheel, "--to", index).rc == 0
    before = {p: p.stat().st_mtime_ns for p in index.rglob("*")}
    r = publish_cli(wheel, "--to", index)
    assert r.rc == 0, r.err
    assert r.out.splitlines() == [
        f"skipped {PY3_WHEEL} (already published, same sha256)",
        f"0 published, 1 skipped: {index}",
    ]
    assert {p: p.stat().st_mtime_ns for p in index.rglob("*")} == before


def test_static_index_never_overwrites_a_published_file(
    tmp_path: Path, wheels: Path, publish_cli
) -> None:
    index = tmp_path / "index"
    assert publish_cli(make_wheel(wheels), "--to", index).rc == 0
    before = tree(index)
    other = make_wheel(tmp_path / "rebuilt", payload="changed = True\n")
    assert other.name == PY3_WHEEL
    r = publish_cli(other, "--to", index)
    assert r.rc == 1
    assert f"{PY3_WHEEL} is already published with sha256" in r.err
    assert "never overwritten" in r.err
    assert tree(index) == before


def test_static_index_recovers_from_an_interrupted_or_damaged_publish(
    tmp_path: Path, wheels: Path, publish_cli, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = tmp_path / "index"
    first = make_wheel(wheels)
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1000000000")
    assert publish_cli(first, "--to", index).rc == 0
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "2000000000")
    (index / "packages" / first.name).unlink()  # lost from the web root
    (index / "simple" / "index.html").unlink()
    second = make_wheel(wheels, version="0.24.0+ovl.2.def")
    shutil.copy(second, index / "packages" / second.name)  # a run killed before its record
    r = publish_cli(first, second, "--to", index)
    assert r.rc == 0, r.err
    assert r.out.splitlines()[:2] == [
        f"published {first.name} (restored a file missing from packages/)",
        f"published {second.name} (recorded a file already in packages/)",
    ]
    assert (index / "packages" / first.name).read_bytes() == first.read_bytes()
    assert (index / "simple" / "index.html").is_file()
    doc = json.loads((index / "simple" / "vllm" / "index.json").read_text())
    times = {f["filename"]: f["upload-time"] for f in doc["files"]}
    assert times == {first.name: "2001-09-09T01:46:40Z", second.name: "2033-05-18T03:33:20Z"}


def test_static_index_is_deterministic(
    tmp_path: Path, wheels: Path, publish_cli, monkeypatch
) -> None:
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    a = make_wheel(wheels)
    b = make_wheel(wheels, tag=REAL_TAG)
    c = make_wheel(wheels, name="vllm_extras", version="1.0")
    assert publish_cli(a, b, c, "--to", tmp_path / "one").rc == 0
    assert publish_cli(c, "--to", tmp_path / "two").rc == 0
    assert publish_cli(b, a, "--to", tmp_path / "two").rc == 0
    one, two = tree(tmp_path / "one"), tree(tmp_path / "two")
    assert one == two
    assert "simple/vllm-extras/index.json" in one


def test_static_index_is_locked_while_publishing(
    tmp_path: Path, wheels: Path, publish_cli, monkeypatch
) -> None:
    index = tmp_path / "index"
    index.mkdir()
    monkeypatch.setenv("VLLM_OVERLAY_LOCK_TIMEOUT", "0.3")  # it waits, then gives up
    with exclusive_lock(index / ".vllm-overlay-index.lock", "test"):
        r = publish_cli(make_wheel(wheels), "--to", index)
    assert r.rc == 1
    assert "another vllm-overlay process is using the index" in r.err
    assert "waiting for the index" in r.err and "after waiting 0.3 s" in r.err
    assert not (index / "packages").exists()


# --------------------------------------------------------------------------- bad input


def test_bad_wheels_are_refused_before_anything_is_written(
    tmp_path: Path, wheels: Path, publish_cli
) -> None:
    index = tmp_path / "index"
    good = make_wheel(wheels)
    text = wheels / "notes.txt"
    text.write_text("not a wheel\n")
    not_zip = wheels / "vllm-0.24.0-py3-none-any.whl"
    not_zip.write_bytes(b"this is not a zip archive")
    renamed = wheels / "renamed" / "vllm-0.24.1-py3-none-any.whl"
    renamed.parent.mkdir()
    shutil.copy(good, renamed)
    wrong_name = make_wheel(wheels / "name", metadata_name="vllm-fork")
    cases = {
        text: "is not a wheel",
        not_zip: "is not a readable wheel (zip archive)",
        renamed: "does not match its METADATA: the file name says vllm 0.24.1",
        wrong_name: "METADATA says vllm-fork 0.24.0+ovl.1.abc",
        wheels / "missing.whl": "no such file",
    }
    for path, message in cases.items():
        r = publish_cli(good, path, "--to", index)
        assert r.rc == 1, path
        assert message in r.err, r.err
        assert "Traceback" not in r.err
    assert not index.exists()


def _flip_member_byte(wheel: Path, member: str) -> None:
    """Flip one byte in the middle of ``member``'s compressed data (headers left intact)."""
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(member)
    data = bytearray(wheel.read_bytes())
    local = info.header_offset
    name_len, extra_len = (
        int.from_bytes(data[local + 26 : local + 28], "little"),
        int.from_bytes(data[local + 28 : local + 30], "little"),
    )
    at = local + 30 + name_len + extra_len + info.compress_size // 2
    data[at] ^= 0x10
    wheel.write_bytes(bytes(data))


def test_a_corrupt_member_or_a_wrong_record_hash_is_refused(
    tmp_path: Path, wheels: Path, publish_cli
) -> None:
    """Each member is read once (CRC and RECORD hash in the same read), and every kind still
    refuses: a deflated member with a flipped byte, a stored one with changed bytes, and a
    sound member that RECORD does not match."""
    index = tmp_path / "index"
    payload = "".join(f"X{i} = {i * 7919 % 104729}\n" for i in range(2000))
    flipped = make_wheel(wheels / "flipped", payload=payload)
    _flip_member_byte(flipped, "vllm/__init__.py")
    stored = make_wheel(wheels / "crc", stored=True)
    stored.write_bytes(stored.read_bytes().replace(b"__version__", b"__VERSION__"))
    wrong = make_wheel(wheels / "record", tampered={"vllm/__init__.py": "__version__ = 'evil'\n"})
    for bad, problem in [
        (flipped, "zip: vllm/__init__.py: cannot be read: "),
        (stored, "zip: vllm/__init__.py: cannot be read: CRC-32 "),
        (wrong, "record: vllm/__init__.py: RECORD says sha256="),
    ]:
        r = publish_cli(bad, "--to", index)
        assert r.rc == 1
        assert f"{bad.name}: {problem}" in r.err, r.err
        assert "Nothing was published" in r.err and "Traceback" not in r.err
    assert not index.exists()
    r = publish_cli(make_wheel(wheels / "good", payload=payload), "--to", index)
    assert r.rc == 0, r.err


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"unrecorded": {"/etc/evil.conf": "x"}}, "names: /etc/evil.conf: an absolute path"),
        ({"unrecorded": {"vllm\\evil.py": "x"}}, "names: vllm\\evil.py: contains a backslash"),
        ({"drop": ["WHEEL"]}, "dist-info: vllm-0.24.0+ovl.1.abc.dist-info/WHEEL is missing"),
        (
            {"unrecorded": {"vllm-0.24.0+ovl.1.abc.dist-info/extra": "x"}},
            "record: vllm-0.24.0+ovl.1.abc.dist-info/extra: not listed in RECORD",
        ),
        (
            {"unrecorded": {"other-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\n"}},
            "dist-info: expected exactly one .dist-info directory, found 2",
        ),
    ],
)
def test_installer_checks_name_the_problem(
    tmp_path: Path, wheels: Path, publish_cli, kwargs, problem
) -> None:
    bad = make_wheel(wheels, **kwargs)
    r = publish_cli(bad, "--to", tmp_path / "index")
    assert r.rc == 1
    assert f"{bad.name}: {problem}" in r.err, r.err
    assert not (tmp_path / "index").exists()


def test_index_path_under_a_regular_file_fails_cleanly(
    tmp_path: Path, wheels: Path, publish_cli
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = publish_cli(make_wheel(wheels), "--to", blocker / "index")
    assert r.rc == 1
    assert f"cannot write to the index directory {blocker / 'index'}" in r.err
    r = publish_cli(make_wheel(wheels), "--to", blocker)
    assert r.rc == 1
    assert "exists and is not a directory" in r.err


def test_unsupported_destination_is_a_usage_error(wheels: Path, publish_cli) -> None:
    r = publish_cli(make_wheel(wheels), "--to", "s3://bucket/pypi")
    assert r.rc == 2
    assert "publish to a directory and sync it" in r.err


# --------------------------------------------------------------------------- server index


def test_server_unreachable_names_the_url_without_credentials(wheels: Path, publish_cli) -> None:
    port = free_port()
    r = publish_cli(make_wheel(wheels), "--to", f"http://{USER}:{PASSWORD}@127.0.0.1:{port}/")
    assert r.rc == 1
    assert f"the package index at http://127.0.0.1:{port}/simple/vllm/ is unreachable" in r.err
    assert PASSWORD not in r.all and f"{USER}:" not in r.all


def test_redact_cleans_command_errors() -> None:
    index = ServerIndex("http://127.0.0.1:1/", "http://127.0.0.1:1/simple/", USER, PASSWORD)
    err = CommandError(
        ("twine", "upload", f"https://{USER}:{PASSWORD}@pypi.internal.example/"),
        1,
        f"password was {PASSWORD}",
        "see https://a:b@pypi.internal.example/simple/",
    )
    text = index.redact(str(err))
    assert PASSWORD not in text and "a:b@" not in text
    assert "https://****@pypi.internal.example/" in text
