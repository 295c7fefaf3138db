"""Where each change stands upstream (overlay.toml's `forwarded`): validated with a message
that names the fix, shown by status and the outlook (ours not yet sent flagged, with the
releases it has been carried on), and the pull request a dropped change came back through."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import CID
from vllm_overlay.errors import OverlayConfigError
from vllm_overlay.overlay import history
from vllm_overlay.overlay.model import parse_overlay
from vllm_overlay.track import render

OURS = """\
[[change]]
id = "fix-one"
title = "One"
why = "because"
origin = "https://github.com/vllm-project/vllm/blob/v0.24.0/vllm/a.py"
origin_kind = "original"
drop_condition = "upstream does it"
{extra}files = ["vllm/a.py"]
tests = ["tests/test_a.py"]
"""
BACKPORT = """\
[[change]]
id = "fix-two"
title = "Two"
why = "because"
origin = "https://github.com/vllm-project/vllm/pull/2"
drop_when = "vllm>=0.25.0"
{extra}files = ["vllm/b.py"]
tests = ["tests/test_b.py"]
"""
PR = "https://github.com/vllm-project/vllm/pull/123"
GHSA = "https://github.com/vllm-project/vllm/security/advisories/GHSA-abcd-efgh-ijkl"


def ours(extra: str):
    return parse_overlay(OURS.format(extra=extra), Path("/p/overlay")).changes[0]


def backport(extra: str = ""):
    return parse_overlay(BACKPORT.format(extra=extra), Path("/p/overlay")).changes[0]


@pytest.mark.parametrize(
    ("extra", "state", "summary"),
    [
        ('forwarded = "not-yet"\n', "not-yet", "not yet sent upstream"),
        ('forwarded = { state = "not-yet" }\n', "not-yet", "not yet sent upstream"),
        ('forwarded = { state = "not-needed", reason = "upstream has its own CPU path" }\n',
         "not-needed", "not needed upstream: upstream has its own CPU path"),
        (f'forwarded = {{ state = "sent", to = "{PR}" }}\n', "sent",
         f"sent upstream (pull request {PR})"),
        (f'forwarded = {{ state = "sent", to = "{GHSA}" }}\n', "sent",
         f"sent upstream (advisory {GHSA})"),
        (f'forwarded = {{ state = "merged", to = "{PR}", release = "0.35.0" }}\n'
         'drop_when = "vllm>=0.35.0"\n', "merged",
         f"merged upstream (pull request {PR}), released in 0.35.0"),
        ('upstream_status = "open"\n', "unrecorded",
         "unrecorded (upstream_status: open); replace it with `forwarded`"),
    ],
)  # fmt: skip
def test_each_standing(extra, state, summary):
    c = ours(extra)
    assert c.forwarded.state == state
    assert c.forwarded.summary() == summary
    assert c.forwarded.pull_request == (PR if PR in extra else "")


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("", "our own change needs `forwarded`"),
        ('forwarded = "maybe"\n', "state must be one of not-yet, not-needed, sent, merged"),
        ('forwarded = { state = "not-needed" }\n', "missing ['reason']"),
        ('forwarded = { state = "sent" }\n', "missing ['to']"),
        ('forwarded = { state = "sent", to = "vllm#12" }\n', "must be the URL"),
        (f'forwarded = {{ state = "not-yet", to = "{PR}" }}\n', "unknown ['to']"),
        (f'forwarded = {{ state = "merged", to = "{PR}", release = "0.35.0" }}\n',
         'add drop_when = "vllm>=0.35.0"'),
        (f'forwarded = {{ state = "merged", to = "{PR}", release = "0.35.0" }}\n'
         'drop_when = "vllm>=0.36.0"\n', "which `drop_when` (vllm>=0.36.0) does not reach"),
        (f'forwarded = {{ state = "merged", to = "{PR}", release = "soon" }}\n',
         "`forwarded.release` must be a release version"),
        ('forwarded = "not-yet"\nupstream_status = "open"\n', "has both `forwarded` and"),
        ('forwarded = "not-yet"\nsince = "someday"\n', "`since` must be a release version"),
        ('forwarded = "not-yet"\nsecurity = "yes"\n', "`security` must be true or false"),
    ],
)  # fmt: skip
def test_bad_standing_names_the_fix(extra, message):
    with pytest.raises(OverlayConfigError, match="change 'fix-one'") as e:
        ours(extra)
    assert message in str(e.value)


def test_a_backports_standing_is_its_origin():
    assert backport().forwarded.state == "sent"
    assert backport().forwarded.pull_request == "https://github.com/vllm-project/vllm/pull/2"
    merged = backport('forwarded = { state = "merged", release = "0.25.0" }\n').forwarded
    assert merged.to == "https://github.com/vllm-project/vllm/pull/2"
    with pytest.raises(OverlayConfigError, match="a backport's standing is its origin"):
        backport('forwarded = "not-yet"\n')


def test_the_outlook_flags_ours_not_yet_sent_with_the_releases_carried():
    data = {"name": "vllm", "pin": "0.34.0", "releases": [], "skipped": [], "targets": [],
            "safe_target": None, "changes": [
                {"id": "ours", "title": "t", "forwarded": {"state": "not-yet",
                 "summary": "not yet sent upstream"}, "flag": True, "security": True,
                 "carried": ["0.24.0", "0.25.0", "0.34.0"]},
                {"id": "theirs", "title": "t", "forwarded": {"state": "sent",
                 "summary": f"sent upstream (pull request {PR})"}, "flag": False,
                 "carried": ["0.34.0"]}]}  # fmt: skip
    text = render.terminal(data)
    assert "upstream standing (1 of ours not yet sent):" in text
    assert (
        "  ours: NOT YET SENT: ours, carried on 3 release(s) (0.24.0 .. 0.34.0); a security "
        "fix: a private advisory; `vllm-overlay upstream ours` prepares it"
    ) in text
    assert f"  theirs: sent upstream (pull request {PR}); carried on 1 release(s) (0.34.0)" in text
    page = render.page(data)
    assert 'id="standing"' in page and "NOT YET SENT" in page


def test_outlook_counts_the_releases_a_change_is_carried_on(cli, project):
    cfg = project.overlay / "overlay.toml"
    cfg.write_text(cfg.read_text().replace(
        'origin_kind = "backport"\n',
        'origin_kind = "original"\nforwarded = "not-yet"\nsince = "1.0.0"\n'
        'drop_condition = "upstream reads the group block size"\n',
    ).replace('drop_when = "vllm>=1.3.0"\n', ""))  # fmt: skip
    res = cli("outlook", "--json", "--index-url", project.index.url, cwd=project.root)
    assert res.rc == 0, res.err
    [ch] = json.loads(res.out)["changes"]
    assert ch["carried"] == ["1.0.0", "1.1.0", "1.2.0"]
    assert ch["flag"] is True and ch["forwarded"]["state"] == "not-yet"
    text = cli("outlook", "--index-url", project.index.url, cwd=project.root).out
    assert f"{CID}: NOT YET SENT: ours, carried on 3 release(s) (1.0.0 .. 1.2.0)" in text


def test_a_dropped_record_says_which_pull_request_it_came_back_through():
    text = "revision = 1\n" + BACKPORT.format(extra="")
    rec = history.DroppedRecord("fix-two", "Two", "https://x", "0.25.0", "merged", "proof",
                                pull_request="https://github.com/vllm-project/vllm/pull/2")  # fmt: skip
    out = history.rewrite(text, dropped=[rec], bump_revision=True)
    dropped = parse_overlay(out, Path("/p/overlay")).history[0]
    assert dropped["pull_request"] == "https://github.com/vllm-project/vllm/pull/2"
    bare = history.DroppedRecord("fix-two", "Two", "https://x", "0.25.0", "merged", "proof")
    assert "pull_request" not in bare.table()
