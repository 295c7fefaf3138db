"""Cache-billing bench: how many tokens vLLM's KV cache planner gives a model with
hidden-state extraction on, against what the layers' own pages allow (vllm#56774).

With ``speculative_config={"method": "extract_hidden_states"}`` vLLM adds a one-layer
hidden-state cache (``HiddenStateCacheSpec``). On a hybrid model whose pages are unified
(the layer-outer path of ``get_kv_cache_groups``, the one our connector's LBNHC layout takes)
it becomes its own one-layer group, with a smaller block size, drawing block ids from the
pool that every group shares. The pool sizes each block id by the widest group
(``_get_kv_cache_bytes_per_block``), so every block id the hidden-state group takes costs as
many pages as the widest group has layers, of which it uses one.

No model is loaded and no weights are read. For each layout the bench builds the per-layer
KV cache specs vLLM would build (attention: ``FullAttentionSpec``; gated-delta-net:
``MambaSpec`` from vLLM's own ``MambaStateShapeCalculator.gated_delta_net_state_shape``;
the extraction layer: ``HiddenStateCacheSpec``), with the block size and Mamba padding that
the platform's ``_align_hybrid_block_size`` picks (mirrored in ``block_sizes``, from the
attention backend's own supported and preferred block sizes), then runs vLLM's own planner
on them, as the engine core does: ``get_global_kv_cache_groups``, ``get_kv_cache_configs``,
``generate_scheduler_kv_cache_config``, ``get_kv_cache_capacity``; "needed for one request"
is ``_max_memory_usage_bytes_from_groups``, the figure vLLM's "To serve at least one
request with the model's max seq len" error quotes. The tree is pristine vLLM at the pin
(``make apply``'s upstream, without our overlay), run from the CPU test environment
(``vllm-overlay testenv``).

Per layout it reports the tokens the cache holds (vLLM's ``kv_cache_size_tokens``:
concurrency at max_model_len, times max_model_len) without extraction, with it, and

- ideal: every group billed at its own width, i.e. per request
  ``sum over groups g of layers_g * page_g * blocks_per_request_g`` bytes (for an attention
  or hidden-state group ``blocks_per_request = cdiv(max_model_len, block_size_g)``, so it
  pays ``layers_g * page_g / block_size_g`` bytes per token; a Mamba group pays its states);
  ideal tokens = ``budget / per_request * max_model_len``;
- over-charge: ideal tokens / planned tokens;
- fix (our model of it, not vLLM's code): the same planner run on the groups vLLM makes,
  each target group split into one-layer groups (the pool's block is then one page wide),
  as vllm#56822 proposes.

Our series carries the fix (hidden-state-cache-billed-at-its-own-page): ``--tree .work/vllm``
(``make apply``'s checkout) runs vLLM's planner with it, and "with" then equals the model.

    python bench/bench_cache_billing.py [--tree DIR] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GIB = 1 << 30
MIB = 1 << 20

# The layouts. Each number says where it came from.
LAYOUTS: dict[str, dict] = {
    # Qwen3.6-35B-A3B (Qwen3_5MoeForConditionalGeneration; its text config is the Qwen3.5-MoE
    # family's). From the model card as published on the Hub (quoted by the MERA submission
    # page for Qwen3.6-35B-A3B and the Qwen3.6-35B-A3B release write-ups): 40 layers, hidden
    # 2048, layout 10 x (3 x Gated DeltaNet, 1 x Gated Attention); Gated DeltaNet: 32 heads
    # for V and 16 for QK, head dim 128; Gated Attention: 16 Q heads, 2 KV heads, head dim
    # 256. Transformers' qwen3_5_moe docs: Qwen3.6 checkpoints share Qwen3.5's architecture
    # and model_type. Conv kernel 4 and mamba_ssm_dtype "float32": the Qwen3.5 family's
    # config.json (e.g. the published Qwen3_5ForCausalLM configs: linear_conv_kernel_dim 4,
    # mamba_ssm_dtype float32; MAX's Qwen3_5Config defaults: linear_conv_kernel_dim=4,
    # mamba_ssm_dtype=float32). vLLM 0.34.0 takes mamba_ssm_cache_dtype from that field
    # (Qwen3_5ForConditionalGenerationConfig). Uncertain: conv kernel and ssm dtype are the
    # family's, not read from this checkpoint's own config.json.
    "qwen3.6-35b-a3b": {
        "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
        "hidden_size": 2048,
        "num_kv_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "conv_kernel": 4,
        "ssm_dtype": "float32",
        # speculators' EAGLE-3 data: 3 middle layers and the final one (hidden_size each).
        "extract": [2, 20, 37, 40],
        "backend": "FLASH_ATTN",  # an H100 (CUDA); the attention backend is our assumption
    },
    # tests/engine/env/models.py, "qwen3next": Qwen3NextConfig with COMMON (hidden 256,
    # 4 layers, 2 KV heads, head_dim 64), 3 linear_attention + 1 full_attention,
    # linear_num_key_heads 2, linear_num_value_heads 4, key/value head dim 64; conv kernel:
    # Transformers' Qwen3NextConfig default (linear_conv_kernel_dim=4). The SSM state is
    # float32 on the CPU backend (upstream on AVX-512-BF16 machines, our
    # cpu-gdn-ssm-state-float32 elsewhere). Extraction as tests/engine/sessions.py: [1, 2, 4].
    "tiny-qwen3next": {
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "hidden_size": 256,
        "num_kv_heads": 2,
        "head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "conv_kernel": 4,
        "ssm_dtype": "float32",
        "extract": [1, 2, 4],
        "backend": "CPU_ATTN",
    },
    # tests/engine/env/models.py, "llama": LlamaConfig with COMMON.
    "tiny-llama": {
        "layer_types": ["full_attention"] * 4,
        "hidden_size": 256,
        "num_kv_heads": 2,
        "head_dim": 64,
        "extract": [1, 2, 4],
        "backend": "CPU_ATTN",
    },
}

# (layout, KV budget, max_model_len, prefix caching, TP). The engine tests' caches: 128 MiB,
# max_model_len 1024 (tests/engine/sessions.py, env/driver.py); their measured figures came
# from engines with prefix caching on (vLLM's default), which sets mamba_cache_mode "align".
# #56774's report ran with mamba_cache_mode "none" (prefix caching off).
SCENARIOS = [
    ("qwen3.6-35b-a3b", 30 * GIB, 65536, False, 1),
    ("qwen3.6-35b-a3b", 30 * GIB, 65536, True, 1),
    ("tiny-qwen3next", 128 * MIB, 1024, True, 1),
    ("tiny-qwen3next", 128 * MIB, 1024, False, 1),
    ("tiny-llama", 128 * MIB, 1024, True, 1),
]


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--tree",
        type=Path,
        help="a vLLM tree to plan with (default: pristine vLLM at the pin, made in "
        ".work/bench-cache-billing/pristine and kept)",
    )
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure_all(), indent=2))
        return 0
    return _parent(args)


# --- the parent: the tool's venv --------------------------------------------------------


def _parent(args: argparse.Namespace) -> int:
    sys.path.insert(0, str(REPO / "tools"))
    os.environ.setdefault("VLLM_OVERLAY_PROJECT", str(REPO))
    from vllm_overlay import process, util
    from vllm_overlay.envs import testenv
    from vllm_overlay.overlay.checkout import apply_overlay
    from vllm_overlay.overlay.project import find_project

    work = REPO / ".work" / "bench-cache-billing"
    tree = args.tree.absolute() if args.tree else work / "pristine"
    if args.tree is None and not (tree / "vllm" / "v1" / "core").is_dir():
        apply_overlay(find_project().lock(), None, tree, force=True)
    env = testenv.ensure_testenv(tree)
    out = process.run(
        env.python, __file__, "--child",
        env=env.environ(work / "scratch", tree), cwd=work,
        hint="the cache-billing bench's child failed; its output is above.",
    )  # fmt: skip
    figures = json.loads(out.stdout)
    print(report(figures))
    if args.json:
        util.atomic_write_text(args.json, json.dumps(figures, indent=2))
    return 0


def report(figures: dict) -> str:
    """One row per scenario and extraction state, then the arithmetic of each."""
    head = (
        f"{'layout':16} {'budget':>8} {'max_len':>7} {'pc':>3} {'tokens w/o':>11} "
        f"{'tokens with':>11} {'ideal':>11} {'over':>6} {'fix':>11} "
        f"{'needed w/o':>10} {'with':>10} {'ideal':>10} {'fix':>10}"
    )
    lines = [head]
    for s in figures["scenarios"]:
        w, x = s["without"], s["with"]
        lines.append(
            f"{s['layout']:16} {_size(s['budget']):>8} {s['max_model_len']:>7} "
            f"{'on' if s['prefix_caching'] else 'off':>3} {w['tokens']:>11,} "
            f"{x['tokens']:>11,} {x['ideal_tokens']:>11,} {x['over_charge']:>6.2f} "
            f"{x['fix']['tokens']:>11,} {_size(w['needed_one_request']):>10} "
            f"{_size(x['needed_one_request']):>10} {_size(x['ideal_one_request']):>10} "
            f"{_size(x['fix']['needed_one_request']):>10}"
        )
    lines.append("")
    for s in figures["scenarios"]:
        x = s["with"]
        h, wide = x["hidden"], x["widest"]
        lines.append(
            f"{s['layout']} (prefix caching {'on' if s['prefix_caching'] else 'off'}), with "
            f"extraction: block {x['block_size']}, page {x['page']:,} B; groups (kind "
            "layers x block size, ids/request): "
            + ", ".join(
                f"{g['kind']} {g['layers']}x{g['block_size']} {g['blocks_per_request']}"
                for g in x["groups"]
            )
            + f"; pool block {x['bytes_per_block']:,} B (widest: {wide['kind']}, "
            f"{wide['layers']} layers); hidden-state layer: block {h['block_size']}, billed "
            f"{h['billed_per_token']:,} B/token against {h['own_per_token']:,} of its own "
            f"page and {h['real_per_token']:,} it stores (page-alignment waste "
            f"{h['alignment_waste']:.2%}); tokens if it were billed what it stores: "
            f"{x['stored_tokens']:,}; our model of the fix: {len(x['fix']['groups'])} groups, "
            f"pool block {x['fix']['bytes_per_block']:,} B"
        )
    lines.append("")
    lines.append("check: " + figures["check"]["note"])
    return "\n".join(lines)


def _size(n: int) -> str:
    return f"{n / GIB:.2f}G" if n >= GIB else f"{n / MIB:.1f}M"


# --- the child: the test environment, vLLM from the tree --------------------------------


def measure_all() -> dict:
    """Every scenario, with and without extraction, and the founding bug's block-size check."""
    import logging

    logging.disable(logging.WARNING)
    scenarios = []
    for name, budget, max_len, prefix_caching, tp in SCENARIOS:
        layout = LAYOUTS[name]
        row = {
            "layout": name,
            "budget": budget,
            "max_model_len": max_len,
            "prefix_caching": prefix_caching,
            "tp": tp,
        }
        for side, extract in (("without", False), ("with", True)):
            row[side] = measure(layout, budget, max_len, prefix_caching, tp, extract)
        scenarios.append(row)
    return {"scenarios": scenarios, "check": founding_check()}


