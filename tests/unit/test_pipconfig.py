"""pip's configuration is read once per process for each Python and environment, and read
again when a configuration file or a variable it depends on changes (the real pip)."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm_overlay.envs.installer import Installer
from vllm_overlay.index import pipconfig


@pytest.fixture
def runs(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, ...]]:
    """Each ``pip config list`` the reader starts (run for real), from a new process's state."""
    seen: list[tuple[str, ...]] = []
    real = pipconfig.run

    def counting(*argv, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(tuple(map(str, argv)))
        return real(*argv, **kwargs)

    monkeypatch.setattr(pipconfig, "run", counting)
    monkeypatch.setattr(pipconfig, "_read", {})
    return seen


def test_read_once_then_again_when_pip_conf_or_a_variable_changes(
    runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\ncert = /ca/one.pem\n")
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))
    for var in ("PIP_CERT", "PIP_CLIENT_CERT", "PIP_FIND_LINKS"):
        monkeypatch.delenv(var, raising=False)
    assert pipconfig.pip_setting("cert") == "/ca/one.pem"
    assert pipconfig.pip_setting("client-cert") == "" and pipconfig.pip_setting("find-links") == ""
    Installer("/usr/bin/uv-not-run").env({})  # cert, client-cert: asked, not read again
    assert len(runs) == 1
    conf.write_text("[global]\ncert = /ca/the-second.pem\n")
    assert pipconfig.pip_setting("cert") == "/ca/the-second.pem" and len(runs) == 2
    monkeypatch.setenv("PIP_TIMEOUT", "30")  # a variable pip's configuration shows
    assert pipconfig.pip_setting("cert") == "/ca/the-second.pem" and len(runs) == 3
    monkeypatch.setenv("PIP_CERT", "/ca/from-the-variable.pem")  # the variable wins, as in pip
    assert pipconfig.pip_setting("cert") == "/ca/from-the-variable.pem"
