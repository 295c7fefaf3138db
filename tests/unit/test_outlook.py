"""vllm-overlay outlook on the synthetic upstream: the matrix, the cache, the HTML page (in
headless Chromium), and one clear message for each kind of bad input."""

from __future__ import annotations

import hashlib
import json
import socket
from pathlib import Path

from conftest import tree_snapshot
from synthetic import CONNECTOR, BlobHost
from vllm_overlay.rebase import decide, releasewalk, sdist, walkdata


def _outlook(cli, project, *args):
    return cli("outlook", "--index-url", project.index.url, *args, cwd=project.root)


def test_matrix_over_every_newer_release(cli, project):
    before = tree_snapshot(project.root)
    res = _outlook(cli, project, "--json")
    assert res.rc == 0, res.err
    data = json.loads(res.out)
    assert data["pin"] == "1.0.0"
    assert [c["version"] for c in data["releases"]] == ["1.1.0", "1.2.0"]
    states = {c["version"]: c["outcomes"][0] for c in data["releases"]}
    assert states["1.1.0"]["state"] == "refreshed"
    assert states["1.2.0"]["state"] == "conflict"
    assert states["1.2.0"]["files"] == [CONNECTOR]
    hunk = states["1.2.0"]["hunks"][CONNECTOR]
    assert "<<<<<<< vllm 1.2.0" in hunk and "upstream rewrote this" in hunk
    assert "group_block_size" in hunk and ">>>>>>> our change" in hunk
    assert data["safe_target"] == "1.1.0"
    # The walk over every release says each verdict as it decides it, once: the walks to
    # each target and the direct jumps, which repeat its decisions, say nothing.
    said = [ln for ln in res.err.splitlines() if ln.startswith(("vllm 1.", "  group-block-size"))]
    assert said == ["vllm 1.1.0 (1/2)", "  group-block-size: refreshed: " + states["1.1.0"]["reason"],
                    "vllm 1.2.0 (2/2)", "  group-block-size: conflict (stop): "
                    + states["1.2.0"]["reason"].splitlines()[0]]  # fmt: skip
    # It never writes upstream.lock, overlay/ or a checkout.
    assert tree_snapshot(project.root) == before


def test_terminal_matrix_legend_and_safe_target(cli, project):
    res = _outlook(cli, project)
    assert res.rc == 0, res.err
    lines = res.out.splitlines()
    header = next(ln for ln in lines if ln.startswith("change"))
    assert header.split() == ["change", "1.1.0", "1.2.0"]
    row = next(ln for ln in lines if ln.startswith("group-block-size"))
    assert row.split() == ["group-block-size", "refresh", "CONFLICT"]
    assert "legend:" in lines
    assert ("safe target: vllm 1.1.0 (the newest release the walk reaches without asking a "
            "person)") in res.out  # fmt: skip
    # per target, the stops of the walk and of the direct jump
    assert any(ln.split()[:4] == ["1.2.0", "1", "|", "1"] for ln in lines), res.out
    assert "\x1b[" not in res.out  # not a terminal: no colour


def test_to_and_releases_select_columns(cli, project):
    data = json.loads(_outlook(cli, project, "--to", "1.1.0", "--json").out)
    assert [c["version"] for c in data["releases"]] == ["1.1.0"]
    data = json.loads(_outlook(cli, project, "--releases", "1.2.0", "--json").out)
    assert [c["version"] for c in data["releases"]] == ["1.2.0"]
    assert data["safe_target"] is None


def test_results_are_cached_per_series_and_release(cli, project):
    first = _outlook(cli, project, "--json")
    assert "(0 from the cache)" in first.err
    sdist_gets = [r for r in project.index.requests if r.startswith("/files/")]
    second = _outlook(cli, project, "--json")
    assert "(2 from the cache)" in second.err
    assert json.loads(second.out) == json.loads(first.out)
    assert [r for r in project.index.requests if r.startswith("/files/")] == sdist_gets
    # A change to the series is a new key: computed again.
    toml = project.overlay / "overlay.toml"
    toml.write_text(toml.read_text())  # rewritten, same bytes: same digest
    assert "(2 from the cache)" in _outlook(cli, project).err
    toml.write_text(toml.read_text().replace("vllm>=1.3.0", "vllm>=1.2.0"))
    res = _outlook(cli, project, "--json")
    assert "(0 from the cache)" in res.err
    states = [c["outcomes"][0]["state"] for c in json.loads(res.out)["releases"]]
    assert states == ["refreshed", "dropped"]


