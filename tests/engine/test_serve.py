"""The real clients against ``vllm serve`` of our CPU wheel (see clients.py and server.py).

One server per wheel: speculators 0.9.0's pipeline (its own environment, no vLLM in it),
then clients sending ids and paths that try to leave the storage directory and malformed
kv_transfer_params, then a crowd of clients of which a seeded third disconnects. Every file
written for a client is checked against the Transformers reference. Out-of-tree
connectors: hs-connectors 0.9.0's FP8 connector, loaded by module path as speculators
configures it.
"""

from __future__ import annotations

import pytest
from engine import harness
from engine.checks import assert_layers_right, assert_right
from engine.clients import SERVER_RUNNERS, SPECULATORS_ROWS, STORM
from engine.fulldisk import DISK
from engine.sessions import FP8_TOLERANCE, RUNNERS_OF

serve_on = pytest.mark.parametrize("runner", SERVER_RUNNERS["ours-serve"])


@serve_on
def test_vllm_serve_starts_from_our_cpu_wheel(server_session, engine_wheels, runner):
    """vllm-cpu installs as the distribution vllm-cpu; the `vllm` command looked up one named
    vllm and stopped before any subcommand (cli-version-of-any-distribution). The server
    that answers is our wheel's: its /version is the installed wheel's version. Its worker
    ran the model runner and proposer the session is named for."""
    r = server_session("ours-serve", runner)
    assert r["start_error"] is None, r["start_error"]
    assert r["served_version"] == {"version": engine_wheels[f"ours-{runner}"].env.vllm_version}
    assert r["ran"] == r["expected_ran"], r


@serve_on
def test_speculators_generates_the_hidden_states_the_model_computes(server_session, runner):
    spec = server_session("ours-serve", runner)["speculators"]
    assert spec["prepare"]["rc"] == 0, spec["prepare"]["log_tail"]
    assert spec["generate"]["rc"] == 0, spec["generate"]["log_tail"]
    assert len(spec["files"]) == len(SPECULATORS_ROWS)
    assert spec["token_ids"] == sorted(SPECULATORS_ROWS)  # prepare-data shuffles the rows
    for name, checks in spec["checks"].items():
        assert_layers_right(checks, f"speculators file {name}")
    # speculators moved every file and removed its lock: nothing is left to collect.
    assert spec["storage_left"] == []


# What each probe of clients._probe_list gets from our wheel: 200, a file in the storage
# directory (the id confined, a custom path ignored); 400, a client error and no file.
PROBE_STATUS = {
    "header-dot-dot": 200,
    "header-absolute": 200,
    "header-symlinked-dir": 200,
    "body-request-id-dot-dot": 200,
    "custom-path-disallowed": 200,
    "custom-path-not-a-string": 200,
    "header-too-long": 200,
    "kv-transfer-params-not-an-object": 400,
    "kv-transfer-params-list": 400,
}


@serve_on
def test_no_client_writes_outside_the_storage_directory(server_session, runner):
    probes = server_session("ours-serve", runner)["probes"]
    assert probes["outside_storage"] == [] and probes["outside_dir"] == [], probes
    assert {n: p["status"] for n, p in probes["probes"].items()} == PROBE_STATUS
    for name, p in probes["probes"].items():
        assert p["healthy_after"], (name, p)
        if PROBE_STATUS[name] == 200:
            assert "path" in p and p["in_storage"] and "read_error" not in p, (name, p)
        else:
            assert "path" not in p, (name, p)
    files = sorted(n for n, status in PROBE_STATUS.items() if status == 200)
    assert sorted(probes["checks"]) == files
    for name, checks in probes["checks"].items():
        assert_layers_right(checks, f"probe {name}")


@serve_on
@pytest.mark.parametrize("probe", ["kv-transfer-params-not-an-object", "kv-transfer-params-list"])
def test_malformed_kv_transfer_params_get_a_client_error(server_session, runner, probe):
    p = server_session("ours-serve", runner)["probes"]["probes"][probe]
    assert 400 <= p["status"] < 500 and p["healthy_after"], p


