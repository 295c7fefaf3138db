"""A release whose full commit cannot be resolved offline: the sdist's sha256 is the pin, the
commit the sdist records is kept as it is and marked unverified, and every reader says so."""

from __future__ import annotations

import tomllib

from vllm_overlay.pin.lockfile import parse_lock, read_lock, render_lock


def unreachable_lock(project, cli, version: str = "1.0.0"):
    return cli("lock", "--version", version, "--git-url", str(project.root / "nope.git"),
               "--index-url", project.index.url, cwd=project.root)  # fmt: skip


def test_an_existing_pin_of_the_same_version_keeps_its_verified_commit(project, cli):
    before = read_lock(project.lock).upstream
    res = unreachable_lock(project, cli)
    assert res.rc == 0, res.err
    after = read_lock(project.lock).upstream  # nothing to resolve: the commit is reused
    assert after.commit == before.commit and after.commit_verified


def test_an_unresolvable_tag_pins_the_sdists_abbreviation_unverified(project, cli):
    full = project.upstream.releases["1.0.0"].commit
    sdist_sha = read_lock(project.lock).sdist().sha256
    project.lock.unlink()
    res = unreachable_lock(project, cli)
    assert res.rc == 0, res.err
    assert "recording the commit the sdist records" in res.err and "unverified" in res.err
    doc = tomllib.loads(project.lock.read_text())
    assert doc["upstream"]["commit"] == full[:9]  # what the synthetic sdist records
    assert doc["upstream"]["commit_verified"] is False
    lock = read_lock(project.lock)
    assert not lock.upstream.commit_verified and lock.sdist().sha256 == sdist_sha

    res = cli("lock", "--check", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0, res.err
    assert "abbreviated, unverified" in res.out
    assert "the commit is unverified" in res.err and "--commit SHA" in res.err

    # Verifying later: the full commit, checked against the abbreviation, replaces it.
    res = cli("lock", "--version", "1.0.0", "--commit", full, "--index-url", project.index.url,
              cwd=project.root)  # fmt: skip
    assert res.rc == 0, res.err
    doc = tomllib.loads(project.lock.read_text())
    assert doc["upstream"]["commit"] == full and "commit_verified" not in doc["upstream"]


def test_a_wrong_full_commit_is_still_refused_against_the_sdist(project, cli):
    project.lock.unlink()
    assert unreachable_lock(project, cli).rc == 0
    before = project.lock.read_bytes()
    wrong = project.upstream.releases["1.1.0"].commit
    res = cli("lock", "--version", "1.0.0", "--commit", wrong, "--index-url", project.index.url,
              cwd=project.root)  # fmt: skip
    assert res.rc == 1 and "does not match the sdist" in res.err
    assert project.lock.read_bytes() == before


def test_unverified_commits_must_still_look_like_commits(project):
    text = project.lock.read_text()
    good = parse_lock(text)
    assert render_lock(good) == text  # the tomlkit writer gives the committed bytes back
    bad = text.replace(
        f'commit = "{good.upstream.commit}"', 'commit = "xyz"\ncommit_verified = false'
    )
    try:
        parse_lock(bad)
    except Exception as e:  # noqa: BLE001 - the message is what is asserted
        assert "7 to 40 hex digits" in str(e)
    else:
        raise AssertionError("an unverified commit of 'xyz' was accepted")
    flag = text.replace(
        f'commit = "{good.upstream.commit}"',
        f'commit = "{good.upstream.commit}"\ncommit_verified = "no"',
    )
    try:
        parse_lock(flag)
    except Exception as e:  # noqa: BLE001
        assert "commit_verified should be a bool" in str(e)
    else:
        raise AssertionError("commit_verified = 'no' was accepted")
