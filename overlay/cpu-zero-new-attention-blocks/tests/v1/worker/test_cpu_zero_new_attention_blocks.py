# SPDX-License-Identifier: Apache-2.0
"""The CPU model runner zeroes newly allocated full-attention KV blocks (backport of
vLLM 0.25.0's ``CPUModelRunner._zero_block_ids``).

Added by vllm-overlay. A hybrid model (Mamba/GDN + attention) shares one block pool
between its float32 SSM states and its bf16 attention pages, so a block handed from one
to the other keeps bit patterns that read as NaN; the scheduler lists such blocks in
``new_block_ids_to_zero``. vLLM 0.24.0's CPU runner ignored the list ("CPU attention
assigns -INF to logits at invalid positions"), but masking does not clear a NaN value
(0 * NaN = NaN): with prefix caching on, a tiny Qwen3-Next saved NaN hidden states for
the last 12 tokens of a 300-token prompt, after its full-attention layer.

Running on an unpatched tree: set ``VLLM_OVERLAY_TREE=pristine``; the tests that need
the fix are then ``xfail(strict=True)``.
"""

import os
from types import SimpleNamespace

import pytest
import torch

from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
)
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")
if _TREE not in ("patched", "pristine"):
    raise ValueError(
        f"VLLM_OVERLAY_TREE={_TREE!r}: expected 'patched' (the default) or 'pristine'"
    )

needs_fix = pytest.mark.xfail(
    _TREE == "pristine",
    reason="needs the CPU runner that zeroes new full-attention blocks",
    strict=True,
)


def _runner():
    """A CPUModelRunner with only what _zero_block_ids reads: the KV cache groups and
    the layers' caches, one attention and one Mamba layer, every value NaN."""
    attn = torch.full((4, 2, 16, 2 * 8), float("nan"), dtype=torch.bfloat16)
    mamba = torch.full((4, 2, 8, 8), float("nan"), dtype=torch.float32)
    runner = object.__new__(CPUModelRunner)
    runner.kv_cache_config = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["attn"],
                FullAttentionSpec(
                    block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16
                ),
            ),
            KVCacheGroupSpec(
                ["mamba"],
                MambaSpec(block_size=16, shapes=((2, 8, 8),), dtypes=(torch.float32,)),
            ),
        ],
    )
    runner.compilation_config = SimpleNamespace(
        static_forward_context={
            "attn": SimpleNamespace(kv_cache=attn),
            "mamba": SimpleNamespace(kv_cache=[mamba]),
        }
    )
    return runner, attn, mamba


@needs_fix
def test_new_attention_blocks_are_zeroed():
    runner, attn, mamba = _runner()
    runner._zero_block_ids([1, 3])
    assert torch.count_nonzero(attn[[1, 3]]) == 0
    assert attn[[0, 2]].isnan().all()
    # SSM states are overwritten whole by their first step: left alone.
    assert mamba.isnan().all()
