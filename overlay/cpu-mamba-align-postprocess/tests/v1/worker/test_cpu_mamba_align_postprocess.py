# SPDX-License-Identifier: Apache-2.0
"""On the CPU backend the fused Mamba "align" state copies run without Triton.

Added by vllm-overlay (our own change: vLLM up to 0.33.0 has no CPU implementation of
``mamba_utils.postprocess_mamba_fused_kernel`` nor, from 0.31.0, of
``precopy_mamba_align_fused_kernel``). A hybrid model with a speculative config
(``extract_hidden_states`` included) and prefix caching (Mamba cache mode "align") runs
the precopy before every step and the postprocess after it, to move each request's SSM
and conv state between blocks. On the CPU backend both are Triton kernels with no
driver, so the first step stopped the engine ("'function' object is not subscriptable").
The CPU platform registers CPU twins for Triton kernels through vLLM's kernel dispatcher
(``CpuPlatform.register_triton_kernel_overrides``); ours take the same decisions over the
same metadata and copy with memmove.

These tests drive the real callers (``MambaSpecDecodeGPUContext.run_fused_postprocess``
and ``run_fused_precopy``, with their metadata built by
``initialize_from_forward_context``) and compare every state with the copies the
kernels' contract describes. Running on an unpatched tree: set
``VLLM_OVERLAY_TREE=pristine``; the tests that need the fix are then
``xfail(strict=True)``.

From vLLM 0.34.0 the CPU platform registers no CPU kernels of its own (``cpu_triton_utils``
and ``CpuPlatform.register_triton_kernel_overrides`` are gone) and refuses x86 without
Triton, whose kernels then run themselves: the twins have nothing left to serve. The tests
of the twins skip there, saying so, and
``test_x86_without_triton_never_meets_the_align_kernels`` holds at every release: the
change's drop at 0.34.0 is proven by it (and, in the engine, by the hybrid model with prefix
caching on Model Runner V2).
"""

import os
import sys
from types import SimpleNamespace

import pytest
import torch

from vllm.model_executor.layers.mamba.mamba_utils import (
    get_conv_copy_spec,
    get_temporal_copy_spec,
    is_conv_state_dim_first,
)
from vllm.triton_utils import HAS_TRITON
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec
from vllm.v1.utils import CpuGpuBuffer
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.worker.mamba_utils import MambaSpecDecodeGPUContext

_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")
if _TREE not in ("patched", "pristine"):
    raise ValueError(
        f"VLLM_OVERLAY_TREE={_TREE!r}: expected 'patched' (the default) or 'pristine'"
    )

needs_fix = pytest.mark.xfail(
    _TREE == "pristine",
    reason="needs the CPU implementations of the fused Mamba align copies",
    strict=True,
)

pytestmark = pytest.mark.skipif(
    HAS_TRITON, reason="with a Triton backend the CPU runner keeps the Triton kernels"
)

# Up to 0.33.0 the CPU platform registers CPU kernels where Triton is missing; 0.34.0 deleted
# them (its base Platform's method does nothing) and requires Triton on x86.
OWN_KERNELS = "register_triton_kernel_overrides" in vars(CpuPlatform)
twins = pytest.mark.skipif(
    not OWN_KERNELS,
    reason="this release's CPU platform registers no CPU kernels (0.34.0 deleted them and "
    "requires Triton on x86): the twins have nothing to serve",
)
ALIGN_KERNELS = (
    "vllm.v1.worker.mamba_utils.postprocess_mamba_fused_kernel",
    "vllm.v1.worker.mamba_utils.precopy_mamba_align_fused_kernel",
)

BLOCK, BLOCKS, WIDTH, DIM = 4, 8, 3, 6  # conv state: WIDTH (= kernel - 1) x DIM


@pytest.fixture
def cpu_kernels():
    """The kernels as the CPU platform registers them (restored afterwards)."""
    from vllm.triton_utils import dispatcher

    before = {n: dict(vars(m)) for n, m in sys.modules.items() if n.startswith("vllm.")}
    registry = dict(dispatcher._registry)
    CpuPlatform.register_triton_kernel_overrides()
    yield
    dispatcher._registry.clear()
    dispatcher._registry.update(registry)
    for name, saved in before.items():
        module = sys.modules[name]
        for key, value in saved.items():
            if vars(module).get(key) is not value:
                setattr(module, key, value)


