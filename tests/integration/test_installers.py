"""The test environment's installers for real: a venv and an install with uv and with pip, offline,
reading pip's index and find-links and honouring a constraint."""

from __future__ import annotations

import sys

import pytest
from vllm_overlay import util
from vllm_overlay.envs import childenv


@pytest.mark.parametrize("kind", ["uv", "pip"])
def test_the_installer_reads_pips_indexes_and_installs_the_pinned_version(
    kind, tmp_path, monkeypatch
):
    """A real venv and install, offline: pip's index and find-links, a constraint."""
    from fixtures_publish import make_wheel
    from vllm_overlay.envs import installer

    links = tmp_path / "links"
    links.mkdir()
    for version in ("1.0", "2.0"):
        make_wheel(links, name="alpha", version=version)
    simple = tmp_path / "simple"
    simple.mkdir()
    (simple / "index.html").write_text("<!DOCTYPE html><html><body></body></html>\n")
    monkeypatch.setenv("PIP_INDEX_URL", simple.as_uri())
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    monkeypatch.setenv("PIP_CACHE_DIR", str(tmp_path / "pip-cache"))
    if kind == "pip":
        monkeypatch.setenv(util.INSTALLER_ENV, "pip")
    inst = installer.installer()
    assert inst.name == kind  # uv is a dependency of the tool: it is there
    argv = inst.install_command("python")
    env = inst.env(childenv.clean_environ())
    if kind == "uv":
        assert env["UV_INDEX_URL"] == simple.as_uri()  # pip's index, not in the argv
        assert argv[argv.index("--find-links") + 1] == str(links)
    python = inst.venv(sys.executable, tmp_path / "venv", env)
    (tmp_path / "pins.txt").write_text("alpha==1.0\n")
    inst.install(python, ["-c", str(tmp_path / "pins.txt"), "alpha"], env, hint="")
    assert "alpha==1.0" in inst.freeze(python, env).splitlines()
