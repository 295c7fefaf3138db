# SPDX-License-Identifier: Apache-2.0
"""The CPU stand-in for the rejection sampler's recovered-token kernel takes the
``USE_FP64_GUMBEL`` keyword (backport of vLLM 0.25.0's ``vllm/utils/cpu_triton_utils.py``).

Added by vllm-overlay. vLLM 0.24.0's ``sample_recovered_tokens`` passes
``USE_FP64_GUMBEL=...`` to the kernel, and ``CPUModelRunner`` swaps the Triton kernel for
``cpu_triton_utils.sample_recovered_tokens_kernel``, whose function did not accept the
keyword: every speculative configuration on the CPU backend (``extract_hidden_states``
included) died in the profile run with a ``TypeError``. The C++ kernel reads ``inv_q`` as
float32, so the stand-in also casts the fp64 noise down.

These tests drive the real caller (``rejection_sampler.sample_recovered_tokens``) through
the stand-in, with the compiled op replaced by a recorder (the source tree has no
``vllm._C``). Running on an unpatched tree: set ``VLLM_OVERLAY_TREE=pristine``; the tests
that need the fix are then ``xfail(strict=True)``.
"""

import os
from types import SimpleNamespace

import pytest
import torch

import vllm.utils.cpu_triton_utils as cpu_tl
from vllm.v1.sample import rejection_sampler

_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")
if _TREE not in ("patched", "pristine"):
    raise ValueError(
        f"VLLM_OVERLAY_TREE={_TREE!r}: expected 'patched' (the default) or 'pristine'"
    )

needs_fix = pytest.mark.xfail(
    _TREE == "pristine",
    reason="needs the CPU recovered-token stand-in that takes USE_FP64_GUMBEL",
    strict=True,
)


@pytest.fixture
def recorded_op(monkeypatch):
    """The compiled CPU op, replaced by one that records what it is given and picks the
    argmax of target_probs * inv_q (what the kernel computes without draft probs)."""
    calls = []

    def op(out, cu_num_draft, draft_ids, draft_probs, target_probs, inv_q, vocab, no_dp):
        calls.append({"inv_q_dtype": inv_q.dtype, "no_draft_probs": no_dp})
        out.copy_((target_probs * inv_q[0].to(target_probs.dtype)).argmax(-1))

    monkeypatch.setattr(
        torch.ops._C, "sample_recovered_tokens_kernel_impl", op, raising=False
    )
    monkeypatch.setattr(
        rejection_sampler,
        "sample_recovered_tokens_kernel",
        cpu_tl.sample_recovered_tokens_kernel,
    )
    return calls


@needs_fix
@pytest.mark.parametrize("use_fp64_gumbel", [False, True])
def test_recovered_tokens_through_the_cpu_stand_in(recorded_op, use_fp64_gumbel):
    vocab = 16
    target_probs = torch.zeros(1, vocab)
    target_probs[0, 5] = 1.0
    recovered = rejection_sampler.sample_recovered_tokens(
        max_spec_len=1,
        num_draft_tokens=[1],
        cu_num_draft_tokens=torch.tensor([1], dtype=torch.int32),
        draft_token_ids=torch.tensor([3], dtype=torch.int32),
        draft_probs=None,
        target_probs=target_probs,
        sampling_metadata=SimpleNamespace(generators={}),
        device=torch.device("cpu"),
        use_fp64_gumbel=use_fp64_gumbel,
    )
    assert recovered.tolist() == [5]
    # The C++ kernel reads float*: fp64 noise must reach it as float32.
    assert recorded_op == [{"inv_q_dtype": torch.float32, "no_draft_probs": True}]
