# SPDX-License-Identifier: Apache-2.0
"""ExampleHiddenStatesConnector writes only into its shared storage directory,
whatever request id a client chose.

Added by vllm-overlay with its change hidden-states-connector-confined-paths.
The OpenAI server takes a request's id from the client (the X-Request-Id header,
or the body's request_id) and the connector named the file
``<shared_storage_path>/<request id>.safetensors``, creating missing directories:
an id such as ``x/../../escape`` made the worker create and write files outside
the storage directory, through a symlinked directory in it too, and an id longer
than a file name may be failed the worker's open and took the engine down; a
``hidden_states_path`` that is not a string did the same once custom paths were
allowed. Now the id is percent-encoded into one file name in the directory (a long
one shortened with its hash), and a non-string custom path is ignored.

Running on an unpatched tree: set ``VLLM_OVERLAY_TREE=pristine``; the tests that
need the change are then ``xfail(strict=True)``.
"""

import os

import pytest

from tests.v1.kv_connector.unit.hidden_states_connector_steps import ConnectorSteps
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: E501
    load_hidden_states,
)
from vllm.v1.request import RequestStatus

_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")
if _TREE not in ("patched", "pristine"):
    raise ValueError(
        f"VLLM_OVERLAY_TREE={_TREE!r}: expected 'patched' (the default) or 'pristine'"
    )

needs_change = pytest.mark.xfail(
    _TREE == "pristine",
    reason="needs hidden-states-connector-confined-paths",
    strict=True,
)


def _everything(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def _save(steps, request_id, **kwargs):
    """Schedule a request, finish it, let the worker write; its path."""
    request = steps.add(request_id, **kwargs)
    steps.step()
    steps.finish(request, RequestStatus.FINISHED_LENGTH_CAPPED)
    assert steps.step() == {request.request_id}
    steps.wait_for_writes()
    return request


@pytest.mark.parametrize(
    "request_id",
    [
        "cmpl-x/../../escaped-0-1a2b3c4d",
        "cmpl-/etc/cron.d/job-0-1a2b3c4d",
        "cmpl-link/planted-0-1a2b3c4d",
        "cmpl-" + "y" * 300 + "-0-1a2b3c4d",
    ],
    ids=["dot-dot", "absolute", "symlinked-dir", "too-long"],
)
@needs_change
def test_a_client_chosen_request_id_names_one_file_in_the_storage(
    tmp_path, monkeypatch, request_id
):
    storage = tmp_path / "storage" / "hs"
    storage.mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (storage / "cmpl-link").symlink_to(outside, target_is_directory=True)
    steps = ConnectorSteps(storage, monkeypatch)

    request = _save(steps, request_id)

    assert _everything(outside) == []
    written = [p for p in storage.iterdir() if p.name != "cmpl-link"]
    assert sorted(p.suffix for p in written) == [".lock", ".safetensors"]
    assert all(len(p.name) <= 255 for p in written)
    data = next(p for p in written if p.suffix == ".safetensors")
    saved = load_hidden_states(str(data))
    assert saved["token_ids"].tolist() == request.prompt_token_ids
    assert _everything(tmp_path) == sorted(
        ["outside", "storage", "storage/hs", "storage/hs/cmpl-link"]
        + [f"storage/hs/{p.name}" for p in written]
    )


def test_ids_of_vllms_own_making_keep_their_file_names(tmp_path, monkeypatch):
    steps = ConnectorSteps(tmp_path, monkeypatch)
    _save(steps, "cmpl-3f1e2d-0-1a2b3c4d")
    _save(steps, "17-9c8b7a6f")  # the offline LLM's
    assert _everything(tmp_path) == [
        "17-9c8b7a6f.safetensors",
        "17-9c8b7a6f.safetensors.lock",
        "cmpl-3f1e2d-0-1a2b3c4d.safetensors",
        "cmpl-3f1e2d-0-1a2b3c4d.safetensors.lock",
    ]


@needs_change
def test_distinct_ids_keep_distinct_files(tmp_path, monkeypatch):
    steps = ConnectorSteps(tmp_path, monkeypatch)
    ids = ["cmpl-a/b-0-0", "cmpl-a%2Fb-0-0", "cmpl-a_b-0-0", "cmpl-" + "z" * 400]
    ids.append(ids[-1] + "w")
    for request_id in ids:
        _save(steps, request_id)
    assert len(list(tmp_path.glob("*.safetensors"))) == len(ids)


@needs_change
def test_a_custom_path_that_is_not_a_string_is_ignored(tmp_path, monkeypatch):
    steps = ConnectorSteps(tmp_path, monkeypatch, allow_custom_save_path=True)
    _save(steps, "cmpl-odd-0-0", kv_transfer_params={"hidden_states_path": 5})
    assert _everything(tmp_path) == [
        "cmpl-odd-0-0.safetensors",
        "cmpl-odd-0-0.safetensors.lock",
    ]


def test_custom_paths_stay_ignored_unless_allowed(tmp_path, monkeypatch):
    elsewhere = tmp_path / "elsewhere.safetensors"
    storage = tmp_path / "storage"
    storage.mkdir()
    steps = ConnectorSteps(storage, monkeypatch)
    _save(steps, "cmpl-c-0-0", kv_transfer_params={"hidden_states_path": str(elsewhere)})
    assert not elsewhere.exists()
    assert _everything(storage) == [
        "cmpl-c-0-0.safetensors",
        "cmpl-c-0-0.safetensors.lock",
    ]