@serve_on
def test_a_request_id_too_long_for_a_file_name_is_served(server_session, runner):
    """The worker opened <storage>/<id>.safetensors.lock: ENAMETOOLONG took EngineCore down."""
    p = server_session("ours-serve", runner)["probes"]["probes"]["header-too-long"]
    assert p["status"] == 200 and p["in_storage"] and p["healthy_after"], p


@serve_on
def test_aborts_under_load_leave_a_working_server_and_no_files(server_session, runner):
    """Every disconnect of the storm hits a request in flight by construction (clients.STORM):
    a holder frozen mid-prefill by the engine's own pause, a crowd queued behind it of which
    a seeded third leaves. The counts are the test's own, whatever the machine's speed."""
    r = server_session("ours-serve", runner)
    storm = r["storm"]
    leavers = storm["leavers"]
    # The premise, from the server's side: the engine paused itself in the step that gave
    # the holder its first chunk; the holder was running, with most of its prompt to go.
    pause = storm["pause"]
    assert storm["paused"] and len(pause["paused_for"]) == 1, storm
    (hold,) = pause["paused_for"]
    assert "storm-hold-0" in hold and hold in pause["running"], pause
    assert pause["scheduled_tokens"][hold] < pause["prompt_tokens"][hold], pause
    assert 0 < leavers < STORM["requests"]
    assert storm["outcomes"] == {
        "completed": STORM["requests"] - leavers, "left while waiting": leavers,
    }, [c for c in storm["clients"] if c["outcome"] not in ("completed", "left while waiting")]  # fmt: skip
    # The server's side of every disconnect: the engine aborted each request whose client
    # left (the running holder, every waiting leaver) and no other, then resumed.
    assert storm["all_aborted"], f"not aborted: {storm['not_aborted']}"
    assert storm["aborted"] == sorted(storm["left"]), storm["aborted"]
    assert storm["resume_status"] == 200
    assert storm["healthy_after"] and storm["follow_up_status"] == 200, storm["outcomes"]
    # Every completed request's file equals the reference; nothing else was left behind.
    assert storm["wrong_files"] == [], storm["wrong_files"]
    assert storm["files_verified"] == STORM["requests"] - leavers
    assert storm["settled"], f"locks without their file: {storm['storage_left']}"
    assert storm["storage_after_reading"] == [], storm["storage_after_reading"]
    assert storm["kv_cache_freed"], f"KV cache usage stayed at {storm['kv_cache_usage']}"
    assert r["healthy_at_end"]
    assert r["log_errors"] == [], r["log_errors"][:20]


@serve_on
@pytest.mark.parametrize("part", ["stop-string", "paused"])
def test_a_request_the_engine_aborts_for_its_client_keeps_its_file(server_session, runner, part):
    """The core finishes a request that ends on a stop string (found in the frontend), and
    every request a pause with mode "abort" stops, as FINISHED_ABORTED: the client is still
    there, its prompt computed (stops.py). It finds its file by its request id (the reply
    to an aborted request carries no path, on 0.34.0 as released too), and the file holds
    the rows the model computed for its prompt."""
    stop = server_session("ours-serve", runner)["stops"]
    got = stop[part]
    if part == "stop-string":  # the premise: a word of the greedy text, where it stopped
        assert got["stop"] and got["client"]["finish"] == "stop", got
    else:  # the premise: generating (its prompt computed) when the pause aborted it
        assert got["generating_when_paused"] and got["client"]["finish"] == "abort", got
        assert got["pause_status"] == got["resume_status"] == 200, got
    c = got["client"]
    assert c["status"] == 200 and c["lock_released"] and c["found"] and "kept" in c, c
    assert_layers_right(stop["checks"][c["name"]], f"{part} file")
    assert stop["healthy_after"] and stop["storage_left"] == [], stop


