"""The check every engine test makes of a saved file (see env/driver.py for the figures)."""

from __future__ import annotations

from engine.sessions import TOLERANCE


def assert_right(session, case: str) -> None:
    """Every request of ``case``: the file holds its token ids and, per extracted layer, no
    zero or NaN row, each row within TOLERANCE of the reference and equal to the proposer's."""
    requests = session.requests(case)
    assert requests, f"{session.name}: case {case} saved nothing"
    for r in requests:
        checks = r["checks"]
        where = f"{session.name}/{case}, request {r['request_id']} ({len(r['prompt'])} tokens)"
        assert checks["token_ids_match"], where
        assert checks["shape"][0] == len(r["prompt"]), where
        for layer in checks["layers"]:
            at = f"{where}, layer {layer['layer']}"
            assert layer["zero_rows"] == 0, f"{at}: {layer['zero_rows']} all-zero rows"
            assert layer["nan_rows"] == 0, f"{at}: {layer['nan_rows']} rows with NaN/Inf"
            assert layer["max_rel_err"] <= TOLERANCE, f"{at}: {layer}"
            assert layer["right_rows"] == layer["rows"], f"{at}: {layer}"
        proposer = checks["proposer"]
        assert proposer["rows_without_record"] == 0, f"{where}: {proposer}"
        assert proposer["rows_equal"] == len(r["prompt"]), f"{where}: {proposer}"