def founding_check() -> dict:
    """speculators#613 / vllm#46301 saw a block size of 528 beside the hidden-state group's
    22 on Qwen3.6-35B-A3B. Our layout gives 528 at TP=4 with the default block size of
    that time (16); the hidden-state block that page allows under 0.34.0's rule is
    computed from the page and 4 layers of 2048 bf16."""
    layout = LAYOUTS["qwen3.6-35b-a3b"]
    sizes = {
        (tp, default): block_sizes(layout, tp, True, False, default_block_size=default)[0]
        for tp in (1, 2, 4)
        for default in (16, 64)
    }
    attn_1 = 2 * max(1, layout["num_kv_heads"] // 4) * layout["head_dim"] * 2
    page_528 = 528 * attn_1
    per_token = 4 * layout["hidden_size"] * 2
    note = (
        "Qwen3.6 attention block size with extraction (num_spec 1), by (TP, default block "
        "size): "
        + ", ".join(f"TP{tp}/{d}: {bs}" for (tp, d), bs in sizes.items())
        + f". At TP=4 the 528 block's page is {page_528:,} B: {page_528 // per_token} tokens "
        f"of 4 x 2048 bf16 hidden states fit ({per_token:,} B/token); a block of 22 means "
        f"{page_528 // 22:,} B/token (6 layers of 2048, or 3 of 4096)."
    )
    return {"block_sizes": {f"tp{tp}/default{d}": bs for (tp, d), bs in sizes.items()},
            "note": note}  # fmt: skip


def block_sizes(
    layout: dict, tp: int, extract: bool, prefix_caching: bool, default_block_size: int = 0
) -> tuple[int, int | None, int]:
    """(attention block size, Mamba page padded to it or None, Mamba block size) as the
    platform picks them: phase 1 of ``update_block_size_for_backend`` (the backend's
    preferred size for vLLM's default; the CPU platform asks for 128) and
    ``_align_hybrid_block_size`` (vllm/platforms/interface.py), mirrored here because they
    need a model instance. The Mamba block size is max_model_len without prefix caching
    (MambaModelConfig), the attention block size with it ("align" mode); the caller
    fills max_model_len in."""
    import math

    from vllm.config.cache import CacheConfig
    from vllm.utils.math_utils import cdiv
    from vllm.v1.attention.backend import MultipleOf

    backend = _backend(layout["backend"])
    if not default_block_size:
        default_block_size = (
            128 if layout["backend"] == "CPU_ATTN" else CacheConfig.DEFAULT_BLOCK_SIZE
        )
    block = backend.get_preferred_block_size(default_block_size)
    mamba = mamba_shapes(layout, tp, extract)
    if mamba is None:
        return block, None, block
    kernel_min = min(
        s.base if isinstance(s, MultipleOf) else s
        for s in backend.get_supported_kernel_block_sizes()
    )
    attn_1 = attention_spec(layout, tp, 1).page_size_bytes
    mamba_page = mamba_spec(layout, tp, extract, -1, None, "none").page_size_bytes
    alignment = max(kernel_min, block)
    if prefix_caching:  # GDN on FLA / CPU declares no prefill checkpoint alignment
        alignment = math.lcm(alignment, 1)
    attn_block = alignment * cdiv(mamba_page, alignment * attn_1)
    attn_block = kernel_min * cdiv(attn_block, kernel_min)
    block = max(block, attn_block)
    padded = block * attn_1 if block * attn_1 != mamba_page else None
    return block, padded, block


def _backend(name: str):
    if name == "CPU_ATTN":
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        return CPUAttentionBackend
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend

    return FlashAttentionBackend


def mamba_shapes(layout: dict, tp: int, extract: bool):
    """The GDN state shapes and dtypes vLLM's Qwen3.5/Qwen3-Next models declare
    (``get_mamba_state_shape_from_config``: num_spec = num_speculative_tokens, 1 with
    extraction), or None for a model without linear attention."""
    import torch
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator

    if "linear_attention" not in layout["layer_types"]:
        return None
    shapes = MambaStateShapeCalculator.gated_delta_net_state_shape(
        tp,
        layout["linear_num_key_heads"],
        layout["linear_num_value_heads"],
        layout["linear_key_head_dim"],
        layout["linear_value_head_dim"],
        layout["conv_kernel"],
        1 if extract else 0,
    )
    ssm = {"float32": torch.float32, "bfloat16": torch.bfloat16}[layout["ssm_dtype"]]
    return tuple(shapes), (torch.bfloat16, ssm)


def attention_spec(layout: dict, tp: int, block_size: int):
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=max(1, layout["num_kv_heads"] // tp),
        head_size=layout["head_dim"],
        dtype=torch.bfloat16,
    )


def mamba_spec(layout, tp, extract, block_size, padded, cache_mode):
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import MambaSpec

    shapes, dtypes = mamba_shapes(layout, tp, extract)
    return MambaSpec(
        block_size=block_size,
        shapes=shapes,
        dtypes=dtypes,
        page_size_padded=padded,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
        mamba_cache_mode=cache_mode,
        num_speculative_blocks=1 if extract else 0,
    )


def layer_specs(layout: dict, tp: int, max_len: int, prefix_caching: bool, extract: bool):
    """Every layer's KV cache spec, as the model's layers report them."""
    import torch
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

    block, padded, mamba_block = block_sizes(layout, tp, extract, prefix_caching)
    cache_mode = "align" if prefix_caching else "none"
    if not prefix_caching:
        mamba_block = max_len
    specs = {}
    for i, kind in enumerate(layout["layer_types"]):
        if kind == "full_attention":
            specs[f"model.layers.{i}.self_attn.attn"] = attention_spec(layout, tp, block)
        else:
            specs[f"model.layers.{i}.linear_attn"] = mamba_spec(
                layout, tp, extract, mamba_block, padded, cache_mode
            )
    if extract:
        n = len(layout["layer_types"])
        specs[f"cache_only_layers.{n}"] = HiddenStateCacheSpec(
            block_size=block,
            num_kv_heads=len(layout["extract"]),
            head_size=layout["hidden_size"],
            dtype=torch.bfloat16,
        )
    return specs, block


def vllm_config(layout: dict, max_len: int, prefix_caching: bool, tp: int):
    """A minimal VllmConfig: a real ModelConfig (the test environment's config-only OPT,
    offline) with max_model_len set, the layout resolved as the engine core would (the
    connector's LBNHC on CUDA; the CPU backend's only one, LBHNC: both layer-outer)."""
    from vllm.config import CacheConfig, ModelConfig, VllmConfig

    model = ModelConfig(model="facebook/opt-125m", max_model_len=1024)
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(enable_prefix_caching=prefix_caching),
    )
    config.parallel_config.tensor_parallel_size = tp
    config.model_config.max_model_len = max_len
    config.cache_config.mamba_cache_mode = "align" if prefix_caching else "none"
    config.cache_config.kv_cache_layout = "LBHNC" if layout["backend"] == "CPU_ATTN" else "LBNHC"
    config.cache_config.num_gpu_blocks_override = None
    return config


