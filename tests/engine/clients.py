"""The real clients against ``vllm serve`` of our wheel: speculators' offline data generation,
clients that send what they should not, and a crowd of clients that disconnect.

A server session is one ``vllm serve`` (one wheel, one configuration) and the parts of
SERVER_SESSIONS run against it one after another; it runs once per pytest run, whichever
xdist worker asks first (a lock; the other reads the same result.json), like the offline
engine sessions of harness.py. Every file the server wrote for a client is checked against
the Transformers reference in the engine environment (``harness.check_files``): the check
speculators' own ``--validate-outputs`` lacks (it passes all-zero tensors).
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine import fulldisk, harness, server, stops
from engine.sessions import ENGINE_DEFAULTS, LAYERS, prompts

SPECULATORS = "speculators==0.9.0"
# Requests wait (2 at a time, 32 tokens a step): the storm's holders take both slots with a
# chunked prefill, and the crowd queues behind them.
SERVE_ENGINE = {
    **ENGINE_DEFAULTS,
    "dtype": "bfloat16",
    "max_model_len": 1024,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 2,
    "enforce_eager": True,
    "seed": 0,
    "enable_prefix_caching": False,
    "enable_log_requests": True,  # "Added request"/"Aborted request(s)": the server's side
    # The storm's VLLM_SERVER_DEV_MODE=1 turns this on: a client error (the probes' malformed
    # kv_transfer_params, answered 400) would then be logged as an ERROR with its stack.
    "log_error_stack": False,
}
SPECULATORS_ROWS = prompts(11, 5, 17, 32, 33, 64, 90, 128, 200)


# -- speculators --------------------------------------------------------------------------


def _run(cmd: list, env: dict, where: Path, name: str, timeout: float = 900) -> dict:
    t0 = time.monotonic()
    with open(where / f"{name}.log", "w") as log:
        proc = subprocess.run([str(c) for c in cmd], env=env, cwd=where, stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout, check=False)  # fmt: skip
    return {"rc": proc.returncode, "seconds": round(time.monotonic() - t0, 1),
            "log_tail": (where / f"{name}.log").read_text()[-3000:]}  # fmt: skip


def prepare_speculators_data(client, model: str, shared: Path) -> dict:
    """speculators' ``prepare-data`` on a local JSONL of token ids (``input_ids``,
    ``loss_mask``), once per pytest run: it needs no server, and every server session's
    ``generate-offline-data`` reads the same prepared dataset."""
    from vllm_overlay import util

    where = shared / "speculators-data"
    with util.exclusive_lock(where.with_suffix(".lock"), "speculators' prepared data"):
        done = where / "prepare.json"
        if done.is_file():
            return json.loads(done.read_text())
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        data = where / "data.jsonl"
        data.write_text("".join(
            json.dumps({"input_ids": p, "loss_mask": [1] * len(p)}) + "\n"
            for p in SPECULATORS_ROWS
        ))  # fmt: skip
        env = client.environ(where / "work")
        out = _run([client.bin("speculators"), "prepare-data", "--model", model,
                    "--data", data, "--output", where / "prepared", "--seq-length", "512",
                    "--num-preprocessing-workers", "1"], env, where, "prepare-data")  # fmt: skip
        shutil.rmtree(env["TMPDIR"], ignore_errors=True)
        out["prepared"] = str(where / "prepared")
        done.write_text(json.dumps(out))
        return out


# The token ids of each row of speculators' prepared dataset, as generate-offline-data sends
# them (its item["input_ids"] for hs_<i>), read in the client's environment.
SENT_ROWS = (
    "import json, sys; from datasets import load_from_disk; "
    "rows = load_from_disk(sys.argv[1]).with_format(None)['input_ids']; "
    "print(json.dumps([[int(t) for t in r] for r in rows]))"
)


def run_speculators(srv: server.Server, client, prepared: dict, model: str, where: Path) -> dict:
    """speculators' ``generate-offline-data --validate-outputs --fail-on-error`` against the
    server, on the prepared dataset; the files it wrote, for the reference check."""
    where.mkdir(parents=True, exist_ok=True)
    env = client.environ(where / "work")
    out: dict = {"rows": len(SPECULATORS_ROWS), "prepare": prepared}
    if prepared["rc"] != 0:
        return out
    out["generate"] = _run([client.bin("speculators"), "generate-offline-data",
                            "--endpoint", f"{srv.url}/v1", "--model", model,
                            "--preprocessed-data", prepared["prepared"],
                            "--output", where / "hidden_states", "--concurrency", "4",
                            "--validate-outputs", "--fail-on-error"], env, where,
                           "generate-offline-data")  # fmt: skip
    # hs_<i> is for the prepared dataset's row i (prepare-data shuffles the rows): the prompt
    # each file is checked against is the row the client sent, read from its own dataset.
    sent = subprocess.run([client.python, "-c", SENT_ROWS, prepared["prepared"]], env=env,
                          capture_output=True, text=True, check=True, timeout=300)  # fmt: skip
    rows = json.loads(sent.stdout.strip().splitlines()[-1])
    files = sorted((where / "hidden_states").glob("hs_*.safetensors"))
    out["files"] = [{"name": f.name, "kept": str(f), "prompt": rows[int(f.stem[len("hs_"):])]}
                    for f in files]  # fmt: skip
    out["storage_left"] = server.everything_under(srv.storage)
    shutil.rmtree(env["TMPDIR"], ignore_errors=True)
    return out


# -- what clients may send ----------------------------------------------------------------


def _probe_list(outside: Path, fatal: bool) -> list[tuple]:
    """(name, headers, extra body) of each probe; ``fatal``: also those that took a pristine
    connector's engine down."""
    p = prompts(21, 12)[0]
    probes = [
        ("header-dot-dot", {"X-Request-Id": "x/../../escaped-header"}, {}),
        ("header-absolute", {"X-Request-Id": f"{outside}/absolute"}, {}),
        ("header-symlinked-dir", {"X-Request-Id": "link/planted"}, {}),
        ("body-request-id-dot-dot", {}, {"request_id": "y/../../escaped-body"}),
        ("custom-path-disallowed", {},
         {"kv_transfer_params": {"hidden_states_path": str(outside / "custom.safetensors")}}),
        ("custom-path-not-a-string", {}, {"kv_transfer_params": {"hidden_states_path": 5}}),
        ("kv-transfer-params-not-an-object", {}, {"kv_transfer_params": "not an object"}),
        ("kv-transfer-params-list", {}, {"kv_transfer_params": [1, 2]}),
    ]  # fmt: skip
    if fatal:
        probes.append(("header-too-long", {"X-Request-Id": "z" * 300}, {}))
    return [(name, headers, body, p) for name, headers, body in probes]


