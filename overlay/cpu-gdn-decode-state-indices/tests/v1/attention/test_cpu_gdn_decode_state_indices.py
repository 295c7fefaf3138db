# SPDX-License-Identifier: Apache-2.0
"""The CPU GDN decode with a speculative config: dense state indices.

Added by vllm-overlay (our own change). With a speculative config (every
``extract_hidden_states`` run) a 1-token query (a 1-token prompt, the last token of a
prompt whose prefix is cached, a 1-token prefill chunk) goes to the CPU decode path,
where the state indices are column 0 of a block table with ``num_spec + 1`` columns, a
view with stride ``num_spec + 1``; the fused recurrent update
(``fused_sigmoid_gating_delta_rule_update_cpu``) checks the last stride of every tensor,
and the engine died with "tensor must be contiguous at last dimension". ``.contiguous()``
does not help: a one-element view counts as contiguous whatever its stride. The indices
are copied to a dense tensor. From vLLM 0.32.0 a speculative config takes the
spec-aware path (``_spec_aware_nonspec``, for the wide conv buffer), which calls
``.contiguous()`` on the indices: a no-op for one request, and the engine still died
there. (Up to 0.31.0 the change also cut the conv window to its ``width - 1`` state
columns; 0.32.0's spec-aware path does that itself.)

The compiled CPU ops (the conv update and the fused recurrent update) are replaced by
recorders that make the kernels' checks (the source tree has no ``vllm._C``). Running on
an unpatched tree: set ``VLLM_OVERLAY_TREE=pristine``; the tests that need the fix are
then ``xfail(strict=True)``.
"""

import os
from types import SimpleNamespace

import pytest
import torch

from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")
if _TREE not in ("patched", "pristine"):
    raise ValueError(
        f"VLLM_OVERLAY_TREE={_TREE!r}: expected 'patched' (the default) or 'pristine'"
    )

needs_fix = pytest.mark.xfail(
    _TREE == "pristine",
    reason="needs dense GDN state indices for the CPU fused decode update",
    strict=True,
)

HEADS, HEAD_K, HEAD_V, WIDTH, SLOTS = 2, 8, 8, 4, 6
DIM = 2 * HEADS * HEAD_K + HEADS * HEAD_V


