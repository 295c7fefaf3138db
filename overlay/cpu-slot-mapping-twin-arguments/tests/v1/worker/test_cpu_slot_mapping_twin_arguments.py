# SPDX-License-Identifier: Apache-2.0
"""The CPU twin of block_table.py's slot-mapping kernel takes the kernel's arguments.

Added by vllm-overlay (a backport of vLLM 0.33.0's ``_compute_slot_mapping_kernel_impl``).
On the CPU backend vLLM's kernel dispatcher runs the twin in place of the Triton kernel;
the JIT warmup launches it with the kernel's argument names, and where the twin's names
differ the dispatcher passes them in the kernel's order. vLLM 0.32.0's twin had a
``block_size`` parameter the kernel lacks: the slot-mapping tensor landed in it and Model
Runner V1 died at its first step ("Boolean value of Tensor with more than one value is
ambiguous").

The launch goes through the real dispatcher (``KernelOverride``) with the real kernel's
argument names; the compiled ``_C`` op the twin calls is not in this test environment, so
the test defines it with the kernel's contract (slot = block number * block size + offset
in the block). Running on an unpatched tree: set ``VLLM_OVERLAY_TREE=pristine``; the tests
that need the fix are then ``xfail(strict=True)``.
"""

import inspect
import os

import pytest
import torch

from vllm.triton_utils.dispatcher import KernelOverride, _kernel_arg_names
from vllm.utils.cpu_triton_utils import _compute_slot_mapping_kernel_impl
from vllm.v1.worker.block_table import ComputeSlotMappingKernel

_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")
if _TREE not in ("patched", "pristine"):
    raise ValueError(
        f"VLLM_OVERLAY_TREE={_TREE!r}: expected 'patched' (the default) or 'pristine'"
    )

needs_fix = pytest.mark.xfail(
    _TREE == "pristine",
    reason="needs the slot-mapping twin that takes the kernel's arguments",
    strict=True,
)

BLOCK = 16
PAD = -1


def _contract(query_start_loc, positions, block_table, slot_mapping, block_size):
    """What the compiled op computes: each token's slot in the KV cache."""
    for req in range(query_start_loc.numel() - 1):
        for i in range(int(query_start_loc[req]), int(query_start_loc[req + 1])):
            pos = int(positions[i])
            block = int(block_table[req, pos // block_size])
            slot_mapping[i] = block * block_size + pos % block_size


@pytest.fixture(scope="module", autouse=True)
def compiled_op():
    if hasattr(torch.ops._C, "compute_slot_mapping_kernel_impl"):
        yield  # a build with vLLM's compiled kernels: the real op
        return
    lib = torch.library.Library("_C", "FRAGMENT")
    lib.define(
        "compute_slot_mapping_kernel_impl(Tensor query_start_loc, Tensor positions, "
        "Tensor block_table, Tensor(a!) slot_mapping, int block_size) -> ()"
    )
    lib.impl("compute_slot_mapping_kernel_impl", _contract, "CPU")
    yield
    lib._destroy()


@needs_fix
def test_the_twin_takes_the_kernels_arguments_name_for_name():
    kernel = _kernel_arg_names(ComputeSlotMappingKernel.kernel)
    twin = tuple(inspect.signature(_compute_slot_mapping_kernel_impl).parameters)
    assert tuple(n.removesuffix("_ptr") for n in kernel) == twin


@needs_fix
def test_a_launch_as_the_warmup_makes_it_maps_every_token_to_its_slot():
    # two requests: 3 tokens from position 14 (crossing a block), 2 tokens from position 0
    query_start_loc = torch.tensor([0, 3, 5], dtype=torch.int32)
    positions = torch.tensor([14, 15, 16, 0, 1], dtype=torch.int64)
    block_table = torch.tensor([[7, 3, 0], [5, 0, 0]], dtype=torch.int32)
    slot_mapping = torch.full((8,), -2, dtype=torch.int64)
    override = KernelOverride(ComputeSlotMappingKernel.kernel, _compute_slot_mapping_kernel_impl)
    launch = {
        "num_tokens": 5,
        "max_num_tokens": 8,
        "query_start_loc_ptr": query_start_loc,
        "positions_ptr": positions,
        "block_table_ptr": block_table,
        "block_table_stride": block_table.stride(0),
        "slot_mapping_ptr": slot_mapping,
        "KV_CACHE_BLOCK_SIZE": BLOCK,
        "TOTAL_CP_WORLD_SIZE": 1,
        "TOTAL_CP_RANK": 0,
        "CP_KV_CACHE_INTERLEAVE_SIZE": 1,
        "PAD_ID": PAD,
        "BLOCK_SIZE": 1024,
    }
    assert set(launch) == set(_kernel_arg_names(ComputeSlotMappingKernel.kernel))
    override[(3,)](**launch)
    assert slot_mapping[:5].tolist() == [7 * 16 + 14, 7 * 16 + 15, 3 * 16 + 0, 5 * 16, 5 * 16 + 1]
