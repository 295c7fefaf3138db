"""The CPU test environment: its recipe, its cache entry, the environment it gives a run.

The unit tests use small fake vLLM trees and a fake build (no pip, no network); the one
``network`` test builds the real environment from the pinned vLLM tree and imports vLLM
from that tree through it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from vllm_overlay import process, util
from vllm_overlay.envs import childenv, testenv, testfiles, tritoncpu
from vllm_overlay.errors import BusyError, OverlayError

ROOT = Path(__file__).resolve().parents[2]

COMMON = """\
regex # Replace re for higher-performance regex matching
numpy
transformers >= 5.5.3
protobuf >= 5.29.6, !=6.30.*  # CVE
llguidance >= 1.7.0, < 1.8.0; platform_machine == "x86_64"
"""


def make_tree(root: Path, common: str = COMMON, **extra: str) -> Path:
    """A fake vLLM tree: requirements/common.txt (and any other requirements files)."""
    req = root / "requirements"
    req.mkdir(parents=True)
    (req / "common.txt").write_text(common)
    for name, text in extra.items():
        (req / name).write_text(text)
    return root


def fake_build(calls: list[str]):
    """A stand-in for testenv._build: writes what a complete environment has, no pip."""

    def build(rec: testenv.Recipe, staging: Path) -> dict:
        calls.append(rec.hash)
        python = staging / testenv.VENV / "bin" / "python"
        python.parent.mkdir(parents=True)
        python.write_text("")
        return {"recipe_hash": rec.hash, "torch_version": "2.13.0+cpu", "triton_interpret": False}

    return build


def no_subprocess(*args, **kwargs):
    raise AssertionError(f"unexpected subprocess: {args}")


# ---- the recipe ---------------------------------------------------------------------------


def test_recipe_reads_the_requirement_lines_of_the_tree(tmp_path):
    rec = testenv.recipe(make_tree(tmp_path))
    assert rec.requirements == (
        "regex",
        "numpy",
        "transformers >= 5.5.3",
        "protobuf >= 5.29.6, !=6.30.*",
        'llguidance >= 1.7.0, < 1.8.0; platform_machine == "x86_64"',
    )
    assert rec.python == "3.11"
    assert rec.torch == "torch==2.13.0"
    assert "ray==2.48.0" in rec.test_tools and "msgpack==1.1.0" in rec.test_tools
    assert any(t.startswith("pytest==") for t in rec.test_tools)


def test_recipe_hash_is_stable_for_the_same_requirements(tmp_path):
    a = testenv.recipe(make_tree(tmp_path / "a"))
    b = testenv.recipe(make_tree(tmp_path / "b"))
    assert a.hash == b.hash == testenv.recipe(tmp_path / "a").hash
    assert len(a.hash) == 16


def test_recipe_hash_ignores_comments_and_spacing(tmp_path):
    a = testenv.recipe(make_tree(tmp_path / "a"))
    reformatted = "# a header comment\n\n" + COMMON.replace("numpy", "numpy   # arrays")
    b = testenv.recipe(make_tree(tmp_path / "b", reformatted))
    assert a.hash == b.hash


def test_recipe_hash_changes_when_common_txt_changes(tmp_path):
    a = testenv.recipe(make_tree(tmp_path / "a"))
    b = testenv.recipe(make_tree(tmp_path / "b", COMMON.replace(">= 5.5.3", ">= 5.6.0")))
    c = testenv.recipe(make_tree(tmp_path / "c", COMMON + "einops\n"))
    assert len({a.hash, b.hash, c.hash}) == 3


def test_recipe_follows_includes(tmp_path):
    tree = make_tree(tmp_path, "-r base.txt\nnumpy\n", **{"base.txt": "regex  # fast\n"})
    assert testenv.recipe(tree).requirements == ("regex", "numpy")


def test_recipe_refuses_other_pip_options(tmp_path):
    tree = make_tree(tmp_path, "--extra-index-url https://example.invalid/simple\nnumpy\n")
    with pytest.raises(OverlayError, match="unsupported pip option line"):
        testenv.recipe(tree)


def test_recipe_refuses_include_cycles(tmp_path):
    tree = make_tree(tmp_path, "-r other.txt\n", **{"other.txt": "-r common.txt\n"})
    with pytest.raises(OverlayError, match="include each other"):
        testenv.recipe(tree)


def test_recipe_of_a_directory_that_is_no_vllm_tree(tmp_path):
    with pytest.raises(OverlayError, match=r"requirements/common\.txt.*--tree DIR"):
        testenv.recipe(tmp_path)


def test_platform_plugin_selects_the_cpu_platform(tmp_path):
    files = dict(testenv.recipe(make_tree(tmp_path)).plugin_files)
    pyproject = tomllib.loads(files["pyproject.toml"])
    entry_points = pyproject["project"]["entry-points"]["vllm.platform_plugins"]
    assert entry_points == {testfiles.PLUGIN_ENTRY_POINT: f"{testfiles.PLUGIN_MODULE}:cpu_platform"}
    namespace: dict[str, object] = {}
    exec(files[f"{testfiles.PLUGIN_MODULE}.py"], namespace)
    assert namespace["cpu_platform"]() == "vllm.platforms.cpu.CpuPlatform"


def test_hf_cache_holds_the_opt_125m_config(tmp_path):
    models = dict(testenv.recipe(make_tree(tmp_path)).hf_models)
    config = json.loads(models["facebook/opt-125m"])
    assert config["model_type"] == "opt"
    assert config["architectures"] == ["OPTForCausalLM"]


def test_a_tree_that_requires_triton_on_x86_gets_the_test_backend_and_a_cpu_version(tmp_path):
    """vLLM 0.34.0 refuses x86 without Triton's CPU backend, and takes one only where the
    distribution named vllm says "+cpu": a tree that refuses gets both (and Triton itself);
    every process of its environment runs under Triton's interpreter."""
    old = released_tree(tmp_path / "old")
    (old / "vllm" / "platforms").mkdir(parents=True)
    (old / "vllm" / "platforms" / "cpu.py").write_text("class CpuPlatform: ...\n")
    plain = testenv.recipe(old)
    assert (
        plain.triton_files == () and plain.cpu_version == "" and not testenv.needs_triton_cpu(old)
    )
    assert "triton" not in plain.install_args(Path("p"), Path("r"))
    new = released_tree(tmp_path / "new")
    (new / "vllm" / "platforms").mkdir(parents=True)
    (new / "vllm" / "platforms" / "cpu.py").write_text(
        'raise RuntimeError("vLLM on x86 CPUs requires Triton (triton-cpu).")\n'
    )
    rec = testenv.recipe(new)
    assert testenv.needs_triton_cpu(new) and rec.cpu_version == "9.9.9+cpu"
    assert dict(rec.triton_files) == dict(tritoncpu.FILES) and rec.hash != plain.hash
    shim = tomllib.loads(dict(rec.triton_files)["pyproject.toml"])
    assert shim["project"]["entry-points"]["triton.backends"] == {
        "cpu": "vllm_overlay_triton_cpu_shim"
    }
    marker = tomllib.loads(dict(testfiles.version_marker_files(rec.cpu_version))["pyproject.toml"])
    assert marker["project"]["name"] == "vllm" and marker["project"]["version"] == "9.9.9+cpu"
    assert marker["tool"]["setuptools"]["packages"] == []  # metadata only: vLLM is the tree's
    local = [Path("shim"), Path("marker")]
    args = rec.install_args(Path("plugin"), Path("reqs.txt"), None, local)
    assert args[-3:] == ["triton", "shim", "marker"]
    env = testenv.TestEnv(path=tmp_path / "e", python=tmp_path / "e/venv/bin/python",
                          recipe_hash="0" * 16, torch_version="x", triton_interpret=True)  # fmt: skip
    assert env.environ(tmp_path / "w", new)["TRITON_INTERPRET"] == "1"
    # vLLM reads that version in every process, even where its own tree, which carries the
    # sdist's vllm.egg-info (no "+cpu"), is first on sys.path (pytest puts it there for the
    # tests in it): the site's .pth puts the marker's metadata first.
    site = tmp_path / "site"
    (site / "vllm-9.9.9+cpu.dist-info").mkdir(parents=True)
    (site / "vllm-9.9.9+cpu.dist-info/METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9+cpu\n"
    )
    testfiles.put_version_first(site)
    (new / "vllm" / "__init__.py").write_text("")
    (new / "vllm.egg-info").mkdir()
    (new / "vllm.egg-info/PKG-INFO").write_text(
        "Metadata-Version: 2.1\nName: vllm\nVersion: 9.9.9\n"
    )
    code = (
        "import importlib.metadata as m, site, sys, vllm; {}"
        "print(m.version('vllm'), m.version('VLLM'), vllm.__file__, sys.path[0] == '')"
    )
    run = [sys.executable, "-S", "-c"]  # -S: only the site dir named here; cwd (the tree) first
    plain = subprocess.run([*run, code.format("")], capture_output=True, text=True, cwd=new,
                           check=True).stdout.split()  # fmt: skip
    assert plain[:2] == ["9.9.9", "9.9.9"]  # the tree's metadata: what vLLM saw before
    first = subprocess.run([*run, code.format(f"site.addsitedir({str(site)!r}); ")],
                           capture_output=True, text=True, cwd=new, check=True).stdout.split()  # fmt: skip
    assert first == ["9.9.9+cpu", "9.9.9+cpu", str(new / "vllm/__init__.py"), "True"]
    assert "TRITON_INTERPRET" not in an_env(tmp_path).environ(tmp_path / "w2", old)


