"""The row check can fail: a file the engine saved right, broken as a wrong engine would break
it, fails the check it should (checks.assert_layers_right, over driver.py's figures).

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
from engine.checks import assert_layers_right
from engine.sessions import LAYERS, RUNNERS_OF

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
