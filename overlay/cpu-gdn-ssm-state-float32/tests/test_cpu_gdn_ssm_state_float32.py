# SPDX-License-Identifier: Apache-2.0
"""On the CPU backend a gated-delta-net model gets a float32 SSM state.

Added by vllm-overlay (our own change; from vLLM 0.32.0 upstream decides the state's
dtype on machines with AVX-512-BF16, where its accelerated GDN backend takes a bf16
state, and leaves it as configured elsewhere). vLLM 0.24.0's CPU gated-delta-rule kernels
(``chunk_gated_delta_rule_cpu`` for prefill, the fused recurrent update for decode)
take a float32 state on every ISA, while the default ``mamba_ssm_cache_dtype="auto"``
gives the model's bf16: on an AVX2 machine every Qwen3-Next/Qwen3.5 prefill stopped
the engine with "Input tensor dtype mismatch". ``CpuPlatform.check_and_update_config``
now sets ``mamba_ssm_cache_dtype = "float32"`` for models with linear-attention layers
on machines without AVX-512-BF16; the tests make the machine one (the ISA probe returns
False), whatever machine runs them.

The test builds a real ``VllmConfig`` for a tiny Qwen3-Next written to a temporary
directory (config only, no weights). Running on an unpatched tree: set
``VLLM_OVERLAY_TREE=pristine``; the tests that need the fix are then
``xfail(strict=True)``.
"""

import json
import os

import pytest

from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.platforms import current_platform

_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")
if _TREE not in ("patched", "pristine"):
    raise ValueError(
        f"VLLM_OVERLAY_TREE={_TREE!r}: expected 'patched' (the default) or 'pristine'"
    )

needs_fix = pytest.mark.xfail(
    _TREE == "pristine",
    reason="needs the float32 SSM state for GDN models on the CPU backend",
    strict=True,
)

pytestmark = pytest.mark.skipif(
    not current_platform.is_cpu(), reason="the CPU platform's configuration"
)

_QWEN3_NEXT = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
    "linear_conv_kernel_dim": 4,
    "num_experts": 2,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
    "mlp_only_layers": [0, 1, 2],
    "max_position_embeddings": 4096,
    "torch_dtype": "bfloat16",
}


@pytest.fixture(autouse=True)
def without_avx512_bf16(monkeypatch):
    """The machine as an AVX2-only one: the ISA probe the platform asks says no."""
    import torch

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)


def _config(tmp_path, **cache) -> VllmConfig:
    (tmp_path / "config.json").write_text(json.dumps(_QWEN3_NEXT))
    model = ModelConfig(model=str(tmp_path), skip_tokenizer_init=True, dtype="bfloat16")
    return VllmConfig(model_config=model, cache_config=CacheConfig(**cache))


@needs_fix
def test_gdn_model_gets_a_float32_ssm_state(tmp_path):
    assert _config(tmp_path).cache_config.mamba_ssm_cache_dtype == "float32"


@needs_fix
def test_a_bf16_ssm_state_asked_for_is_replaced(tmp_path):
    config = _config(tmp_path, mamba_ssm_cache_dtype="bfloat16")
    assert config.cache_config.mamba_ssm_cache_dtype == "float32"


def test_float32_asked_for_stays(tmp_path):
    config = _config(tmp_path, mamba_ssm_cache_dtype="float32")
    assert config.cache_config.mamba_ssm_cache_dtype == "float32"
