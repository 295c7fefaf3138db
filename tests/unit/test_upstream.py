"""`vllm-overlay upstream` on the synthetic upstream: the change of ours as upstream would take
it (one commit, signed off, without our scaffolding), its tests with the commit (pass) and
without it (fail), the hooks, and what it writes or refuses. Runs git, pytest (this Python)
and ruff (this tool's, the synthetic tree pins none) for real."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from conftest import ADDED_TEST_BODY, CID, git_out
from synthetic import ADDED_TEST, CONNECTOR
from vllm_overlay.upstream import checklist, ci, hooks, prepare, scrub, texts

NAME, EMAIL = "Ada Lovelace", "ada@example.org"
ASSISTANT = "Claude <noreply@anthropic.com>"

SCAFFOLDED = (
    '"""The connector reads its own group\'s block size.\n\n'
    "Added by vllm-overlay with its change group-block-size.\n"
    "The hidden-states group has a block size of its own.\n\n"
    "Running on an unpatched tree: set ``VLLM_OVERLAY_TREE=pristine``; the tests that\n"
    'need the change are then ``xfail(strict=True)``.\n"""\n\n'
    "import os\n\nimport pytest\n\n"
    '_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")\n'
    'if _TREE not in ("patched", "pristine"):\n'
    '    raise ValueError(f"VLLM_OVERLAY_TREE={_TREE!r}")\n\n'
    "needs_change = pytest.mark.xfail(\n"
    '    _TREE == "pristine", reason="needs group-block-size", strict=True\n)\n\n\n'
    "@needs_change\n"
) + ADDED_TEST_BODY


def _make_ours(p, *, security: bool = False, test_body: str = SCAFFOLDED) -> None:
    """The project's one change as a change of ours, its test with our scaffolding."""
    cfg = p.overlay / "overlay.toml"
    text = (
        cfg.read_text()
        .replace(
            'origin_kind = "backport"\n',
            'origin_kind = "original"\nforwarded = "not-yet"\nsince = "1.0.0"\n'
            'drop_condition = "the connector reads the group\'s block size"\n'
            'reproduction = "Give the connector a group block size of 22: slots start at 528."\n'
            + ("security = true\n" if security else ""),
        )
        .replace('drop_when = "vllm>=1.3.0"\n', "")
    )
    cfg.write_text(text)
    p.change_file(ADDED_TEST).write_text(test_body)


def _identity(root: Path, *, assistant: bool = True) -> None:
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    for key, val in (("user.name", NAME), ("user.email", EMAIL)):
        subprocess.run(["git", "config", key, val], cwd=root, check=True)
    if assistant:
        subprocess.run(["git", "config", "vllm-overlay.assistedBy", ASSISTANT], cwd=root,
                       check=True)  # fmt: skip