# ---- the environment of a run -------------------------------------------------------------


def an_env(tmp_path: Path) -> testenv.TestEnv:
    path = tmp_path / "env"
    return testenv.TestEnv(
        path=path, python=path / "venv" / "bin" / "python", recipe_hash="0" * 16, torch_version="x"
    )


def test_environ_keeps_temporary_files_inside_the_workdir(tmp_path):
    env = an_env(tmp_path)
    workdir, tree = tmp_path / "work", tmp_path / "tree"
    environ = env.environ(workdir, tree)
    for key in (
        "TMPDIR",
        "TORCHINDUCTOR_CACHE_DIR",
        "TRITON_CACHE_DIR",
        "VLLM_CACHE_ROOT",
    ):
        path = Path(environ[key])
        assert path.is_relative_to(workdir.resolve()), key
        assert path.is_dir(), key
    # Ray's sockets live under RAY_TMPDIR and their paths may not exceed 107 bytes.
    ray = environ["RAY_TMPDIR"]
    assert Path(ray).is_dir() and Path(ray).name.startswith(childenv.RAY_PREFIX)
    assert len(ray) + len(childenv.RAY_SOCKET_SUFFIX) <= childenv.SOCKET_PATH_MAX


def test_environ_runs_vllm_from_the_tree_offline_on_cpu(tmp_path):
    env = an_env(tmp_path)
    tree = tmp_path / "tree"
    environ = env.environ(tmp_path / "work", tree)
    assert environ["PYTHONPATH"] == str(tree.resolve())
    assert environ["HF_HUB_OFFLINE"] == "1"
    assert environ["HF_HOME"] == str(env.path / testfiles.HF_HOME)
    assert environ["VLLM_TARGET_DEVICE"] == "cpu"
    assert environ["VLLM_NO_USAGE_STATS"] == "1"
    assert environ["PATH"].split(os.pathsep)[0] == str(env.python.parent)


