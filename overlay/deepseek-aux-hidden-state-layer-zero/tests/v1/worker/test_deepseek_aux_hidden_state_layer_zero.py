# SPDX-License-Identifier: Apache-2.0
"""Layer 0 of a DeepSeek model's auxiliary hidden states is its embedding.

Added by vllm-overlay. ``eagle_aux_hidden_state_layer_ids`` (EAGLE3 and
extract_hidden_states) counts as Llama's model does: layer k is the residual stream
before decoder layer k, so 0 is the embedding and ``num_hidden_layers`` the last layer's
output. DeepseekV2Model computed ``hidden_states + residual`` before the first layer,
where ``residual`` is still None: asking for layer 0 raised TypeError in the model's
forward and killed the engine at its first step. This runs the real
``DeepseekV2Model.forward`` over stand-in decoder layers (a fused add that keeps the
residual stream, as the real ones do) on CPU tensors.

Running on an unpatched tree: set ``VLLM_OVERLAY_TREE=pristine``; the tests that
need the fix are then ``xfail(strict=True)``.
"""

import os
from types import SimpleNamespace

import pytest
import torch

from vllm.model_executor.models import deepseek_v2

_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")
if _TREE not in ("patched", "pristine"):
    raise ValueError(
        f"VLLM_OVERLAY_TREE={_TREE!r}: expected 'patched' (the default) or 'pristine'"
    )

needs_fix = pytest.mark.xfail(
    _TREE == "pristine",
    reason="needs DeepSeek's layer 0 taken without a residual",
    strict=True,
    raises=TypeError,
)

NUM_LAYERS = 3
HIDDEN = 8
EMBEDDING = 7.0


class _Layer(torch.nn.Module):
    """Adds its input to the residual (the first layer starts it) and outputs
    10 * (index + 1): the residual stream before layer k is then
    EMBEDDING + 5 * k * (k + 1)."""

    use_sequence_parallel_moe = False

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def forward(self, positions, hidden_states, residual, llama_4_scaling):
        residual = hidden_states if residual is None else hidden_states + residual
        return torch.full_like(hidden_states, 10.0 * (self.index + 1)), residual


class _Norm(torch.nn.Module):
    def forward(self, hidden_states, residual):
        out = hidden_states + residual
        return out, out


def _stream(k: int) -> float:
    return EMBEDDING + 5 * k * (k + 1)


@pytest.fixture
def model(monkeypatch):
    group = SimpleNamespace(world_size=1, is_first_rank=True, is_last_rank=True)
    monkeypatch.setattr(deepseek_v2, "get_pp_group", lambda: group)
    m = deepseek_v2.DeepseekV2Model.__new__(deepseek_v2.DeepseekV2Model)
    torch.nn.Module.__init__(m)
    m.config = SimpleNamespace(hidden_size=HIDDEN)
    m.hidden_size = HIDDEN
    m.start_layer, m.end_layer = 0, NUM_LAYERS
    m.layers = torch.nn.ModuleList(_Layer(i) for i in range(NUM_LAYERS))
    m.norm = _Norm()
    return m


def _forward(model, layers):
    model.aux_hidden_state_layers = tuple(layers)
    tokens = 5
    embeds = torch.full((tokens, HIDDEN), EMBEDDING)
    positions = torch.arange(tokens)
    return deepseek_v2.DeepseekV2Model.forward(model, None, positions, None, embeds)


@needs_fix
def test_layer_zero_is_the_embedding(model):
    _, aux = _forward(model, (0, 1, NUM_LAYERS))
    assert len(aux) == 3
    for got, k in zip(aux, (0, 1, NUM_LAYERS)):
        assert torch.equal(got, torch.full((5, HIDDEN), _stream(k))), (k, got)


def test_later_layers_unchanged(model):
    """Without layer 0 the residual exists wherever a layer is taken, as before."""
    hidden, aux = _forward(model, (1, 2, NUM_LAYERS))
    assert [float(a[0, 0]) for a in aux] == [_stream(1), _stream(2), _stream(3)]
    assert torch.equal(hidden, torch.full((5, HIDDEN), _stream(NUM_LAYERS)))