def measure(layout, budget, max_len, prefix_caching, tp, extract) -> dict:
    """vLLM's plan for one layout, its ideal, and (with extraction) our model of the fix."""
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups

    config = vllm_config(layout, max_len, prefix_caching, tp)
    specs, block = layer_specs(layout, tp, max_len, prefix_caching, extract)
    groups = get_global_kv_cache_groups(config, [specs])
    plan = plan_from_groups(config, specs, groups, budget)
    ideal_request = sum(g["width"] * g["blocks_per_request"] for g in plan["groups"])
    ideal_tokens = int(budget / ideal_request * max_len)
    if extract:
        out_hidden = hidden_figures(plan, specs, max_len)
        # the hidden-state group billed at the bytes it stores (no page-alignment waste)
        stored = (
            ideal_request
            - out_hidden["own_bytes_per_request"]
            + out_hidden["stored_bytes_per_request"]
        )
    out = {
        **plan,
        "block_size": block,
        "page": next(iter(specs.values())).page_size_bytes,
        "ideal_one_request": ideal_request,
        "ideal_tokens": ideal_tokens,
        "over_charge": ideal_tokens / plan["tokens"] if plan["tokens"] else float("inf"),
    }
    if extract:
        out["hidden"] = out_hidden
        out["stored_tokens"] = int(budget / stored * max_len)
        out["fix"] = plan_from_groups(config, specs, split_groups(groups), budget)
    return out


