"""A command's settings are made once from its options (``Settings.from_options``) and carried
down as one object; a rebase keeps them in its state, so --continue works with them again and
a state saved before the object existed still loads."""

from __future__ import annotations

import json

import pytest
from vllm_overlay.index.settings import DEFAULTS, Settings
from vllm_overlay.main import build_parser
from vllm_overlay.rebase.state import State

INDEX = "http://127.0.0.1:9/simple/"


def _settings(*argv: str) -> Settings:
    return Settings.from_options(build_parser().parse_args(list(argv)))


def test_the_options_give_the_settings():
    got = _settings("rebase", "--to", "1.1.0", "--index-url", INDEX, "--source", "git",
                    "--git-url", "/srv/vllm.git", "--test-python", "/opt/py/bin/python")  # fmt: skip
    assert got == Settings(index_url=INDEX, source="git", git_url="/srv/vllm.git",
                           test_python="/opt/py/bin/python")  # fmt: skip
    assert _settings("rebase", "--to", "1.1.0") == DEFAULTS
    assert _settings("status") == DEFAULTS  # a command without these options: the defaults
    # the suite's and the build's --python are environments of their own, not the test Python
    assert _settings("suite", "--python", "/opt/py/bin/python").test_python is None


def test_the_index_is_the_option_else_pips(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:8/simple/")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", INDEX)
    assert DEFAULTS.index_urls == ["http://127.0.0.1:8/simple/", INDEX]
    assert Settings(index_url=INDEX).index_urls == [INDEX]
    secret = Settings(index_url="http://user:s3cret-token@127.0.0.1:9/simple/")
    assert "s3cret" not in secret.where()
    assert secret.client().auth.for_url(INDEX).password == "s3cret-token"  # the same host


def test_a_rebase_state_keeps_its_settings_and_one_saved_before_still_loads():
    saved = {  # a state.json as rebases before the settings object wrote it
        "from_version": "1.0.0", "from_commit": "a" * 40, "new_lock": "", "source": "git",
        "index_url": INDEX, "git_url": "/srv/vllm.git", "test_python": None,
        "checkout": {"path": "/tmp/co", "created": True}, "format": 2, "status": "stopped",
    }  # fmt: skip
    state = State.from_json(json.dumps(saved), "state.json")
    assert state.settings == Settings(index_url=INDEX, source="git", git_url="/srv/vllm.git")
    again = json.loads(state.to_json())
    assert {k: again[k] for k in saved if k != "checkout"} == {
        k: v for k, v in saved.items() if k != "checkout"
    }
    assert "settings" not in again  # the file's format is unchanged