def test_tests_run_the_proofs_the_rebase_would_run(cli, project, tmp_path):
    toml = project.overlay / "overlay.toml"
    toml.write_text(toml.read_text().replace("vllm>=1.3.0", "vllm>=1.2.0"))
    import sys

    res = _outlook(cli, project, "--tests", "--test-python", sys.executable, "--json")
    assert res.rc == 0, res.err
    data = json.loads(res.out)
    assert data["releases"][0]["tests"] is None  # refreshed on 1.1.0: nothing to prove
    t12 = data["releases"][1]["tests"]["group-block-size"]
    # Dropped on 1.2.0 by drop_when, but 1.2.0 lacks the fix: the proof fails.
    assert t12["on"].startswith("the pristine tree") and t12["ran"] and not t12["ok"]
    assert "1 failed" in t12["counts"]
    assert data["releases"][1]["outcomes"][0]["state"] == "tests-failed"
    assert data["safe_target"] == "1.1.0"


# --- the pieces ------------------------------------------------------------------------------


def test_sdist_scan_matches_tarfile(upstream):
    import tarfile

    sd = upstream.releases["1.1.0"].sdist
    got = sdist.scan(sd, [CONNECTOR, "missing.py"])
    with tarfile.open(sd) as tf:
        names = {m.name.split("/", 1)[1] for m in tf if m.isfile()}
        want = tf.extractfile(f"vllm-1.1.0/{CONNECTOR}").read()
    assert got.names == names
    assert got.files == {CONNECTOR: want, "missing.py": None}


def test_classifier_finds_renames_and_collisions(tmp_path):
    from vllm_overlay.overlay.model import Change

    old = b"".join(b"line %d\n" % i for i in range(30))
    ours = old.replace(b"line 3\n", b"line 3 ours\n")
    change = Change("c", "t", "w", "https://x", "s", "vllm>=9", ("a/f.py", "t/new.py"), ())
    step = decide.Step(change, {"a/f.py": old, "t/new.py": None},
                       {"a/f.py": ours, "t/new.py": b"ours\n"})  # fmt: skip
    moved_to = old.replace(b"line 29\n", b"line 29 upstream\n")
    rel = decide.Release("vllm", "2.0", frozenset({"b/g.py", "t/new.py"}),
                         lambda paths: {"b/g.py": moved_to})  # fmt: skip
    o = decide.decide(step, decide.Scratch(tmp_path), {"a/f.py": None, "t/new.py": b"theirs\n"},
                      rel, frozenset({"a/f.py"}), ("vllm 2.0", "vllm 1.0", "our change"))  # fmt: skip
    assert o.state == "moved"
    assert o.candidates["a/f.py"][0][0] == "b/g.py"
    assert "renamed it" in o.reason and "collision" not in o.reason.split(";")[0]
    assert "t/new.py: the change adds it" in o.reason


# --- bad input: one clear message each --------------------------------------------------------


def _static_index(tmp_path: Path, upstream, entries: list[dict]) -> str:
    """A file:// PEP 691 index listing ``entries`` (filename, path, and overrides)."""
    root = tmp_path / "static"
    (root / "vllm").mkdir(parents=True)
    files = []
    for e in entries:
        data = Path(e["path"]).read_bytes()
        files.append(
            {
                "filename": e["filename"],
                "url": Path(e["path"]).as_uri(),
                "hashes": {"sha256": e.get("sha256", hashlib.sha256(data).hexdigest())},
                "size": len(data),
                "yanked": e.get("yanked", False),
            }
        )
    (root / "vllm" / "index.json").write_text(json.dumps({"meta": {}, "files": files}))
    return root.as_uri()


def _entries(upstream, versions, *, sdist=True, wheel=True, **over):
    out = []
    for v in versions:
        r = upstream.releases[v]
        if sdist:
            out.append({"filename": r.sdist.name, "path": r.sdist, **over.get(v, {})})
        if wheel:
            out.append({"filename": r.wheel.name, "path": r.wheel})
    return out


def test_release_without_sdist_is_skipped_with_a_note(cli, project, upstream, tmp_path):
    entries = _entries(upstream, ["1.0.0", "1.1.0"])
    entries += _entries(upstream, ["1.2.0"], sdist=False)
    url = _static_index(tmp_path, upstream, entries)
    res = cli("outlook", "--index-url", url, cwd=project.root)
    assert res.rc == 0, res.err
    assert ("note: vllm 1.2.0 skipped: the index lists no sdist for it (the tool builds from "
            "the release sdist)") in res.out  # fmt: skip
    res = cli("outlook", "--index-url", url, "--to", "1.2.0", cwd=project.root)
    assert res.rc == 2
    assert "vllm 1.2.0 cannot be a target: the index lists no sdist for it" in res.err


