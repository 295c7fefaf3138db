# SPDX-License-Identifier: Apache-2.0
"""The CPU rotary embedding rotates the heads of a query or key whose heads lie further
apart than head_size (MLA's rope part of each head).

Added by vllm-overlay. The CPU kernel (csrc/cpu/pos_encoding.cpp) reads a token's heads
head_size apart and each token ``stride(-2)`` after the last, with
``size(-1) // head_size`` heads: a ``[num_tokens, num_heads * head_size]`` tensor.
MLA (DeepSeek V2/V3, Kimi K2, ...) hands it ``q[..., qk_nope_head_dim:]``, a
``[num_tokens, num_heads, qk_rope_head_dim]`` view whose heads are
``qk_nope_head_dim + qk_rope_head_dim`` apart, and ``k_pe``, a ``[num_tokens, 1,
qk_rope_head_dim]`` view of the compressed KV: the kernel rotated other elements, at
other positions, and every token's attention after the first was wrong. The tree's CPU
test environment has no compiled kernel, so ``ops.rotary_embedding`` is replaced by
the kernel's own addressing (``_cpu_kernel``); the engine runs the real one.

Running on an unpatched tree: set ``VLLM_OVERLAY_TREE=pristine``; the tests that
need the fix are then ``xfail(strict=True)``.
"""

import os

import pytest
import torch

from vllm import _custom_ops as ops
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")
if _TREE not in ("patched", "pristine"):
    raise ValueError(
        f"VLLM_OVERLAY_TREE={_TREE!r}: expected 'patched' (the default) or 'pristine'"
    )

needs_fix = pytest.mark.xfail(
    _TREE == "pristine",
    reason="needs the CPU rotary embedding to rotate strided heads",
    strict=True,
    raises=AssertionError,
)

TOKENS, HEADS, NOPE, ROPE, KV_LORA = 7, 4, 64, 64, 512


def _cpu_kernel(positions, query, key, head_size, cos_sin_cache, is_neox):
    """What csrc/cpu/pos_encoding.cpp's rotary_embedding does to memory, in place."""
    rot_dim = cos_sin_cache.shape[1]
    half = rot_dim // 2
    for x in (query, key):
        if x is None:
            continue
        heads = x.shape[-1] // head_size
        rows = torch.as_strided(
            x,
            (positions.numel(), heads, head_size),
            (x.stride(-2), head_size, 1),
        )
        cos = cos_sin_cache[positions, :half].unsqueeze(1).to(x.dtype)
        sin = cos_sin_cache[positions, half:].unsqueeze(1).to(x.dtype)
        if is_neox:
            a, b = rows[..., :half], rows[..., half:rot_dim]
        else:
            a, b = rows[..., 0:rot_dim:2], rows[..., 1:rot_dim:2]
        a0, b0 = a.clone(), b.clone()
        a.copy_(a0 * cos - b0 * sin)
        b.copy_(b0 * cos + a0 * sin)


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(ops, "rotary_embedding", _cpu_kernel)


def _rope(is_neox: bool) -> RotaryEmbedding:
    with set_current_vllm_config(VllmConfig()):
        return RotaryEmbedding(ROPE, ROPE, 4096, 10000.0, is_neox, torch.float32)


@needs_fix
@pytest.mark.parametrize("is_neox", [False, True])
def test_mla_rope_part_of_each_head(kernel, is_neox):
    """MLA's call:
    ``q[..., nope:], k_pe = rotary_emb(positions, q[..., nope:], k_pe)``."""
    rope = _rope(is_neox)
    torch.manual_seed(0)
    positions = torch.arange(TOKENS) * 3
    q = torch.randn(TOKENS, HEADS, NOPE + ROPE)
    kv = torch.randn(TOKENS, KV_LORA + ROPE)
    want_q, want_k = rope.forward_native(
        positions, q[..., NOPE:].clone(), kv[..., KV_LORA:].unsqueeze(1).clone()
    )
    got_q, got_k = q.clone(), kv.clone()
    k_pe = got_k[..., KV_LORA:].unsqueeze(1)
    got_q[..., NOPE:], k_pe = rope.forward_cpu(positions, got_q[..., NOPE:], k_pe)
    torch.testing.assert_close(got_q[..., NOPE:], want_q)
    torch.testing.assert_close(k_pe, want_k)
    assert torch.equal(got_q[..., :NOPE], q[..., :NOPE])  # the nope part untouched
    assert torch.equal(got_k[..., :KV_LORA], kv[..., :KV_LORA])


@pytest.mark.parametrize("is_neox", [False, True])
def test_packed_heads_rotate_in_place(kernel, is_neox):
    """Llama's call: query and key as slices of the fused qkv, rotated in place."""
    rope = _rope(is_neox)
    torch.manual_seed(0)
    positions = torch.arange(TOKENS)
    qkv = torch.randn(TOKENS, (HEADS + 2 + 2) * ROPE)
    q, k, _ = qkv.split([HEADS * ROPE, 2 * ROPE, 2 * ROPE], dim=-1)
    want_q, want_k = rope.forward_native(positions, q.clone(), k.clone())
    got_q, got_k = rope.forward_cpu(positions, q, k)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