@serve_on
def test_a_full_disk_fails_writes_cleanly_and_the_server_goes_on(server_session, runner):
    """hidden-states-connector-atomic-files, on a tmpfs the test mounts over the storage
    directory (fulldisk.py): every write that meets the full disk fails whole, logged with
    its request's id; no client ever reads a torn file; nothing is left behind; the server
    goes on, and once space returns every request is saved whole and right."""
    r = server_session("ours-serve", runner)
    disk = r["full-disk"]
    assert disk["mount_error"] is None, disk["mount_error"]
    assert disk["storage_before"] == [], disk["storage_before"]
    assert disk["all_written"], disk["clients"]
    fits = DISK["size"] // disk["file_bytes"]
    assert [c["status"] for c in disk["clients"] + disk["later"]] == [200] * (
        DISK["requests"] + DISK["after"]
    )
    outcomes = disk["outcomes"]
    assert outcomes["torn"] == 0, disk["clients"]
    # The premise: the disk filled, by construction (no file was removed while others were
    # written), so at most `fits` writes found room.
    assert outcomes["whole"] <= fits and outcomes["missing"] >= DISK["requests"] - fits, outcomes
    assert outcomes["whole"] + outcomes["missing"] == DISK["requests"], outcomes
    missing = sorted(c["name"] for c in disk["clients"] if c["outcome"] == "missing")
    assert disk["failures_logged"] == missing
    assert disk["later_outcomes"] == {"whole": DISK["after"], "missing": 0, "torn": 0}
    assert disk["storage_left"] == [], disk["storage_left"]
    assert disk["healthy_after"]
    assert disk["wrong_files"] == [] and len(disk["checks"]) == len(disk["files"])
    assert len(disk["files"]) == outcomes["whole"] + DISK["after"]
    for name, checks in disk["checks"].items():
        assert_layers_right(checks, f"full-disk file {name}")


@pytest.mark.parametrize("runner", RUNNERS_OF["ours-hybrid-hs-connectors"])
@pytest.mark.parametrize("case", ["batch", "long"])
def test_hs_connectors_fp8_connector_on_our_wheel(engine_session, runner, case):
    """hs-connectors 0.9.0 subclasses ExampleHiddenStatesConnector (its _write_tensors) and
    imports extract_from_kv_cache, HiddenStateCacheSpec, CacheOnlyAttentionLayer and
    SupportsHMA from vLLM: our series must keep that surface. Its files are float8 with a
    scale per row, dequantized for the check."""
    s = engine_session("ours-hybrid-hs-connectors", runner)
    assert s.result["start_error"] is None, s.result["start_error"]
    assert_right(s, case, tolerance=FP8_TOLERANCE, proposer=False)


SURFACE = """
import ast, importlib, json, pathlib, sys
import hs_connectors
names = []
for f in sorted(pathlib.Path(hs_connectors.__file__).parent.glob("*.py")):
    for node in ast.walk(ast.parse(f.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vllm"):
            names += [(f.name, node.module, a.name) for a in node.names]
missing = []
for where, module, name in names:
    try:
        mod = importlib.import_module(module)
        getattr(mod, name) if hasattr(mod, name) else importlib.import_module(f"{module}.{name}")
    except Exception as e:
        missing.append([where, module, name, repr(e)])
print(json.dumps({"names": names, "missing": missing}))
"""


def test_hs_connectors_imports_resolve_on_our_wheel(engine_wheels, tmp_path):
    """Every ``from vllm… import`` in hs-connectors 0.9.0's modules resolves on our wheel."""
    import json
    import shutil
    import subprocess

    env = harness.ours_env(engine_wheels)
    environ = env.environ(tmp_path)
    out = subprocess.run([env.python, "-c", SURFACE], env=environ,
                         capture_output=True, text=True, check=False, timeout=300)  # fmt: skip
    shutil.rmtree(environ["VLLM_RPC_BASE_PATH"], ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    imported = {name for _, _, name in found["names"]}
    assert {"ExampleHiddenStatesConnector", "extract_from_kv_cache", "SupportsHMA"} <= imported
    assert found["missing"] == [], found["missing"]
