"""The check every engine test makes of a saved file (see env/driver.py for the figures)."""

from __future__ import annotations

from engine.sessions import CASES, TOLERANCE


def assert_layers_right(checks: dict, where: str, tolerance: float = TOLERANCE) -> None:
    """One file's figures: its token ids, a row per token and, per extracted layer, no zero
    or NaN row and each row within ``tolerance`` of the reference."""
    assert checks["token_ids_match"], where
    assert checks["shape"][0] == checks["tokens"], (
        f"{where}: {checks['shape']} rows, {checks['tokens']} tokens"
    )
    for layer in checks["layers"]:
        at = f"{where}, layer {layer['layer']}"
        assert layer["zero_rows"] == 0, f"{at}: {layer['zero_rows']} all-zero rows"
        assert layer["nan_rows"] == 0, f"{at}: {layer['nan_rows']} rows with NaN/Inf"
        assert layer["max_rel_err"] <= tolerance, f"{at}: {layer}"
        assert layer["right_rows"] == layer["rows"], f"{at}: {layer}"


def assert_ran(session) -> None:
    """The session ran the model runner and proposer it is named for, as the probe read their
    classes in the worker (not the setting that asked for them)."""
    assert session.ran == session.expected_ran, (
        f"{session.name}: the worker ran {session.ran}, not {session.expected_ran}; see "
        f"{session.dir / 'engine.log'}"
    )


def assert_right(session, case: str, tolerance: float = TOLERANCE, proposer: bool = True) -> None:
    """The session's runner (``assert_ran``), and every request of ``case``: the file holds its
    token ids and, per extracted layer, no zero or NaN row, each row within ``tolerance`` of
    the reference and (``proposer``) equal to the proposer's."""
    assert_ran(session)
    requests = session.requests(case)
    assert requests, f"{session.name}: case {case} saved nothing"
    for r in requests:
        checks = r["checks"]
        where = f"{session.name}/{case}, request {r['request_id']} ({len(r['prompt'])} tokens)"
        assert checks["shape"][0] == len(r["prompt"]), where
        assert_layers_right(checks, where, tolerance)
        if proposer:
            found = checks["proposer"]
            assert found["rows_without_record"] == 0, f"{where}: {found}"
            assert found["rows_equal"] == len(r["prompt"]), f"{where}: {found}"


# bf16 engine against the float32 model: where two tokens' logits are this close (relative to
# the chosen one's), either may come out; a token the model did not choose by more is wrong.
NEAR_TIE = 0.05


def assert_generated(session, case: str) -> None:
    """Every request of ``case`` generated the model's own greedy choice at each step, given
    its tokens before it (a near tie excepted): no repeated or skipped token
    (vllm#56417, #56442: the proposer read only column 0 of sampled_token_ids)."""
    asked = CASES[case]["max_tokens"]  # ignore_eos: every request generates exactly this many
    requests = session.requests(case)
    assert requests, f"{session.name}: case {case} generated nothing"
    for r in requests:
        where = f"{session.name}/{case}, request {r['request_id']}"
        assert len(r["output"]) == asked, f"{where}: {len(r['output'])} of {asked} tokens"
        assert_tokens_right(r["checks"]["output"], asked, where)


def assert_tokens_right(out: dict, asked: int, where: str) -> None:
    """The reference's figures of one request's generated tokens (driver.Reference.generated):
    all compared, each the model's greedy choice (a near tie excepted)."""
    assert out["tokens"] == asked, f"{where}: the reference compared {out['tokens']} tokens"
    wrong = [d for d in out["differ"] if d["rel_gap"] > NEAR_TIE]
    assert not wrong, f"{where}: {out}"
