"""Every check can fail: a file the engine saved right, broken as a wrong engine would break
it, fails the check it should (checks.py, over driver.py's figures): the row check (zero,
NaN, shifted, truncated rows, wrong token ids, a row from the next layer, a wrong FP8 scale),
the proposer's bit-equality, and the generated tokens' (a duplicated token).

On 0.32.0 and later the wheel without our changes gets every row right too, so no other test
would notice if the comparison quietly stopped comparing. The broken copies are made here from
the safetensors bytes (an 8-byte header length, a JSON header, the tensors' bytes), so what
changes is exactly what the test says.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from engine import harness
from engine.checks import assert_layers_right, assert_tokens_right
from engine.sessions import FP8_TOLERANCE, LAYERS, RUNNERS_OF, TOLERANCE

BF16_NAN = b"\xc0\x7f"  # 0x7FC0, little-endian


def read(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write(path: Path, header: dict, tensors: dict[str, bytes]) -> None:
    """A safetensors file of ``tensors`` (name -> bytes), dtype and shape from ``header``."""
    out, data, offset = {}, b"", 0
    for name, blob in tensors.items():
        out[name] = {**header[name], "data_offsets": [offset, offset + len(blob)]}
        data += blob
        offset += len(blob)
    text = json.dumps(out).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def broken(src: Path, dest: Path) -> dict[str, Path]:
    """The right file and five broken copies of it, by name."""
    header, data = read(src)
    blobs = {
        k: data[v["data_offsets"][0] : v["data_offsets"][1]]
        for k, v in header.items()
        if k != "__metadata__"
    }
    hs, ids = blobs["hidden_states"], blobs["token_ids"]
    (last,) = struct.unpack("<q", ids[-8:])
    rows = header["hidden_states"]["shape"][0]
    row = len(hs) // rows  # one token's rows of every extracted layer
    layer = row // len(LAYERS)
    mid = rows // 2
    rows_of = [hs[i * row : (i + 1) * row] for i in range(rows)]
    short = {
        **header,
        "hidden_states": {**header["hidden_states"]},
        "token_ids": {**header["token_ids"]},
    }
    short["hidden_states"]["shape"] = [rows - 1, *header["hidden_states"]["shape"][1:]]
    variants = {
        "right": (header, blobs),
        # one token's row of every layer all zero (speculators#613: every row was)
        "zero": (
            header,
            {**blobs, "hidden_states": hs[: mid * row] + bytes(row) + hs[(mid + 1) * row :]},
        ),
        # one token's row of the first layer NaN
        "nan": (
            header,
            {
                **blobs,
                "hidden_states": hs[: mid * row]
                + BF16_NAN * (layer // 2)
                + hs[mid * row + layer :],
            },
        ),  # fmt: skip
        # every row one position early (the next token's), the last one repeated
        "shifted": (header, {**blobs, "hidden_states": b"".join(rows_of[1:] + rows_of[-1:])}),
        # the last token's row gone (the token ids stay the prompt's)
        "truncated": (short, {**blobs, "hidden_states": hs[: (rows - 1) * row]}),
        # the right rows under one wrong token id
        "token-ids": (header, {**blobs, "token_ids": ids[:-8] + struct.pack("<q", last + 1)}),
    }
    out = {}
    for name, (h, b) in variants.items():
        out[name] = dest / f"{name}.safetensors"
        write(out[name], h, b)
    return out


@pytest.mark.parametrize("runner", RUNNERS_OF["ours-dense"])
def test_each_broken_file_fails_the_check_it_should(
    engine_session, engine_wheels, engine_models, runner, tmp_path
):
    session = engine_session("ours-dense", runner)
    request = max(session.requests("long"), key=lambda r: len(r["prompt"]))
    files = broken(Path(request["kept"]), tmp_path)
    missing = tmp_path / "missing.safetensors"
    spec = [{"name": n, "kept": str(p), "prompt": request["prompt"]} for n, p in files.items()]
    checked = harness.check_files(
        harness.ours_env(engine_wheels), engine_models["llama"], LAYERS, spec, tmp_path / "check"
    )
    got = {f["name"]: f["checks"] for f in checked["files"]}
    tokens = len(request["prompt"])

    assert_layers_right(got["right"], "the unbroken copy")  # the copy itself is right
    for name in ("zero", "nan", "shifted", "truncated", "token-ids"):
        with pytest.raises(AssertionError):
            assert_layers_right(got[name], name)
    assert [lay["zero_rows"] for lay in got["zero"]["layers"]] == [1] * len(LAYERS)
    assert [lay["nan_rows"] for lay in got["nan"]["layers"]] == [1] + [0] * (len(LAYERS) - 1)
    assert got["nan"]["layers"][0]["right_rows"] == tokens - 1
    assert all(lay["right_rows"] < tokens - 1 for lay in got["shifted"]["layers"])
    assert got["truncated"]["shape"][0] == tokens - 1 and got["truncated"]["tokens"] == tokens
    assert not got["token-ids"]["token_ids_match"]
    assert [lay["right_rows"] for lay in got["token-ids"]["layers"]] == [tokens] * len(LAYERS)

    # a file that is not there is no file checked: the check run fails, naming it
    with pytest.raises(RuntimeError, match="missing.safetensors"):
        harness.check_files(
            harness.ours_env(engine_wheels), engine_models["llama"], LAYERS,
            [{"name": "missing", "kept": str(missing), "prompt": request["prompt"]}],
            tmp_path / "check-missing",
        )  # fmt: skip


def _copy(src: Path, dest: Path, change) -> Path:
    """``src`` rewritten with ``change(header, blobs)`` applied to its tensors' bytes."""
    header, data = read(src)
    blobs = {
        k: data[v["data_offsets"][0] : v["data_offsets"][1]]
        for k, v in header.items()
        if k != "__metadata__"
    }
    write(dest, header, change(header, dict(blobs)) or blobs)
    return dest


