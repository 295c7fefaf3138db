"""Reading a package index that needs credentials, as pip would: from the URL's user part
(--index-url, PIP_INDEX_URL, pip.conf), ~/.netrc and keyring (a real file-based backend).

The index is the synthetic upstream's, served on loopback by a server that answers 401 to
any request without the right HTTP basic credentials; the CLI runs as a real process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_overlay
from synthetic import IndexServer, Upstream

USER = "reader"
TOKEN = "tok-Q7v9-r34d3r"  # distinctive, so a leak into any output is easy to spot
NULL_KEYRING = "keyring.backends.null.Keyring"

FILE_KEYRING = '''
"""A keyring backend that reads a JSON file: {service: {username: password}}."""
import json
import os

from keyring.backend import KeyringBackend
from keyring.credentials import SimpleCredential


class FileKeyring(KeyringBackend):
    priority = 1

    def _entries(self, service):
        with open(os.environ["TEST_KEYRING_FILE"]) as f:
            return json.load(f).get(service, {})

    def get_password(self, service, username):
        return self._entries(service).get(username)

    def get_credential(self, service, username):
        for user, password in self._entries(service).items():
            if username in (None, user):
                return SimpleCredential(user, password)
        return None

    def set_password(self, service, username, password):
        raise NotImplementedError

    def delete_password(self, service, username):
        raise NotImplementedError
'''


def overlay(*args: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m vllm_overlay ARGS`` as its own process (keyring state is per process)."""
    return subprocess.run(
        [sys.executable, "-m", "vllm_overlay", *args],
        cwd=cwd,
        env={**os.environ, "PYTHON_KEYRING_BACKEND": NULL_KEYRING, **env},
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )


def with_user(url: str, password: str = TOKEN) -> str:
    return url.replace("http://", f"http://{USER}:{password}@", 1)


def cached() -> list[str]:
    root = Path(os.environ["VLLM_OVERLAY_CACHE"]) / "artifacts"
    return sorted(p.name for p in root.rglob("*") if p.is_file()) if root.exists() else []


def no_secret(res: subprocess.CompletedProcess[str], *files: Path, secret: str = TOKEN) -> None:
    assert secret not in res.stdout and secret not in res.stderr
    for f in files:
        assert secret not in f.read_text()


@pytest.fixture
def secured(upstream: Upstream):
    with IndexServer(upstream.repo.parent / "dist", basic_auth=(USER, TOKEN)) as srv:
        yield srv


def statuses(srv: IndexServer) -> list[tuple[int, bool]]:
    """(status, whether credentials were sent) for every request the server answered."""
    return [(status, auth is not None) for _, status, _, auth in srv.log]


@pytest.mark.parametrize("where", ["--index-url", "PIP_INDEX_URL", "pip.conf"])
def test_credentials_in_the_index_url(project, secured, tmp_path, where):
    url = with_user(secured.url)
    if where == "--index-url":
        res = overlay("fetch", "--index-url", url, cwd=project.root)
    elif where == "PIP_INDEX_URL":
        res = overlay("fetch", cwd=project.root, PIP_INDEX_URL=url)
    else:
        conf = tmp_path / "pip.conf"
        conf.write_text(f"[global]\nindex-url = {url}\n")
        res = overlay("fetch", cwd=project.root, PIP_CONFIG_FILE=str(conf))
    assert res.returncode == 0, res.stderr
    assert cached() == ["vllm-1.0.0.tar.gz"]
    assert statuses(secured) == [(200, True), (200, True)]  # sent up front, as pip does
    no_secret(res)


def test_credentials_from_netrc(project, secured):
    netrc = Path(os.environ["HOME"]) / ".netrc"
    netrc.write_text(f"machine 127.0.0.1\n  login {USER}\n  password {TOKEN}\n")
    netrc.chmod(0o600)
    res = overlay("fetch", "--index-url", secured.url, cwd=project.root)
    assert res.returncode == 0, res.stderr
    assert cached() == ["vllm-1.0.0.tar.gz"]
    assert statuses(secured) == [(200, True), (200, True)]
    no_secret(res)


