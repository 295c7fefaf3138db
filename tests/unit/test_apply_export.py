"""apply, edit, export and status on a synthetic upstream: strict, atomic, deterministic."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import ADDED_TEST_BODY, CID, FIXED_CONNECTOR_SNIPPET, git_out, tree_snapshot
from synthetic import ADDED_TEST, CONNECTOR, release_files


def apply(cli, project, dest: Path, *extra: str):
    return cli(
        "apply", "--checkout", dest, "--index-url", project.index.url, *extra, cwd=project.root
    )


def test_apply_gives_one_commit_per_change_over_the_recorded_base(project, cli, tmp_path):
    co = tmp_path / "co"
    res = apply(cli, project, co)
    assert res.rc == 0, res.err
    assert "applied group-block-size" in res.out
    base = git_out(co, "rev-parse", "refs/vllm-overlay/base")
    assert git_out(co, "rev-parse", "HEAD~1") == base
    msg = git_out(co, "log", "-1", "--format=%B")
    assert msg.startswith("group-block-size: Read the hidden-states block size")
    assert "Overlay-Change: group-block-size" in msg
    assert git_out(co, "rev-parse", "--abbrev-ref", "HEAD") == "overlay"
    assert git_out(co, "status", "--porcelain") == ""
    # the patched file carries the change, the rest of it is upstream's
    want = release_files("1.0.0")[CONNECTOR].replace(*FIXED_CONNECTOR_SNIPPET)
    assert (co / CONNECTOR).read_text() == want
    assert (co / ADDED_TEST).read_text() == ADDED_TEST_BODY
    assert (co / "vllm/_version.py").is_file()  # an ignored file of the sdist is still in the tree
    changed = git_out(co, "diff", "--name-only", base, "HEAD").splitlines()
    assert sorted(changed) == sorted([CONNECTOR, ADDED_TEST])


def test_apply_is_deterministic(project, cli, tmp_path):
    heads = []
    for name in ("a", "b"):
        res = apply(cli, project, tmp_path / name)
        assert res.rc == 0, res.err
        heads.append(git_out(tmp_path / name, "rev-parse", "HEAD"))
    assert heads[0] == heads[1]


def test_pristine_checkout(project, cli, tmp_path):
    co = tmp_path / "pristine"
    res = apply(cli, project, co, "--pristine")
    assert res.rc == 0, res.err
    assert git_out(co, "rev-parse", "HEAD") == git_out(co, "rev-parse", "refs/vllm-overlay/base")
    assert (co / CONNECTOR).read_text() == release_files("1.0.0")[CONNECTOR]
    assert not (co / ADDED_TEST).exists()


def test_reapply_over_a_clean_checkout(project, cli, tmp_path):
    co = tmp_path / "co"
    assert apply(cli, project, co).rc == 0
    head = git_out(co, "rev-parse", "HEAD")
    res = apply(cli, project, co)
    assert res.rc == 0, res.err
    assert git_out(co, "rev-parse", "HEAD") == head


def test_patch_that_does_not_apply_names_change_file_hunk_line(project, cli, tmp_path):
    co = tmp_path / "co"
    assert apply(cli, project, co).rc == 0
    before = tree_snapshot(co)
    patch = project.change_file(CONNECTOR + ".patch")
    patch.write_text(patch.read_text().replace(" class Connector:", " class Konnector:"))
    res = apply(cli, project, co)
    assert res.rc == 1
    assert "change 'group-block-size', file " + CONNECTOR in res.err
    assert "hunk 1 (@@ -" in res.err
    assert "should be 'class Konnector:' but is 'class Connector:'" in res.err
    assert "line 5 " in res.err
    assert tree_snapshot(co) == before
    # into a new directory: nothing is created
    res = apply(cli, project, tmp_path / "new")
    assert res.rc == 1 and not (tmp_path / "new").exists()
    assert not list(tmp_path.glob(".new.*"))


def test_patch_with_offset_context_is_refused(project, cli, tmp_path):
    """No offsets: a hunk whose lines exist elsewhere in the file is still refused."""
    patch = project.change_file(CONNECTOR + ".patch")
    text = patch.read_text()
    import re

    shifted = re.sub(r"@@ -(\d+),", lambda m: f"@@ -{int(m.group(1)) + 2},", text, count=1)
    patch.write_text(shifted)
    res = apply(cli, project, tmp_path / "co")
    assert res.rc == 1 and "does not apply" in res.err


def test_base_file_differing_from_lock(project, cli, tmp_path):
    text = project.lock.read_text()
    key = f'"{CONNECTOR}" = "sha256:'
    i = text.index(key) + len(key)
    project.lock.write_text(text[:i] + ("0" if text[i] != "0" else "1") + text[i + 1 :])
    res = apply(cli, project, tmp_path / "co")
    assert res.rc == 1
    assert f"upstream file {CONNECTOR} differs from upstream.lock: expected sha256:" in res.err
    assert "found sha256:" in res.err and "nothing was applied" in res.err
    assert not (tmp_path / "co").exists()


def test_added_file_that_upstream_has_is_a_base_mismatch(project, cli, tmp_path):
    text = project.lock.read_text().replace(f'"{ADDED_TEST}" = "absent"', '"README.md" = "absent"')
    project.lock.write_text(text)
    res = apply(cli, project, tmp_path / "co")
    assert res.rc == 1 and "[base]" in res.err  # the lock no longer covers the overlay's files


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("../escape.py", "escapes or is not normalised"),
        ("vllm/../../escape.py", "escapes or is not normalised"),
        ("/etc/passwd", "is absolute"),
        ("vllm//x.py", "escapes or is not normalised"),
    ],
)
def test_unsafe_overlay_paths(project, cli, tmp_path, path, message):
    cfg = project.overlay / "overlay.toml"
    cfg.write_text(
        cfg.read_text().replace(f'    "{ADDED_TEST}",\n', f'    "{ADDED_TEST}",\n    "{path}",\n')
    )
    snap = tree_snapshot(project.root)
    res = apply(cli, project, tmp_path / "co")
    assert res.rc == 1
    assert message in res.err
    assert "Traceback" not in res.err
    assert tree_snapshot(project.root) == snap
    assert not (tmp_path / "co").exists()


def test_overlay_path_through_a_symlink(project, cli, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    real = project.change_file("tests")
    real.rename(outside / "tests")
    os.symlink(outside / "tests", project.change_file("tests"))
    res = apply(cli, project, tmp_path / "co")
    assert res.rc == 1
    assert "passes through a symlink" in res.err
    assert not (tmp_path / "co").exists()


def test_tree_path_through_a_symlink_is_refused(tmp_path):
    """A tree whose directory is a symlink (possible from a git source) is never written through."""
    from vllm_overlay.errors import UnsafePathError
    from vllm_overlay.overlay.model import safe_join

    victim = tmp_path / "victim"
    victim.mkdir()
    root = tmp_path / "tree"
    (root / "vllm").mkdir(parents=True)
    os.symlink(victim, root / "vllm" / "linked")
    os.symlink(victim / "f.py", root / "vllm" / "f.py")
    with pytest.raises(UnsafePathError, match="passes through a symlink"):
        safe_join(root, "vllm/linked/x.py")
    with pytest.raises(UnsafePathError, match="passes through a symlink"):
        safe_join(root, "vllm/f.py")
    assert safe_join(root, "vllm/plain.py") == root / "vllm" / "plain.py"


def test_dirty_checkout_is_refused_and_force_stashes(project, cli, tmp_path):
    co = tmp_path / "co"
    assert apply(cli, project, co).rc == 0
    (co / "README.md").write_text("my uncommitted work\n")
    (co / "notes.txt").write_text("untracked work\n")
    before = tree_snapshot(co)
    res = apply(cli, project, co)
    assert res.rc == 1
    assert "has uncommitted changes" in res.err and "README.md" in res.err and "--force" in res.err
    assert tree_snapshot(co) == before
    res = apply(cli, project, co, "--force")
    assert res.rc == 0, res.err
    assert "stashed uncommitted changes" in res.out
    assert not (co / "notes.txt").exists()
    git_out(co, "stash", "pop")
    assert (co / "README.md").read_text() == "my uncommitted work\n"
    assert (co / "notes.txt").read_text() == "untracked work\n"


def test_existing_foreign_directory_is_refused(project, cli, tmp_path):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "file").write_text("keep me")
    res = apply(cli, project, d)
    assert res.rc == 1 and "is not a vllm-overlay checkout" in res.err
    assert (d / "file").read_text() == "keep me"


def test_export_round_trip_is_canonical_and_deterministic(project, cli, tmp_path):
    co = tmp_path / "co"
    assert apply(cli, project, co).rc == 0
    res = cli("export", "--checkout", co, cwd=project.root)
    assert res.rc == 0, res.err
    first = tree_snapshot(project.overlay)
    patch = first[f"{CID}/{CONNECTOR}.patch"].decode()
    assert patch.startswith(f"diff --git a/{CONNECTOR} b/{CONNECTOR}\n--- a/{CONNECTOR}\n")
    assert "\nindex " not in patch
    # export again (and from a second, independent checkout): same bytes
    assert cli("export", "--checkout", co, cwd=project.root).out.endswith(
        "0 written, 0 removed, 2 unchanged\n"
    )
    co2 = tmp_path / "co2"
    assert apply(cli, project, co2).rc == 0
    assert cli("export", "--checkout", co2, cwd=project.root).rc == 0
    assert tree_snapshot(project.overlay) == first
    res = cli("export", "--check", "--checkout", co2, cwd=project.root)
    assert res.rc == 0 and "up to date" in res.out


def test_export_check_names_every_file_that_would_change(project, cli, tmp_path):
    co = tmp_path / "co"
    assert apply(cli, project, co).rc == 0
    assert cli("export", "--checkout", co, cwd=project.root).rc == 0
    (co / CONNECTOR).write_text((co / CONNECTOR).read_text() + "\n# more\n")
    (co / ADDED_TEST).write_text(ADDED_TEST_BODY + "\n# more\n")
    stray = project.change_file("vllm/stale.py.patch")
    stray.write_text("old\n")
    snap = tree_snapshot(project.overlay)
    res = cli("export", "--check", "--checkout", co, cwd=project.root)
    assert res.rc == 1
    assert f"would write overlay/{CID}/{CONNECTOR}.patch" in res.err
    assert f"would write overlay/{CID}/{ADDED_TEST}" in res.err
    assert f"would remove overlay/{CID}/vllm/stale.py.patch" in res.err
    assert tree_snapshot(project.overlay) == snap
    res = cli("export", "--checkout", co, cwd=project.root)
    assert res.rc == 0
    assert not stray.exists()
    assert "+# more" in (project.change_file(CONNECTOR + ".patch")).read_text()


def test_export_from_a_stale_checkout_is_refused(project, cli, tmp_path):
    """A checkout applied before overlay/ changed (a pull, a merge: here, another checkout's
    export) holds nothing to export: export and --check say so, write nothing, and name
    apply; after apply it is up to date."""
    old, new = tmp_path / "old", tmp_path / "new"
    assert apply(cli, project, old).rc == 0
    assert cli("export", "--checkout", old, cwd=project.root).rc == 0  # canonical bytes
    assert apply(cli, project, new).rc == 0
    (new / CONNECTOR).write_text((new / CONNECTOR).read_text() + "\n# theirs\n")
    assert cli("export", "--checkout", new, cwd=project.root).rc == 0
    snap = tree_snapshot(project.overlay)
    for extra in ((), ("--check",)):
        res = cli("export", *extra, "--checkout", old, cwd=project.root)
        assert res.rc == 1, res.out
        assert f"{old} is stale" in res.err and f"overlay/{CID}/{CONNECTOR}.patch" in res.err
        assert "vllm-overlay apply" in res.err
        assert tree_snapshot(project.overlay) == snap
    assert apply(cli, project, old).rc == 0
    res = cli("export", "--check", "--checkout", old, cwd=project.root)
    assert res.rc == 0 and "up to date" in res.out, res.err


def test_export_check_without_checkout_makes_one(project, cli):
    # the fixture's patch was written by difflib, not export: the round trip shows it
    res = cli("export", "--check", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 1 and f"would write overlay/{CID}/{CONNECTOR}.patch" in res.err
    assert cli("export", cwd=project.root).rc == 0
    res = cli("export", "--check", cwd=project.root)
    assert res.rc == 0, res.err


def test_export_refuses_changes_outside_the_overlay(project, cli, tmp_path):
    co = tmp_path / "co"
    assert apply(cli, project, co).rc == 0
    (co / "README.md").write_text("changed\n")
    (co / "vllm" / "new_module.py").write_text("x = 1\n")
    snap = tree_snapshot(project.overlay)
    res = cli("export", "--checkout", co, cwd=project.root)
    assert res.rc == 1
    assert (
        "changes files it does not list" in res.err
        and "README.md" in res.err
        and "vllm/new_module.py" in res.err
    )
    assert tree_snapshot(project.overlay) == snap


def test_export_refuses_a_reverted_file(project, cli, tmp_path):
    co = tmp_path / "co"
    assert apply(cli, project, co).rc == 0
    (co / CONNECTOR).write_text(release_files("1.0.0")[CONNECTOR])
    res = cli("export", "--checkout", co, cwd=project.root)
    assert res.rc == 1 and f"does not change {CONNECTOR}" in res.err


def test_edit_then_export_then_apply(project, cli):
    res = cli("edit", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0, res.err
    co = project.root / ".work" / "vllm"
    assert (co / ADDED_TEST).is_file()
    (co / CONNECTOR).write_text(
        (co / CONNECTOR).read_text().replace('return "NHD"', 'return "NHD"  # ours')
    )
    res = cli("edit", cwd=project.root)  # a second edit keeps the work
    assert "already has edits" in res.out
    assert 'return "NHD"  # ours' in (co / CONNECTOR).read_text()
    st = json.loads(cli("status", "--json", cwd=project.root).out)
    assert st["checkout"]["state"] == "edited"
    assert cli("export", cwd=project.root).rc == 0
    assert (
        '+        return "NHD"  # ours' in (project.change_file(CONNECTOR + ".patch")).read_text()
    )
    res = cli("apply", "--force", cwd=project.root)
    assert res.rc == 0, res.err
    st = json.loads(cli("status", "--json", cwd=project.root).out)
    assert st["checkout"]["state"] == "matches"


def test_status(project, cli, tmp_path):
    res = cli("status", "--checkout", tmp_path / "none", cwd=project.root)
    assert res.rc == 0
    assert "upstream: vllm 1.0.0 (v1.0.0, commit " in res.out
    assert "group-block-size" in res.out and "drop when vllm>=1.3.0" in res.out
    assert f"patched {CONNECTOR}" in res.out and f"added   {ADDED_TEST}" in res.out
    assert "missing" in res.out
    co = tmp_path / "co"
    apply(cli, project, co)
    cli("export", "--checkout", co, cwd=project.root)
    st = json.loads(cli("status", "--json", "--checkout", co, cwd=project.root).out)
    assert st["checkout"]["state"] == "matches"
    assert st["changes"][0]["drop_now"] is False
    assert st["upstream"]["commit"] == project.upstream.releases["1.0.0"].commit
    # change the overlay: the checkout is stale
    p = project.change_file(ADDED_TEST)
    p.write_text(p.read_text() + "# v2\n")
    st = json.loads(cli("status", "--json", "--checkout", co, cwd=project.root).out)
    assert st["checkout"]["state"] == "stale"