def plan_from_groups(config, specs, groups, budget: int) -> dict:
    """get_kv_cache_configs on ``groups``, then the capacity as the engine core logs it."""
    from vllm.v1.core.kv_cache_config_builder import get_kv_cache_config_builder
    from vllm.v1.core.kv_cache_planning import (
        _max_memory_usage_bytes_from_groups,
        _pool_bytes_per_block,
        get_kv_cache_configs,
    )
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_capacity,
    )

    builder = get_kv_cache_config_builder(config)
    needed = _max_memory_usage_bytes_from_groups(builder, config, groups)
    bytes_per_block = _pool_bytes_per_block(config, groups)
    rows = [group_figures(config, g) for g in groups]
    base = {
        "groups": rows,
        "bytes_per_block": bytes_per_block,
        "widest": max(rows, key=lambda g: g["width"]),
        "needed_one_request": needed,
    }
    try:
        configs = get_kv_cache_configs(config, [specs], [budget], groups)
    except ValueError as e:  # one request does not fit: vLLM refuses to start
        return {**base, "num_blocks": 0, "tokens": 0, "error": str(e).splitlines()[0]}
    scheduler = generate_scheduler_kv_cache_config(configs)
    tokens, concurrency = get_kv_cache_capacity(config, scheduler)
    return {**base, "num_blocks": scheduler.num_blocks, "tokens": tokens,
            "concurrency": concurrency}  # fmt: skip