def test_environ_drops_variables_that_would_leak(tmp_path, monkeypatch):
    for key in ("VIRTUAL_ENV", "PYTHONHOME", "VLLM_PLUGINS", "VLLM_OVERLAY_TREE", "PYTEST_ADDOPTS"):
        monkeypatch.setenv(key, "leak")
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("SOME_SETTING", "kept")
    environ = an_env(tmp_path).environ(tmp_path / "work", tmp_path / "tree")
    assert "leak" not in environ.values()
    assert "/elsewhere" not in environ["PYTHONPATH"]
    assert environ["SOME_SETTING"] == "kept"


# ---- the cache entry ----------------------------------------------------------------------


def test_ensure_builds_once_then_returns_at_once(tmp_path, monkeypatch):
    tree = make_tree(tmp_path / "tree")
    calls: list[str] = []
    monkeypatch.setattr(testenv, "_build", fake_build(calls))
    first = testenv.ensure_testenv(tree)
    assert first.path == util.cache_dir() / "testenv" / testenv.recipe(tree).hash
    assert first.torch_version == "2.13.0+cpu"
    monkeypatch.setattr(testenv, "_build", no_subprocess)
    monkeypatch.setattr(process, "run", no_subprocess)
    assert testenv.ensure_testenv(tree) == first
    assert calls == [first.recipe_hash]