def test_upstream_prepares_a_signed_commit_proven_both_ways(project, cli):
    _make_ours(project)
    _identity(project.root)
    out = project.root / "out"
    res = cli(
        "upstream", CID, "--out", out, "--json", "--index-url", project.index.url, cwd=project.root
    )
    assert res.rc == 0, res.err
    rep = json.loads(res.out)
    assert rep["with"]["ok"] and rep["with"]["passed"] == 1
    assert rep["without"]["failed"] == 1  # the tests fail on the release without the commit
    assert sorted(p.name for p in out.iterdir()) == [
        f"0001-{CID}.patch", "checklist.md", "proof.json", "pull-request.md", "vllm",
    ]  # fmt: skip
    clone = out / "vllm"
    assert git_out(clone, "rev-parse", "--abbrev-ref", "HEAD") == f"upstream/{CID}"
    assert git_out(clone, "rev-list", "--count", "refs/vllm-overlay/base..HEAD") == "1"
    msg = git_out(clone, "log", "-1", "--format=%B")
    assert msg.startswith("[Bugfix][KVConnector] Read the hidden-states block size")
    assert msg.rstrip().endswith(f"Signed-off-by: {NAME} <{EMAIL}>")
    assert "Reproduction:" in msg and "slots start at 528" in msg
    assert git_out(clone, "log", "-1", "--format=%an <%ae>") == f"{NAME} <{EMAIL}>"
    test = (clone / ADDED_TEST).read_text()
    assert "vllm-overlay" not in test and "VLLM_OVERLAY_TREE" not in test
    assert "needs_change" not in test and "import os" not in test  # ruff's fix took the import
    assert "The hidden-states group has a block size of its own." in test
    # ruff format's fix of the connector's line is in the commit, and the hooks then pass
    assert "getattr(\n" in (clone / CONNECTOR).read_text()
    assert {h["id"]: h["ok"] for h in rep["hooks"]} == {"ruff-check": True, "ruff-format": True}
    assert git_out(clone, "status", "--porcelain") == ""
    patch = (out / f"0001-{CID}.patch").read_text()
    assert patch.startswith("From ") and f"Signed-off-by: {NAME} <{EMAIL}>" in patch
    # the patch applies to the release as it was (git am, as a maintainer would)
    subprocess.run(["git", "checkout", "-q", "-B", "check", "refs/vllm-overlay/base"], cwd=clone,
                   check=True)  # fmt: skip
    env = {"GIT_COMMITTER_NAME": "m", "GIT_COMMITTER_EMAIL": "m@x", "HOME": str(project.root)}
    subprocess.run(["git", "am", "-q", str(out / f"0001-{CID}.patch")], cwd=clone, check=True,
                   env={**env, "PATH": "/usr/bin:/bin"})  # fmt: skip
    body = (out / "pull-request.md").read_text()
    assert body.startswith("## Purpose") and "## Test Plan" in body and "## Test Result" in body
    # both commands, runnable in vLLM's tree, and the output of each: the failing test's
    # short summary line with its assertion, then pytest's own last line
    code = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
    assert f"git diff HEAD~1 -- {code} | git apply -R\n" in body
    assert f".venv/bin/python -m pytest -v {ADDED_TEST}\n" in body
    assert f"FAILED {ADDED_TEST}::test_group_block_size - assert 528 == 22\n" in body
    assert re.search(r"^1 failed in [\d.]+s$", body, re.M)
    assert re.search(r"^1 passed in [\d.]+s$", body, re.M)
    assert "no step file under `.buildkite/test_areas/`" in body  # the synthetic tree has none
    assert "2 of the hooks that select the changed files pass" in body
    assert "AI assistance was used" in body and "review every changed line" in body
    assert "## Not a duplicate" in body and "speculators/issues/613" in body
    trailers = msg.rstrip().splitlines()[-2:]
    assert trailers == [f"Co-authored-by: {ASSISTANT}", f"Signed-off-by: {NAME} <{EMAIL}>"]
    proof = json.loads((out / "proof.json").read_text())
    assert proof["ok"] is True and proof["assisted_by"] == ASSISTANT
    verdict = {i["rule"].split(" (")[0].split(":")[0]: i["verdict"] for i in proof["checklist"]}
    assert verdict["tests pass with the commit and fail without it; both commands and their "
                   "output in the PR body"] == "yes"  # fmt: skip
    assert verdict["a regression test through `LLM`"] == "no"  # its test calls the connector
    assert verdict["the statement of AI assistance, and an attribution trailer before "
                   "Signed-off-by"] == "yes"  # fmt: skip
    assert verdict["a CI step selects each test"] == "left for the person"
    assert verdict["the duplicate-work searches themselves"] == "left for the person"
    listed = (out / "checklist.md").read_text()
    assert "| 3 | tests extend the existing test files" in listed and "**no**" in listed
    assert f"{ADDED_TEST}: a new file" in listed and "test_layout.py already tests" in listed
    assert "docs not updated" in listed and "heuristic" in listed
    assert "finding: the docs of a user-visible change" not in res.out  # --json: no text
    assert "upstream: NOT YET SENT" in cli("status", cwd=project.root).out


def test_a_security_fix_gets_an_advisory_and_no_pull_request_body(project, cli):
    _make_ours(project, security=True)
    _identity(project.root, assistant=False)  # the option names the assistant instead
    out = project.root / "out"
    res = cli("upstream", CID, "--out", out, "--assisted-by", "Other Bot <bot@example.org>",
              "--index-url", project.index.url, cwd=project.root)  # fmt: skip
    assert res.rc == 0, res.err
    assert not (out / "pull-request.md").exists()
    adv = (out / "advisory.md").read_text()
    assert adv.startswith("# Security advisory draft:")
    assert "privately" in adv and "1 failed" in adv
    assert "AI assistance was used to prepare this change (Other Bot," in adv
    patch = (out / f"0001-{CID}.patch").read_text()
    assert "Co-authored-by: Other Bot <bot@example.org>\nSigned-off-by: Ada" in patch
    assert "a security fix" in res.out
    # the report prints the checklist, and each "no" as a finding with its evidence
    assert "checklist against the release's AGENTS.md and tests/AGENTS.md" in res.out
    assert "finding: the docs of a user-visible change, in the same PR:" in res.out
    assert "docs not updated" in res.out
    assert (out / "checklist.md").is_file()


