"""Every git child under the one runner's policy (gitcmd.py): real git, real process groups.

Each hang is built by the test (a git alias whose shell leaves a grandchild sleeping, a
loopback server that accepts and never answers), so the time limits here are the test's own
construction, not a race with the machine."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

import pytest
from procs import gone
from vllm_overlay import gitrepo
from vllm_overlay.errors import CommandTimeout
from vllm_overlay.gitrepo import commit, git, host_of, open_repo, remote_git, run_git
from vllm_overlay.pin.pinning import resolve_commit
from vllm_overlay.rebase.target import release_of_commit


def _hang(tmp_path: Path) -> tuple[list[str], Path]:
    """git arguments that start a shell whose grandchild sleeps (its pid in the file)."""
    pidfile = tmp_path / "grandchild.pid"
    alias = f"!sh -c 'sleep 300 & echo $! > {pidfile}; wait'"
    return ["-c", f"alias.hang={alias}", "hang"], pidfile


@pytest.fixture
def repo(tmp_path):
    path = tmp_path / "r"
    git("init", "-q", str(path))
    (path / "f.txt").write_text("x\n")
    with open_repo(path) as r:
        commit(r, "first\n", "f.txt")
    return path


def test_a_git_past_its_time_is_stopped_with_its_whole_group(repo, tmp_path):
    args, pidfile = _hang(tmp_path)
    with open_repo(repo) as r, pytest.raises(CommandTimeout, match="timed out after 2 s") as e:
        run_git(r.git, *args, timeout=2)
    assert e.value.cmd[:2] == ("git", "-c")
    assert gone(int(pidfile.read_text()))  # the grandchild went with the group


def test_gitpythons_own_calls_run_through_the_runner(repo, tmp_path):
    """``repo.git.X(...)`` and GitPython's object model call ``execute``: ours, so a git
    GitPython starts has the same limit and the same group stop."""
    args, pidfile = _hang(tmp_path)
    with open_repo(repo) as r:
        assert r.git.rev_parse("HEAD") == r.head.commit.hexsha  # GitPython's own parsing
        assert r.is_ancestor("HEAD", "HEAD")  # merge-base --is-ancestor, its exit status
        with pytest.raises(CommandTimeout):
            r.git.execute(["git", *args], kill_after_timeout=2)
    assert gone(int(pidfile.read_text()))


def test_gitpythons_persistent_readers_run_in_their_group_and_stop_with_the_repo(repo):
    with open_repo(repo) as r:
        assert r.head.commit.tree["f.txt"].data_stream.read() == b"x\n"  # cat-file --batch
        pids = [r.git.cat_file_all.pid]
        assert all(os.getpgid(pid) == pid for pid in pids)  # a group of its own
    assert all(gone(pid) for pid in pids)


@pytest.fixture
def silent_host():
    """A loopback git:// address whose server accepts and never answers."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    held: list[socket.socket] = []
    done = threading.Event()

    def accept() -> None:
        while not done.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    yield f"git://127.0.0.1:{srv.getsockname()[1]}/vllm.git"
    done.set()
    srv.close()
    for c in held:
        c.close()


def test_network_git_times_out_naming_the_host(silent_host, monkeypatch, tmp_path):
    monkeypatch.setattr(gitrepo, "NETWORK_TIMEOUT", 2)
    for call in (
        lambda: resolve_commit(silent_host, "v1.0.0"),  # pin: ls-remote of one tag
        lambda: release_of_commit(silent_host, "0" * 40),  # rebase: ls-remote --tags
    ):
        with pytest.raises(CommandTimeout) as e:
            call()
        assert "127.0.0.1 did not answer git ls-remote within 2 s" in str(e.value)
    git("init", "-q", "--bare", str(tmp_path / "b.git"))
    with pytest.raises(CommandTimeout, match="127.0.0.1 did not answer git fetch within 3 s"):
        remote_git("fetch", "-q", "--depth", "1", silent_host, "0" * 40, url=silent_host,
                   cwd=tmp_path / "b.git", timeout=3)  # fmt: skip


def test_host_of_names_the_host_and_no_credentials():
    assert host_of("https://user:token@example.org:8443/vllm.git") == "example.org"
    assert host_of("git@example.org:vllm-project/vllm.git") == "example.org"
    assert host_of("/srv/mirror/vllm.git") == "/srv/mirror/vllm.git"
