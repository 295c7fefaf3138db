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
"""

from __future__ import annotations

import os
import threading

_current = threading.local()


def register() -> None:
    if os.environ.get("VO_PAUSE_ON"):
        _pause_on(os.environ["VO_PAUSE_ON"], os.environ["VO_PAUSE_FILE"])
    out = os.environ.get("VO_PROBE_DIR")
    if not out:
        return
    from vllm.v1.spec_decode.extract_hidden_states import ExtractHiddenStatesProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(ExtractHiddenStatesProposer, "_vo_probe", False):
        return
    os.makedirs(out, exist_ok=True)
    draft = GPUModelRunner.propose_draft_token_ids
    propose = ExtractHiddenStatesProposer.propose

    def propose_draft_token_ids(self, *args, **kwargs):
        _current.runner = self
        try:
            return draft(self, *args, **kwargs)
        finally:
            _current.runner = None

    def probed_propose(
        self,
        num_speculative_tokens,
        sampled_token_ids,
        target_hidden_states,
        common_attn_metadata,
        *args,
        **kwargs,
    ):
        _record(out, getattr(_current, "runner", None), target_hidden_states, common_attn_metadata)
        return propose(
            self,
            num_speculative_tokens,
            sampled_token_ids,
            target_hidden_states,
            common_attn_metadata,
            *args,
            **kwargs,
        )

    GPUModelRunner.propose_draft_token_ids = propose_draft_token_ids
    ExtractHiddenStatesProposer.propose = probed_propose
    ExtractHiddenStatesProposer._vo_probe = True


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


def _record(out, runner, target_hidden_states, metadata) -> None:
    import torch
    from safetensors.torch import save_file
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    if runner is None or get_tensor_model_parallel_rank() != 0:
        return
    stacked = torch.stack(target_hidden_states, dim=1).cpu()
    qsl = metadata.query_start_loc_cpu.tolist()
    seq_lens = metadata.seq_lens.cpu().tolist()
    req_ids = runner.input_batch.req_ids
    for i in range(metadata.num_reqs):
        lo, hi = qsl[i], qsl[i + 1]
        if hi <= lo:
            continue
        start = seq_lens[i] - (hi - lo)
        name = f"{req_ids[i]}.{start:06d}.safetensors"
        tmp = os.path.join(out, f".{name}.tmp")
        save_file({"hidden_states": stacked[lo:hi].contiguous()}, tmp)
        os.replace(tmp, os.path.join(out, name))
