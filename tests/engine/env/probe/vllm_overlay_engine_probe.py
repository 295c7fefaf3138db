"""Test-only vLLM plugin for vllm-overlay's engine tests; never part of a wheel we ship.

vLLM loads every ``vllm.general_plugins`` entry point in each of its processes.

With ``VO_PAUSE_ON`` set (a request id stem, ``storm-hold-``), the scheduler pauses itself
(``PauseState.PAUSED_ALL``, what ``/pause?mode=keep`` sets) in the step that first schedules
such a request, after giving it its first prefill chunk, and writes the running and waiting
requests of that moment to ``VO_PAUSE_FILE``: the storm's holder is running, mid-prefill,
by construction, and stays so until ``/resume``.

With ``VO_PROBE_DIR`` set, this one wraps the extract_hidden_states proposer in the worker and
saves what the model handed it, per request and chunk, before the cache layer stores it:
``<dir>/<request id>.<first position>.safetensors`` with ``hidden_states`` [tokens, layers,
hidden]. The engine tests compare the connector's files with these rows, bit for bit.
Only tensor-parallel rank 0 records (rank 0 is the one that writes the files).

The request ids and the first position of each chunk come from the model runner that calls
the proposer: its input batch order matches the rows, and ``seq_lens - query length`` is
the number of tokens computed before the chunk.

Both of vLLM 0.32.0's model runners are probed: V1 (``GPUModelRunner`` and its CPU subclass,
whose ``propose_draft_token_ids`` calls ``ExtractHiddenStatesProposer.propose``) and Model
Runner V2 (``vllm.v1.worker.gpu.model_runner.GPUModelRunner`` and its CPU subclass, whose
``sample_tokens`` calls ``ExtractHiddenStatesSpeculator.propose``; V2's modules are imported
only where vLLM found Triton, which V2 needs). The first proposal with a request in it also
writes ``VO_RAN_FILE`` (when set, with or without ``VO_PROBE_DIR``): the classes of the model
runner and of the proposer that ran, read from the worker's objects, not from a setting.

With ``VO_GATHER_FILE`` set, every call the worker's ExampleHiddenStatesConnector makes to
``extract_from_kv_cache`` (the module's function, looked up at each call, on every wheel) is
counted, and the file says how many rows and bytes the calls gathered, and the most at once:
``{"gathers", "rows", "bytes", "max_rows", "max_bytes"}``, rewritten after each call.
"""

from __future__ import annotations

import os
import threading

_current = threading.local()
_ran: dict = {"written": False, "file": None}  # VO_RAN_FILE, written once per process


def register() -> None:
    if os.environ.get("VO_PAUSE_ON"):
        _pause_on(os.environ["VO_PAUSE_ON"], os.environ["VO_PAUSE_FILE"])
    if os.environ.get("VO_GATHER_FILE"):
        _record_gathers(os.environ["VO_GATHER_FILE"])
    out = os.environ.get("VO_PROBE_DIR")
    _ran["file"] = os.environ.get("VO_RAN_FILE")
    if not (out or _ran["file"]):
        return
    if out:
        os.makedirs(out, exist_ok=True)
    from importlib.util import find_spec

    if find_spec("vllm.v1.spec_decode.extract_hidden_states") is not None:  # 0.34.0: no V1
        _probe_v1(out)
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        _probe_v2(out)


def _within(runner_cls, method: str) -> None:
    """Make ``runner_cls.method`` the current runner while it runs (the proposer's caller)."""
    inner = getattr(runner_cls, method)

    def wrapped(self, *args, **kwargs):
        _current.runner = self
        try:
            return inner(self, *args, **kwargs)
        finally:
            _current.runner = None

    setattr(runner_cls, method, wrapped)


def _probe_v1(out: str) -> None:
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(ExtractHiddenStatesProposer, "_vo_probe", False):
        return
    propose = ExtractHiddenStatesProposer.propose

    def probed_propose(
        self,
        num_speculative_tokens,
        sampled_token_ids,
        target_hidden_states,
        common_attn_metadata,
        *args,
        **kwargs,
    ):
        runner = getattr(_current, "runner", None)
        if _recording(runner):
            qsl = common_attn_metadata.query_start_loc_cpu.tolist()
            seq_lens = common_attn_metadata.seq_lens.cpu().tolist()
            _record(out, runner, self, runner.input_batch.req_ids, qsl, seq_lens,
                    common_attn_metadata.num_reqs, target_hidden_states)  # fmt: skip
        return propose(
            self,
            num_speculative_tokens,
            sampled_token_ids,
            target_hidden_states,
            common_attn_metadata,
            *args,
            **kwargs,
        )

    _within(GPUModelRunner, "propose_draft_token_ids")
    ExtractHiddenStatesProposer.propose = probed_propose
    ExtractHiddenStatesProposer._vo_probe = True


