"""One side of bench_connector.py: a version of vLLM's hidden-states connector module, loaded
under a name of its own beside the others, driven as the scheduler and the worker call it.

Runs in the CPU test environment with vLLM's pristine tree on PYTHONPATH (bench_connector.py
starts it); imports vLLM and torch, never vllm_overlay.
"""

from __future__ import annotations

import importlib.util
import os
import random
import socket
import sys
import time
import uuid
from pathlib import Path

import torch
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import HiddenStateCacheSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

BLOCK_SIZE = 16
LAYER = "model.cache_only_layers.12"


def init_rank_zero() -> None:
    """A real one-process gloo group, so that the worker's connector is TP rank 0 as in an
    engine (register_kv_caches asks the tensor-parallel group)."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.parallel_state import (
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )  # fmt: skip
    with set_current_vllm_config(_configs(Path("/nonexistent"), 1, 8)[0]):
        ensure_model_parallel_initialized(1, 1)


def request_ids(n: int, seed: int) -> list[str]:
    """Ids as vLLM's OpenAI server makes them: its own (``cmpl-<uuid hex>-0-<suffix>``,
    ``chatcmpl-…``) and a client's X-Request-Id (a UUID) with the engine's suffix."""
    rng = random.Random(seed)

    def hex_(bits: int) -> str:
        return f"{rng.getrandbits(bits):0{bits // 4}x}"

    kinds = (
        lambda: f"cmpl-{hex_(128)}-0-{hex_(32)}",
        lambda: f"chatcmpl-{hex_(128)}-{hex_(32)}",
        lambda: f"{uuid.UUID(int=rng.getrandbits(128))}-{hex_(32)}",
    )
    return [kinds[i % len(kinds)]() for i in range(n)]


def load_module(name: str, path: str):
    """The connector module file at ``path`` as module ``name`` (its own classes, sharing
    the rest of vLLM with every other side)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _configs(storage: Path, layers: int, hidden: int) -> tuple[VllmConfig, KVCacheConfig]:
    model = ModelConfig(model="facebook/opt-125m", dtype="bfloat16", max_model_len=2048)
    spec_config = SpeculativeConfig(
        target_model_config=model,
        target_parallel_config=ParallelConfig(),
        method="extract_hidden_states",
        num_speculative_tokens=1,
        draft_model_config={"hf_config": {"eagle_aux_hidden_state_layer_ids": list(range(layers))}},
    )
    vllm_config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK_SIZE),
        speculative_config=spec_config,
        scheduler_config=SchedulerConfig(
            max_model_len=model.max_model_len, is_encoder_decoder=model.is_encoder_decoder
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="ExampleHiddenStatesConnector",
            kv_role="kv_producer",
            kv_connector_extra_config={"shared_storage_path": str(storage)},
        ),
    )
    cache_spec = HiddenStateCacheSpec(
        block_size=BLOCK_SIZE, num_kv_heads=layers, head_size=hidden, dtype=torch.bfloat16
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=0, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec([LAYER], cache_spec)]
    )
    return vllm_config, kv_cache_config


class Side:
    """A scheduler-role and a worker-role connector of one version, sharing ``storage``."""

    def __init__(self, name: str, module_path: str, storage: Path, spec: dict):
        self.module = load_module(f"_bench_connector_{name.strip('+')}", module_path)
        self.storage = storage
        storage.mkdir(parents=True, exist_ok=True)
        self.batch_size = spec["batch"]
        self.tokens = spec["tokens"]
        self.blocks_per_request = -(-self.tokens // BLOCK_SIZE)
        config, kv_config = _configs(storage, spec["layers"], spec["hidden"])
        config.compilation_config.static_forward_context[LAYER] = CacheOnlyAttentionLayer.__new__(
            CacheOnlyAttentionLayer
        )
        cls = self.module.ExampleHiddenStatesConnector
        self.scheduler = cls(config, KVConnectorRole.SCHEDULER, kv_config)
        self.worker = cls(config, KVConnectorRole.WORKER, kv_config)
        num_blocks = self.batch_size * self.blocks_per_request
        cache = torch.randn(num_blocks, spec["layers"], BLOCK_SIZE, spec["hidden"])
        self.worker.register_kv_caches({LAYER: cache.to(torch.bfloat16)})
        self.path_of = getattr(self.module, "storage_file_name", None)

    def _requests(self, ids: list[str]) -> list[tuple[Request, NewRequestData, list[int]]]:
        out = []
        for i, req_id in enumerate(ids):
            req = Request(
                request_id=req_id,
                prompt_token_ids=list(range(i, i + self.tokens)),
                sampling_params=SamplingParams(max_tokens=1),
                pooling_params=None,
            )
            blocks = list(range(i * self.blocks_per_request, (i + 1) * self.blocks_per_request))
            out.append((req, NewRequestData.from_request(req, (blocks,)), blocks))
        return out

    def _step(self, new: list[NewRequestData], finished: set[str]) -> None:
        """One engine step of the connector: the scheduler's metadata, the worker's calls."""
        output = SchedulerOutput.make_empty()
        output.scheduled_new_reqs = new
        output.finished_req_ids = finished
        self.worker.bind_connector_metadata(self.scheduler.build_connector_meta(output))
        self.worker.wait_for_save()
        self.worker.get_finished(finished)
        self.worker.clear_connector_metadata()

    def batch(self, ids: list[str], aborted: bool) -> dict[str, tuple[int, int]]:
        """One batch of requests through the connector: scheduled in one step, finished
        (or aborted) and saved (or discarded) in the next; (ns, requests) per operation."""
        clock = time.perf_counter_ns
        storage = str(self.storage)
        batch = self._requests(ids)
        finish_op, save_op = ("abort", "discard") if aborted else ("finish", "save")
        status = RequestStatus.FINISHED_ABORTED if aborted else RequestStatus.FINISHED_STOPPED
        output = SchedulerOutput.make_empty()
        output.scheduled_new_reqs = [new for _, new, _ in batch]
        finished = {req.request_id for req, _, _ in batch}

        t0 = clock()
        if self.path_of is None:
            for req_id in ids:
                os.path.join(storage, f"{req_id}.safetensors")
        else:
            for req_id in ids:
                os.path.join(storage, self.path_of(req_id))
        t1 = clock()
        meta = self.scheduler.build_connector_meta(output)
        t2 = clock()
        self.worker.bind_connector_metadata(meta)
        self.worker.wait_for_save()
        self.worker.get_finished(set())
        self.worker.clear_connector_metadata()
        t3 = clock()
        for req, _, _ in batch:
            req.status = status
        t4 = clock()
        for req, _, blocks in batch:
            self.scheduler.request_finished(req, blocks)
        t5 = clock()
        self._step([], finished)
        for future in list(self.worker._req_futures.values()):
            future.result()
        t6 = clock()
        self._clear()
        n = len(batch)
        return {"path": (t1 - t0, n), "schedule": (t2 - t1, n), "lock": (t3 - t2, n),
                finish_op: (t5 - t4, n), save_op: (t6 - t5, n)}  # fmt: skip

    def _clear(self) -> None:
        """The client's part, untimed: every file and lock of the batch removed."""
        with os.scandir(self.storage) as entries:
            for entry in entries:
                os.remove(entry.path)
