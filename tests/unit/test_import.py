"""vllm-overlay import: a change from a format-patch, a pull request or a later release, merged
three-way onto the series in the checkout; conflicts stop with markers, --continue and --abort;
bad input refused with one message and nothing written."""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import threading
import tomllib
from pathlib import Path

import pytest
from conftest import CID, pinned_project, tree_snapshot
from synthetic import CONNECTOR, EXTRACT, make_upstream, release_files
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay.checkout import CheckoutState, checkout_state
from vllm_overlay.overlay.importing import Request, continue_, import_change, web_url
from vllm_overlay.overlay.project import Project

AUTHOR = "Ada Lovelace <ada@example.invalid>"


def sh(repo: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1",
               GIT_COMMITTER_NAME="gh", GIT_COMMITTER_EMAIL="gh@example.invalid")  # fmt: skip
    out = subprocess.run(["git", *args], cwd=repo, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def upstream_patch(upstream, tmp: Path, edits: dict[str, tuple[str, str]], subject: str,
                   body: str = "") -> str:  # fmt: skip
    """A real `git format-patch` of one upstream commit on release 1.0.0 (a PR's .patch)."""
    clone = tmp / "pr-clone"
    if not clone.exists():
        subprocess.run(["git", "clone", "-q", str(upstream.repo), str(clone)], check=True)
    sh(clone, "checkout", "-q", "-f", "v1.0.0")
    for path, (old, new) in edits.items():
        text = (clone / path).read_text() if (clone / path).exists() else ""
        assert old in text
        (clone / path).parent.mkdir(parents=True, exist_ok=True)
        (clone / path).write_text(text.replace(old, new, 1) if old else new)
    sh(clone, "add", "-A")
    sh(clone, "commit", "-q", f"--author={AUTHOR}", "-m", f"{subject}\n\n{body}".strip())
    return sh(clone, "format-patch", "-1", "--stdout")


GUARD_SLOTS = ("        out = []\n", "        out = []  # slots of real blocks only\n")
BASIC_CACHE = (
    "    for value, slot in zip(to_cache, slot_mapping):\n",
    "    for value, slot in zip(to_cache, slot_mapping):\n"
    "        if slot < 0:  # padding \u2014 never a real slot\n            continue\n",
)


LAYOUT_TEST = "tests/v1/kv_connector/unit/test_layout.py"
LAYOUT_EDIT = ("        block_size = 4\n", "        block_size = 8\n")


def imp(cli, project, *args: str, checkout: Path | None = None):
    co = ("--checkout", checkout) if checkout else ()
    return cli("import", *args, *co, "--index-url", project.index.url, cwd=project.root)


def overlay_toml(project) -> dict:
    return tomllib.loads((project.overlay / "overlay.toml").read_text())


def assert_strict_apply(cli, project, tmp_path: Path, name: str = "fresh") -> Path:
    fresh = tmp_path / name
    res = cli("apply", "--checkout", fresh, "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0, res.err
    res = cli("export", "--check", "--checkout", fresh, cwd=project.root)
    assert res.rc == 0, res.err
    return fresh


@pytest.fixture
def canonical(project, cli, tmp_path):
    """The project with its overlay as export writes it, and its checkout."""
    co = tmp_path / "co"
    res = cli("apply", "--checkout", co, "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0, res.err
    assert cli("export", "--checkout", co, cwd=project.root).rc == 0
    assert cli("apply", "--checkout", co, cwd=project.root).rc == 0
    return co


def test_import_format_patch_fills_title_origin_authors(project, cli, canonical, tmp_path):
    text = upstream_patch(project.upstream, tmp_path, {EXTRACT: BASIC_CACHE},
                          "[Bugfix] Skip padding slots in basic_cache (#4242)",
                          "Padding slots are -1.\n\nSigned-off-by: Ada Lovelace <ada@example.invalid>")  # fmt: skip
    pfile = tmp_path / "4242.patch"
    pfile.write_text(text)
    res = imp(cli, project, "--patch", pfile, "--drop-when", "vllm>=1.3.0", checkout=canonical)
    assert res.rc == 0, res.err
    cid = "bugfix-skip-padding-slots-in-basic-cache"
    assert f"wrote overlay/{cid}/{EXTRACT}.patch" in res.out
    changes = overlay_toml(project)["change"]
    assert [c["id"] for c in changes] == [CID, cid]  # appended last
    new = changes[1]
    assert new["title"] == "[Bugfix] Skip padding slots in basic_cache"
    lock_git = tomllib.loads(project.lock.read_text())["upstream"]["git"]
    assert new["origin"] == f"{web_url(lock_git)}/pull/4242"
    assert new["authors"] == [AUTHOR] and new["why"].strip() == "Padding slots are -1."
    assert new["files"] == [EXTRACT] and new["drop_when"] == "vllm>=1.3.0"
    assert "upstream_tests" not in new  # the pull request changes no test
    assert overlay_toml(project)["revision"] == 2
    patch = project.change_file(EXTRACT + ".patch", cid).read_text()
    assert "+        if slot < 0:  # padding \u2014 never a real slot" in patch  # 8-bit mail body
    assert "index " not in patch
    # the checkout holds it as the change's commit; status says it matches
    log = sh(canonical, "log", "-1", "--format=%B")
    assert f"Overlay-Change: {cid}" in log
    st = json.loads(cli("status", "--json", "--checkout", canonical, cwd=project.root).out)
    assert st["checkout"]["state"] == "matches"
    assert_strict_apply(cli, project, tmp_path)


def test_three_way_merge_over_the_blob_the_patch_names(project, cli, canonical, tmp_path):
    """Upstream's patch touches lines next to our change: its context no longer matches the
    series, so it is merged over its own preimage (the pin's blob its index line names)."""
    text = upstream_patch(project.upstream, tmp_path, {CONNECTOR: GUARD_SLOTS},
                          "Comment slots (#77)")  # fmt: skip
    pfile = tmp_path / "77.patch"
    pfile.write_text(text)
    direct = subprocess.run(["git", "apply", "--check", str(pfile)], cwd=canonical,
                            capture_output=True)  # fmt: skip
    assert direct.returncode != 0  # plain application fails on this series
    res = imp(cli, project, "--patch", pfile, "--drop-when", "vllm>=2", "--id", "comment-slots",
              checkout=canonical)  # fmt: skip
    assert res.rc == 0, res.err
    assert f"merged   {CONNECTOR} (three-way merge over blob " in res.out
    text = (canonical / CONNECTOR).read_text()
    assert "group_block_size" in text and "out = []  # slots of real blocks only" in text
    second = project.change_file(CONNECTOR + ".patch", "comment-slots").read_text()
    assert "-        self._block_size" not in second  # only its own edit, over the first change
    assert_strict_apply(cli, project, tmp_path)


def test_patch_without_a_base_is_refused_then_base_release_merges(
    project, cli, canonical, tmp_path
):
    text = upstream_patch(project.upstream, tmp_path, {CONNECTOR: GUARD_SLOTS}, "Comment (#78)")
    stripped = "".join(ln for ln in text.splitlines(True) if not ln.startswith("index "))
    pfile = tmp_path / "78.patch"
    pfile.write_text(stripped)
    snap, co_snap = tree_snapshot(project.overlay), tree_snapshot(canonical)
    res = imp(cli, project, "--patch", pfile, "--drop-when", "vllm>=2", checkout=canonical)
    assert res.rc == 1
    assert f"the patch of {CONNECTOR} does not apply to the file as the series leaves it" in res.err
    assert "Pass --base-release VERSION" in res.err and "Nothing was written" in res.err
    assert tree_snapshot(project.overlay) == snap and tree_snapshot(canonical) == co_snap
    res = imp(cli, project, "--patch", pfile, "--drop-when", "vllm>=2", "--base-release", "1.0.0",
              checkout=canonical)  # fmt: skip
    assert res.rc == 0, res.err
    assert f"three-way merge over {CONNECTOR} of 1.0.0" in res.out
    assert_strict_apply(cli, project, tmp_path)


def test_from_release_clean(project, cli, canonical, tmp_path):
    res = imp(cli, project, "--from-release", "1.1.0", "--paths", CONNECTOR, "--id", "docs-110",
              checkout=canonical)  # fmt: skip
    assert res.rc == 0, res.err
    new = overlay_toml(project)["change"][-1]
    assert new["id"] == "docs-110" and new["drop_when"] == "vllm>=1.1.0"
    assert new["origin"].endswith("/compare/v1.0.0...v1.1.0")
    assert "upstream_tests" not in new  # the release diff of its paths changes no test
    text = (canonical / CONNECTOR).read_text()
    assert "Now with more docs." in text and "group_block_size" in text
    patch = project.change_file(CONNECTOR + ".patch", "docs-110").read_text()
    assert "+Now with more docs." in patch and "-        self._block_size" not in patch
    fresh = assert_strict_apply(cli, project, tmp_path)
    assert (fresh / CONNECTOR).read_text() == text


def test_from_release_names_the_tests_the_release_diff_adds_or_changes(cli, tmp_path):
    """upstream_tests of a release import: the test files that differ between the pin and the
    release under --paths (changed or added), not the unchanged ones nor other files."""
    new_test = "tests/v1/kv_connector/unit/test_docs.py"
    helper = "tests/v1/kv_connector/unit/utils.py"
    v110 = {
        **release_files("1.1.0"),
        LAYOUT_TEST: release_files("1.1.0")[LAYOUT_TEST].replace(*LAYOUT_EDIT),
        new_test: "def test_docs():\n    pass\n",
        helper: "HELPER = 1\n",  # a changed test helper is no test to run
    }
    trees = {"1.0.0": release_files("1.0.0"), "1.1.0": v110}
    up = make_upstream(tmp_path / "synthetic", trees=trees)
    with pinned_project(up, tmp_path / "project") as project:
        co = tmp_path / "co"
        res = cli("apply", "--checkout", co, "--index-url", project.index.url, cwd=project.root)
        assert res.rc == 0, res.err
        assert cli("export", "--checkout", co, cwd=project.root).rc == 0  # as `canonical`
        assert cli("apply", "--checkout", co, cwd=project.root).rc == 0
        unit = "tests/v1/kv_connector/unit"
        res = imp(cli, project, "--from-release", "1.1.0", "--paths", CONNECTOR, unit,
                  "--id", "docs-110", checkout=co)  # fmt: skip
        assert res.rc == 0, res.err
        new = overlay_toml(project)["change"][-1]
        assert new["upstream_tests"] == [new_test, LAYOUT_TEST]  # in the diff's order
        assert sorted(new["files"]) == sorted([CONNECTOR, new_test, LAYOUT_TEST, helper])
        assert f"{unit}/__init__.py" not in new["files"]  # the same in the pin and 1.1.0
        assert_strict_apply(cli, project, tmp_path)
        # a path outside tests/ given to --upstream-tests is refused up front
        res = imp(cli, project, "--from-release", "1.1.0", "--paths", EXTRACT, "--id", "x",
                  "--upstream-tests", "vllm/a.py", checkout=co)  # fmt: skip
        assert res.rc == 1 and "expected an upstream test under tests/" in res.err


def test_upstream_tests_option_overrides_the_default(project, cli, canonical, tmp_path):
    edits = {EXTRACT: BASIC_CACHE, LAYOUT_TEST: LAYOUT_EDIT}
    text = upstream_patch(project.upstream, tmp_path, edits, "Skip padding (#322)")
    pfile = tmp_path / "322.patch"
    pfile.write_text(text)
    node = f"{LAYOUT_TEST}::test_layout"
    res = imp(cli, project, "--patch", pfile, "--drop-when", "vllm>=2", "--upstream-tests", node,
              checkout=canonical)  # fmt: skip
    assert res.rc == 0, res.err
    assert overlay_toml(project)["change"][-1]["upstream_tests"] == [node]


def test_from_release_conflict_stops_with_markers_then_continue(project, cli, canonical, tmp_path):
    before = tree_snapshot(project.overlay), project.lock.read_bytes()
    res = imp(cli, project, "--from-release", "1.2.0", "--paths", CONNECTOR, "--id", "rewrite",
              checkout=canonical)  # fmt: skip
    assert res.rc == 1, res.err
    assert f"CONFLICT {CONNECTOR}" in res.out and "import --continue" in res.out
    text = (canonical / CONNECTOR).read_text()
    assert "<<<<<<< series" in text and ">>>>>>> release 1.2.0" in text and "||||||| pin" in text
    assert (tree_snapshot(project.overlay), project.lock.read_bytes()) == before
    res = cli("apply", "--checkout", canonical, cwd=project.root)
    assert res.rc == 1 and "an import is stopped" in res.err
    st = json.loads(cli("status", "--json", cwd=project.root).out)
    assert st["import"] == {"id": "rewrite", "checkout": str(canonical), "conflicted": [CONNECTOR]}
    res = imp(cli, project, "--continue")
    assert res.rc == 1 and "conflict markers" in res.err
    # resolve: upstream's int() and our group block size
    lines, out, skip = text.splitlines(keepends=True), [], False
    for ln in lines:
        if ln.startswith("<<<<<<<"):
            skip = True
            out.append("        # Use the hidden-states group's own block size.\n")
            out.append("        self._block_size = int(getattr(cache_config, 'group_block_size', "
                       "cache_config.block_size))\n")  # fmt: skip
        elif ln.startswith(">>>>>>>"):
            skip = False
        elif not skip:
            out.append(ln)
    (canonical / CONNECTOR).write_text("".join(out))
    res = imp(cli, project, "--continue")
    assert res.rc == 0, res.err
    assert overlay_toml(project)["change"][-1]["id"] == "rewrite"
    assert "int(getattr(" in project.change_file(CONNECTOR + ".patch", "rewrite").read_text()
    assert not (project.root / ".work" / "import").exists()
    assert_strict_apply(cli, project, tmp_path)


def test_abort_restores_the_checkout(project, cli, canonical, tmp_path):
    head = sh(canonical, "rev-parse", "HEAD")
    co_snap = tree_snapshot(canonical)
    before = tree_snapshot(project.root / "overlay"), project.lock.read_bytes()
    res = imp(cli, project, "--from-release", "1.2.0", "--paths", CONNECTOR, "--id", "rewrite",
              checkout=canonical)  # fmt: skip
    assert res.rc == 1
    res = imp(cli, project, "--abort")
    assert res.rc == 0, res.err
    assert (
        sh(canonical, "rev-parse", "HEAD") == head and sh(canonical, "status", "--porcelain") == ""
    )
    assert {k: v for k, v in tree_snapshot(canonical).items() if not k.startswith(".git/")} == {
        k: v for k, v in co_snap.items() if not k.startswith(".git/")
    }
    assert (tree_snapshot(project.root / "overlay"), project.lock.read_bytes()) == before
    assert imp(cli, project, "--abort").rc == 1  # nothing to abort now


def test_new_file_gets_a_base_entry_and_is_stored_whole(project, cli, canonical, tmp_path):
    newtest = "tests/v1/kv_connector/unit/test_padding.py"
    text = upstream_patch(project.upstream, tmp_path,
                          {EXTRACT: BASIC_CACHE, newtest: ("", "def test_padding():\n    pass\n")},
                          "Skip padding (#99)")  # fmt: skip
    pfile = tmp_path / "99.patch"
    pfile.write_text(text)
    res = imp(cli, project, "--patch", pfile, "--drop-when", "vllm>=2", "--id", "padding",
              checkout=canonical)  # fmt: skip
    assert res.rc == 0, res.err
    new = overlay_toml(project)["change"][-1]
    assert sorted(new["files"]) == sorted([EXTRACT, newtest]) and new["tests"] == [newtest]
    assert new["upstream_tests"] == [newtest]  # upstream's test of the fix, as upstream names it
    assert project.change_file(newtest, "padding").read_text() == "def test_padding():\n    pass\n"
    assert tomllib.loads(project.lock.read_text())["base"][newtest] == "absent"
    assert_strict_apply(cli, project, tmp_path)


# ---------------------------------------------------------------------------------------------
# Bad input: one message each, nothing written


def nothing_written(project, canonical):
    return tree_snapshot(project.root), tree_snapshot(canonical)


@pytest.mark.parametrize(
    "mangle, message",
    [
        (
            lambda t: t.replace(f"a/{EXTRACT}", "a/../outside.py").replace(
                f"b/{EXTRACT}", "b/../outside.py"
            ),
            "escapes or is not normalised",
        ),  # fmt: skip
        (
            lambda t: t.replace(f"a/{EXTRACT}", "a//etc/passwd").replace(
                f"b/{EXTRACT}", "b//etc/passwd"
            ),
            "is absolute",
        ),  # fmt: skip
        (
            lambda t: t.replace(f"a/{EXTRACT}", "a/.git/config").replace(
                f"b/{EXTRACT}", "b/.git/config"
            ),
            "points into .git",
        ),  # fmt: skip
        (
            lambda t: t.split("--- a/")[0] + "GIT binary patch\nliteral 3\nKcmZQzU|;|=0000\n\n",
            "is a binary hunk",
        ),  # fmt: skip
        (lambda t: t.replace("index ", "deleted file mode 100644\nindex ", 1), "deletes the file"),
        (lambda t: t.replace(f"b/{EXTRACT}", "b/vllm/moved.py", 1), "renames a file"),
    ],
)
def test_bad_patches_are_refused(project, cli, canonical, tmp_path, mangle, message):
    text = upstream_patch(project.upstream, tmp_path, {EXTRACT: BASIC_CACHE}, "Fix (#5)")
    pfile = tmp_path / "bad.patch"
    pfile.write_text(mangle(text))
    before = nothing_written(project, canonical)
    res = imp(cli, project, "--patch", pfile, "--drop-when", "vllm>=2", checkout=canonical)
    assert res.rc == 1, res.out
    assert message in res.err and "Traceback" not in res.err
    assert res.err.count("error:") == 1
    assert nothing_written(project, canonical) == before


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_pr_with_the_host_unreachable(project, cli, tmp_path):
    url = f"http://127.0.0.1:{closed_port()}/vllm-project/vllm.git"
    before = tree_snapshot(project.root)
    res = cli("import", "--pr", "51108", "--git-url", url, "--drop-when", "vllm>=2",
              "--index-url", project.index.url, cwd=project.root)  # fmt: skip
    assert res.rc == 1
    assert f"cannot fetch {url.removesuffix('.git')}/pull/51108.patch" in res.err
    assert "not reachable from here; nothing was written" in res.err and "--patch FILE" in res.err
    assert tree_snapshot(project.root) == before


def test_pr_fetches_the_pull_requests_patch(project, cli, canonical, tmp_path):
    edits = {EXTRACT: BASIC_CACHE, LAYOUT_TEST: LAYOUT_EDIT}
    text = upstream_patch(project.upstream, tmp_path, edits, "Skip padding (#321)")
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append(self.path)
            ok = self.path == "/vllm-project/vllm/pull/321.patch"
            self.send_response(200 if ok else 404)
            self.end_headers()
            if ok:
                self.wfile.write(text.encode())

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, args=(0.02,), daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_port}/vllm-project/vllm.git"
        res = imp(cli, project, "--pr", "321", "--git-url", url, "--drop-when", "vllm>=2",
                  checkout=canonical)  # fmt: skip
    finally:
        srv.shutdown()
    assert res.rc == 0, res.err
    assert seen == ["/vllm-project/vllm/pull/321.patch"]
    new = overlay_toml(project)["change"][-1]
    assert new["id"] == "skip-padding" and new["origin"] == f"{url[:-4]}/pull/321"
    assert release_files("1.0.0")[EXTRACT] != (canonical / EXTRACT).read_text()
    # the test file the pull request changes: imported with it, and named as upstream's test
    assert sorted(new["files"]) == sorted([EXTRACT, LAYOUT_TEST]) and new["tests"] == [LAYOUT_TEST]
    assert new["upstream_tests"] == [LAYOUT_TEST]
    st = json.loads(cli("status", "--json", "--checkout", canonical, cwd=project.root).out)
    assert st["changes"][-1]["upstream_tests"] == [LAYOUT_TEST]
    assert st["changes"][0]["upstream_tests"] == []


LATIN1 = "vllm/legacy/names_latin1.txt"
V1 = b"# Latin-1, not UTF-8\nname = Jos\xe9\ncity = Mal\xe9\ncount = 1\nend\n"
V2 = V1.replace(b"name = Jos\xe9\n", b"name = Jos\xe9 Mar\xeda\n")  # the series' own edit
V3 = V1.replace(b"count = 1\n", b"count = 2 \xa9\n")  # written against V1


def _latin1_patches(tmp: Path) -> list[Path]:
    """Three real `git format-patch` mails of a Latin-1 file: add it (V1), edit its name
    line (V2), and, from V1 again, edit a line two further down (its index line names V1's blob)."""
    repo = tmp / "latin1-src"
    repo.mkdir()
    sh(repo, "init", "-q")
    f = repo / LATIN1
    f.parent.mkdir(parents=True)
    out = []
    for i, (start, data, subject) in enumerate(
        [(None, V1, "Add names (#1)"), (V1, V2, "Full name (#2)"), (V1, V3, "Country (#3)")]
    ):
        sh(repo, "checkout", "-q", "--orphan", f"b{i}")
        sh(repo, "rm", "-rfq", "--cached", ".") if i else None
        if start is not None:
            f.write_bytes(start)
            sh(repo, "add", "-A")
            sh(repo, "commit", "-q", f"--author={AUTHOR}", "-m", "base")
        f.write_bytes(data)
        sh(repo, "add", "-A")
        sh(repo, "commit", "-q", f"--author={AUTHOR}", "-m", subject)
        mail = subprocess.run(["git", "format-patch", "-1", "--stdout"], cwd=repo,
                              capture_output=True, check=True).stdout  # fmt: skip
        assert b"Jos\xe9" in mail  # the 8-bit body as it is
        out.append(tmp / f"{i}.patch")
        out[-1].write_bytes(mail)
    return out


def test_a_latin1_file_goes_through_import_byte_exact(project, cli, canonical, tmp_path):
    """A file that is not UTF-8: added, edited, then merged three-way over the blob the
    third mail names (read from the checkout as bytes); the checkout, the exported overlay
    and a fresh strict apply hold git's bytes exactly."""
    added, edit, other = _latin1_patches(tmp_path)
    for i, pfile in enumerate((added, edit)):
        res = imp(cli, project, "--patch", pfile, "--drop-when", "vllm>=9", "--id", f"l{i}",
                  checkout=canonical)  # fmt: skip
        assert res.rc == 0, res.err
    assert (canonical / LATIN1).read_bytes() == V2
    res = imp(cli, project, "--patch", other, "--drop-when", "vllm>=9", "--id", "l2",
              checkout=canonical)  # fmt: skip
    assert res.rc == 0, res.err
    assert f"merged   {LATIN1} (three-way merge over blob " in res.out
    want = V2.replace(b"count = 1\n", b"count = 2 \xa9\n")
    assert (canonical / LATIN1).read_bytes() == want
    patch = project.change_file(LATIN1 + ".patch", "l2").read_bytes()
    assert b"+count = 2 \xa9\n" in patch and b" city = Mal\xe9\n" in patch
    fresh = assert_strict_apply(cli, project, tmp_path)
    assert (fresh / LATIN1).read_bytes() == want


def test_import_is_one_call_that_returns_what_it_did(project, canonical):
    """The library call the command wraps: a stopped import returns its conflicts and writes
    nothing to the project; continue_ returns the files written; the checkout state is typed."""
    proj = Project(project.root)
    req = Request(checkout=canonical, from_release="1.2.0", paths=[CONNECTOR], id="rewrite",
                  settings=Settings(index_url=project.index.url))  # fmt: skip
    out = import_change(proj, req)
    assert out.stopped and out.meta.id == "rewrite" and not out.written
    assert [(m.path, m.conflicted) for m in out.merged] == [(CONNECTOR, True)]
    text = (canonical / CONNECTOR).read_text()
    start, end = text.index("<<<<<<<"), text.index(">>>>>>>")
    resolved = (
        text[:start] + text[start:end].split("=======\n")[1] + text[text.index("\n", end) + 1 :]
    )
    (canonical / CONNECTOR).write_text(resolved)
    done = continue_(proj)
    assert not done.stopped and done.written == (f"rewrite/{CONNECTOR}.patch",)
    state = checkout_state(canonical, proj.lock(), proj.overlay())
    assert state == CheckoutState("matches", state.base, sh(canonical, "rev-parse", "HEAD").strip())
    assert state.to_json() == {"exists": True, "state": "matches", "base": state.base,
                               "head": state.head, "dirty_files": 0}  # fmt: skip