def test_refused_when_the_tests_pass_without_the_change(project, cli):
    passing = "def test_nothing_to_do_with_it():\n    assert True\n"
    _make_ours(project, test_body=passing)
    _identity(project.root)
    out = project.root / "out"
    out.mkdir()
    (out / "old.txt").write_text("kept")
    res = cli("upstream", CID, "--out", out, "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 1
    assert "the tests without the commit did not fail" in res.err
    assert [p.name for p in out.iterdir()] == ["old.txt"]  # the old output stays as it was
    refused = json.loads((project.root / "out.refused.json").read_text())
    assert refused["ok"] is False and refused["without"]["passed"] == 1


def test_refused_without_a_git_identity(project, cli):
    _make_ours(project)
    res = cli("upstream", CID, "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 2
    assert "git config --global user.name" in res.err


def test_refused_where_the_overlay_is_still_named(project, cli):
    _make_ours(project, test_body="# Written for vllm-overlay's series.\n" + ADDED_TEST_BODY)
    _identity(project.root)
    res = cli("upstream", CID, "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 1
    assert f"{ADDED_TEST}:1: # Written for vllm-overlay's series." in res.err


def test_a_backport_is_not_ours_to_send(project, cli):
    _identity(project.root)
    res = cli("upstream", CID, "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 2 and "is a backport of" in res.err


def test_scrub_leaves_what_upstream_reads():
    out = scrub.scrub(SCAFFOLDED)
    assert scrub.leftovers("t.py", out) == []
    assert "@needs_change" not in out and "_TREE" not in out
    assert out.startswith('"""The connector reads its own group\'s block size.\n\n')
    assert "def test_group_block_size" in out
    assert scrub.scrub(ADDED_TEST_BODY) == ADDED_TEST_BODY  # nothing to take out


def test_adjacent_insertions_keep_ours_without_the_earlier_change():
    merged = (
        b"a\n<<<<<<< upstream\n||||||| series\nearlier\n=======\nmine\nearlier\n>>>>>>> change\nz\n"
    )
    assert prepare._adjacent(merged) == b"a\nmine\nz\n"
    after = merged.replace(b"mine\nearlier\n", b"earlier\nmine\n")
    assert prepare._adjacent(after) == b"a\nmine\nz\n"
    overlap = merged.replace(b"mine\nearlier\n", b"changed\n")
    assert prepare._adjacent(overlap) is None
    within = merged.replace(b"mine\nearlier\n", b"mine_earlier\n")  # not whole lines
    assert prepare._adjacent(within) is None


def test_title_follows_vllms_rule():
    assert prepare.title_ok("[Bugfix][KVConnector] Keep files inside")
    assert not prepare.title_ok("Keep files inside")
    assert not prepare.title_ok("[Bugfix]Keep")


def _hook_tree(tmp_path: Path, config: str) -> Path:
    tree = tmp_path / "tree"
    (tree / "tools").mkdir(parents=True)
    (tree / ".pre-commit-config.yaml").write_text(config)
    (tree / "tools" / "no_print.py").write_text(
        "import sys\n"
        "bad = [f for f in sys.argv[1:] if 'print(' in open(f).read()]\n"
        "print(*bad)\nsys.exit(1 if bad else 0)\n"
    )
    (tree / "a.py").write_text("print('x')\n")
    (tree / "b.txt").write_text("print(\n")
    subprocess.run(["git", "init", "-q", str(tree)], check=True)
    subprocess.run(["git", "-C", str(tree), "add", "-A"], check=True)
    return tree


RUFF = """\
- repo: https://github.com/astral-sh/ruff-pre-commit
  rev: 0123456789abcdef0123456789abcdef01234567  # frozen: v0.17.2
  hooks:
  - id: ruff-check
"""
LOCAL = """\
- repo: local
  hooks:
  - id: no-print
    name: no print
    language: python
    entry: python tools/no_print.py
    types: [python]
  - id: needs-mypy
    name: mypy
    language: python
    entry: python tools/mypy.py
    types: [python]
    additional_dependencies: ["mypy==0.0.1"]
  - id: msg
    name: msg
    language: system
    entry: true
    stages: [commit-msg]
"""
CONFIG = "repos:\n" + RUFF + LOCAL


def test_the_ruff_version_comes_from_the_frozen_comment(tmp_path):
    tree = _hook_tree(tmp_path, CONFIG)
    config = hooks.load_config(tree, sys.executable)
    assert hooks.ruff_version(tree, config) == "0.17.2"
    tagged = {"repos": [{"repo": "https://github.com/astral-sh/ruff-pre-commit", "rev": "v0.6.1"}]}
    assert hooks.ruff_version(tree, tagged) == "0.6.1"
    assert hooks.ruff_version(tree, None) == ""


def test_local_python_hooks_run_on_the_files_they_select(tmp_path):
    tree = _hook_tree(tmp_path, "repos:\n" + LOCAL)  # no ruff: nothing to install
    selected = hooks.select(tree, ["a.py", "b.txt"], sys.executable)
    ids = [e[0] for e in selected.entries]
    assert ids == ["no-print"]  # the commit-msg hook is not a pre-commit one
    assert selected.entries[0][2] == ["a.py"]  # types: [python]
    [mypy] = selected.skipped
    assert mypy.id == "needs-mypy" and "mypy" in mypy.why_skipped
    results = hooks.run_hooks(tree, selected)
    assert [(r.id, r.ran, r.ok) for r in results] == [("no-print", True, False),
                                                      ("needs-mypy", False, True)]  # fmt: skip
    assert "a.py" in results[0].output


@pytest.mark.parametrize("missing", ["user.name", "user.email"])
def test_identity_needs_both(project, missing):
    from vllm_overlay.gitrepo import user_identity

    _identity(project.root)
    subprocess.run(["git", "config", "--unset", missing], cwd=project.root, check=True)
    assert user_identity(project.root) is None


def test_status_json_has_the_standing(project, cli):
    _make_ours(project)
    data = json.loads(cli("status", "--json", cwd=project.root).out)
    [c] = data["changes"]
    assert c["forwarded"] == {"state": "not-yet", "summary": "not yet sent upstream"}
    assert c["since"] == "1.0.0"
    assert tomllib.loads((project.overlay / "overlay.toml").read_text())["change"][0]["forwarded"]


def test_refused_without_an_assistant_named(project, cli):
    _make_ours(project)
    _identity(project.root, assistant=False)
    res = cli("upstream", CID, "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 2
    assert "--assisted-by" in res.err and "git config --global vllm-overlay.assistedBy" in res.err


def test_refused_where_the_assistant_names_the_overlay(project, cli):
    _make_ours(project)
    _identity(project.root, assistant=False)
    res = cli("upstream", CID, "--assisted-by", "vllm-overlay bot <bot@example.org>",
              "--index-url", project.index.url, cwd=project.root)  # fmt: skip
    assert res.rc == 1
    assert "commit message:" in res.err and "Co-authored-by: vllm-overlay bot" in res.err


STEPS = """\
group: Misc
steps:
- label: KV Connectors
  source_file_dependencies:
    - vllm/distributed/
    - "!vllm/distributed/kv_transfer/"
    - tests/v1/kv_connector/unit
  commands:
    - export X=1
    - pytest -v -s -m 'not cpu_test' v1/kv_connector/unit --ignore=v1/kv_connector/unit/test_slow.py
- label: KV Connectors (CPU)
  commands:
    - pytest -v -s -m 'cpu_test' v1/kv_connector/unit
- label: Hidden states
  working_dir: "/vllm-workspace"
  source_file_dependencies:
    - vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py
  commands:
    - >-
      pytest -v -s
      tests/v1/kv_connector/extract_hidden_states_integration
      tests/v1/other/test_one.py::test_a
"""


def _areas(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    (tree / ci.AREAS).mkdir(parents=True)
    (tree / ci.AREAS / "misc.yaml").write_text(STEPS)
    (tree / ci.AREAS / "empty.yaml").write_text("")
    return tree


def test_ci_finds_the_step_that_selects_each_test_and_what_it_leaves_out(tmp_path):
    steps = ci.load_steps(_areas(tmp_path), sys.executable)
    assert [s.label for s in steps] == ["KV Connectors", "KV Connectors (CPU)", "Hidden states"]
    unit = "tests/v1/kv_connector/unit/test_hs.py"
    marked = "import pytest\n\npytestmark = pytest.mark.cpu_test\n"
    tests = {unit: "def test_a(): pass\n", "tests/v1/kv_connector/unit/test_cpu.py": marked,
             "tests/v1/kv_connector/unit/test_slow.py": "",
             "tests/v1/kv_connector/extract_hidden_states_integration/test_e.py": "",
             "tests/v1/other/test_one.py": "", "tests/v1/other/test_two.py": ""}  # fmt: skip
    sel = {s.test: s for s in ci.select(steps, tests)}
    [(step, run, note)] = sel[unit].steps  # the -m 'cpu_test' step does not take it
    assert step.label == "KV Connectors" and note == "-m 'not cpu_test'"
    assert run.command.startswith("pytest -v -s -m 'not cpu_test' v1/kv_connector/unit")
    [(cpu, _, _)] = sel["tests/v1/kv_connector/unit/test_cpu.py"].steps
    assert cpu.label == "KV Connectors (CPU)"
    assert sel["tests/v1/kv_connector/unit/test_slow.py"].steps == []  # --ignore
    assert sel["tests/v1/kv_connector/unit/test_slow.py"].suggestion.startswith(
        ".buildkite/test_areas/misc.yaml (its step 'KV Connectors'"
    )
    assert [s.label for s, _, _ in sel["tests/v1/other/test_one.py"].steps] == ["Hidden states"]
    assert sel["tests/v1/other/test_two.py"].steps == []
    code = "vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py"
    assert ci.uncovered(step, [code, unit]) == [(code, "!vllm/distributed/kv_transfer/")]
    assert ci.uncovered(steps[1], [code]) == []  # no dependencies: it always runs
    assert ci.uncovered(steps[2], [code, "vllm/x.py"]) == [("vllm/x.py", "")]


def test_ci_reads_pytest_in_commands_and_marker_expressions():
    [a, b] = ci.pytest_runs("cd x && python3 -m pytest -k 'abc' v1/a --deselect v1/a/t.py::t ; "
                            "pytest -x tests/../v1/b.py")  # fmt: skip
    assert (a.paths, a.ignores, a.keyword) == (["tests/v1/a"], ["tests/v1/a/t.py::t"], "abc")
    assert b.paths == ["tests/v1/b.py"]
    assert ci.pytest_runs("bash run.sh v1/a") == []
    assert ci.markers_select("not cpu_test", {"slow_test"}) is True
    assert ci.markers_select("cpu_test and not slow_test", {"cpu_test"}) is True
    assert ci.markers_select("cpu_test", set()) is False
    assert ci.markers_select("__import__('os')", set()) is None  # only names and operators


def test_the_static_checks_list_the_added_test_lines_they_flag():
    old = b"import pytest\n\n\ndef test_old(monkeypatch):\n    monkeypatch.setattr(a, 'b', 1)\n"
    new = old + (
        b"\n\ndef test_new():\n"
        b"    layer = Layer.__new__(Layer)\n"
        b"    cfg = SimpleNamespace(x=1)\n"
        b"    assert conn._req_futures == {}\n"
        b"    if hasattr(conn, 'foo'):  # vLLM >= 0.33.0\n"
        b"        self._ok = True\n"
        b"    llm = LLM(model='m')\n"
    )
    files, base = {"tests/t/test_a.py": new, "vllm/x.py": b"y\n"}, {"tests/t/test_a.py": old}
    hits = checklist.scan(files, base, checklist.STAND_INS)
    assert hits == [
        "tests/t/test_a.py:9: layer = Layer.__new__(Layer) "
        "(builds an object without its constructor)",
        "tests/t/test_a.py:10: cfg = SimpleNamespace(x=1) (a stand-in object)",
        "tests/t/test_a.py:11: assert conn._req_futures == {} (reaches a private attribute)",
    ]  # the old test's monkeypatch is not the commit's; self._ok is the test's own
    shims = checklist.scan(files, base, checklist.SHIMS)
    assert shims == ["tests/t/test_a.py:12: if hasattr(conn, 'foo'):  # vLLM >= 0.33.0 (hasattr)"]
    assert checklist.scan({"tests/t/test_b.py": b"# vLLM >= 0.33.0 needs it\n"}, {},
                          checklist.SHIMS) == [
        "tests/t/test_b.py:1: # vLLM >= 0.33.0 needs it (a version)"]  # fmt: skip
    entry = checklist.scan(files, base, (("entry point", checklist.ENTRY),))
    assert entry == ["tests/t/test_a.py:14: llm = LLM(model='m') (entry point)"]


def test_duplicate_work_commands_come_from_agents_md_filled_in():
    agents = (
        "```bash\n"
        "gh issue view <issue_number> --repo vllm-project/vllm --comments\n"
        'gh pr list --repo vllm-project/vllm --state open --search "<issue_number> in:body"\n'
        'gh pr list --repo vllm-project/vllm --state open --search "<short area keywords>"\n'
        "```\n"
    )
    urls = ["https://github.com/vllm-project/vllm/issues/49310",
            "https://github.com/vllm-project/speculators/issues/613"]  # fmt: skip
    files = {"vllm/distributed/example_hidden_states_connector.py": b""}
    cmds = checklist.duplicate_commands(agents, urls, checklist.area_keywords(files))
    assert cmds == [
        "gh issue view 49310 --repo vllm-project/vllm --comments",
        'gh pr list --repo vllm-project/vllm --state open --search "49310 in:body"',
        "gh pr list --repo vllm-project/vllm --state open --search "
        '"example hidden states connector"',
    ]  # the other repository's issue is not searched in vLLM's
    assert checklist.duplicate_commands(agents, [], "") == []
    assert checklist.duplicate_commands(None, urls, "x") == []


def test_a_body_that_repeats_itself_is_found():
    body = ("## Overview\n\nThe connector keeps every file it writes.\n\n## Claims\n\n"
            "- The connector keeps every file it writes.\n- Other.\n\n"
            "```text\nsame line in a block is fine\nsame line in a block is fine\n```\n")  # fmt: skip
    assert checklist.repeated_sentences(body) == ["the connector keeps every file it writes"]
    assert checklist.repeated_sentences("## A\n\nOne thing said.\n\n## B\n\nAnother.\n") == []


def test_the_hooks_line_names_only_what_matters():
    proof = {"hooks": [{"id": "ruff-check", "ran": True, "ok": True},
                       {"id": "spdx", "ran": True, "ok": True},
                       {"id": "tethering", "ran": True, "ok": False},
                       {"id": "typos", "ran": False, "ok": True}],
             "hook_fixes": [{"id": "ruff-check", "changed": ["a.py"]}]}  # fmt: skip
    line = texts.hooks_line(proof)
    assert line == (
        "pre-commit (the release's `.pre-commit-config.yaml`): 2 of the hooks that select the "
        "changed files pass on this commit; FAILED: tethering; ruff-check fixed the files first "
        "(the fixes are in the commit); 1 not run here (typos)."
    )
    assert "spdx" not in line


def test_a_build_only_change_is_refused_by_name_not_skipped():
    """A change scoped to our CPU builds (overlay.toml `builds`) edits our build of vLLM: its
    proof is the build it enables, and there is nothing for upstream to take."""
    from vllm_overlay.errors import UpstreamError
    from vllm_overlay.overlay.model import parse_overlay

    overlay = parse_overlay(
        '[[change]]\nid = "cpu-gate"\ntitle = "T"\nwhy = "w"\norigin = "https://x.invalid/"\n'
        'origin_kind = "original"\ndrop_condition = "never"\n'
        'forwarded = { state = "not-needed", reason = "our build only" }\n'
        'builds = ["cpu-source"]\nfiles = ["cmake/cpu_extension.cmake"]\ntests = []\n',
        Path("/p/overlay"),
    )
    with pytest.raises(UpstreamError, match=r"cpu-gate is a build-only change \(builds = "):
        prepare.prepare(None, overlay, "cpu-gate")  # refused before anything is read
