"""The overlay as a series: two changes patching one file, each its own unit in apply, export,
status and migration; the bad inputs of a series refused with one message, nothing written."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import CID, FIXED_CONNECTOR_SNIPPET, git_out, tree_snapshot, unified
from synthetic import ADDED_TEST, CONNECTOR, release_files

SECOND = "slots-guard"
GUARD = (
    "        out = []\n",
    "        out = []\n        block_ids = [b for b in block_ids if b >= 0]\n",
)
SECOND_TOML = f'''
[[change]]
id = "{SECOND}"
title = "Skip padding blocks in slots"
why = "Padding block ids (-1) must not produce slots."
origin = "https://github.com/vllm-project/vllm/pull/2"
upstream_status = "open"
drop_when = "vllm>=9"
files = ["{CONNECTOR}"]
tests = []
'''


def git(repo: Path, *args: str, **env: str) -> str:
    """git as a person runs it in the checkout (their identity, an editor given by env)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    e.update(
        GIT_AUTHOR_NAME="dev", GIT_AUTHOR_EMAIL="dev@example.invalid",
        GIT_COMMITTER_NAME="dev", GIT_COMMITTER_EMAIL="dev@example.invalid",
        GIT_CONFIG_GLOBAL=os.devnull, GIT_CONFIG_NOSYSTEM="1", **env,
    )  # fmt: skip
    out = subprocess.run(["git", *args], cwd=repo, env=e, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return out.stdout


def apply(cli, project, dest: Path, *extra: str):
    return cli(
        "apply", "--checkout", dest, "--index-url", project.index.url, *extra, cwd=project.root
    )


@pytest.fixture
def series(project, cli, tmp_path):
    """The project with a second change on the connector, made the way a person makes one:
    append its [[change]], edit the checkout, export. Returns the checkout."""
    co = tmp_path / "co"
    assert apply(cli, project, co).rc == 0
    assert cli("export", "--checkout", co, cwd=project.root).rc == 0  # canonical first change
    with open(project.overlay / "overlay.toml", "a") as f:
        f.write(SECOND_TOML)
    (co / CONNECTOR).write_text((co / CONNECTOR).read_text().replace(*GUARD))
    res = cli("export", "--checkout", co, cwd=project.root)
    assert res.rc == 0, res.err
    assert f"wrote overlay/{SECOND}/{CONNECTOR}.patch" in res.out
    assert res.out.count("wrote ") == 1  # the first change is untouched
    res = apply(cli, project, co, "--force")
    assert res.rc == 0, res.err
    return co


def test_second_change_of_a_file_is_its_own_patch_and_commit(project, cli, series):
    first = project.change_file(CONNECTOR + ".patch").read_text()
    second = project.change_file(CONNECTOR + ".patch", SECOND).read_text()
    assert "+        # Use the hidden-states group's own block size." in first
    assert "block_ids = [b for b in block_ids if b >= 0]" not in first
    assert "+        block_ids = [b for b in block_ids if b >= 0]" in second
    assert "-        self._block_size = cache_config.block_size" not in second
    # it applies to the file as the first change left it: its context/line numbers say so
    assert "@@ -9,6 +9,7 @@" in second  # upstream has these lines one higher (-8)
    co = series
    base = git_out(co, "rev-parse", "refs/vllm-overlay/base")
    log = git_out(co, "log", "--reverse", "--format=%(trailers:key=Overlay-Change,valueonly)",
                  f"{base}..HEAD").split()  # fmt: skip
    assert log == [CID, SECOND]
    assert git_out(co, "diff", "--name-only", "HEAD~1", "HEAD") == CONNECTOR
    want = release_files("1.0.0")[CONNECTOR].replace(*FIXED_CONNECTOR_SNIPPET).replace(*GUARD)
    assert (co / CONNECTOR).read_text() == want
    res = cli("export", "--check", "--checkout", co, cwd=project.root)
    assert res.rc == 0, res.err
    st = json.loads(cli("status", "--json", "--checkout", co, cwd=project.root).out)
    assert st["checkout"]["state"] == "matches"
    assert [c["id"] for c in st["changes"]] == [CID, SECOND]
    assert st["changes"][1]["files"] == [
        {"path": CONNECTOR, "base": st["changes"][0]["files"][0]["base"], "kind": "patched",
         "after": [CID]}
    ]  # fmt: skip
    text = cli("status", "--checkout", co, cwd=project.root).out
    assert f"2. {SECOND}" in text and f"patched {CONNECTOR} (on top of {CID})" in text


def test_edit_the_first_change_without_touching_the_second(project, cli, series):
    """docs/overlay.md: `git rebase -i refs/vllm-overlay/base`, mark the change `edit`,
    amend, continue, export: the edit lands in the first change's patch only."""
    co = series
    second_before = project.change_file(CONNECTOR + ".patch", SECOND).read_bytes()
    git(co, "rebase", "-i", "refs/vllm-overlay/base", GIT_SEQUENCE_EDITOR="sed -i 1s/^pick/edit/")
    text = (co / CONNECTOR).read_text()
    assert "block_ids = [b for b in block_ids if b >= 0]" not in text  # stopped at the first
    (co / CONNECTOR).write_text(text.replace("group's own block size", "group's block size"))
    git(co, "commit", "-a", "--amend", "--no-edit")
    git(co, "rebase", "--continue")
    res = cli("export", "--checkout", co, cwd=project.root)
    assert res.rc == 0, res.err
    assert res.out.splitlines()[0] == f"wrote overlay/{CID}/{CONNECTOR}.patch"
    assert "written, 0 removed" in res.out and res.out.count("wrote ") == 1
    assert "group's block size" in project.change_file(CONNECTOR + ".patch").read_text()
    assert project.change_file(CONNECTOR + ".patch", SECOND).read_bytes() == second_before


def test_uncommitted_edits_belong_to_the_last_change(project, cli, series):
    co = series
    first_before = project.change_file(CONNECTOR + ".patch").read_bytes()
    (co / CONNECTOR).write_text((co / CONNECTOR).read_text().replace("return out", "return out  #"))
    res = cli("export", "--checkout", co, cwd=project.root)
    assert res.rc == 0, res.err
    assert "+        return out  #" in project.change_file(CONNECTOR + ".patch", SECOND).read_text()
    assert project.change_file(CONNECTOR + ".patch").read_bytes() == first_before


def test_an_edit_of_an_earlier_change_left_uncommitted_is_refused(project, cli, series):
    co = series
    (co / ADDED_TEST).write_text((co / ADDED_TEST).read_text() + "# more\n")
    snap = tree_snapshot(project.overlay)
    res = cli("export", "--checkout", co, cwd=project.root)
    assert res.rc == 1
    assert f"change '{SECOND}' (uncommitted work and commits on top" in res.err
    assert ADDED_TEST in res.err and "git commit --fixup=COMMIT" in res.err
    assert tree_snapshot(project.overlay) == snap
    # the way the message gives: a fixup commit, squashed into the first change's commit
    first = git_out(co, "log", "--format=%H", "--grep", f"Overlay-Change: {CID}", "-1")
    git(co, "commit", "-a", f"--fixup={first}")
    res = cli("export", "--checkout", co, cwd=project.root)
    assert res.rc == 1 and "is not squashed into its change yet" in res.err
    assert tree_snapshot(project.overlay) == snap
    git(co, "rebase", "-i", "--autosquash", "refs/vllm-overlay/base", GIT_SEQUENCE_EDITOR="true")
    res = cli("export", "--checkout", co, cwd=project.root)
    assert res.rc == 0, res.err
    assert project.change_file(ADDED_TEST).read_text().endswith("# more\n")  # whole: it adds it


def test_changes_in_the_wrong_order_are_refused_nothing_written(project, cli, series, tmp_path):
    """Bad input: two changes whose patches of one file conflict in the given order."""
    cfg = project.overlay / "overlay.toml"
    text = cfg.read_text()
    head, first, second = text.split("\n[[change]]\n")
    cfg.write_text(f"{head}\n[[change]]\n{second.rstrip()}\n\n[[change]]\n{first}")
    snap = tree_snapshot(project.root)
    res = apply(cli, project, tmp_path / "fresh")
    assert res.rc == 1
    assert f"change '{SECOND}', file {CONNECTOR}: hunk 1" in res.err
    assert f"Later change(s) {CID} in overlay/overlay.toml also patch {CONNECTOR}" in res.err
    assert "the order of the [[change]] tables is wrong" in res.err
    assert "Traceback" not in res.err
    assert not (tmp_path / "fresh").exists()
    assert tree_snapshot(project.root) == snap
    # the checkout, ordered as the commits say, disagrees with overlay.toml: export refuses
    res = cli("export", "--checkout", series, cwd=project.root)
    assert res.rc == 1 and "order" in res.err and tree_snapshot(project.root) == snap


def test_a_later_patch_that_no_longer_applies_after_an_edit_is_refused(
    project, cli, series, tmp_path
):
    """Bad input: the first change's patch edited by hand (one line more); the second, written
    on the old version, no longer applies: one message naming both, nothing written."""
    old = release_files("1.0.0")[CONNECTOR]
    new = old.replace(
        FIXED_CONNECTOR_SNIPPET[0], "        # one more line\n" + FIXED_CONNECTOR_SNIPPET[1]
    )
    project.change_file(CONNECTOR + ".patch").write_text(unified(CONNECTOR, old, new))
    snap = tree_snapshot(project.root)
    co_snap = tree_snapshot(series)
    res = apply(cli, project, series, "--force")
    assert res.rc == 1
    assert f"change '{SECOND}', file {CONNECTOR}: hunk 1" in res.err
    assert f"as the earlier change(s) {CID} leave it" in res.err
    assert "Nothing was applied" in res.err
    assert tree_snapshot(project.root) == snap and tree_snapshot(series) == co_snap
    assert not (tmp_path / "fresh").exists()


def test_commit_trailers_must_name_changes(project, cli, series):
    co = series
    (co / CONNECTOR).write_text((co / CONNECTOR).read_text() + "# x\n")
    git(co, "commit", "-a", "-m", "stray\n\nOverlay-Change: no-such-change")
    res = cli("export", "--checkout", co, cwd=project.root)
    assert res.rc == 1 and "has no change 'no-such-change'" in res.err


# ---------------------------------------------------------------------------------------------
# Migration from the one-change-per-file layout


def to_legacy(overlay: Path) -> None:
    """Move every change's files to overlay/<path> (the layout before the series)."""
    for d in [p for p in overlay.iterdir() if p.is_dir()]:
        for f in sorted(d.rglob("*")):
            if f.is_file():
                dest = overlay / f.relative_to(d)
                dest.parent.mkdir(parents=True, exist_ok=True)
                f.rename(dest)
        shutil.rmtree(d)


def test_migrate_converts_the_old_layout_with_the_same_applied_tree(project, cli, tmp_path):
    co = tmp_path / "co"
    assert apply(cli, project, co).rc == 0
    assert cli("export", "--checkout", co, cwd=project.root).rc == 0
    assert apply(cli, project, co).rc == 0
    head = git_out(co, "rev-parse", "HEAD")
    canonical = tree_snapshot(project.overlay)
    to_legacy(project.overlay)
    assert (project.overlay / (CONNECTOR + ".patch")).is_file()
    res = apply(cli, project, tmp_path / "refused")
    assert res.rc == 1 and "vllm-overlay export --migrate" in res.err
    res = cli("export", "--check", "--checkout", co, cwd=project.root)
    assert res.rc == 1 and "vllm-overlay export --migrate" in res.err
    res = cli("export", "--migrate", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0, res.err
    assert f"moved overlay/{CONNECTOR}.patch -> overlay/{CID}/{CONNECTOR}.patch" in res.out
    after = tree_snapshot(project.overlay)
    assert {k: v for k, v in after.items() if k != "overlay.toml"} == {
        k: v for k, v in canonical.items() if k != "overlay.toml"
    }
    assert b"revision = 2" in after["overlay.toml"]
    res = cli("export", "--check", "--checkout", co, cwd=project.root)
    assert res.rc == 0, res.err
    fresh = tmp_path / "fresh"
    assert apply(cli, project, fresh).rc == 0
    assert git_out(fresh, "rev-parse", "HEAD") == head  # same trees, same commits
    res = cli("export", "--migrate", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 1 and "already in the series layout" in res.err


def test_wheel_provenance_lists_each_change_of_a_file(project, cli, series, tmp_path):
    """The repacked wheel carries the file as the whole series leaves it (verify checks it),
    and its provenance lists both changes, each with its own overlay file and result."""
    import hashlib
    import zipfile

    from fixtures_build import build_args
    from vllm_overlay.wheel.provenance import PROVENANCE_NAME

    res = cli(*build_args(project, tmp_path / "dist"), cwd=project.root)
    assert res.rc == 0, res.err
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        want = release_files("1.0.0")[CONNECTOR].replace(*FIXED_CONNECTOR_SNIPPET).replace(*GUARD)
        assert zf.read(CONNECTOR).decode() == want
        (prov,) = [n for n in zf.namelist() if n.endswith(PROVENANCE_NAME)]
        doc = json.loads(zf.read(prov))
    assert [c["id"] for c in doc["changes"]] == [CID, SECOND]
    (step,) = [f for f in doc["changes"][1]["files"] if f["path"] == CONNECTOR]
    patch = project.change_file(CONNECTOR + ".patch", SECOND).read_bytes()
    assert step["overlay_file"] == f"{SECOND}/{CONNECTOR}.patch"
    assert step["overlay_sha256"] == hashlib.sha256(patch).hexdigest()
    assert step["result_sha256"] == hashlib.sha256(want.encode()).hexdigest()
    first = [f for f in doc["changes"][0]["files"] if f["path"] == CONNECTOR][0]
    assert first["result_sha256"] != step["result_sha256"]  # the file after the first change
    res = cli("inspect", wheel, cwd=project.root)
    assert res.rc == 0 and f"    {SECOND}: Skip padding blocks in slots" in res.out


def test_rebase_keeps_each_change_of_a_file_on_its_own(project, cli, series):
    """A rebase moves a two-change file change by change: each is cherry-picked on its own,
    and the exported patches stay one per change (here both refreshed by moved context)."""
    res = cli("rebase", "--to", "1.1.0", "--index-url", project.index.url, "--json",
              cwd=project.root)  # fmt: skip
    assert res.rc == 0, res.err
    rep = json.loads(res.out)
    assert rep["status"] == "complete"
    assert [c["id"] for c in rep["changes"]] == [CID, SECOND]
    assert {c["state"] for c in rep["changes"]} <= {"kept", "refreshed"}
    second = project.change_file(CONNECTOR + ".patch", SECOND).read_text()
    assert "+        block_ids = [b for b in block_ids if b >= 0]" in second
    first = project.change_file(CONNECTOR + ".patch").read_text()
    assert "block_ids = [b for b in block_ids if b >= 0]" not in first
    res = cli("export", "--check", cwd=project.root)
    assert res.rc == 0, res.err
    fresh = project.root / ".work" / "fresh"
    res = cli("apply", "--checkout", fresh, "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0, res.err
    text = (fresh / CONNECTOR).read_text()
    assert "Now with more docs." in text and "group_block_size" in text and "b >= 0" in text


def test_rebase_stops_at_the_change_that_conflicts_and_goes_on_with_the_next(project, cli, series):
    """1.2.0 rewrites the line the first change edits: the rebase stops at that change only;
    after the resolution the second change of the same file is picked on top of it."""
    res = cli("rebase", "--to", "1.2.0", "--index-url", project.index.url, "--json",
              cwd=project.root)  # fmt: skip
    assert res.rc == 1, res.err
    rep = json.loads(res.out)
    assert rep["stopped_at"]["id"] == CID and rep["stopped_at"]["state"] == "conflict"
    assert [c["state"] for c in rep["changes"]][1] == "pending"
    co = project.root / ".work" / "vllm"
    text = release_files("1.2.0")[CONNECTOR].replace(
        "        self._block_size = int(cache_config.block_size)  # upstream rewrote this\n",
        "        # Use the hidden-states group's own block size.\n"
        "        self._block_size = int(getattr(cache_config, 'group_block_size', "
        "cache_config.block_size))\n",
    )
    (co / CONNECTOR).write_text(text)
    res = cli("rebase", "--continue", "--json", cwd=project.root)
    assert res.rc == 0, res.err
    rep = json.loads(res.out)
    assert [(c["id"], c["state"]) for c in rep["changes"]] == [
        (CID, "resolved"), (SECOND, "refreshed")
    ]  # fmt: skip
    assert "int(getattr(" in project.change_file(CONNECTOR + ".patch").read_text()
    second = project.change_file(CONNECTOR + ".patch", SECOND).read_text()
    assert "+        block_ids = [b for b in block_ids if b >= 0]" in second
    assert "int(getattr(" not in second.split("\n+", 1)[1]  # only its own edit is added
    assert cli("export", "--check", cwd=project.root).rc == 0


def test_a_file_one_change_adds_and_a_later_one_patches(project, cli, series, tmp_path):
    """The second change stores a patch of the file the first one added (not a second whole
    copy), and apply and the wheel take the file as the series leaves it."""
    co = series
    with open(project.overlay / "overlay.toml", "a") as f:
        f.write(SECOND_TOML.replace(SECOND, "more-tests").replace(CONNECTOR, ADDED_TEST))
    (co / ADDED_TEST).write_text((co / ADDED_TEST).read_text() + "\n\ndef test_more():\n    pass\n")
    res = cli("export", "--checkout", co, cwd=project.root)
    assert res.rc == 0, res.err
    patch = project.change_file(ADDED_TEST + ".patch", "more-tests").read_text()
    assert (
        "+def test_more():" in patch and not project.change_file(ADDED_TEST, "more-tests").exists()
    )
    fresh = tmp_path / "fresh"
    res = apply(cli, project, fresh)
    assert res.rc == 0, res.err
    assert (fresh / ADDED_TEST).read_text() == (co / ADDED_TEST).read_text()
    st = json.loads(cli("status", "--json", "--checkout", fresh, cwd=project.root).out)
    assert st["checkout"]["state"] == "matches"
    assert st["changes"][2]["files"][0]["kind"] == "patched"
    assert st["changes"][2]["files"][0]["after"] == [CID]