def _probe_v2(out: str) -> None:
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.spec_decode.extract_hidden_states import (
        ExtractHiddenStatesSpeculator,
    )

    if getattr(ExtractHiddenStatesSpeculator, "_vo_probe", False):
        return
    propose = ExtractHiddenStatesSpeculator.propose

    def probed_propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                       aux_hidden_states, *args, **kwargs):  # fmt: skip
        runner = getattr(_current, "runner", None)
        if _recording(runner) and aux_hidden_states is not None:
            n = input_batch.num_reqs
            qsl = input_batch.query_start_loc_np[: n + 1].tolist()
            seq_lens = input_batch.seq_lens[:n].cpu().tolist()
            _record(out, runner, self, input_batch.req_ids, qsl, seq_lens, n, aux_hidden_states)
        return propose(self, input_batch, attn_metadata, slot_mappings, last_hidden_states,
                       aux_hidden_states, *args, **kwargs)  # fmt: skip

    _within(GPUModelRunner, "sample_tokens")
    ExtractHiddenStatesSpeculator.propose = probed_propose
    ExtractHiddenStatesSpeculator._vo_probe = True


def _record_gathers(path: str) -> None:
    import json

    from vllm.distributed.kv_transfer.kv_connector.v1 import (
        example_hidden_states_connector as connector,
    )

    if getattr(connector, "_vo_gathers", None) is not None:
        return
    extract = connector.extract_from_kv_cache
    seen = connector._vo_gathers = {"gathers": 0, "rows": 0, "bytes": 0, "max_rows": 0,
                                    "max_bytes": 0}  # fmt: skip
    lock = threading.Lock()

    def recorded(kv_cache, slot_mapping, num_tokens):
        rows = extract(kv_cache, slot_mapping, num_tokens)
        with lock:
            seen["gathers"] += 1
            seen["rows"] += rows.shape[0]
            seen["bytes"] += rows.nbytes
            seen["max_rows"] = max(seen["max_rows"], rows.shape[0])
            seen["max_bytes"] = max(seen["max_bytes"], rows.nbytes)
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(seen, f)
            os.replace(tmp, path)
        return rows

    connector.extract_from_kv_cache = recorded


def _pause_on(stem: str, path: str) -> None:
    import json

    from vllm.v1.core.sched.interface import PauseState
    from vllm.v1.core.sched.scheduler import Scheduler

    if getattr(Scheduler, "_vo_pause", False):
        return
    schedule = Scheduler.schedule

    def pausing_schedule(self, *args, **kwargs):
        out = schedule(self, *args, **kwargs)
        new = [r for r in out.scheduled_new_reqs if stem in r.req_id]
        if new and not getattr(self, "_vo_paused_once", False):
            self._vo_paused_once = True
            self.set_pause_state(PauseState.PAUSED_ALL)
            state = {
                "paused_for": [r.req_id for r in new],
                "scheduled_tokens": {r.req_id: out.num_scheduled_tokens[r.req_id] for r in new},
                "prompt_tokens": {r.req_id: len(r.prompt_token_ids or ()) for r in new},
                "running": [r.request_id for r in self.running],
                "waiting": [r.request_id for r in self.waiting],
            }
            tmp = f"{path}.tmp"
            with open(tmp, "w") as f:
                json.dump(state, f)
            os.replace(tmp, path)
        return out

    Scheduler.schedule = pausing_schedule
    Scheduler._vo_pause = True


def _recording(runner) -> bool:
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    # Proposals outside a model runner's step (its dummy runs) hold no request.
    return runner is not None and get_tensor_model_parallel_rank() == 0


def _name(obj) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def _record(out, runner, proposer, req_ids, qsl, seq_lens, num_reqs, hidden_states) -> None:
    import json

    import torch
    from safetensors.torch import save_file

    if _ran["file"] and not _ran["written"]:
        ran = {"model_runner": _name(runner), "proposer": _name(proposer)}
        tmp = f"{_ran['file']}.tmp"
        with open(tmp, "w") as f:
            json.dump(ran, f)
        os.replace(tmp, _ran["file"])
        _ran["written"] = True
    if not out:
        return
    stacked = torch.stack(list(hidden_states), dim=1).cpu()
    for i in range(num_reqs):
        lo, hi = qsl[i], qsl[i + 1]
        if hi <= lo:
            continue
        start = seq_lens[i] - (hi - lo)
        name = f"{req_ids[i]}.{start:06d}.safetensors"
        tmp = os.path.join(out, f".{name}.tmp")
        save_file({"hidden_states": stacked[lo:hi].contiguous()}, tmp)
        os.replace(tmp, os.path.join(out, name))
