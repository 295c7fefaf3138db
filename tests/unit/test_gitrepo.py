"""The git layer (gitrepo.py) on real repositories: clean environment, fixed identity, reads."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from vllm_overlay.gitrepo import (
    IDENTITY,
    commit,
    commit_message,
    git,
    head_state,
    open_repo,
    restore_head,
    rev_parse,
    show_bytes,
    switch,
    uncommitted,
    untracked,
)


def _repo(path: Path, files: dict[str, bytes]) -> Path:
    git("init", "-q", str(path))
    for rel, data in files.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_bytes(data)
    with open_repo(path) as r:
        commit(r, "first\n", *files)
    return path


def test_outside_git_variables_and_user_config_do_not_reach_git(tmp_path, monkeypatch):
    other = _repo(tmp_path / "other", {"o.txt": b"other\n"})
    before = rev_parse(other, "HEAD")
    # A caller inside a git hook has these; a user config signs commits with a failing gpg.
    monkeypatch.setenv("GIT_DIR", str(other / ".git"))
    monkeypatch.setenv("GIT_INDEX_FILE", str(tmp_path / "nope" / "index"))
    monkeypatch.setenv("GIT_AUTHOR_NAME", "Somebody Else")
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text(
        "[user]\n\tname = Someone\n[commit]\n\tgpgsign = true\n[gpg]\n\tprogram = false\n"
    )
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("GIT_CONFIG_GLOBAL", raising=False)

    ours = _repo(tmp_path / "ours", {"a.txt": b"a\n"})
    assert rev_parse(other, "HEAD") == before  # nothing went to the repository in GIT_DIR
    assert "GIT_DIR" not in os.environ
    log = subprocess.run(
        ["git", "log", "-1", "--format=%an <%ae> %ad %cn %G?", "--date=iso-strict"],
        cwd=ours, capture_output=True, text=True, check=True, env={**os.environ, "HOME": str(home)},
    ).stdout.strip()  # fmt: skip
    assert log == f"{IDENTITY[0]} <{IDENTITY[1]}> 2000-01-01T00:00:00+00:00 {IDENTITY[0]} N"


def test_show_bytes_reads_exact_bytes_and_none_for_what_is_not_a_file(tmp_path):
    data = b"caf\xe9 \x00\r\n"  # not UTF-8, a NUL, a CR
    repo = _repo(tmp_path / "r", {"d/e/f.bin": data, "top.txt": b"t\n"})
    with open_repo(repo) as r:
        assert show_bytes(r, "HEAD", "d/e/f.bin") == data
        assert show_bytes(r, "HEAD", "d/e") is None  # a tree
        assert show_bytes(r, "HEAD", "d/missing") is None
        assert show_bytes(r, "no-such-rev", "top.txt") is None
    assert show_bytes(repo, "HEAD", "top.txt") == b"t\n"  # by path, too


def test_uncommitted_lists_staged_unstaged_renamed_and_untracked(tmp_path):
    repo = _repo(tmp_path / "r", {"a.txt": b"a\n", "b.txt": b"b\n", "c.txt": b"c\n"})
    (repo / ".gitignore").write_text("*.log\n")
    git("add", ".gitignore", cwd=repo)
    (repo / "a.txt").write_text("changed\n")
    git("mv", "b.txt", "moved.txt", cwd=repo)
    (repo / "new.txt").write_text("n\n")
    (repo / "ignored.log").write_text("x\n")
    with open_repo(repo) as r:
        assert sorted(uncommitted(r)) == sorted(
            [" M a.txt", "A  .gitignore", "R  b.txt -> moved.txt", "?? new.txt"]
        )
        assert untracked(r) == ["new.txt"]


def test_head_state_round_trip_on_a_branch_and_detached(tmp_path):
    repo = _repo(tmp_path / "r", {"a.txt": b"a\n"})
    with open_repo(repo) as r:
        first = rev_parse(r, "HEAD")
        (repo / "a.txt").write_text("b\n")
        second = commit(r, commit_message("second", "body", {"Trailer": "x"}), "a.txt")
        saved = head_state(r)
        assert saved.branch == "main" and saved.commit == second
        switch(r, first, None)
        (repo / "stray.txt").write_text("s\n")
        restore_head(r, saved, clean=True)
        assert head_state(r) == saved and not (repo / "stray.txt").exists()
        assert r.head.commit.message == "second\n\nbody\n\nTrailer: x\n"
        switch(r, first, None)
        detached = head_state(r)
        assert detached.branch is None and detached.commit == first
