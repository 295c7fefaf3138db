"""Our CPU wheel, run as users run it, extracts the hidden states the model computes.

Every saved row is checked twice: against Transformers' ``output_hidden_states`` for the
same weights and token ids (float32 reference, bf16 engine: a row's relative L2 error must
stay under ``TOLERANCE``), and against what the model handed the extract_hidden_states
proposer, bit for bit (the probe plugin's record).
"""

from __future__ import annotations

import pytest
from engine.checks import assert_generated, assert_right
from engine.sessions import BATCH, LONG


@pytest.mark.parametrize("case", ["batch", "long", "tail", "repeat"])
def test_hybrid_verifier(engine_session, case):
    """Qwen3-Next (3 gated-delta-net layers, 1 attention layer): a batch of different
    lengths (1 to 129 tokens), a prompt longer than max_num_batched_tokens, one whose last
    chunk is a single token, a repeat."""
    assert_right(engine_session("ours-hybrid"), case)


@pytest.mark.parametrize("case", ["batch", "long", "tail", "repeat"])
def test_hybrid_verifier_with_prefix_caching(engine_session, case):
    s = engine_session("ours-hybrid-prefix-caching")
    assert_right(s, case)


def test_a_repeated_prompt_reads_its_prefix_from_the_cache(engine_session):
    s = engine_session("ours-hybrid-prefix-caching")
    (first,), (again,) = s.requests("long"), s.requests("repeat")
    assert first["prompt"] == again["prompt"] == LONG
    # Hybrid models cache whole attention blocks (256 tokens here): the rows of the cached
    # prefix were computed for the first request and must be read back unchanged.
    assert first["num_cached_tokens"] == 0 and again["num_cached_tokens"] >= 256, (first, again)
    assert again["checks"]["proposer"]["rows_recorded"] == len(LONG) - again["num_cached_tokens"]


@pytest.mark.parametrize("case", ["batch", "long", "repeat"])
def test_dense_control(engine_session, case):
    """A dense Llama: right on pristine vLLM too, so any error here is ours."""
    assert_right(engine_session("ours-dense"), case)


@pytest.mark.parametrize("session", ["ours-hybrid", "ours-dense"])
def test_generated_tokens_are_the_models_greedy_choice(engine_session, session):
    """vllm#56417 and #56442 report duplicated output tokens with extraction on (the
    proposer reads only column 0 of sampled_token_ids). 16 greedy tokens per prompt: each is
    the model's own choice given the tokens before it, and the files are right."""
    s = engine_session(session)
    assert_right(s, "decode")
    assert_generated(s, "decode")


def test_offline_collector_pattern(engine_session):
    """use_synchronization_lock (on by default): the module's load_hidden_states waits for the
    write, cleanup_hidden_states removes the file and its lock; nothing is left."""
    s = engine_session("ours-hybrid")
    assert_right(s, "collector")
    for r in s.requests("collector"):
        assert r["left_after_cleanup"] == [], r


def test_an_aborted_waiting_request_leaves_the_engine_working(engine_session):
    """vllm#56841: a request aborted before it was scheduled must not kill EngineCore; the
    engine extracts correctly afterwards."""
    s = engine_session("ours-hybrid")
    assert s.result["died"] is None, s.result["died"]
    abort = s.case("abort")
    assert abort["finished"] == ["abort-long"]
    assert_right(s, "abort")


def test_every_case_ran_in_one_engine(engine_session):
    s = engine_session("ours-hybrid")
    assert s.result["start_error"] is None
    assert set(s.result["cases"]) == {
        "batch", "long", "tail", "repeat", "collector", "abort", "decode"
    }  # fmt: skip
    assert [len(r["prompt"]) for r in s.requests("batch")] == [len(p) for p in BATCH]


@pytest.mark.parametrize("case", ["batch", "long"])
def test_hybrid_verifier_with_tensor_parallelism(engine_session, case):
    """tensor_parallel_size=2 on the CPU (gloo, one core per rank): rank 0 writes the files
    (get_finished_count, vllm#56841), the page holds a token of hidden states (#50894)."""
    s = engine_session("ours-hybrid-tp2")
    assert s.result["start_error"] is None, s.result["start_error"]
    assert_right(s, case)