class _Layer:
    """What the CPU GDN core reads from a Qwen3-Next linear-attention layer; the conv state
    of slot 3 holds a known history, then ``num_spec`` columns of garbage."""

    prefix = "model.layers.0.linear_attn"
    activation = "silu"

    def __init__(self, num_spec: int):
        torch.manual_seed(0)
        self.history = torch.randn(DIM, WIDTH - 1).to(torch.bfloat16)
        conv = torch.zeros(SLOTS, DIM, WIDTH - 1 + num_spec, dtype=torch.bfloat16)
        conv[3, :, : WIDTH - 1] = self.history
        conv[3, :, WIDTH - 1 :] = 100.0
        if not is_conv_state_dim_first():
            conv = conv.transpose(-1, -2).contiguous()
        ssm = torch.zeros(SLOTS, HEADS, HEAD_V, HEAD_K, dtype=torch.float32)
        self.kv_cache = [conv, ssm]
        self.conv1d = SimpleNamespace(
            weight=torch.ones(DIM, 1, WIDTH, dtype=torch.bfloat16), bias=None
        )
        self.A_log = torch.zeros(HEADS)
        self.dt_bias = torch.zeros(HEADS)

    def conv_state(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s conv state as [DIM, columns], whatever the layout."""
        conv = self.kv_cache[0][slot]
        return conv if is_conv_state_dim_first() else conv.t()

    def rearrange_mixed_qkv(self, mixed_qkv):
        q, k, v = torch.split(
            mixed_qkv, [HEADS * HEAD_K, HEADS * HEAD_K, HEADS * HEAD_V], dim=-1
        )
        n = mixed_qkv.shape[0]
        return (
            q.reshape(1, n, HEADS, HEAD_K).contiguous(),
            k.reshape(1, n, HEADS, HEAD_K).contiguous(),
            v.reshape(1, n, HEADS, HEAD_V).contiguous(),
        )


def _check_strides(kw):
    for name, t in kw.items():
        if isinstance(t, torch.Tensor) and t.dim() and name not in (
            "initial_state_source",
            "conv_state",
            "conv_states",
        ):
            if t.stride(-1) != 1:
                raise RuntimeError(f"{name} must be contiguous at last dimension")


@pytest.fixture
def fused_update(monkeypatch):
    """The compiled conv and fused recurrent updates, replaced by recorders with their
    checks; the conv update returns its input, so q is the input's q."""
    seen = []

    def conv(**kw):
        _check_strides(kw)
        seen.append({"conv_indices": kw["conv_state_indices"].tolist()})
        return kw["x"]

    def op(**kw):
        _check_strides(kw)
        seen.append({"indices": kw["initial_state_indices"].tolist(), "q": kw["q"].clone()})
        q = kw["q"]
        return torch.zeros(1, q.shape[1], HEADS, HEAD_V, dtype=q.dtype)

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(gdn_attention, "is_arm_bf16", lambda: False)
    monkeypatch.setattr(gdn_attention, "causal_conv1d_update_cpu", conv)
    monkeypatch.setattr(gdn_attention.ops, "fused_sigmoid_gating_delta_rule_update_cpu", op)
    return seen


def _decode_one_token(layer, monkeypatch, num_spec: int, x: torch.Tensor) -> None:
    # Column 0 of a [requests, num_spec + 1] block table, as the metadata builder
    # takes it; the request being decoded holds slot 3.
    # One request: its index column is a one-element view with stride num_spec + 1.
    rows = [[3, 4]]
    block_table = torch.tensor([r[: num_spec + 1] for r in rows], dtype=torch.int32)
    metadata = GDNAttentionMetadata(
        num_prefills=0,
        num_prefill_tokens=0,
        num_decodes=1,
        num_decode_tokens=1,
        num_spec_decodes=0,
        num_spec_decode_tokens=0,
        num_actual_tokens=1,
        non_spec_query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
        non_spec_state_indices_tensor=block_table[:, 0],
    )
    context = SimpleNamespace(
        no_compile_layers={layer.prefix: layer}, attn_metadata={layer.prefix: metadata}
    )
    monkeypatch.setattr(gdn_attention, "get_forward_context", lambda: context)
    core_out = torch.empty(1, HEADS, HEAD_V, dtype=torch.bfloat16)
    gdn_attention.cpu_gdn_attention_core(
        x,
        torch.randn(1, HEADS, dtype=torch.bfloat16),
        torch.randn(1, HEADS, dtype=torch.bfloat16),
        core_out,
        layer.prefix,
    )


def _expected_q(x: torch.Tensor) -> torch.Tensor:
    """q as the recorded conv update leaves it: the input's first part."""
    return x[:, : HEADS * HEAD_K].reshape(1, 1, HEADS, HEAD_K)


@needs_fix
def test_one_token_query_with_a_speculative_config(monkeypatch, fused_update):
    layer, x = _Layer(num_spec=1), torch.randn(1, DIM, dtype=torch.bfloat16)
    _decode_one_token(layer, monkeypatch, 1, x)
    conv, call = fused_update
    assert conv["conv_indices"] == [3] and call["indices"] == [3]
    torch.testing.assert_close(call["q"], _expected_q(x))


def test_one_token_query_without_speculation(monkeypatch, fused_update):
    layer, x = _Layer(num_spec=0), torch.randn(1, DIM, dtype=torch.bfloat16)
    _decode_one_token(layer, monkeypatch, 0, x)
    conv, call = fused_update
    assert conv["conv_indices"] == [3] and call["indices"] == [3]
    torch.testing.assert_close(call["q"], _expected_q(x))