def _states():
    torch.manual_seed(0)
    shape = (BLOCKS, DIM, WIDTH) if is_conv_state_dim_first() else (BLOCKS, WIDTH, DIM)
    conv = torch.randn(shape, dtype=torch.bfloat16)
    ssm = torch.randn(BLOCKS, 2, 4, 4, dtype=torch.float32)
    return conv, ssm


def _conv_rows(conv: torch.Tensor, block: int) -> torch.Tensor:
    """One block's conv state as [WIDTH, DIM], whatever the layout."""
    return conv[block].t() if is_conv_state_dim_first() else conv[block]


def _context(conv, ssm, block_table):
    spec = MambaSpec(
        block_size=BLOCK,
        shapes=(tuple(conv.shape[1:]), tuple(ssm.shape[1:])),
        dtypes=(conv.dtype, ssm.dtype),
        mamba_cache_mode="align",
        num_speculative_blocks=1,
    )
    config = KVCacheConfig(
        num_blocks=BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["gdn"], spec)],
    )

    copy_funcs = {spec.mamba_type: (get_conv_copy_spec, get_temporal_copy_spec)}

    def make_buffer(*size, dtype):
        return CpuGpuBuffer(*size, dtype=dtype, device="cpu", pin_memory=False)

    ctx = MambaSpecDecodeGPUContext.create(
        max_num_reqs=2,
        kv_cache_config=config,
        copy_funcs=copy_funcs,
        device=torch.device("cpu"),
        make_buffer=make_buffer,
    )
    ctx.initialize_from_forward_context(
        config,
        {"gdn": SimpleNamespace(kv_cache=[conv, ssm])},
        copy_funcs,
        [block_table],
    )
    return ctx


@twins
@needs_fix
def test_states_move_to_the_block_of_the_last_accepted_token(cpu_kernels):
    conv, ssm = _states()
    conv0, ssm0 = conv.clone(), ssm.clone()
    block_table = torch.tensor([[5, 2, 7, 0, 0, 0], [1, 6, 3, 4, 0, 0]], dtype=torch.int32)
    ctx = _context(conv, ssm, block_table)
    # Request 0: 6 computed, 1 token + 2 drafts scheduled, 3 accepted: 9 tokens, so the
    # state of token 8 (block index 1, one token past the running state) goes to block
    # index 1 from the running state at block index 1: a shift inside one block.
    # Request 1: 4 computed, 2 scheduled, none drafted, 1 accepted: 6 tokens, not at a
    # block boundary: nothing moves.
    def i32(values):
        return torch.tensor(values, dtype=torch.int32)

    num_accepted = i32([3, 1])
    ctx.run_fused_postprocess(
        num_reqs=2,
        num_accepted_tokens_gpu=num_accepted,
        mamba_state_idx_gpu=i32([1, 1]),
        num_scheduled_tokens_gpu=i32([3, 2]),
        num_computed_tokens_gpu=i32([6, 4]),
        num_draft_tokens_gpu=i32([2, 0]),
    )
    # The kernel's contract, request 0: running = 6 + 3 - 2 = 7 tokens, new = 9,
    # aligned = 8, bias = 1, destination block index 8 // 4 - 1 = 1 (= the source).
    src_block, bias = int(block_table[0, 1]), 1
    expected_conv, expected_ssm = conv0.clone(), ssm0.clone()
    rows = _conv_rows(expected_conv, src_block)
    rows[: WIDTH - bias] = _conv_rows(conv0, src_block)[bias:]
    expected_ssm[src_block] = ssm0[int(block_table[0, 1 + bias])]
    assert torch.equal(conv, expected_conv)
    assert torch.equal(ssm, expected_ssm)
    # Source and destination are the same block: the next step starts from one token.
    assert ctx.num_accepted_tokens_out[:2].tolist() == [1, 1]