def run_probes(srv: server.Server, where: Path, fatal: bool) -> dict:
    """Request ids and hidden_states_path values that try to leave the storage directory,
    and malformed kv_transfer_params; what the server answered and what it wrote where."""
    shared = srv.storage.parent  # .../shared: the storage directory's parent
    outside = where / "outside"
    outside.mkdir(parents=True, exist_ok=True)
    (srv.storage / "cmpl-link").symlink_to(outside, target_is_directory=True)
    results, prompts_by_name = {}, {}
    for name, headers, body, prompt in _probe_list(outside, fatal):
        reply = srv.complete(prompt, headers=headers, timeout=120, **body)
        entry = {"status": reply.status}
        params = reply.body.get("kv_transfer_params") if isinstance(reply.body, dict) else None
        path = (params or {}).get("hidden_states_path")
        if path:
            entry["path"] = path
            entry["in_storage"] = Path(path).resolve().parent == srv.storage.resolve()
            prompts_by_name[name] = prompt
        elif isinstance(reply.body, dict):
            entry["error"] = str(reply.body.get("error", reply.body))[:300]
        entry["healthy_after"] = srv.healthy()
        results[name] = entry
        if not entry["healthy_after"]:
            break
    # Where the files went, before a client reads (moves) them.
    out = {
        "probes": results,
        "outside_storage": [
            p for p in server.everything_under(shared) if not p.startswith(srv.storage.name)
        ],  # fmt: skip
        "outside_dir": server.everything_under(outside),
    }
    files = []
    for name, prompt in prompts_by_name.items():
        kept = where / "saved" / f"{name}.safetensors"
        try:
            server.read_locked(results[name]["path"], kept)
            files.append({"name": name, "kept": str(kept), "prompt": prompt})
        except (OSError, TimeoutError) as e:
            results[name]["read_error"] = f"{type(e).__name__}: {e}"
    (srv.storage / "cmpl-link").unlink()
    out["storage_left"] = server.everything_under(srv.storage)
    out["files"] = files
    return out


