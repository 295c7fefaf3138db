"""The strict patch applier against git's own output."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from vllm_overlay.errors import PatchError
from vllm_overlay.overlay.patches import apply_patch, canonical_diff, parse_patch


def git_diff(tmp_path: Path, old: bytes | None, new: bytes) -> str:
    """What `git diff --no-index` writes for old -> new (a real git, no hand-written diffs)."""
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir(exist_ok=True)
    if old is not None:
        (a / "f.py").write_bytes(old)
    (b / "f.py").write_bytes(new)
    out = subprocess.run(
        ["git", "diff", "--no-index", "--no-color", "/dev/null" if old is None else "a/f.py", "b/f.py"],
        cwd=tmp_path, capture_output=True, text=True,
    ).stdout  # fmt: skip
    out = out.replace("a/a/f.py", "a/f.py").replace("b/b/f.py", "b/f.py")
    if old is None:
        out = out.replace("b/b/f.py", "b/f.py")
    return canonical_diff(out)


CASES = [
    (b"a\nb\nc\n", b"a\nB\nc\n"),
    (
        b"".join(b"line %d\n" % i for i in range(50)),
        b"".join(b"line %d\n" % i for i in range(50) if i != 25) + b"tail\n",
    ),
    (b"x\ny", b"x\ny\n"),  # gains a newline at EOF
    (b"x\ny\n", b"x\nz"),  # loses it
    (b"x\ny", b"x\nz"),  # no newline either side
    (b"", b"new\n"),
    (b"one\n", b""),
    ("ünïcode\n".encode(), "ünïcode ✓\n".encode()),
]


@pytest.mark.parametrize(("old", "new"), CASES)
def test_applies_gits_diffs_exactly(tmp_path, old, new):
    patch = git_diff(tmp_path, old, new)
    fp = parse_patch(patch, "t.patch")
    assert apply_patch(old, fp, "t") == new


def test_mismatch_reports_hunk_and_first_differing_line(tmp_path):
    old = b"".join(b"line %d\n" % i for i in range(20))
    new = old.replace(b"line 10\n", b"LINE 10\n")
    fp = parse_patch(git_diff(tmp_path, old, new), "t.patch")
    changed = old.replace(b"line 9\n", b"line nine\n")
    with pytest.raises(PatchError) as e:
        apply_patch(changed, fp, "change 'x', file f.py")
    msg = str(e.value)
    assert msg.startswith("change 'x', file f.py: hunk 1 (@@ -8,7 +8,7 @@)")
    assert "line 10 should be 'line 9' but is 'line nine'" in msg


def test_patch_past_end_of_file(tmp_path):
    old = b"a\nb\nc\n"
    fp = parse_patch(git_diff(tmp_path, old, b"a\nb\nC\n"), "t.patch")
    with pytest.raises(PatchError, match="but is end of file"):
        apply_patch(b"a\n", fp, "w")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("hello\n", "not a unified diff"),
        ("--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n a\n", "is truncated"),
        ("--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\nnot a hunk\n", "expected a hunk header"),
        ("--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\ndiff --git a/g b/g\n", "more than one file"),
        ("--- a/f\n+++ b/f\n@@ -1 +1 @@\n*a\n+b\n", "bad line in hunk"),
    ],
)
def test_malformed_patches(text, message):
    with pytest.raises(PatchError, match=message):
        parse_patch(text, "t.patch")


def test_canonical_diff_drops_the_index_line():
    raw = "diff --git a/f b/f\nindex 123..456 100644\n--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n"
    assert canonical_diff(raw) == "diff --git a/f b/f\n--- a/f\n+++ b/f\n@@ -1 +1 @@\n-a\n+b\n"