def test_a_new_requirements_file_gets_a_new_environment(tmp_path, monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(testenv, "_build", fake_build(calls))
    a = testenv.ensure_testenv(make_tree(tmp_path / "a"))
    b = testenv.ensure_testenv(make_tree(tmp_path / "b", COMMON + "einops\n"))
    assert a.path != b.path and a.path.is_dir() and b.path.is_dir()
    assert len(calls) == 2


def test_a_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    tree = make_tree(tmp_path / "tree")

    def failing_build(rec, staging):
        (staging / testenv.VENV).mkdir()
        (staging / testenv.VENV / "half").write_text("")
        raise OverlayError("pip failed")

    monkeypatch.setattr(testenv, "_build", failing_build)
    with pytest.raises(OverlayError, match="pip failed"):
        testenv.ensure_testenv(tree)
    assert sorted(p.name for p in testenv.root().iterdir()) == ["locks"]


def test_an_unfinished_environment_is_rebuilt(tmp_path, monkeypatch):
    tree = make_tree(tmp_path / "tree")
    final = testenv.root() / testenv.recipe(tree).hash
    (final / testenv.VENV / "bin").mkdir(parents=True)  # no marker: a killed build
    stale = testenv.root() / f"{final.name}.build-x"
    stale.mkdir()
    calls: list[str] = []
    monkeypatch.setattr(testenv, "_build", fake_build(calls))
    env = testenv.ensure_testenv(tree)
    assert calls and (env.path / testenv.MARKER).is_file()
    assert not stale.exists()


def test_rebuild_replaces_a_complete_environment(tmp_path, monkeypatch):
    tree = make_tree(tmp_path / "tree")
    calls: list[str] = []
    monkeypatch.setattr(testenv, "_build", fake_build(calls))
    env = testenv.ensure_testenv(tree)
    (env.path / "old-file").write_text("")
    again = testenv.ensure_testenv(tree, rebuild=True)
    assert again.path == env.path and len(calls) == 2
    assert not (env.path / "old-file").exists()
    assert sorted(p.name for p in testenv.root().iterdir()) == [env.path.name, "locks"]


def test_a_second_builder_waits_then_gives_up(tmp_path, monkeypatch, capsys):
    tree = make_tree(tmp_path / "tree")
    calls: list[str] = []
    monkeypatch.setattr(testenv, "_build", fake_build(calls))
    monkeypatch.setenv("VLLM_OVERLAY_LOCK_TIMEOUT", "0.3")
    with util.exclusive_lock(testenv.lock_path(testenv.recipe(tree)), "test"):
        with pytest.raises(BusyError, match="another vllm-overlay process") as e:
            testenv.ensure_testenv(tree)
    assert f"held by pid {os.getpid()}" in str(e.value) and "after waiting 0.3 s" in str(e.value)
    waiting = f"waiting for the test environment {testenv.recipe(tree).hash}, held by pid"
    assert f"{waiting} {os.getpid()}" in capsys.readouterr().err
    assert not calls
    other = make_tree(tmp_path / "other", COMMON + "einops\n")
    assert testenv.ensure_testenv(other).path.is_dir()  # another recipe does not wait
    assert testenv.ensure_testenv(tree).path.is_dir() and len(calls) == 2  # free again: built


def test_a_builder_that_waited_takes_the_environment_another_made_and_holds(tmp_path, monkeypatch):
    """Another process builds the environment and, once built, holds it shared for its whole
    run: a process that found it missing and waits to build it takes it as soon as it is
    complete (it waited for that process's run to end: the 0.34.0 integration tests hung)."""
    import threading

    from vllm_overlay.envs import envbuild

    tree = make_tree(tmp_path / "tree")
    calls: list[str] = []
    monkeypatch.setattr(testenv, "_build", fake_build(calls))
    final = testenv.ensure_testenv(tree).path  # made once, then moved aside: "not yet built"
    envbuild.release(final.name)
    final.rename(final.with_name("aside"))
    monkeypatch.setenv("VLLM_OVERLAY_LOCK_TIMEOUT", "60")
    lock = testenv.lock_path(testenv.recipe(tree))
    got: list = []
    with util.exclusive_lock(lock, "the other builder"):  # the other process builds...
        waiter = threading.Thread(target=lambda: got.append(testenv.ensure_testenv(tree)))
        waiter.start()
        final.with_name("aside").rename(final)  # ...and is done
    fd = util.shared_lock(lock, "the other builder's run")  # and holds it until its run ends
    try:
        waiter.join(timeout=30)
        assert not waiter.is_alive(), "still waiting for the other process's run to end"
    finally:
        os.close(fd)
        waiter.join()
    assert got and got[0].path == final and len(calls) == 1  # taken, not built again


# ---- pinned by constraints, built with uv -------------------------------------------------


def released_tree(root: Path, version: str = "9.9.9") -> Path:
    tree = make_tree(root)
    (tree / "PKG-INFO").write_text(f"Metadata-Version: 2.4\nName: vLLM\nVersion: {version}\n")
    return tree


def test_the_recipe_pins_the_set_in_the_projects_constraints_file(tmp_path, monkeypatch):
    project = tmp_path / "project"
    monkeypatch.setenv("VLLM_OVERLAY_PROJECT", str(project))
    tree = released_tree(tmp_path / "tree")
    free = testenv.recipe(tree)
    assert (free.upstream, free.constraints_file, free.constraints) == ("vllm 9.9.9", "", "")
    pins = project / "constraints" / "testenv-vllm-9.9.9.txt"
    pins.parent.mkdir(parents=True)
    pins.write_text("numpy==2.3.5\n")
    pinned = testenv.recipe(tree)
    assert pinned.constraints_file == "constraints/testenv-vllm-9.9.9.txt"
    assert pinned.constraints == "numpy==2.3.5\n" and pinned.hash != free.hash
    pins.write_text("numpy==2.3.4\n")
    assert testenv.recipe(tree).hash not in (free.hash, pinned.hash)  # the content counts
    assert testenv.recipe(tree, pinned=False).hash == free.hash
    args = pinned.install_args(tmp_path / "plugin", tmp_path / "req.txt", pins)
    assert args[:2] == ["-c", str(pins)]
    assert testenv.recipe(make_tree(tmp_path / "no-release")).upstream == ""


def test_freeze_writes_sorted_pins_without_the_generated_plugin(tmp_path):
    env = an_env(tmp_path)
    env.path.mkdir()
    (env.path / testenv.FREEZE).write_text(
        "torch==2.13.0+cpu\nNumPy==2.3.5\n"
        f"{testfiles.PLUGIN_DIST} @ file:///tmp/src/{testfiles.PLUGIN_DIST}\naiohttp==3.13.3\n"
        f"{tritoncpu.DIST} @ file:///tmp/src/triton_cpu_shim\nvllm @ file:///tmp/src/marker\n"
    )
    text = testenv.freeze_constraints(env, testenv.recipe(released_tree(tmp_path / "t")))
    assert text.startswith("# The CPU test environment of vllm 9.9.9")
    pins = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert pins == ["aiohttp==3.13.3", "NumPy==2.3.5", "torch==2.13.0+cpu"]


# ---- the command --------------------------------------------------------------------------


def test_print_recipe(cli, tmp_path):
    tree = make_tree(tmp_path / "tree")
    res = cli("testenv", "--tree", tree, "--print-recipe")
    assert res.rc == 0, res.err
    doc = json.loads(res.out)
    assert doc["hash"] == testenv.recipe(tree).hash
    assert doc["recipe"]["torch"] == "torch==2.13.0"
    assert not (util.cache_dir() / "testenv").exists()


def test_command_builds_and_prints_the_path(cli, tmp_path, monkeypatch):
    tree = make_tree(tmp_path / "tree")
    monkeypatch.setattr(testenv, "_build", fake_build([]))
    res = cli("testenv", "--tree", tree)
    assert res.rc == 0, res.err
    assert res.out.strip() == str(testenv.root() / testenv.recipe(tree).hash)
    assert "torch 2.13.0+cpu" in res.err


def test_command_needs_a_vllm_tree(cli, tmp_path):
    res = cli("testenv", "--tree", tmp_path / "missing")
    assert res.rc == 2 and "not a directory" in res.err
    res = cli("testenv", "--tree", tmp_path)
    assert res.rc == 1 and "requirements/common.txt" in res.err
