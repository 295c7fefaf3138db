# SPDX-License-Identifier: Apache-2.0
"""ExampleHiddenStatesConnector saves hidden states from a KV cache in host memory.

Added by vllm-overlay (our own change). The connector copies each finished request's
hidden states out of the cache with a CUDA stream, CUDA events and pinned host memory.
On vLLM's CPU backend none of them exist (the CPU worker's stand-in stream has no
``wait_event``, its stand-in event no ``query``, and ``pin_memory=True`` needs an
accelerator), so extraction stopped the engine at the first finished request. For a
cache on the CPU the connector now copies the rows synchronously and reports the copy
as done.

No CUDA is stood in for here: the test runs the connector's real copy path on a CPU
tensor and reads back the safetensors file it writes. Running on an unpatched tree:
set ``VLLM_OVERLAY_TREE=pristine``; the tests that need the fix are then
``xfail(strict=True)``.
"""

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from tests.v1.kv_connector.unit.utils import create_request
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1 import (
    example_hidden_states_connector as hs_connector_module,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: E501
    load_hidden_states,
)
from vllm.model_executor.models.extract_hidden_states import (
    CacheOnlyAttentionBackend,
    CacheOnlyAttentionLayer,
    basic_cache,
)
from vllm.v1.core.sched.output import NewRequestData, SchedulerOutput
from vllm.v1.kv_cache_interface import (
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)

_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")
if _TREE not in ("patched", "pristine"):
    raise ValueError(
        f"VLLM_OVERLAY_TREE={_TREE!r}: expected 'patched' (the default) or 'pristine'"
    )

needs_fix = pytest.mark.xfail(
    _TREE == "pristine",
    reason="needs the connector's copy path for a KV cache in host memory",
    strict=True,
)

BLOCK_SIZE, NUM_BLOCKS, NUM_AUX, HIDDEN_SIZE = 16, 32, 3, 64
HIDDEN_LAYER = "model.cache_only_layers.12"
DTYPE = torch.bfloat16


def _vllm_config(storage: Path) -> VllmConfig:
    model_config = ModelConfig(
        model="facebook/opt-125m", dtype="bfloat16", max_model_len=2048
    )
    speculative_config = SpeculativeConfig(
        target_model_config=model_config,
        target_parallel_config=ParallelConfig(),
        method="extract_hidden_states",
        num_speculative_tokens=1,
        draft_model_config={
            "hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 6, 12]}
        },
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE)
    if "kv_cache_layout" in {f.name for f in dataclasses.fields(CacheConfig)}:
        cache_config.kv_cache_layout = "LBNHC"  # vLLM >= 0.33.0 asks for it
    return VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        speculative_config=speculative_config,
        scheduler_config=SchedulerConfig(
            max_model_len=model_config.max_model_len,
            is_encoder_decoder=model_config.is_encoder_decoder,
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="ExampleHiddenStatesConnector",
            kv_role="kv_producer",
            kv_connector_extra_config={"shared_storage_path": str(storage)},
        ),
    )


def _hidden_states_cache() -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer in this release's layout, the view basic_cache writes through)."""
    if not hasattr(CacheOnlyAttentionBackend, "get_kv_cache_shape"):  # vLLM >= 0.29
        # [block, head, slot, dim]; from 0.32.0 basic_cache indexes that layout itself
        buffer = torch.zeros(NUM_BLOCKS, NUM_AUX, BLOCK_SIZE, HIDDEN_SIZE, dtype=DTYPE)
        return buffer, buffer
    buffer = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, NUM_AUX, HIDDEN_SIZE, dtype=DTYPE)
    return buffer, buffer


@needs_fix
def test_hidden_states_saved_from_a_cpu_cache(tmp_path, monkeypatch):
    vllm_config = _vllm_config(tmp_path)
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                [HIDDEN_LAYER],
                HiddenStateCacheSpec(
                    block_size=BLOCK_SIZE,
                    num_kv_heads=NUM_AUX,
                    head_size=HIDDEN_SIZE,
                    dtype=DTYPE,
                ),
            )
        ],
    )
    monkeypatch.setattr(
        hs_connector_module, "get_tensor_model_parallel_rank", lambda: 0
    )
    with set_current_vllm_config(vllm_config):
        CacheOnlyAttentionLayer(
            num_heads=NUM_AUX, head_size=HIDDEN_SIZE, prefix=HIDDEN_LAYER
        )

    def connector(role):
        return KVConnectorFactory.create_connector(
            config=vllm_config, role=role, kv_cache_config=kv_cache_config
        )

    scheduler, worker = connector(KVConnectorRole.SCHEDULER), connector(
        KVConnectorRole.WORKER
    )
    kv_cache, view = _hidden_states_cache()
    worker.register_kv_caches({HIDDEN_LAYER: kv_cache})

    num_tokens, blocks = 20, [5, 2]
    request = create_request(request_id=3, num_tokens=num_tokens)
    step = SchedulerOutput.make_empty()
    step.scheduled_new_reqs = [
        NewRequestData.from_request(request, (blocks,), request.prefill_token_ids)
    ]
    worker.bind_connector_metadata(scheduler.build_connector_meta(step))
    worker.wait_for_save()
    worker.clear_connector_metadata()

    expected = torch.randn(num_tokens, NUM_AUX, HIDDEN_SIZE, dtype=DTYPE) + 3.0
    slots = torch.tensor(
        [blocks[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(num_tokens)]
    )
    basic_cache(expected, view, slots)

    delay_free, params = scheduler.request_finished(request, blocks)
    assert delay_free
    worker.bind_connector_metadata(
        scheduler.build_connector_meta(SchedulerOutput.make_empty())
    )
    done_sending, _ = worker.get_finished({request.request_id})
    worker.clear_connector_metadata()
    assert done_sending == {request.request_id}

    saved = load_hidden_states(params["hidden_states_path"])
    assert saved["token_ids"].tolist() == request.prompt_token_ids
    torch.testing.assert_close(saved["hidden_states"], expected, rtol=0, atol=0)
