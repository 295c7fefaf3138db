"""Write the engine tests' tiny models with Transformers, from a fixed seed (no hub).

Runs in the engine environment: ``python models.py OUT_DIR``. Each model is random
weights in bf16 saved as safetensors with its config.json, and a word-level tokenizer of its
vocabulary (token k is the word ``t<k>``): prompts are token ids, and the offline engine runs
with ``skip_tokenizer_init``, but ``vllm serve`` and speculators' ``prepare-data`` load a
tokenizer from the model directory.

- ``llama``: a dense Llama, 4 layers, hidden 256 (the control: pristine vLLM is right on it);
- ``qwen3next``: a hybrid Qwen3-Next, 3 gated-delta-net layers then 1 full-attention layer,
  hidden 256. Qwen3NextForCausalLM needs at least one MoE layer: the last one has 2 experts,
  both routed to every token, so no routing decision can flip between vLLM's kernels and
  Transformers' (a flip moves a row by ~20% and says nothing about extraction);
- ``qwen3next-wide``: the same pattern twice (8 layers), so that vLLM's planner puts two
  layers in each KV cache group, as a real hybrid has several (hidden-state-cache-billed-at-
  its-own-page: the hidden-state group was billed at that width);
- ``deepseek``: a DeepSeek-V3 (MLA with a compressed query; kv_lora_rank 512 and
  qk_rope_head_dim 64, what vLLM's CPU MLA backend takes), layer 0 dense, layers 1-3 MoE with
  a shared expert;
- ``gptoss``: a gpt-oss layout, sliding window (32 tokens) and full attention alternating,
  attention sinks, every layer MoE;
- ``qwen3moe``: a Qwen3-MoE, every layer MoE;
- ``gemma3``: a Gemma 3 (``Gemma3ForCausalLM``), which vLLM 0.34.0 refuses to extract from (it
  has no EAGLE3 interface): the session shows the refusal.

Every MoE layer routes every token to all of its experts (top-k = the number of experts;
DeepSeek's one expert group holds them all): the experts' weights still come from the
router's logits, but no expert is chosen or left out, so no routing decision can flip
between vLLM's kernels and Transformers (a flip moves a row by ~20% and says nothing about
extraction).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    DeepseekV3Config,
    Gemma3TextConfig,
    GptOssConfig,
    LlamaConfig,
    Qwen3MoeConfig,
    Qwen3NextConfig,
)

SEED = 0
COMMON = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 16384,  # room for the staging session's long request
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MODELS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "qwen3next": lambda: _qwen3next(4),
    "qwen3next-wide": lambda: _qwen3next(8),
    "deepseek": lambda: _deepseek(),
    "gptoss": lambda: _gptoss(),
    "qwen3moe": lambda: _qwen3moe(),
    "gemma3": lambda: Gemma3TextConfig(**COMMON, sliding_window=32),
}
EXPERTS = 4  # every MoE layer's experts, each routed to every token


def _deepseek() -> DeepseekV3Config:
    attention = {k: v for k, v in COMMON.items() if k not in ("num_key_value_heads", "head_dim")}
    return DeepseekV3Config(
        **attention,
        num_key_value_heads=4,
        q_lora_rank=128,
        kv_lora_rank=512,  # vLLM's CPU MLA backend takes 512 only
        qk_rope_head_dim=64,  # and 64 only
        qk_nope_head_dim=64,
        v_head_dim=64,
        first_k_dense_replace=1,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=EXPERTS,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        moe_intermediate_size=128,
        # what DeepSeek-V3's own config says (vLLM reads them; Transformers' model is this)
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )


def _gptoss() -> GptOssConfig:
    return GptOssConfig(
        **{**COMMON, "intermediate_size": 128},
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=32,
        num_local_experts=EXPERTS,
        num_experts_per_tok=EXPERTS,
    )


def _qwen3moe() -> Qwen3MoeConfig:
    return Qwen3MoeConfig(
        **COMMON,
        num_experts=EXPERTS,
        num_experts_per_tok=EXPERTS,
        moe_intermediate_size=128,
        norm_topk_prob=True,
    )


def _qwen3next(layers: int) -> Qwen3NextConfig:
    """3 gated-delta-net layers to 1 full-attention layer; the last layer is the one MoE
    layer (2 experts, both routed to every token)."""
    return Qwen3NextConfig(
        **{**COMMON, "num_hidden_layers": layers},
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=2,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        mlp_only_layers=list(range(layers - 1)),
    )


def tokenizer(vocab_size: int):
    """A word-level tokenizer whose ids are the model's vocabulary: ``t<k>`` is token k."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{k}": k for k in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="t0", pad_token="t0", eos_token="t1", bos_token="t2"
    )


def write(out: Path) -> dict[str, str]:
    written = {}
    for name, make_config in MODELS.items():
        torch.manual_seed(SEED)
        config = make_config()
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
        dest = out / name
        model.save_pretrained(dest, safe_serialization=True)
        tokenizer(config.vocab_size).save_pretrained(dest)
        written[name] = str(dest)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1])
    print(json.dumps(write(target)))
