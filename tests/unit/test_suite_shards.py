"""The suite's split across machines (testing/shards.py): K/N, the files of a selection, a
deterministic split balanced by durations, and a merge that refuses shards of another split.
Shards really run and merge in tests/integration/test_suite_shard_runs.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from vllm_overlay.errors import SuiteError, UsageError
from vllm_overlay.testing import shards


@pytest.mark.parametrize("text", ["0/3", "4/3", "3", "a/b", "1/", "-1/2"])
def test_a_bad_shard_is_a_usage_error(text):
    with pytest.raises(UsageError, match="give K/N"):
        shards.ShardSpec.parse(text)


def test_the_selection_becomes_its_test_files(tmp_path):
    for rel in ("t/test_a.py", "t/b_test.py", "t/helper.py", "t/sub/test_c.py", "u/test_d.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    (tmp_path / "t/__pycache__").mkdir()
    (tmp_path / "t/__pycache__/test_a.py").write_text("")
    got = shards.expand(tmp_path, ("t", "u/test_d.py::test_x", "u/test_d.py::test_y"))
    assert got == {
        "t/b_test.py": ("t/b_test.py",),
        "t/sub/test_c.py": ("t/sub/test_c.py",),
        "t/test_a.py": ("t/test_a.py",),
        "u/test_d.py": ("u/test_d.py::test_x", "u/test_d.py::test_y"),
    }
    # A file selected whole stays whole.
    assert shards.expand(tmp_path, ("t/test_a.py::t1", "t"))["t/test_a.py"] == ("t/test_a.py",)


def test_the_split_balances_by_duration_and_defaults_to_the_median():
    files = [f"f{i}.py" for i in range(7)]
    durations = {"f0.py": 60.0, "f1.py": 10.0, "f2.py": 10.0, "f3.py": 30.0}
    parts = shards.split(files, durations, 3)
    assert sorted(f for p in parts for f in p) == files  # each file once
    assert parts[0] == ["f0.py"]  # 60 s alone; the others (median 20 s for unknowns) share
    loads = [sum(durations.get(f, 20.0) for f in p) for p in parts]
    assert max(loads) - min(loads) <= 20.0
    assert shards.split(files, {}, 3) == [
        ["f0.py", "f3.py", "f6.py"],
        ["f1.py", "f4.py"],
        ["f2.py", "f5.py"],
    ]
    assert shards.split(["a.py"], {}, 3) == [["a.py"], [], []]  # more shards than files


def test_the_split_does_not_depend_on_order_or_hash_seed(tmp_path):
    files = [f"tests/test_{i:02}.py" for i in range(40)]
    durations = {f: float(i % 7) for i, f in enumerate(files)}
    forward = shards.split(files, durations, 4)
    assert shards.split(list(reversed(files)), dict(reversed(durations.items())), 4) == forward
    code = (
        "import json, sys; from vllm_overlay.testing import shards; "
        "files, d = json.load(sys.stdin); print(json.dumps(shards.split(set(files), d, 4)))"
    )
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            input=json.dumps([files, durations]),
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        assert json.loads(out) == forward


def test_durations_round_trip_and_a_bad_file_is_named(tmp_path):
    path = tmp_path / "d.json"
    assert shards.load_durations(path) == {}
    shards.write_durations(path, {"b.py": 1.26, "a.py": 3.0}, "vllm 1.0.0")
    assert shards.load_durations(path) == {"a.py": 3.0, "b.py": 1.3}
    assert list(json.loads(path.read_text())["files"]) == ["a.py", "b.py"]
    path.write_text("[1]")
    with pytest.raises(UsageError, match="not a durations file"):
        shards.load_durations(path)


def _shard_dir(tmp_path, k, n, split="s1", status="done"):
    d = tmp_path / f"s{k}"
    d.mkdir()
    doc = {"format": 1, "shard": k, "of": n, "status": status, "split": split, "meta": {}}
    (d / shards.MANIFEST).write_text(json.dumps(doc))
    return d


def test_a_merge_names_every_shard_it_cannot_use(tmp_path):
    one = _shard_dir(tmp_path, 1, 4)
    running = _shard_dir(tmp_path, 3, 4, status="running")
    with pytest.raises(SuiteError) as e:
        shards.merge([one, running])
    msg = str(e.value)
    assert "shard 2/4: missing" in msg and "shard 4/4: missing" in msg
    assert f"shard 3/4: did not finish ({running}: 'running')" in msg
    with pytest.raises(SuiteError, match="given twice"):
        shards.merge([one, one])
    other = _shard_dir(tmp_path, 2, 2, split="s2")
    with pytest.raises(SuiteError, match="different splits"):
        shards.merge([one, other])
    with pytest.raises(SuiteError, match="no shard.json"):
        shards.merge([tmp_path])


def test_shards_of_different_splits_are_refused(tmp_path):
    a = _shard_dir(tmp_path, 1, 2, split="aaaa")
    b = _shard_dir(tmp_path, 2, 2, split="bbbb")
    with pytest.raises(SuiteError, match="split the suite differently"):
        shards.merge([a, b])
