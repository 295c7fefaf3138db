# SPDX-License-Identifier: Apache-2.0
"""Hybrid prefix caching with a hidden-states KV cache group (vllm#51108).

Added by vllm-overlay with the backport of vllm-project/vllm#51108 (first released
in vLLM 0.28.0). ``extract_hidden_states`` adds a hidden-states layer whose KV cache
group gets a page-aligned block size of its own. Before the fix that block size was
``common_page // per_token_bytes``, which need not divide the other groups' block
sizes: for a 544-token Mamba + attention hybrid it is 181, so the scheduler block
size becomes lcm(544, 181) = 98464 and the hash block size gcd = 1, and, once the
engine lowers ``cache_config.block_size`` to the smallest group's, the Mamba
group is taken for a non-"align" one and block hashing falls back to 98464 tokens:
``HybridKVCacheCoordinator`` then refuses to start (block sizes not divisible by
the hash block size).

Running on an unpatched tree: set ``VLLM_OVERLAY_TREE=pristine``; the tests that
need the fix are then ``xfail(strict=True)``. Unset (or ``patched``), all must pass.

Version-robust: ``get_kv_cache_groups`` moved to ``vllm.v1.core.kv_cache_planning``
in vLLM 0.33.0; the configuration is a real ``VllmConfig`` so each release reads the
fields it has (``hash_block_size`` up to 0.27, ``prefix_match_unit`` from 0.28, the
KV cache layout that 0.33.0 must be told).
"""

import dataclasses
import math
import os

import pytest
import torch

from vllm.config import CacheConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    MambaSpec,
    SlidingWindowSpec,
)

try:  # vLLM >= 0.33.0
    from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
except ImportError:  # vLLM <= 0.32
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups

_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")
if _TREE not in ("patched", "pristine"):
    raise ValueError(
        f"VLLM_OVERLAY_TREE={_TREE!r}: expected 'patched' (the default) or 'pristine'"
    )

needs_fix = pytest.mark.xfail(
    _TREE == "pristine",
    reason="needs the hidden-state block size that divides the other groups' "
    "(vllm#51108)",
    strict=True,
)

HIDDEN_LAYER = "cache_only_layers.0"
# The numbers of upstream's test: a 544-token hybrid whose full-attention and
# Mamba pages are both 544 * 1 * (512 + 512) * 2 = 1,114,112 bytes, and a
# hidden-states layer of 3 x 1024 bf16 values (6,144 bytes) per token.
BLOCK_SIZE = 544


def _vllm_config() -> VllmConfig:
    """A real config with prefix caching on (what block hashing needs)."""
    cache_config = CacheConfig(enable_prefix_caching=True)
    if "kv_cache_layout" in {f.name for f in dataclasses.fields(CacheConfig)}:
        # vLLM >= 0.33.0 asks for the resolved layout while grouping; the engine
        # resolves it before. Layer-outermost, as vLLM's own grouping tests use.
        cache_config.kv_cache_layout = "LBNHC"
    return VllmConfig(cache_config=cache_config)


def _full(block_size: int = BLOCK_SIZE) -> FullAttentionSpec:
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=1, head_size=512, dtype=torch.bfloat16
    )


def _mamba(block_size: int = BLOCK_SIZE) -> MambaSpec:
    return MambaSpec(
        block_size=block_size,
        shapes=((557056,),),
        dtypes=(torch.bfloat16,),
        mamba_cache_mode="align",
    )


def _hidden(num_aux: int = 3, hidden_size: int = 1024) -> HiddenStateCacheSpec:
    return HiddenStateCacheSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=num_aux,
        head_size=hidden_size,
        dtype=torch.bfloat16,
    )


def _hybrid_groups(vllm_config: VllmConfig):
    full, mamba = _full(), _mamba()
    # Precondition: vLLM groups these without unifying pages.
    assert full.page_size_bytes == mamba.page_size_bytes
    return get_kv_cache_groups(
        vllm_config,
        {"model.full_attn": full, "model.mamba": mamba, HIDDEN_LAYER: _hidden()},
    )