def test_credentials_from_keyring(project, secured, tmp_path):
    backend = tmp_path / "kr"
    backend.mkdir()
    (backend / "filekeyring.py").write_text(FILE_KEYRING)
    store = tmp_path / "keyring.json"
    host = secured.url.split("/")[2]  # 127.0.0.1:PORT, as pip asks keyring after the URL
    store.write_text(json.dumps({host: {USER: TOKEN}}))
    env = dict(
        PYTHONPATH=os.pathsep.join([str(backend), os.environ.get("PYTHONPATH", "")]),
        PYTHON_KEYRING_BACKEND="filekeyring.FileKeyring",
        TEST_KEYRING_FILE=str(store),
    )
    res = overlay("fetch", "--index-url", secured.url, cwd=project.root, **env)
    assert res.returncode == 0, res.stderr
    assert cached() == ["vllm-1.0.0.tar.gz"]
    # keyring is asked after the first 401, once; later requests send what it gave
    assert statuses(secured) == [(401, False), (200, True), (200, True)]
    no_secret(res)


def test_401_names_where_credentials_were_looked_for(project, secured):
    res = overlay("fetch", "--index-url", with_user(secured.url, "wrong-t0ken"), cwd=project.root)
    assert res.returncode == 1
    err = res.stderr
    assert "refused" in err and "HTTP 401" in err, err
    assert f"{secured.root}/simple/vllm/" in err
    assert "the URL's user part" in err and "sent those from the URL's user part" in err
    assert f"{Path(os.environ['HOME']) / '.netrc'} (machine 127.0.0.1)" in err
    assert "keyring (Keyring: nothing for" in err
    no_secret(res, secret="wrong-t0ken")
    assert cached() == []
    res = overlay("fetch", "--index-url", secured.url, cwd=project.root)
    assert res.returncode == 1 and "none were found" in res.stderr


def test_credentials_are_not_sent_to_another_host(project, upstream, tmp_path):
    """The index redirects its files to another host (as to a CDN); pip sends the index's
    credentials only to the index's own host[:port], and so do we."""
    dist = upstream.repo.parent / "dist"
    with IndexServer(dist, host="localhost") as files_host:
        with IndexServer(dist, basic_auth=(USER, TOKEN), files_at=files_host.root) as idx:
            res = overlay("fetch", "--index-url", with_user(idx.url), cwd=project.root)
    assert res.returncode == 0, res.stderr
    assert cached() == ["vllm-1.0.0.tar.gz"]
    assert [(p, s, a is not None) for p, s, _, a in idx.log] == [
        ("/simple/vllm/", 200, True),
        ("/files/vllm-1.0.0.tar.gz", 302, True),
    ]
    assert [(p, s, a) for p, s, _, a in files_host.log] == [("/files/vllm-1.0.0.tar.gz", 200, None)]
    no_secret(res)


def test_lock_and_fetch_through_a_secured_index_never_write_the_token(tmp_path, upstream, secured):
    root = tmp_path / "project"
    root.mkdir()
    write_overlay(root)
    commit = upstream.releases["1.0.0"].commit
    url = with_user(secured.url)
    res = overlay("lock", "--version", "1.0.0", "--commit", commit, "--index-url", url, cwd=root)
    assert res.returncode == 0, res.stderr
    lock = root / "upstream.lock"
    assert "vllm-1.0.0.tar.gz" in lock.read_text()
    no_secret(res, lock)
    assert USER not in lock.read_text()
    fetched = overlay("fetch", cwd=root, PIP_INDEX_URL=url)
    assert fetched.returncode == 0, fetched.stderr
    check = overlay("lock", "--check", cwd=root, PIP_INDEX_URL=url)
    assert check.returncode == 0, check.stderr
    for r in (fetched, check):
        no_secret(r, lock)
    assert all(auth for _, _, _, auth in secured.log)