# -- aborts under load --------------------------------------------------------------------

# The storm. Every disconnect hits a request in flight by construction, whatever the
# machine's speed, and the server's side confirms each (vLLM's own endpoints and log):
# 1. a holder sends the longest prompt the model takes (1000 tokens: 32 chunks of 32); the
#    engine pauses itself in the step that gives it its first chunk (the engine tests'
#    probe plugin, VO_PAUSE_ON: what vLLM's /pause?mode=keep sets), so the holder is
#    running, mid-prefill, and stays so; the probe writes what ran and waited then;
# 2. the crowd: 64 clients at once, their requests queued behind the pause (waiting by
#    construction); a seeded third leave once the server has logged their request as added
#    ("Added request …": the abort follows the add on the engine's input queue);
# 3. the holder leaves (the abort of a running request); the engine logs an abort for
#    every request whose client left; /resume (a development endpoint:
#    VLLM_SERVER_DEV_MODE=1); the rest of the crowd completes.
# Without vllm#56841 the first abort of a waiting request kills EngineCore.
STORM = {"requests": 64, "leave_share": 1 / 3}
HOLD_TOKENS = 1000  # < max_model_len (1024)
PAUSE_FILE = "pause.json"


def storm_environ(where: Path) -> dict[str, str]:
    """The server's environment for the storm: /resume, and the probe's self-pause."""
    return {"VLLM_SERVER_DEV_MODE": "1", "VO_PAUSE_ON": "storm-hold-",
            "VO_PAUSE_FILE": str(where / PAUSE_FILE)}  # fmt: skip


# How long the server may take to reach a state the test waits for (an abort logged, the
# KV cache freed, a lock removed): a deadline for a slow machine, not an expected time.
SETTLE_SECONDS = 300
_STORM_ID = re.compile(r"storm-(?:hold-)?\d+")
_DEAD = ("EngineDeadError", "EngineCore encountered")


def wait_for(read, done, seconds: float = SETTLE_SECONDS, every: float = 0.2):
    """Poll ``read()`` until ``done(value)`` or ``seconds`` pass: (the last value, whether
    the condition held). The caller fails with the value seen."""
    deadline = time.monotonic() + seconds
    while True:
        value = read()
        if done(value):
            return value, True
        if time.monotonic() > deadline:
            return value, False
        time.sleep(every)