@twins
@needs_fix
def test_a_state_moves_to_another_block(cpu_kernels):
    conv, ssm = _states()
    conv0, ssm0 = conv.clone(), ssm.clone()
    block_table = torch.tensor([[5, 2, 7, 0, 0, 0], [1, 6, 3, 4, 0, 0]], dtype=torch.int32)
    ctx = _context(conv, ssm, block_table)
    # Request 0 only: 1 computed + 11 scheduled, no drafts: 12 tokens, a block
    # boundary. Its running state sits at block index 0 (mamba_state_idx): it moves
    # whole (bias 0) to block index 12 // 4 - 1 = 2.
    def i32(values):
        return torch.tensor(values, dtype=torch.int32)

    ctx.run_fused_postprocess(
        num_reqs=1,
        num_accepted_tokens_gpu=i32([1, 0]),
        mamba_state_idx_gpu=i32([0, 0]),
        num_scheduled_tokens_gpu=i32([11, 0]),
        num_computed_tokens_gpu=i32([1, 0]),
        num_draft_tokens_gpu=i32([0, 0]),
    )
    src_block, dst_block = int(block_table[0, 0]), int(block_table[0, 2])
    expected_conv, expected_ssm = conv0.clone(), ssm0.clone()
    _conv_rows(expected_conv, dst_block)[:] = _conv_rows(conv0, src_block)
    expected_ssm[dst_block] = ssm0[src_block]
    assert torch.equal(conv, expected_conv)
    assert torch.equal(ssm, expected_ssm)
    assert ctx.num_accepted_tokens_out[:1].tolist() == [1]


@twins
@needs_fix
def test_the_precopy_moves_the_previous_blocks_state_before_the_step(cpu_kernels):
    conv, ssm = _states()
    conv0, ssm0 = conv.clone(), ssm.clone()
    block_table = torch.tensor([[5, 2, 7, 0, 0, 0], [1, 6, 3, 4, 0, 0]], dtype=torch.int32)
    ctx = _context(conv, ssm, block_table)

    def i32(values):
        return torch.tensor(values, dtype=torch.int32)

    # Request 0 crossed from block index 0 to 1 with 2 accepted tokens (bias 1): its
    # conv window shifts by one token into block index 1, and its SSM state is the one
    # of the accepted token (block index 0 + 1). Request 1 stays in block index 2:
    # nothing moves.
    ctx.run_fused_precopy(
        num_reqs=2,
        state_idx_gpu=i32([1, 2]),
        src_col_gpu=i32([0, 2]),
        token_bias_gpu=i32([1, 0]),
        idx_mapping=None,
    )
    src_block, dst_block, bias = int(block_table[0, 0]), int(block_table[0, 1]), 1
    expected_conv, expected_ssm = conv0.clone(), ssm0.clone()
    _conv_rows(expected_conv, dst_block)[: WIDTH - bias] = _conv_rows(conv0, src_block)[
        bias:
    ]
    expected_ssm[dst_block] = ssm0[int(block_table[0, 0 + bias])]
    assert torch.equal(conv, expected_conv)
    assert torch.equal(ssm, expected_ssm)


@needs_fix
def test_x86_without_triton_never_meets_the_align_kernels(cpu_kernels, monkeypatch):
    """An x86 CPU engine without Triton either has CPU kernels for both fused align copies
    (our twins, registered by the platform) or does not start at all (vLLM 0.34.0: "requires
    Triton"). Upstream up to 0.33.0 has neither: the engine ran into the Triton kernels."""
    from vllm.platforms.interface import CpuArchEnum
    from vllm.triton_utils import dispatcher

    if all(name in dispatcher._registry for name in ALIGN_KERNELS):
        return  # the platform registered CPU kernels for both
    monkeypatch.setattr("vllm.triton_utils.HAS_TRITON", False)
    x86 = classmethod(lambda cls: CpuArchEnum.X86)
    monkeypatch.setattr(CpuPlatform, "get_cpu_architecture", x86)
    with pytest.raises(RuntimeError, match="requires Triton"):
        CpuPlatform.check_and_update_config(SimpleNamespace(model_config=None))
