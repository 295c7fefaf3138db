"""overlay/overlay.toml validation: every bad key gets a message that points at it."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_overlay.errors import OverlayConfigError, UnsafePathError
from vllm_overlay.overlay import history
from vllm_overlay.overlay.model import load_overlay, overlay_digest, parse_overlay

GOOD = """\
revision = 3

[[change]]
id = "fix-one"
title = "One"
why = "because"
origin = "https://github.com/vllm-project/vllm/pull/1"
upstream_status = "open"
drop_when = "vllm>=0.25.0"
files = ["vllm/a.py", "tests/test_a.py"]
tests = ["tests/test_a.py::test_x"]
"""


def parse(text: str):
    return parse_overlay(text, Path("/p/overlay"))


def test_good_config():
    ov = parse(GOOD)
    assert ov.revision == 3
    (c,) = ov.changes
    assert c.files == ("vllm/a.py", "tests/test_a.py")
    assert c.dropped_by("vllm", "0.25.0") and c.dropped_by("vllm", "0.33.0")
    assert not c.dropped_by("vllm", "0.24.0")
    assert ov.owners("vllm/a.py") == [c] and ov.owners("vllm/b.py") == []


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace('id = "fix-one"\n', ""), "[[change]] #1: missing key(s) ['id']"),
        (lambda t: t.replace('why = "because"\n', ""), "change 'fix-one': missing key(s) ['why']"),
        (lambda t: t.replace('"fix-one"', '"Fix_One"'), "`id` must be kebab-case"),
        (lambda t: t.replace('drop_when = "vllm>=0.25.0"', 'drop_when = "vllm>>1"'), "`drop_when`"),
        (
            lambda t: t.replace('drop_when = "vllm>=0.25.0"', 'drop_when = "soon"'),
            "expected a project and a version specifier",
        ),
        (lambda t: t.replace('origin = "https', 'origin = "ftp'), "`origin` must be a URL"),
        (lambda t: t + 'colour = "blue"\n', "unknown key(s) ['colour']"),
        (lambda t: "nonsense = 1\n" + t, "unknown top-level key(s) ['nonsense']"),
        (
            lambda t: t.replace("revision = 3", "revision = 0"),
            "`revision` must be a positive integer",
        ),
        (
            lambda t: t.replace('files = ["vllm/a.py", "tests/test_a.py"]', "files = []"),
            "`files` is empty",
        ),
        (
            lambda t: t.replace('files = ["vllm/a.py", "tests/test_a.py"]', 'files = "vllm/a.py"'),
            "`files`: expected a list of strings",
        ),
        (lambda t: t.replace('title = "One"', "title = 1"), "`title` must be a non-empty string"),
        (lambda t: t + t.split("\n\n", 1)[1], "duplicate `id` 'fix-one'"),
        (
            lambda t: t.replace('"tests/test_a.py"]', '"tests/test_a.py", "vllm/a.py"]'),
            "lists ['vllm/a.py'] more than once",
        ),
        (lambda t: t.replace("[[change]]", "[change]"), "`change` must be an array of tables"),
        (lambda t: t + "[[change\n", "is not valid TOML"),
    ],
)
def test_bad_config_points_at_the_key(edit, message):
    with pytest.raises(OverlayConfigError) as e:
        parse(edit(GOOD))
    assert message in str(e.value)


@pytest.mark.parametrize(
    "bad", ["/abs/a.py", "../a.py", "vllm/../a.py", "vllm/./a.py", ".git/config", "a\\\\b.py"]
)
def test_bad_paths(bad):
    with pytest.raises(UnsafePathError):
        parse(GOOD.replace('"vllm/a.py"', f'"{bad}"'))


def test_missing_config(tmp_path):
    with pytest.raises(OverlayConfigError, match="does not exist"):
        load_overlay(tmp_path / "overlay")


def test_dropped_history_needs_its_keys():
    with pytest.raises(
        OverlayConfigError, match=r"\[\[dropped\]\] #1: missing key\(s\) \['reason'\]"
    ):
        parse(GOOD + '\n[[dropped]]\nid = "old"\ndropped_in = "0.25.0"\n')
    ov = parse(GOOD + '\n[[dropped]]\nid = "old"\ndropped_in = "0.25.0"\nreason = "merged"\n')
    assert ov.history[0]["id"] == "old"


def test_digest_follows_content(tmp_path):
    d = tmp_path / "overlay"
    (d / "vllm").mkdir(parents=True)
    (d / "overlay.toml").write_text(GOOD)
    (d / "vllm" / "a.py.patch").write_text("x")
    one = overlay_digest(d)
    assert overlay_digest(d) == one
    (d / "vllm" / "a.py.patch").write_text("y")
    assert overlay_digest(d) != one
    (d / "vllm" / "a.py.patch").write_text("x")
    assert overlay_digest(d) == one
    (d / "vllm" / "__pycache__").mkdir()
    (d / "vllm" / "__pycache__" / "junk.pyc").write_bytes(b"1")
    assert overlay_digest(d) == one


def test_several_changes_may_touch_one_file_in_order():
    second = (
        GOOD.split("\n\n", 1)[1]
        .replace("fix-one", "fix-two")
        .replace('"tests/test_a.py"]', '"vllm/b.py"]')
    )
    ov = parse(GOOD + "\n" + second)
    one, two = ov.changes
    assert [c.id for c in ov.owners("vllm/a.py")] == ["fix-one", "fix-two"]
    assert ov.all_files() == ["vllm/a.py", "tests/test_a.py", "vllm/b.py"]  # once each
    assert ov.patch_file("fix-two", "vllm/a.py") == Path("/p/overlay/fix-two/vllm/a.py.patch")
    assert ov.whole_file("fix-one", "tests/test_a.py") == Path("/p/overlay/fix-one/tests/test_a.py")


ORIGINAL = GOOD.replace(
    'drop_when = "vllm>=0.25.0"\n',
    'origin_kind = "original"\ndrop_condition = "upstream saves from a CPU cache"\n',
)


def test_our_own_change_has_a_drop_condition_and_no_release_drops_it():
    (c,) = parse(ORIGINAL).changes
    assert c.origin_kind == "original" and c.drop_when == ""
    assert c.drop_rule == "upstream saves from a CPU cache"
    assert not c.dropped_by("vllm", "0.25.0") and not c.dropped_by("vllm", "9.0")


def test_our_own_change_may_name_the_release_that_meets_its_condition():
    text = ORIGINAL.replace("drop_condition", 'drop_when = "vllm>=0.40.0"\ndrop_condition')
    (c,) = parse(text).changes
    assert c.dropped_by("vllm", "0.40.0") and not c.dropped_by("vllm", "0.39.0")
    assert c.drop_rule == "vllm>=0.40.0, or when upstream saves from a CPU cache"


def test_our_own_change_without_a_drop_condition_is_refused():
    text = ORIGINAL.replace('drop_condition = "upstream saves from a CPU cache"\n', "")
    with pytest.raises(OverlayConfigError, match="needs `drop_condition`"):
        parse(text)


def test_a_backport_without_drop_when_is_refused():
    with pytest.raises(OverlayConfigError, match=r"missing key\(s\) \['drop_when'\]"):
        parse(GOOD.replace('drop_when = "vllm>=0.25.0"\n', ""))


# ---- upstream_tests: a backport's tests as upstream names them ----------------------------

UPSTREAM_TESTS = (
    'upstream_tests = ["tests/v1/core/test_kv_cache_utils.py::test_hidden_group", '
    '"tests/v1/unit/test_new.py"]\n'
)


def test_upstream_tests_are_optional_and_parsed():
    (c,) = parse(GOOD).changes
    assert c.upstream_tests == ()
    (c,) = parse(GOOD + UPSTREAM_TESTS).changes
    assert c.upstream_tests == (
        "tests/v1/core/test_kv_cache_utils.py::test_hidden_group",
        "tests/v1/unit/test_new.py",
    )
    assert c.tests == ("tests/test_a.py::test_x",)  # our own tests stay apart


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        ('"tests/test_a.py"', OverlayConfigError, "`upstream_tests`: expected a list of strings"),
        ("[1]", OverlayConfigError, "`upstream_tests`: expected a list of strings"),
        ('["vllm/a.py"]', OverlayConfigError, "expected an upstream test under tests/"),
        ('["test_a.py::test_x"]', OverlayConfigError, "expected an upstream test under tests/"),
        ('["tests/../vllm/a.py"]', UnsafePathError, "escapes or is not normalised"),
        ('["/tests/test_a.py"]', UnsafePathError, "is absolute"),
    ],
)
def test_bad_upstream_tests_point_at_the_key(value, error, message):
    with pytest.raises(error) as e:
        parse(GOOD + f"upstream_tests = {value}\n")
    assert message in str(e.value) and "change 'fix-one': `upstream_tests`" in str(e.value)


def test_dropped_history_may_keep_upstream_tests():
    dropped = '\n[[dropped]]\nid = "old"\ndropped_in = "0.25.0"\nreason = "merged"\n'
    ov = parse(GOOD + dropped + 'upstream_tests = ["tests/test_old.py"]\n')
    assert ov.history[0]["upstream_tests"] == ["tests/test_old.py"]
    with pytest.raises(UnsafePathError, match=r"\[\[dropped\]\] #1: `upstream_tests`"):
        parse(GOOD + dropped + 'upstream_tests = ["../x.py"]\n')


def test_rewrite_keeps_a_kept_changes_upstream_tests_and_the_dropped_record_carries_them():
    second = GOOD.split("\n\n", 1)[1].replace("fix-one", "fix-two") + UPSTREAM_TESTS
    text = GOOD + UPSTREAM_TESTS + "\n" + second
    rec = history.DroppedRecord(
        "fix-one", "One", "https://x", "0.25.0", "drop_when holds", "tests passed",
        upstream_tests=parse(text).changes[0].upstream_tests,
    )  # fmt: skip
    out = history.rewrite(
        text, dropped=[rec], tests={"fix-two": ["tests/test_b.py"]}, bump_revision=True
    )
    assert UPSTREAM_TESTS in out  # the kept change's line, as it was written
    ov = parse(out)
    (kept,) = ov.changes
    assert kept.id == "fix-two" and kept.tests == ("tests/test_b.py",)
    assert kept.upstream_tests == parse(text).changes[1].upstream_tests
    assert ov.history[0]["upstream_tests"] == list(rec.upstream_tests)
    # without upstream tests the record has no such key
    bare = history.DroppedRecord("fix-two", "Two", "https://x", "0.26.0", "merged", "proof")
    assert "upstream_tests" not in parse(history.rewrite(out, dropped=[bare])).history[1]


def test_add_change_writes_upstream_tests_after_tests():
    fields = {
        "id": "fix-two", "title": "Two", "why": "because", "origin": "https://x/pull/2",
        "upstream_status": "merged", "drop_when": "vllm>=0.26.0", "files": ["vllm/a.py"],
        "tests": [], "upstream_tests": ["tests/v1/test_two.py"],
    }  # fmt: skip
    out = history.add_change(GOOD, fields)
    assert 'tests = []\nupstream_tests = ["tests/v1/test_two.py"]\n' in out
    assert parse(out).changes[1].upstream_tests == ("tests/v1/test_two.py",)
    out = history.add_change(GOOD, {**fields, "upstream_tests": []})
    assert "upstream_tests" not in out  # none: the key is left out


# ---- runners: which of vLLM's model runners a change serves --------------------------------


def test_runners_are_optional_and_parsed():
    (c,) = parse(GOOD).changes
    assert c.runners == ()
    (c,) = parse(GOOD + 'runners = ["v1"]\n').changes
    assert c.runners == ("v1",)
    (c,) = parse(GOOD + 'runners = ["v1", "v2"]\n').changes
    assert c.runners == ("v1", "v2")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ('"v1"', "`runners`: expected a list of strings"),
        ("[]", "`runners` must list the model runners"),
        ('["v3"]', "`runners` must list the model runners"),
        ('["v1", "v1"]', "`runners` must list the model runners"),
    ],
)
def test_bad_runners_point_at_the_key(value, message):
    with pytest.raises(OverlayConfigError) as e:
        parse(GOOD + f"runners = {value}\n")
    assert message in str(e.value) and "change 'fix-one'" in str(e.value)


def test_upstream_after_names_earlier_changes_and_a_drop_takes_it_out():
    second = GOOD.split("\n\n", 1)[1].replace("fix-one", "fix-two")
    text = GOOD + "\n" + second + 'upstream_after = ["fix-one"]\n'
    assert [c.upstream_after for c in parse(text).changes] == [(), ("fix-one",)]
    with pytest.raises(OverlayConfigError, match=r"`upstream_after` names \['fix-two'\]"):
        parse(GOOD + 'upstream_after = ["fix-two"]\n' + "\n" + second)  # a later one
    rec = history.DroppedRecord("fix-one", "One", "https://x", "0.25.0", "merged", "proof")
    (kept,) = parse(history.rewrite(text, dropped=[rec])).changes
    assert kept.id == "fix-two" and kept.upstream_after == ()


def _scoped(cid: str, build: str | None, path: str = "cmake/cpu_extension.cmake") -> str:
    builds = f'builds = ["{build}"]\n' if build else ""
    return (f'\n[[change]]\nid = "{cid}"\ntitle = "T"\nwhy = "w"\norigin = "https://x.invalid/"\n'
            'origin_kind = "original"\ndrop_condition = "never"\nforwarded = "not-yet"\n'
            f'{builds}files = ["{path}"]\ntests = []\n')  # fmt: skip


def test_a_change_scoped_to_a_build_goes_last_and_only_its_builds_carry_it():
    """`builds`: a change to our build of vLLM, proven by the build it enables; the builds
    carry prefixes of the series (none, cpu-source, cpu-test), the whole series is applied."""
    ov = parse(GOOD + _scoped("gate", "cpu-source") + _scoped("one-ext", "cpu-test"))
    one, gate, ext = ov.changes
    assert (one.builds, gate.builds, ext.builds) == ((), ("cpu-source",), ("cpu-test",))
    assert not one.build_only and gate.build_only
    assert gate.proof.startswith("the build it enables (cpu-source): ")
    assert one.proof == "tests/test_a.py::test_x"
    ids = {b: [c.id for c in ov.for_build(b).changes] for b in (None, "cpu-source", "cpu-test")}
    assert ids == {None: ["fix-one"], "cpu-source": ["fix-one", "gate"],
                   "cpu-test": ["fix-one", "gate", "one-ext"]}  # fmt: skip
    # a build's series still knows every path of the whole one (the lock's [base] lists them)
    assert ov.for_build(None).series_files() == ov.all_files()
    assert [c.id for c in ov.build_only()] == ["gate", "one-ext"]


@pytest.mark.parametrize(
    "text, message",
    [
        (_scoped("a", "cpu-test") + _scoped("b", None, "vllm/b.py"), "put every change of every"),
        (_scoped("a", "cpu-test") + _scoped("b", "cpu-source"), "comes after 'a'"),
        (_scoped("a", "cuda"), "`builds` names the one build"),
        (
            _scoped("a", "cpu-test").replace('["cpu-test"]', '["cpu-source", "cpu-test"]'),
            "`builds` names the one build",
        ),
        (_scoped("a", "cpu-test").replace('["cpu-test"]', "[]"), "`builds` names the one build"),
    ],
)
def test_scoped_changes_out_of_order_or_of_an_unknown_build_are_refused(text, message):
    with pytest.raises(OverlayConfigError, match=message):
        parse(GOOD + text)


def test_a_build_only_change_lists_no_engine_tests():
    text = _scoped("a", "cpu-test").replace("tests = []\n", 'tests = []\nengine_tests = ["x"]\n')
    with pytest.raises(OverlayConfigError, match="the build is its proof"):
        parse(GOOD + text)


def test_every_change_of_our_series_has_tests_or_is_proven_by_its_build():
    """What tests/integration/test_overlay_tests.py proves (each test fails without its
    change) covers every change but the build-only ones, which are proven by the build they
    enable (the engine tests compile the test build from the patched tree): said here, so that
    a change with no tests is never passed over silently."""
    ov = load_overlay(Path(__file__).resolve().parents[2] / "overlay")
    untested = [c.id for c in ov.changes if not c.tests and not c.build_only]
    assert untested == []
    scoped = ov.build_only()
    assert scoped and all(c.ours and c.drop_condition and c.since for c in scoped)
    assert all(c.forwarded.state == "not-needed" and not c.engine_tests for c in scoped)
    assert [c.id for c in ov.changes[-len(scoped) :]] == [c.id for c in scoped]  # last