def group_figures(config, group) -> dict:
    """A group's kind, layers, block size, page (its first layer's), width (the pages of all
    its layers: what one of its block ids really holds) and block ids per request."""
    from vllm.utils.math_utils import cdiv
    from vllm.v1.core.kv_cache_planning import _get_per_layer_spec
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec, MambaSpec

    spec = group.kv_cache_spec
    layers = [_get_per_layer_spec(group, name) for name in group.layer_names]
    if isinstance(layers[0], HiddenStateCacheSpec):
        kind = "hidden"
    elif isinstance(layers[0], MambaSpec):
        kind = "mamba"
    elif any(isinstance(s, HiddenStateCacheSpec) for s in layers):
        kind = "attn+hidden"
    else:
        kind = "attn"
    return {
        "kind": kind,
        "layers": len(layers),
        "block_size": spec.block_size,
        "page": layers[0].page_size_bytes,
        "width": sum(s.page_size_bytes for s in layers),
        "blocks_per_request": cdiv(
            layers[0].max_memory_usage_bytes(config), layers[0].page_size_bytes
        ),
    }


def hidden_figures(plan: dict, specs: dict, max_len: int) -> dict:
    """The hidden-state group: its block size, the block ids a request takes, and what each
    token of it is billed (the pool's block over its block size) against its own page over
    its block size and the bytes it stores."""
    hidden = next(s for name, s in specs.items() if name.startswith("cache_only_layers"))
    real = hidden.num_kv_heads * hidden.head_size * 2
    own = [g for g in plan["groups"] if g["kind"] == "hidden"]
    if not own:  # the hidden-state layer shares a uniform-type group (a dense model)
        return {"block_size": hidden.block_size, "blocks_per_request": 0, "shared_group": True,
                "billed_per_token": real, "own_per_token": real, "real_per_token": real,
                "alignment_waste": 0.0, "own_bytes_per_request": 0,
                "stored_bytes_per_request": 0}  # fmt: skip
    (h,) = own
    return {
        "block_size": h["block_size"],
        "blocks_per_request": h["blocks_per_request"],
        "billed_per_token": plan["bytes_per_block"] // h["block_size"],
        "own_per_token": h["page"] // h["block_size"],
        "real_per_token": real,
        "alignment_waste": 1 - h["block_size"] * real / h["page"],
        "own_bytes_per_request": h["page"] * h["blocks_per_request"],
        "stored_bytes_per_request": real * h["block_size"] * h["blocks_per_request"],
    }


def split_groups(groups: list) -> list:
    """Our model of the fix (not vLLM's code): with a hidden-state group present, every
    other group becomes one group per layer, so the pool's block is one page wide and the
    hidden-state group's block ids cost one page each, as vllm#56822 proposes."""
    from vllm.v1.core.kv_cache_planning import _get_per_layer_spec
    from vllm.v1.kv_cache_interface import HiddenStateCacheSpec, KVCacheGroupSpec

    if not any(isinstance(g.kv_cache_spec, HiddenStateCacheSpec) for g in groups):
        return groups
    split = []
    for group in groups:
        if len(group.layer_names) == 1:
            split.append(group)
            continue
        for name in group.layer_names:
            split.append(KVCacheGroupSpec([name], _get_per_layer_spec(group, name)))
    return split


if __name__ == "__main__":
    raise SystemExit(main())
