# SPDX-License-Identifier: Apache-2.0
"""The hidden-state KV cache group is billed at its own page (vllm-project/vllm#56774).

Added by vllm-overlay (after vllm-project/vllm#56822). On a hybrid verifier the planner
groups layers of one kind into groups of W layers; every group draws block ids from one
shared pool, and a block id is one page of each layer of its group. The hidden-state
group of extract_hidden_states has one layer and a small block size, so it takes many
block ids, and each cost W pages: the hidden states were billed W times over (10 on
Qwen3.5/3.6-35B-A3B, whose cache then held 4.7x fewer tokens; the report behind #56774
needed 129.6 GiB where 5.4 GiB sufficed, and the engine refused to start). With a
hidden-state group, every group now has one layer, and a block id is one page.

Running on an unpatched tree: set ``VLLM_OVERLAY_TREE=pristine``; the tests that
need the fix are then ``xfail(strict=True)``.
"""

import os

import pytest
import torch

from vllm.config import ModelConfig, VllmConfig
from vllm.v1.core.kv_cache_planning import (
    get_global_kv_cache_groups,
    get_kv_cache_configs,
)
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    HiddenStateCacheSpec,
    MambaSpec,
)

_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")
if _TREE not in ("patched", "pristine"):
    raise ValueError(
        f"VLLM_OVERLAY_TREE={_TREE!r}: expected 'patched' (the default) or 'pristine'"
    )

needs_fix = pytest.mark.xfail(
    _TREE == "pristine",
    reason="needs the hidden-state group billed at its own page",
    strict=True,
)


BLOCK_SIZE = 64
# A page of 64 x 2 x (128 + 128) x 2 = 65,536 bytes, attention and Mamba state alike.
PAGE = BLOCK_SIZE * 2 * 256 * 2


def _specs(hidden: bool) -> dict:
    full = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=128, dtype=torch.bfloat16
    )
    mamba = MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=((PAGE // 2,),),
        dtypes=(torch.bfloat16,),
        mamba_cache_mode="align",
    )
    assert full.page_size_bytes == mamba.page_size_bytes == PAGE
    # 3:1, twice over: the planner groups them two layers a group.
    specs = {
        f"model.layers.{i}.{'attn' if i % 4 == 3 else 'mamba'}": (
            full if i % 4 == 3 else mamba
        )
        for i in range(8)
    }
    if hidden:  # 3 layers of 1024 in bf16: 6,144 bytes a token
        specs["model.cache_only_layers.8"] = HiddenStateCacheSpec(
            block_size=BLOCK_SIZE, num_kv_heads=3, head_size=1024, dtype=torch.bfloat16
        )
    return specs


def _config(specs: dict, memory: int):
    vllm_config = VllmConfig(
        model_config=ModelConfig(model="facebook/opt-125m", max_model_len=1024)
    )
    vllm_config.cache_config.kv_cache_layout = "LBNHC"
    vllm_config.cache_config.enable_prefix_caching = True
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    (config,) = get_kv_cache_configs(vllm_config, [specs], [memory], groups)
    return config


def test_the_target_layers_are_grouped_several_to_a_group_without_extraction():
    config = _config(_specs(hidden=False), 1024 * PAGE)
    # The premise: groups of two layers, one block id two pages.
    assert {len(g.layer_names) for g in config.kv_cache_groups} == {2}
    assert config.num_blocks == 1024 // 2


@needs_fix
def test_every_block_id_is_one_page_with_a_hidden_state_group():
    memory = 1024 * PAGE
    config = _config(_specs(hidden=True), memory)
    groups = config.kv_cache_groups
    hidden = [g for g in groups if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    assert len(hidden) == 1
    # 65,536 // 6,144 = 10 tokens fit a page; the block size divides the others' (64).
    assert hidden[0].kv_cache_spec.block_size == 8
    assert all(len(g.layer_names) == 1 for g in groups), [g.layer_names for g in groups]
    assert sorted(n for g in groups for n in g.layer_names) == sorted(_specs(True))
    # The whole budget is pages: each block id the hidden-state group takes costs one.
    assert config.num_blocks == memory // PAGE