class LogWatch:
    """The server log, read as it grows: which storm requests the server has added to the
    engine and which it aborted (``Added request …``, ``Aborted request(s) …``), and
    whether the engine died."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self._lock = threading.Lock()
        self._pos = 0
        self.added: set[str] = set()
        self.aborted: set[str] = set()
        self.dead = False

    def read(self) -> LogWatch:
        with self._lock, open(self.log, errors="replace") as f:
            f.seek(self._pos)
            text = f.read()
            cut = text.rfind("\n") + 1
            self._pos += len(text[:cut].encode(errors="replace"))
            for line in text[:cut].splitlines():
                if "Added request" in line:
                    self.added.update(m.group(0) for m in _STORM_ID.finditer(line))
                elif "Aborted request(s)" in line:
                    self.aborted.update(m.group(0) for m in _STORM_ID.finditer(line))
                self.dead = self.dead or any(d in line for d in _DEAD)
        return self

    def wait_added(self, request_id: str) -> bool:
        """True once the server logged ``request_id`` as added; False if the engine died
        first (or the deadline passed)."""
        w, _ = wait_for(self.read, lambda w: request_id in w.added or w.dead)
        return request_id in w.added


def _crowd_client(srv: server.Server, watch: LogWatch, i: int, prompt: list[int],
                  leaves: bool) -> dict:  # fmt: skip
    entry: dict = {"i": i, "tokens": len(prompt), "leaves": leaves}
    try:
        req = srv.open(prompt, request_id=f"storm-{i}")
        if leaves:
            added = watch.wait_added(f"storm-{i}")
            req.leave()
            entry["outcome"] = "left while waiting" if added else "left (never added)"
            return entry
        reply = req.reply()
    except OSError as e:  # TimeoutError included
        entry["outcome"] = f"connection error: {type(e).__name__}"
        return entry
    params = reply.body.get("kv_transfer_params") if isinstance(reply.body, dict) else None
    entry["status"] = reply.status
    entry["path"] = (params or {}).get("hidden_states_path")
    entry["outcome"] = "completed" if reply.status == 200 and entry["path"] else "failed"
    return entry


def _post(srv: server.Server, path: str) -> int | None:
    try:
        return srv.request("POST", path, timeout=120).status
    except OSError:
        return None


def run_storm(srv: server.Server, where: Path, *, requests: int, leave_share: float,
              seed: int = 0) -> dict:  # fmt: skip
    """The storm (see STORM; the server runs with ``storm_environ``): a holder frozen
    mid-prefill, a crowd queued behind the pause of which a seeded share leaves, the holder
    leaves, resume. Then: every completed request's file read and checked, the server asked
    again, what is left in the storage directory, the KV cache's usage, the aborts the
    engine logged."""
    rng = random.Random(seed)
    plan = [
        (i, [rng.randrange(1, 512) for _ in range(rng.randrange(8, 120))],
         rng.random() < leave_share)
        for i in range(requests)
    ]  # fmt: skip
    out: dict = {"requests": requests, "leavers": sum(1 for *_, leaves in plan if leaves)}
    t0 = time.monotonic()
    hold = srv.open(prompts(23, HOLD_TOKENS)[0], request_id="storm-hold-0")
    _, out["paused"] = wait_for(
        lambda: srv.request("GET", "/is_paused", timeout=60).body,
        lambda body: isinstance(body, dict) and body.get("is_paused") is True,
    )
    pause_file = srv.storage.parent.parent / PAUSE_FILE
    out["pause"] = json.loads(pause_file.read_text()) if pause_file.is_file() else {}
    watch = LogWatch(srv.log)
    with ThreadPoolExecutor(requests) as pool:
        futures = [pool.submit(_crowd_client, srv, watch, *a) for a in plan]
        if out["paused"]:
            for f, (*_, leaves) in zip(futures, plan, strict=True):
                if leaves:
                    f.result()  # every leaver has left before the holder does
        hold.leave()
        left = [hold.request_id] + [f"storm-{i}" for i, _, leaves in plan if leaves]
        _, out["all_aborted"] = wait_for(watch.read, lambda w: set(left) <= w.aborted or w.dead)
        out["not_aborted"] = sorted(set(left) - watch.aborted)
        out["resume_status"] = _post(srv, "/resume")
        clients = [f.result() for f in futures]
    out["seconds"] = round(time.monotonic() - t0, 1)
    prompts_by_i = {i: p for i, p, _ in plan}
    files = []
    for c in clients:
        if c["outcome"] == "completed":
            kept = where / "saved" / f"storm-{c['i']}.safetensors"
            try:
                server.read_locked(c["path"], kept)
                files.append({"name": f"storm-{c['i']}", "kept": str(kept),
                              "prompt": prompts_by_i[c["i"]]})  # fmt: skip
            except (OSError, TimeoutError) as e:
                c["read_error"] = f"{type(e).__name__}: {e}"
    out["clients"] = clients
    out["outcomes"] = {k: sum(1 for c in clients if c["outcome"] == k)
                       for k in sorted({c["outcome"] for c in clients})}  # fmt: skip
    out["left"] = left
    out["healthy_after"] = srv.healthy()
    if out["healthy_after"]:
        follow = srv.complete(prompts(22, 40)[0], timeout=600)
        out["follow_up_status"] = follow.status
        # A lock of an aborted request goes at the engine's next step.
        leftovers, out["settled"] = wait_for(lambda: server.everything_under(srv.storage),
                                             lambda names: not _orphan_locks(names))  # fmt: skip
        out["storage_left"] = leftovers
        follow_path = (follow.body.get("kv_transfer_params") or {}).get("hidden_states_path") \
            if isinstance(follow.body, dict) else None  # fmt: skip
        if follow_path:
            server.read_locked(follow_path, where / "saved" / "follow-up.safetensors")
        out["storage_after_reading"] = server.everything_under(srv.storage)
        out["kv_cache_usage"], out["kv_cache_freed"] = wait_for(
            lambda: srv.metric("vllm:kv_cache_usage_perc"), lambda v: v == 0.0
        )
        out["aborted"] = sorted(watch.read().aborted)  # what the engine logged it aborted
    out["files"] = files
    out["files_verified"] = len(files)
    return out


def _orphan_locks(names: list[str]) -> list[str]:
    """Locks without their file: an aborted request's, until the engine's next step."""
    return [n for n in names if n.endswith(".lock") and n[: -len(".lock")] not in names]


def check(parts: dict[str, dict], engine_env, model: str, where: Path) -> None:
    """Every file the parts got against the reference, in one ``driver.py --check`` (one
    Transformers load); into each part: ``checks`` per file, the ``token_ids`` they hold,
    ``worst`` (the end-of-run table's) and ``wrong_files`` (a row not right, or token ids not
    the prompt's)."""
    files = [{**f, "name": f"{part}/{f['name']}"}
             for part, out in parts.items() for f in out.get("files", [])]  # fmt: skip
    if not files:
        return
    checked = harness.check_files(engine_env, model, LAYERS, files, where / "check")
    for part, out in parts.items():
        mine = [(f["name"].split("/", 1)[1], f) for f in checked["files"]
                if f["name"].split("/", 1)[0] == part]  # fmt: skip
        if not mine:
            continue
        layers = [lay for _, f in mine for lay in f["checks"]["layers"]]
        out["checks"] = {name: f["checks"] for name, f in mine}
        out["token_ids"] = sorted(f["prompt"] for _, f in mine)
        out["worst"] = {
            "max_rel_err": max(lay["max_rel_err"] for lay in layers),
            **{
                k: sum(lay[k] for lay in layers)
                for k in ("rows", "right_rows", "zero_rows", "nan_rows")
            },  # fmt: skip
        }
        out["wrong_files"] = [name for name, f in mine
                              if not f["checks"]["token_ids_match"]
                              or any(lay["right_rows"] != lay["rows"]
                                     for lay in f["checks"]["layers"])]  # fmt: skip


def log_errors(log: Path) -> list[str]:
    """The server log's lines that say the engine failed (less the full-disk part's failed
    writes, which that part counts: fulldisk.expected_failure)."""
    marks = ("Traceback", "EngineCore encountered", "EngineDeadError", "ERROR", "KeyError")
    return [ln[:300] for ln in log.read_text(errors="replace").splitlines()
            if any(m in ln for m in marks) and not fulldisk.expected_failure(ln)]  # fmt: skip


# -- the session --------------------------------------------------------------------------

# name -> (wheel, model, parts). "without" runs its fatal part last.
SERVER_SESSIONS = {
    "ours-serve": ("ours", "qwen3next", ("speculators", "probes", "stops", "storm", "full-disk")),
    "without-serve": (
        "without",
        "qwen3next",
        ("speculators", "probes-non-fatal", "stops", "storm"),
    ),
}
# The model runners each server runs on (harness.RUNNERS; see sessions.RUNNERS_OF): our
# wheel on both (CUDA users run V2, CPU users V1: the connector's hooks differ), upstream's
# findings on V2; each only where the pinned release has it (harness.at_pin).
SERVER_RUNNERS = {
    name: harness.at_pin(runners)
    for name, runners in {"ours-serve": ("v2", "v1"), "without-serve": ("v2",)}.items()
}


def run_server_session(shared: Path, name: str, runner: str, wheels: dict, models: dict,
                       client, prepared: dict) -> dict:  # fmt: skip
    """Run the server session ``name`` on the model runner ``runner`` once per pytest run,
    with its wheel of ``wheels`` and its model of ``models`` (``prepared``: speculators' data,
    from prepare_speculators_data); its result."""
    from vllm_overlay import util

    wheel_kind, model_name, parts = SERVER_SESSIONS[name]
    assert runner in SERVER_RUNNERS[name], f"{name} does not run on {runner}"
    wheel = harness.runner_wheel(wheels, wheel_kind, runner)
    where = shared / "servers" / f"{name}-{runner}"
    # Another worker waits as long as the holder lives: its own bounds end a hang.
    with util.exclusive_lock(where.with_suffix(".lock"), f"server session {name}",
                             timeout=math.inf):  # fmt: skip
        result_file = where / "result.json"
        if result_file.is_file():
            return json.loads(result_file.read_text())
        shutil.rmtree(where, ignore_errors=True)
        where.mkdir(parents=True)
        model = models[model_name]
        result: dict = {"wheel": wheel.kind, "runner": runner, "start_error": None,
                        "expected_ran": wheel.env.ran}  # fmt: skip
        env_vars = {**storm_environ(where), "VO_RAN_FILE": str(where / "ran.json")}
        t0 = time.monotonic()
        try:
            with server.serving(wheel.env, model, where, layers=LAYERS, engine=SERVE_ENGINE,
                                env_vars=env_vars) as srv:  # fmt: skip
                result["start_seconds"] = srv.start_seconds
                result["served_version"] = srv.request("GET", "/version", timeout=60).body
                for part in parts:
                    if part == "speculators":
                        out = run_speculators(srv, client, prepared, model, where / part)
                    elif part.startswith("probes"):
                        out = run_probes(srv, where / part, fatal=part == "probes")
                    elif part == "stops":
                        out = stops.run_stops(
                            srv, where / part, max_model_len=SERVE_ENGINE["max_model_len"]
                        )
                    elif part == "full-disk":
                        out = fulldisk.run_full_disk(srv, where / part, **fulldisk.DISK)
                    else:
                        out = run_storm(srv, where / part, **STORM)
                    result[part] = out
                result["healthy_at_end"] = srv.healthy()
                # Before the server is stopped: its shutdown logs errors of its own.
                result["log_errors"] = log_errors(srv.log)
        except RuntimeError as e:
            result["start_error"] = str(e)[:2000]
        # The server is stopped: its CPU is the check's.
        check({part: result[part] for part in parts if part in result}, wheel.env, model, where)
        result["seconds"] = round(time.monotonic() - t0, 1)
        result["ran"] = harness.read_ran(where / "ran.json")
        tmp = result_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=2, sort_keys=True))
        tmp.replace(result_file)
        return result