def _longest(session, case: str) -> dict:
    return max(session.requests(case), key=lambda r: len(r["prompt"]))


@pytest.mark.parametrize("runner", RUNNERS_OF["ours-dense"])
def test_a_row_one_bit_off_the_proposers_fails_the_proposer_check(
    engine_session, engine_wheels, engine_models, runner, tmp_path
):
    """The tolerance cannot see one bit; the proposer's bit-equality does (checks.assert_right:
    every row equal to the row the proposer was given)."""
    session = engine_session("ours-dense", runner)
    request = _longest(session, "long")
    tokens = len(request["prompt"])
    row = len(LAYERS) * 256 * 2  # a token's rows, bf16

    def flip(header, blobs):  # the lowest mantissa bit of one value of the middle token
        hs = bytearray(blobs["hidden_states"])
        hs[(tokens // 2) * row] ^= 0x01
        blobs["hidden_states"] = bytes(hs)
        return blobs

    kept = Path(request["kept"])
    spec = [
        {"name": name, "request_id": request["request_id"], "kept": str(path),
         "prompt": request["prompt"]}
        for name, path in (("right", kept), ("one-bit", _copy(kept, tmp_path / "b.safetensors", flip)))
    ]  # fmt: skip
    got = harness.check_files(
        harness.ours_env(engine_wheels), engine_models["llama"], LAYERS, spec, tmp_path / "check",
        probe=session.dir / "probe",
    )  # fmt: skip
    checks = {f["name"]: f["checks"] for f in got["files"]}
    assert checks["right"]["proposer"]["rows_equal"] == tokens
    assert_layers_right(checks["one-bit"], "one bit off")  # every row within the tolerance
    assert checks["one-bit"]["proposer"]["rows_equal"] == tokens - 1


def _scaled(blob: bytes, dtype: str, factor: float) -> bytes:
    """Every scale of a row-scale tensor (F32 or BF16) times ``factor``."""
    if dtype == "F32":
        vals = struct.unpack(f"<{len(blob) // 4}f", blob)
        return struct.pack(f"<{len(vals)}f", *(v * factor for v in vals))
    assert dtype == "BF16", dtype
    out = bytearray()
    for (bits,) in struct.iter_unpack("<H", blob):
        (v,) = struct.unpack("<f", struct.pack("<I", bits << 16))
        out += struct.pack("<I", struct.unpack("<I", struct.pack("<f", v * factor))[0])[2:]
    return bytes(out)


# A scale 6% off on every row: what FP8_TOLERANCE (sessions.py) must catch, and the 0.08 it
# had passed (a row's error is then about sqrt(0.06^2 + its quantization's^2) < 0.07).
SCALE_ERROR = 1.06


@pytest.mark.parametrize("runner", RUNNERS_OF["ours-hybrid-hs-connectors"])
def test_a_wrong_fp8_scale_fails_the_row_check(
    engine_session, engine_wheels, engine_models, runner, tmp_path
):
    """hs-connectors' files are e4m3 with a scale per row, dequantized for the check: a file
    whose scales are 6% off fails FP8_TOLERANCE in every row, the right file passes it."""
    session = engine_session("ours-hybrid-hs-connectors", runner)
    request = _longest(session, "long")

    def rescale(header, blobs):
        dtype = header["hidden_states_scales"]["dtype"]
        blobs["hidden_states_scales"] = _scaled(blobs["hidden_states_scales"], dtype, SCALE_ERROR)
        return blobs

    kept = Path(request["kept"])
    spec = [
        {"name": name, "kept": str(path), "prompt": request["prompt"]}
        for name, path in (("right", kept), ("scale", _copy(kept, tmp_path / "s.safetensors", rescale)))
    ]  # fmt: skip
    got = harness.check_files(
        harness.ours_env(engine_wheels), engine_models["qwen3next"], LAYERS, spec,
        tmp_path / "check", tolerance=FP8_TOLERANCE,
    )  # fmt: skip
    checks = {f["name"]: f["checks"] for f in got["files"]}
    assert_layers_right(checks["right"], "the unbroken FP8 file", FP8_TOLERANCE)
    for lay in checks["scale"]["layers"]:
        assert lay["right_rows"] == 0 and lay["min_rel_err"] > FP8_TOLERANCE, lay
        assert lay["max_rel_err"] < 0.08, lay  # the tolerance before: it passed every row


@pytest.mark.parametrize(
    ("session_name", "model"),
    [("ours-dense", "llama"), ("ours-hybrid", "qwen3next"), ("ours-hybrid-wide", "qwen3next-wide")],
)
def test_a_row_from_the_next_layer_fails_and_by_how_much(
    engine_session, engine_wheels, engine_models, session_name, model, tmp_path
):
    """Layers 1 and 2 swapped in every token's rows fail both, and the margin: in each tiny
    model every two adjacent layers' rows differ by more than TOLERANCE (the smallest
    relative difference over a 300-token prompt, either way round; docs/engine.md)."""
    (runner,) = RUNNERS_OF[session_name][:1]
    session = engine_session(session_name, runner)
    request = _longest(session, "long")
    tokens, width = len(request["prompt"]), 256 * 2

    def swap(header, blobs):  # per token: [layer 1, layer 2, layer 4] -> [2, 1, 4]
        hs, row = blobs["hidden_states"], len(LAYERS) * width
        blobs["hidden_states"] = b"".join(
            hs[t * row + width : t * row + 2 * width] + hs[t * row : t * row + width]
            + hs[t * row + 2 * width : (t + 1) * row]
            for t in range(tokens)
        )  # fmt: skip
        return blobs

    kept = Path(request["kept"])
    spec = [{"name": "swapped", "kept": str(_copy(kept, tmp_path / "w.safetensors", swap)),
             "prompt": request["prompt"], "layer_gaps": True}]  # fmt: skip
    got = harness.check_files(
        harness.ours_env(engine_wheels), engine_models[model], LAYERS, spec, tmp_path / "check"
    )
    (checks,) = [f["checks"] for f in got["files"]]
    first, second, last = checks["layers"]
    for lay in (first, second):
        assert lay["right_rows"] == 0 and lay["min_rel_err"] > TOLERANCE, lay
    assert last["right_rows"] == tokens  # layer 4's rows untouched
    gaps = checks["layer_gaps"]  # every two adjacent decoder layers, 1 and 2 to n-1 and n
    assert [g["layers"][0] for g in gaps] == list(range(1, len(gaps) + 1)), gaps
    assert min(g["min_rel_diff"] for g in gaps) > TOLERANCE, gaps


@pytest.mark.parametrize(
    ("session_name", "model"), [("ours-dense", "llama"), ("ours-hybrid", "qwen3next")]
)
def test_a_duplicated_token_fails_the_generated_tokens_check(
    engine_session, engine_wheels, engine_models, session_name, model, tmp_path
):
    """vllm#56417's symptom (a token repeated in place of the next): the engine's 16 greedy
    tokens pass checks.assert_tokens_right; each copy with one token repeated where the
    engine's next token differs is judged by it. A tiny random model's logits are close, so
    the model itself nearly chose some of those repeats (a near tie, which the check lets
    pass); at least one is not, and fails it."""
    (runner,) = RUNNERS_OF[session_name][:1]
    session = engine_session(session_name, runner)
    spec = []
    for r in session.requests("decode"):
        out = r["output"]
        spec.append({"name": f"{r['request_id']}/right", "kept": r["kept"],
                     "prompt": r["prompt"], "output": out})  # fmt: skip
        spec += [
            {"name": f"{r['request_id']}/repeat-{k}", "kept": r["kept"], "prompt": r["prompt"],
             "output": out[: k + 1] + [out[k]] + out[k + 1 : -1]}
            for k in range(len(out) - 1)
            if out[k] != out[k + 1]
        ]  # fmt: skip
    got = harness.check_files(
        harness.ours_env(engine_wheels), engine_models[model], LAYERS, spec, tmp_path / "check"
    )
    caught, passed = [], []
    for f in got["files"]:
        if f["name"].endswith("/right"):
            assert_tokens_right(f["checks"]["output"], len(f["output"]), f["name"])
            continue
        try:
            assert_tokens_right(f["checks"]["output"], len(f["output"]), f["name"])
            passed.append(f["name"])
        except AssertionError:
            caught.append(f["name"])
    assert len(caught) + len(passed) == len(spec) - len(session.requests("decode"))
    assert caught, f"no repeated token fails the check here: {passed}"