def _hidden_group(groups):
    (group,) = [g for g in groups if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
    return group


@needs_fix
def test_hidden_state_block_size_divides_hybrid_block_size():
    groups = _hybrid_groups(_vllm_config())
    hidden = _hidden_group(groups).kv_cache_spec
    # 1,114,112 // 6,144 = 181 tokens would fit; 136 is the largest that divides 544.
    assert hidden.block_size == 136
    # The page stays aligned to the common page, and the hidden states fit in it.
    assert hidden.page_size_bytes == _full().page_size_bytes
    assert hidden.real_page_size_bytes <= hidden.page_size_bytes


@needs_fix
def test_resolved_block_sizes_as_the_engine_resolves_them():
    """EngineCore lowers cache_config.block_size to the smallest group's block
    size before it resolves the scheduler and hash block sizes."""
    vllm_config = _vllm_config()
    groups = _hybrid_groups(vllm_config)
    kv_cache_config = KVCacheConfig(
        num_blocks=1, kv_cache_tensors=[], kv_cache_groups=groups
    )
    vllm_config.cache_config.block_size = min(
        g.kv_cache_spec.block_size for g in groups
    )

    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )

    assert (scheduler_block_size, hash_block_size) == (544, 136)
    # What HybridKVCacheCoordinator asserts at start-up.
    assert all(g.kv_cache_spec.block_size % hash_block_size == 0 for g in groups)


@needs_fix
def test_mamba_align_group_keeps_fine_hashing_when_cache_block_size_differs():
    """Upstream's check: the Mamba group's mode, not a comparison with
    cache_config.block_size, decides whether finer hashing is possible."""
    vllm_config = _vllm_config()
    groups = _hybrid_groups(vllm_config)
    kv_cache_config = KVCacheConfig(
        num_blocks=1, kv_cache_tensors=[], kv_cache_groups=groups
    )
    vllm_config.cache_config.block_size = 16
    assert resolve_kv_cache_block_sizes(kv_cache_config, vllm_config) == (544, 136)


def test_mamba_outside_align_mode_still_disables_fine_hashing():
    """Control: a Mamba group that is not in "align" mode keeps block hashing at
    the scheduler block size, before and after the fix."""
    vllm_config = _vllm_config()
    mamba = dataclasses.replace(_mamba(), mamba_cache_mode="none")
    groups = get_kv_cache_groups(
        vllm_config, {"model.full_attn": _full(), "model.mamba": mamba}
    )
    assert len(groups) == 2
    kv_cache_config = KVCacheConfig(
        num_blocks=1, kv_cache_tensors=[], kv_cache_groups=groups
    )
    vllm_config.cache_config.block_size = BLOCK_SIZE
    assert resolve_kv_cache_block_sizes(kv_cache_config, vllm_config) == (544, 544)


@needs_fix
@pytest.mark.parametrize(
    ("num_aux", "hidden_size"),
    # 98,304-byte pages hold 13, 10, 7 and 5 tokens of these: none divides 48.
    [(7, 512), (3, 1500), (3, 2200), (6, 1500)],
)
def test_hidden_block_size_divides_attention_hybrid(num_aux: int, hidden_size: int):
    """Full + sliding-window attention (no Mamba): whatever the hidden-state
    width, the hidden group's block size divides the attention block size, so
    the scheduler block size stays the attention one."""
    block_size = 48
    full = _full(block_size)
    sliding = SlidingWindowSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=512,
        dtype=torch.bfloat16,
        sliding_window=128,
    )
    hidden = dataclasses.replace(_hidden(num_aux, hidden_size), block_size=block_size)
    vllm_config = _vllm_config()
    groups = get_kv_cache_groups(
        vllm_config,
        {
            "model.layers.0.attn": full,
            "model.layers.1.attn": sliding,
            HIDDEN_LAYER: hidden,
        },
    )
    assert len(groups) == 3
    hidden_spec = _hidden_group(groups).kv_cache_spec
    assert block_size % hidden_spec.block_size == 0
    assert hidden_spec.real_page_size_bytes <= hidden_spec.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=1, kv_cache_tensors=[], kv_cache_groups=groups
    )
    vllm_config.cache_config.block_size = min(
        g.kv_cache_spec.block_size for g in groups
    )
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(
        kv_cache_config, vllm_config
    )
    assert scheduler_block_size == block_size
    assert hash_block_size == math.gcd(*(g.kv_cache_spec.block_size for g in groups))
