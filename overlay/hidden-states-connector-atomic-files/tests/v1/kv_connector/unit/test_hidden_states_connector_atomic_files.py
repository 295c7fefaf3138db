# SPDX-License-Identifier: Apache-2.0
"""ExampleHiddenStatesConnector never leaves a torn file at a request's path.

Added by vllm-overlay. The writer thread called save_file(tensors, filename) on the
path the client holds: with safetensors below 0.8 (vLLM allows 0.6.2) a write that
fails part way (a full disk) or a worker killed mid-write leaves a file there that does
not load, and a pipeline scanning the storage directory meets it. A subclass that
overrides _write_tensors (hs-connectors' FP8 connector) calls save_file itself. The
connector now writes a hidden temporary in the same directory and renames it into
place before it releases the lock. The test runs the connector's real path on a KV
cache in host memory (vLLM's CPU backend), with subclasses whose _write_tensors fails
part way, as a full disk makes it, or looks at the directory while it writes.

Running on an unpatched tree: set ``VLLM_OVERLAY_TREE=pristine``; the tests that
need the fix are then ``xfail(strict=True)``.
"""

import errno
import os

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
from vllm.distributed.kv_transfer.kv_connector.v1 import (
    example_hidden_states_connector as hs_connector_module,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: E501
    ExampleHiddenStatesConnector,
    load_hidden_states,
)
from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer
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
    reason="needs the connector's write under a temporary name renamed into place",
    strict=True,
)


BLOCK_SIZE, NUM_BLOCKS, NUM_AUX, HIDDEN_SIZE = 16, 8, 3, 64
HIDDEN_LAYER = "model.cache_only_layers.12"
DTYPE = torch.bfloat16


class _DiskFillsUp(ExampleHiddenStatesConnector):
    """Writes part of the file, then fails as a full disk makes save_file fail."""

    @staticmethod
    def _write_tensors(tensors, event, filename, lock_fd):
        try:
            with open(filename, "wb") as f:
                f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{")
            raise OSError(errno.ENOSPC, "No space left on device")
        finally:
            if lock_fd is not None:
                os.close(lock_fd)


class _LooksWhileWriting(ExampleHiddenStatesConnector):
    """hs-connectors' pattern: its own _write_tensors calls save_file itself; it
    records what the storage directory holds once it has written every byte."""

    seen: list[list[str]] = []

    @staticmethod
    def _write_tensors(tensors, event, filename, lock_fd):
        ExampleHiddenStatesConnector._write_tensors(tensors, event, filename, lock_fd)
        _LooksWhileWriting.seen.append(sorted(os.listdir(os.path.dirname(filename))))


def _save(connector_cls, storage, monkeypatch, num_tokens=20, blocks=(3, 5)):
    """One request through the scheduler's and the worker's connector; returns the
    path the client is given, once the worker's write has ended."""
    monkeypatch.setattr(
        hs_connector_module, "get_tensor_model_parallel_rank", lambda: 0
    )
    model_config = ModelConfig(
        model="facebook/opt-125m", dtype="bfloat16", max_model_len=2048
    )
    cache_config = CacheConfig(block_size=BLOCK_SIZE)
    cache_config.kv_cache_layout = "LBNHC"
    vllm_config = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        speculative_config=SpeculativeConfig(
            target_model_config=model_config,
            target_parallel_config=ParallelConfig(),
            method="extract_hidden_states",
            num_speculative_tokens=1,
            draft_model_config={
                "hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 6, 12]}
            },
        ),
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
    spec = HiddenStateCacheSpec(
        block_size=BLOCK_SIZE, num_kv_heads=NUM_AUX, head_size=HIDDEN_SIZE, dtype=DTYPE
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([HIDDEN_LAYER], spec)],
    )
    with set_current_vllm_config(vllm_config):
        CacheOnlyAttentionLayer(
            num_heads=NUM_AUX, head_size=HIDDEN_SIZE, prefix=HIDDEN_LAYER
        )
    scheduler, worker = (
        connector_cls(vllm_config, role, kv_cache_config)
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)
    )
    worker.register_kv_caches(
        {HIDDEN_LAYER: torch.ones(NUM_BLOCKS, NUM_AUX, BLOCK_SIZE, HIDDEN_SIZE)}
    )
    request = create_request(request_id=1, num_tokens=num_tokens)
    step = SchedulerOutput.make_empty()
    step.scheduled_new_reqs = [
        NewRequestData.from_request(request, (list(blocks),), request.prefill_token_ids)
    ]
    worker.bind_connector_metadata(scheduler.build_connector_meta(step))
    worker.wait_for_save()
    worker.clear_connector_metadata()
    _, params = scheduler.request_finished(request, list(blocks))
    worker.bind_connector_metadata(
        scheduler.build_connector_meta(SchedulerOutput.make_empty())
    )
    worker.get_finished({request.request_id})
    worker.clear_connector_metadata()
    worker._executor.shutdown(wait=True)  # the write has ended, well or not
    return params["hidden_states_path"]


@needs_fix
def test_a_write_that_fails_part_way_leaves_no_file(tmp_path, monkeypatch, caplog):
    path = _save(_DiskFillsUp, tmp_path, monkeypatch)
    # The client wakes (the lock is released) and finds no file, never a torn one;
    # nothing but the lock it removes is left in the storage directory.
    try:
        load_hidden_states(path)
        raise AssertionError(f"{path} loaded")
    except FileNotFoundError:
        pass
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(path) + ".lock"]
    assert "No space left on device" in caplog.text
    assert os.path.basename(path).removesuffix(".safetensors") in caplog.text


@needs_fix
def test_the_file_appears_whole_under_its_name(tmp_path, monkeypatch):
    _LooksWhileWriting.seen = []
    path = _save(_LooksWhileWriting, tmp_path, monkeypatch)
    name = os.path.basename(path)
    # Every byte written, the client's name does not exist yet: it appears whole.
    assert _LooksWhileWriting.seen == [[f".{name}.partial", f"{name}.lock"]]
    saved = load_hidden_states(path)
    assert saved["hidden_states"].shape == (20, NUM_AUX, HIDDEN_SIZE)
    assert bool((saved["hidden_states"] == 1).all())
    assert sorted(os.listdir(tmp_path)) == [name, f"{name}.lock"]