def test_yanked_release_is_skipped_or_refused(cli, project, upstream, tmp_path):
    url = _static_index(
        tmp_path, upstream,
        _entries(upstream, ["1.0.0", "1.1.0", "1.2.0"], **{"1.2.0": {"yanked": True}}),
    )  # fmt: skip
    res = cli("outlook", "--index-url", url, "--json", cwd=project.root)
    assert res.rc == 0, res.err
    data = json.loads(res.out)
    assert [c["version"] for c in data["releases"]] == ["1.1.0"]
    assert data["skipped"] == ["vllm 1.2.0 skipped: its sdist is yanked on the index"]
    res = cli("outlook", "--index-url", url, "--to", "1.2.0", cwd=project.root)
    assert res.rc == 2
    assert "vllm 1.2.0 cannot be a target: its sdist is yanked on the index" in res.err


def test_sdist_hash_differs_from_the_index(cli, project, upstream, tmp_path):
    url = _static_index(
        tmp_path, upstream,
        _entries(upstream, ["1.0.0", "1.1.0"], **{"1.1.0": {"sha256": "0" * 64}}),
    )  # fmt: skip
    res = cli("outlook", "--index-url", url, cwd=project.root)
    assert res.rc == 1
    assert ("vllm 1.1.0: the sdist downloaded from the index does not match the sha256 the "
            "index publishes for it") in res.err  # fmt: skip
    assert "Nothing was cached" in res.err
    assert not list(Path(project.root).glob("**/vllm-1.1.0.tar.gz"))


def test_index_down(cli, project):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/simple"
    res = cli("outlook", "--index-url", url, cwd=project.root)
    assert res.rc == 1
    assert f"the package index at {url}/vllm/ is unreachable" in res.err
    assert "Traceback" not in res.err


def test_the_walk_takes_the_series_in_order_on_one_file():
    """Two changes on one file: the second merges onto what the first left on the release;
    after a stop nobody settles (the outlook), the walk goes on and tries it again."""
    from vllm_overlay.overlay.model import Change

    def ch(cid):
        return Change(cid, "t", "w", "https://x", "s", "vllm>=9", ("f.py",), ())

    old = b"".join(b"line %d\n" % i for i in range(40))
    one = old.replace(b"line 5\n", b"line 5 first\n")
    two = one.replace(b"line 30\n", b"line 30 second\n")
    steps = [decide.Step(ch("a"), {"f.py": old}, {"f.py": one}),
             decide.Step(ch("b"), {"f.py": one}, {"f.py": two})]  # fmt: skip
    shifted = b"new top\n" + old  # upstream adds a line: both patches need new context
    rewritten = shifted.replace(b"line 5\n", b"line 5 upstream\n")  # the first conflicts
    host = BlobHost({"1.0": {"f.py": old}, "2.0": {"f.py": shifted}, "3.0": {"f.py": rewritten},
                  "4.0": {"f.py": shifted}})  # fmt: skip
    blobs = walkdata.Blobs()
    w = walkdata.start("vllm", "1.0", ["2.0", "3.0", "4.0"], steps, blobs)
    changes = {s.change.id: s.change for s in steps}
    releasewalk.Walker(w, blobs, host, changes, {}, stop_at_conflicts=False).run()
    got = {(c.release, c.id): c.state for c in w.cells}
    assert got == {
        ("2.0", "a"): "refreshed", ("2.0", "b"): "refreshed",
        ("3.0", "a"): "waiting", ("3.0", "b"): "kept",  # 4.0 clears a: not asked at 3.0
        ("4.0", "a"): "kept", ("4.0", "b"): "kept",
    }  # fmt: skip
    assert walkdata.person_stops(w) == []
    w = walkdata.start("vllm", "1.0", ["2.0", "3.0"], steps, blobs)  # nothing clears it by 3.0
    releasewalk.Walker(w, blobs, host, changes, {}, stop_at_conflicts=False).run()
    assert walkdata.person_stops(w) == [{"release": "3.0", "id": "a", "state": "conflict"}]
    [cell] = [c for c in w.cells if c.release == "3.0" and c.id == "a"]
    assert cell.stop and "line 5 upstream" in cell.hunks["f.py"]
