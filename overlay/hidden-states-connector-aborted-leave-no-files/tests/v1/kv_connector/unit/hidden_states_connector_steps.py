# SPDX-License-Identifier: Apache-2.0
"""vLLM's Scheduler with ExampleHiddenStatesConnector and the connector of the
worker (TP rank 0), stepped without a forward pass: what the tests of the
connector's files (which are written, which are left behind) drive.

Added by vllm-overlay. The hidden-states buffer is host memory, as on vLLM's CPU
backend. A connector that copies it with a CUDA stream, events and pinned memory has
them stood in for here (on the CPU every copy is already done), so the tests that need
no change pass on a tree without it too.
"""

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import torch

from tests.v1.kv_connector.unit.utils import create_request, create_scheduler
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
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import (
    example_hidden_states_connector as hs_connector_module,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.model_executor.models.extract_hidden_states import (
    CacheOnlyAttentionBackend,
    CacheOnlyAttentionLayer,
)
from vllm.v1.kv_cache_interface import (
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

DTYPE = torch.float32
BLOCK_SIZE = 16
AUX_LAYER_IDS = (1, 5, 9)
HIDDEN_SIZE = 8
NUM_BLOCKS = 64
HIDDEN_LAYER = "model.cache_only_layers.12"


def _vllm_config(
    storage: Path, extra_config: dict[str, Any], token_budget: int | None = None
) -> VllmConfig:
    model_config = ModelConfig(
        model="facebook/opt-125m", dtype="float32", max_model_len=2048
    )
    speculative_config = SpeculativeConfig(
        target_model_config=model_config,
        target_parallel_config=ParallelConfig(),
        method="extract_hidden_states",
        num_speculative_tokens=1,
        draft_model_config={
            "hf_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_LAYER_IDS)}
        },
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE)
    if "kv_cache_layout" in {f.name for f in dataclasses.fields(CacheConfig)}:
        cache_config.kv_cache_layout = "LBNHC"  # vLLM >= 0.33.0
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        speculative_config=speculative_config,
        scheduler_config=SchedulerConfig(
            max_model_len=model_config.max_model_len,
            is_encoder_decoder=model_config.is_encoder_decoder,
            **(
                {"max_num_batched_tokens": token_budget, "max_num_seqs": token_budget}
                if token_budget
                else {}
            ),
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="ExampleHiddenStatesConnector",
            kv_role="kv_producer",
            kv_connector_extra_config={
                "shared_storage_path": str(storage),
                **extra_config,
            },
        ),
    )


def _kv_cache_config() -> KVCacheConfig:
    spec = HiddenStateCacheSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=len(AUX_LAYER_IDS),
        head_size=HIDDEN_SIZE,
        dtype=DTYPE,
    )
    return KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([HIDDEN_LAYER], spec)],
    )


class _CopyStream:
    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


class _CopyEvent:
    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _stand_in_cuda_copies(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "Stream", _CopyStream)
    monkeypatch.setattr(torch.cuda, "Event", _CopyEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    real_empty_like = torch.empty_like

    def empty_like(*args, pin_memory: bool = False, **kwargs):
        return real_empty_like(*args, **kwargs)

    monkeypatch.setattr(torch, "empty_like", empty_like)


class ConnectorSteps:
    """A scheduler and one worker-side connector (TP rank 0) sharing a storage
    directory; ``step()`` is one engine step less the model."""

    def __init__(
        self,
        storage: Path,
        monkeypatch,
        token_budget: int | None = None,
        **extra_config: Any,
    ):
        _stand_in_cuda_copies(monkeypatch)
        vllm_config = _vllm_config(storage, extra_config, token_budget)
        self.scheduler = create_scheduler(
            vllm_config, num_blocks=NUM_BLOCKS, kv_cache_config=_kv_cache_config()
        )
        monkeypatch.setattr(
            hs_connector_module, "get_tensor_model_parallel_rank", lambda: 0
        )
        layer = CacheOnlyAttentionLayer.__new__(CacheOnlyAttentionLayer)
        vllm_config.compilation_config.static_forward_context[HIDDEN_LAYER] = layer
        self.worker = KVConnectorFactory.create_connector(
            config=vllm_config,
            role=KVConnectorRole.WORKER,
            kv_cache_config=_kv_cache_config(),
        )
        num_aux = len(AUX_LAYER_IDS)
        if hasattr(CacheOnlyAttentionBackend, "get_kv_cache_shape"):  # <= 0.28
            shape = CacheOnlyAttentionBackend.get_kv_cache_shape(
                NUM_BLOCKS, BLOCK_SIZE, num_aux, HIDDEN_SIZE
            )
        else:  # vLLM >= 0.29.0: [num_blocks, num_heads, block_size, head_size]
            shape = (NUM_BLOCKS, num_aux, BLOCK_SIZE, HIDDEN_SIZE)
        self.worker.register_kv_caches({HIDDEN_LAYER: torch.ones(shape, dtype=DTYPE)})

    def add(
        self,
        request_id: str,
        num_tokens: int = 20,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> Request:
        """Queue a request with a client-chosen id (and kv_transfer_params, as
        the OpenAI server passes them: in the sampling params' extra_args)."""
        request = create_request(num_tokens=num_tokens, block_size=BLOCK_SIZE)
        request.request_id = request_id
        if kv_transfer_params is not None:
            request.sampling_params.extra_args = {
                "kv_transfer_params": kv_transfer_params
            }
            request.kv_transfer_params = kv_transfer_params
        self.scheduler.add_request(request)
        return request

    def step(self) -> set[str]:
        """Schedule, let the worker's connector see the metadata and report,
        update the scheduler; returns the requests reported as sent."""
        output = self.scheduler.schedule()
        self.worker.bind_connector_metadata(output.kv_connector_metadata)
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(output.finished_req_ids)
        self.worker.clear_connector_metadata()
        self.scheduler._update_from_kv_xfer_finished(
            KVConnectorOutput(finished_sending=sending, finished_recving=recving)
        )
        return set(sending or ())

    def wait_for_writes(self) -> None:
        """Until the worker's writer threads have written every submitted file."""
        for future in list(self.worker._req_futures.values()):
            future.result()

    def finish(self, request: Request, status: RequestStatus) -> None:
        self.scheduler.finish_requests(request.request_id, status)

    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()
