"""Our CPU wheel, run as users run it, extracts the hidden states the model computes.

Every saved row is checked twice: against Transformers' ``output_hidden_states`` for the
same weights and token ids (float32 reference, bf16 engine: a row's relative L2 error must
stay under ``TOLERANCE``), and against what the model handed the extract_hidden_states
proposer, bit for bit (the probe plugin's record). Each session runs on the model runners
sessions.RUNNERS_OF gives it (V2, what our CUDA wheel's users run; V1, what our CPU wheel's
users run), and shows which runner and proposer the worker ran (checks.assert_ran).
"""

from __future__ import annotations

import pytest
from engine.checks import assert_generated, assert_ran, assert_right
from engine.sessions import (
    BATCH,
    LONG,
    ROW_BYTES,
    RUNNERS_OF,
    STAGED,
    STAGING_CAP,
    capacity,
)


def on(name: str):
    """Parametrize a test over the model runners of session ``name``."""
    return pytest.mark.parametrize("runner", RUNNERS_OF[name])


@on("ours-hybrid")
@pytest.mark.parametrize("case", ["batch", "long", "tail", "repeat"])
def test_hybrid_verifier(engine_session, runner, case):
    """Qwen3-Next (3 gated-delta-net layers, 1 attention layer): a batch of different
    lengths (1 to 129 tokens), a prompt longer than max_num_batched_tokens, one whose last
    chunk is a single token, a repeat."""
    assert_right(engine_session("ours-hybrid", runner), case)


@on("ours-hybrid-prefix-caching")
@pytest.mark.parametrize("case", ["batch", "long", "tail", "repeat"])
def test_hybrid_verifier_with_prefix_caching(engine_session, runner, case):
    s = engine_session("ours-hybrid-prefix-caching", runner)
    assert_right(s, case)


@on("ours-hybrid-prefix-caching")
def test_a_repeated_prompt_reads_its_prefix_from_the_cache(engine_session, runner):
    s = engine_session("ours-hybrid-prefix-caching", runner)
    (first,), (again,) = s.requests("long"), s.requests("repeat")
    assert first["prompt"] == again["prompt"] == LONG
    # Hybrid models cache whole attention blocks (256 tokens here): the rows of the cached
    # prefix were computed for the first request and must be read back unchanged.
    assert first["num_cached_tokens"] == 0 and again["num_cached_tokens"] >= 256, (first, again)
    assert again["checks"]["proposer"]["rows_recorded"] == len(LONG) - again["num_cached_tokens"]


@on("ours-dense")
@pytest.mark.parametrize("case", ["batch", "long", "repeat"])
def test_dense_control(engine_session, runner, case):
    """A dense Llama: right on pristine vLLM too, so any error here is ours."""
    assert_right(engine_session("ours-dense", runner), case)


@pytest.mark.parametrize(
    ("session", "runner"), [(n, r) for n in ("ours-hybrid", "ours-dense") for r in RUNNERS_OF[n]]
)
def test_generated_tokens_are_the_models_greedy_choice(engine_session, session, runner):
    """vllm#56417 and #56442 report duplicated output tokens with extraction on (the
    proposer reads only column 0 of sampled_token_ids). 16 greedy tokens per prompt: each is
    the model's own choice given the tokens before it, and the files are right. On the
    hybrid every decode step verifies a draft token: the GDN speculative decode path."""
    s = engine_session(session, runner)
    assert_right(s, "decode")
    assert_generated(s, "decode")
    if session == "ours-dense":  # the premise: steps where the draft (the last token) was
        # accepted, so the step sampled two tokens (the draft and the bonus token)
        outs = [r["checks"]["output"] for r in s.requests("decode")]
        assert any(o["repeats"] > 0 for o in outs), outs


