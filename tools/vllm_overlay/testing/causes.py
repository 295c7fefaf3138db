"""Why a test failed on a machine like this one: one table of rules, first match wins.

A failure that happens on both sides of the comparison is not the overlay's fault, but it
is not a pass either: the report groups such failures by cause so a reader sees at once
that, say, 15 of them need an accelerator. The rules read the failure's message and
traceback text (what JUnit records). They only sort failures into groups; they never
decide the verdict, and a failure no rule matches is "other", listed test by test.

To teach it a new cause, add a row to ``RULES`` (and a test in tests/test_suite.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NO_ACCELERATOR = "no-accelerator"
OPTIONAL_PACKAGE = "optional-package"
MODEL_HUB = "model-hub"
TIMEOUT_CRASH = "timeout-or-crash"
OTHER = "other"

# Report order and titles.
TITLES = {
    NO_ACCELERATOR: "no accelerator",
    OPTIONAL_PACKAGE: "optional package missing",
    MODEL_HUB: "model hub unreachable",
    TIMEOUT_CRASH: "timed out or crashed",
    OTHER: "other",
}


@dataclass(frozen=True)
class Rule:
    cause: str
    pattern: re.Pattern[str]
    why: str  # for docs and for the reader of this table


def _rule(cause: str, pattern: str, why: str) -> Rule:
    return Rule(cause, re.compile(pattern, re.MULTILINE), why)


# First match wins, so the specific rules come before the broad ones. The examples are the
# messages seen in vLLM 0.24.0's tests/v1/kv_connector/unit on a machine without a GPU.
RULES: tuple[Rule, ...] = (
    _rule(
        TIMEOUT_CRASH,
        r"Timeout \(>[\d.]+s\) from pytest-timeout|^HardTimeout:|^WorkerCrash:|"
        r"crashed while running",
        "the per-test timeout fired, or the worker process died during the test",
    ),
    _rule(
        OPTIONAL_PACKAGE,
        r"NIXL is not available|No module named '(?!vllm\b|tests\b)[\w.]+'",
        "a package vLLM treats as optional is not installed: 'NIXL is not available', or "
        "ModuleNotFoundError for anything but vllm and its tests (those are real breakage)",
    ),
    _rule(
        MODEL_HUB,
        r"LocalEntryNotFoundError|OfflineModeIsEnabled|outgoing traffic has been disabled|"
        r"Invalid repository ID or local directory specified|We couldn't connect to",
        "the test needs model files from the Hugging Face hub that the offline, config-only "
        "cache lacks (it starts an engine with a real model)",
    ),
    _rule(
        NO_ACCELERATOR,
        r"Cannot access accelerator device when none is available|"
        r"Torch not compiled with CUDA enabled|"
        r"requires the CUDA flash attention extensions|"
        r"No CUDA GPUs are available|Found no NVIDIA driver|"
        r"All kv cache tensors must have the same number of blocks.*backend=CPU_ATTN",
        "the code needs a GPU: torch.accelerator calls, torch.cuda calls (current_stream, "
        "events), CUDA-only attention backends, or NIXL rejecting the cache layout of the CPU "
        "attention backend that vLLM picks when there is no GPU",
    ),
)


def classify(text: str, output: str = "") -> str:
    """The cause of a failure: its message and traceback ``text`` decide; only when they
    match no rule is the captured ``output`` (logs) read, e.g. for a library that logs the
    real error and returns a status code instead."""
    for where in (text, output):
        for rule in RULES:
            if where and rule.pattern.search(where):
                return rule.cause
    return OTHER
