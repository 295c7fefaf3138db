"""Write the engine tests' tiny models with Transformers, from a fixed seed (no hub).

Runs in the engine environment: ``python models.py OUT_DIR``. Each model is random
weights in bf16 saved as safetensors with its config.json; prompts are token ids, so no
tokenizer is written (the engine runs with ``skip_tokenizer_init``).

- ``llama``: a dense Llama, 4 layers, hidden 256 (the control: pristine vLLM is right on it);
- ``qwen3next``: a hybrid Qwen3-Next, 3 gated-delta-net layers then 1 full-attention layer,
  hidden 256. Qwen3NextForCausalLM needs at least one MoE layer: the last one has 2 experts,
  both routed to every token, so no routing decision can flip between vLLM's kernels and
  Transformers' (a flip moves a row by ~20% and says nothing about extraction).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3NextConfig

SEED = 0
COMMON = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
MODELS = {
    "llama": lambda: LlamaConfig(**COMMON),
    "qwen3next": lambda: Qwen3NextConfig(
        **COMMON,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        num_experts=2,
        num_experts_per_tok=2,
        moe_intermediate_size=128,
        shared_expert_intermediate_size=128,
        mlp_only_layers=[0, 1, 2],
    ),
}


def write(out: Path) -> dict[str, str]:
    written = {}
    for name, make_config in MODELS.items():
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(make_config()).to(torch.bfloat16)
        dest = out / name
        model.save_pretrained(dest, safe_serialization=True)
        written[name] = str(dest)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1])
    print(json.dumps(write(target)))