def summary(name: str, r: dict) -> dict:
    """A server session's figures for the end-of-run table."""
    spec, storm, probes = r.get("speculators", {}), r.get("storm", {}), {}
    disk = r.get("full-disk", {})
    first, later = disk.get("outcomes", {}), disk.get("later_outcomes", {})
    for part in ("probes", "probes-non-fatal"):
        probes = r.get(part, probes)
    worst = spec.get("worst") or {}
    outcomes = storm.get("outcomes", {})
    err = worst.get("max_rel_err")
    return {
        "session": name,
        "start_seconds": r.get("start_seconds"),
        "spec_files": f"{len(spec.get('files', []))}/{spec.get('rows', 0)}",
        "spec_right": f"{worst.get('right_rows', 0)}/{worst.get('rows', 0)}",
        "spec_err": "-" if err is None else f"{err:.4f}",
        "escaped": len(probes.get("outside_storage", [])) + len(probes.get("outside_dir", [])),
        "storm_requests": storm.get("requests", 0),
        "storm_disconnected": len(storm.get("left", [])),
        "storm_completed": outcomes.get("completed", 0),
        "storm_verified": storm.get("files_verified", 0),
        "storm_aborted": len(storm.get("aborted", [])),
        "storm_left": len(storm.get("storage_after_reading", [])),
        "storm_seconds": storm.get("seconds", 0),
        "disk_requests": disk.get("requests", 0) + len(disk.get("later", [])),
        "disk_failed": first.get("missing", 0) + later.get("missing", 0),
        "disk_torn": first.get("torn", 0) + later.get("torn", 0),
        "disk_left": len(disk.get("storage_left", [])),
        "disk_right_after": f"{later.get('whole', 0)}/{len(disk.get('later', []))}",
        "alive": "yes" if r.get("healthy_at_end") else "no",
        "seconds": r.get("seconds", 0),
    }