@on("ours-hybrid")
def test_offline_collector_pattern(engine_session, runner):
    """use_synchronization_lock (on by default): the module's load_hidden_states waits for the
    write, cleanup_hidden_states removes the file and its lock; nothing is left."""
    s = engine_session("ours-hybrid", runner)
    assert_right(s, "collector")
    for r in s.requests("collector"):
        assert r["left_after_cleanup"] == [], r


@on("ours-hybrid")
def test_an_aborted_waiting_request_leaves_the_engine_working(engine_session, runner):
    """vllm#56841: a request aborted before it was scheduled must not kill EngineCore; the
    engine extracts correctly afterwards."""
    s = engine_session("ours-hybrid", runner)
    assert s.result["died"] is None, s.result["died"]
    abort = s.case("abort")
    assert not abort["hung"], f"the engine still had requests after its guard: {abort}"
    assert abort["finished"] == ["abort-long"]
    assert_right(s, "abort")


@on("ours-hybrid")
def test_every_case_ran_in_one_engine(engine_session, runner):
    s = engine_session("ours-hybrid", runner)
    assert s.result["start_error"] is None
    assert_ran(s)
    assert set(s.result["cases"]) == {
        "batch", "long", "tail", "repeat", "collector", "abort", "decode"
    }  # fmt: skip
    assert [len(r["prompt"]) for r in s.requests("batch")] == [len(p) for p in BATCH]


@on("ours-hybrid-tp2")
@pytest.mark.parametrize("case", ["batch", "long"])
def test_hybrid_verifier_with_tensor_parallelism(engine_session, runner, case):
    """tensor_parallel_size=2 on the CPU (gloo, one core per rank): rank 0 writes the files
    (get_finished_count, vllm#56841), the page holds a token of hidden states (#50894)."""
    s = engine_session("ours-hybrid-tp2", runner)
    assert s.result["start_error"] is None, s.result["start_error"]
    assert_right(s, case)


@on("ours-dense-staging")
def test_a_long_request_is_copied_out_within_the_staging_cap(engine_session, runner):
    """vllm#49310: the connector gathered all of a finished request's rows into one device
    tensor (3.5 GiB for 64k tokens of a real verifier). At a 64 KiB cap, 8,200 tokens are
    copied out 42 rows at a time, as the probe counted the gathers in the worker, and every
    row is right across every chunk boundary (hidden-states-connector-bounded-staging)."""
    s = engine_session("ours-dense-staging", runner)
    assert_right(s, "staged")
    rows_at_once = STAGING_CAP // ROW_BYTES
    assert s.gathers == {
        "gathers": -(-len(STAGED) // rows_at_once),
        "rows": len(STAGED),
        "bytes": len(STAGED) * ROW_BYTES,
        "max_rows": rows_at_once,
        "max_bytes": rows_at_once * ROW_BYTES,
    }, s.gathers
    assert s.gathers["max_bytes"] <= STAGING_CAP


@on("ours-hybrid-wide")
@pytest.mark.parametrize("case", ["batch", "long"])
def test_a_hybrid_of_several_layers_a_group_extracts_right(engine_session, runner, case):
    """vllm#56774: with two layers a KV cache group, the one-layer hidden-state group was
    billed two pages a block id. hidden-state-cache-billed-at-its-own-page gives every group
    one layer: the rows stay right, and the same 128 MiB holds more (against the wheel
    without our changes, whose planner bills it so: test_without_our_changes)."""
    s = engine_session("ours-hybrid-wide", runner)
    assert s.result["start_error"] is None, s.result["start_error"]
    assert_right(s, case)


@on("ours-hybrid-wide")
def test_the_hidden_state_cache_is_billed_at_its_own_page(engine_session, runner):
    ours = capacity(engine_session("ours-hybrid-wide", runner).log)
    without = capacity(engine_session("without-hybrid-wide", runner).log)
    assert ours and without, (ours, without)
    assert ours["request_tokens"] == without["request_tokens"] == 1024
    assert ours["concurrency"] > without["concurrency"], (ours, without)
