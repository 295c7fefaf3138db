# SPDX-License-Identifier: Apache-2.0
"""On the CPU backend the Mamba state batch copy runs without Triton (backport of vLLM
0.25.0's ``cpu_triton_utils.batch_memcpy_kernel``).

Added by vllm-overlay. With prefix caching on, a hybrid model copies each request's
running SSM/conv state into the block of its last scheduled token before every step
(``mamba_utils.preprocess_mamba`` -> ``batch_memcpy``), through a Triton kernel. vLLM
0.24.0's ``CPUModelRunner`` swapped in CPU stand-ins for the spec-decode kernels but not
this one, so the first step of a second chunk died with "'function' object is not
subscriptable". The stand-in copies with memmove.

Running on an unpatched tree: set ``VLLM_OVERLAY_TREE=pristine``; the tests that need
the fix are then ``xfail(strict=True)``.
"""

import os
import sys

import pytest
import torch

from vllm.triton_utils import HAS_TRITON
from vllm.v1.worker import mamba_utils
from vllm.v1.worker.cpu_model_runner import CPUModelRunner

_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")
if _TREE not in ("patched", "pristine"):
    raise ValueError(
        f"VLLM_OVERLAY_TREE={_TREE!r}: expected 'patched' (the default) or 'pristine'"
    )

needs_fix = pytest.mark.xfail(
    _TREE == "pristine",
    reason="needs the CPU stand-in for the Mamba state batch copy",
    strict=True,
)

pytestmark = pytest.mark.skipif(
    HAS_TRITON, reason="with a Triton backend the CPU runner keeps the Triton kernels"
)


@pytest.fixture
def cpu_kernels():
    """The module attributes as CPUModelRunner leaves them (restored afterwards)."""
    before = {n: dict(vars(m)) for n, m in sys.modules.items() if n.startswith("vllm.")}
    CPUModelRunner._postprocess_triton(object.__new__(CPUModelRunner))
    yield
    for name, saved in before.items():
        module = sys.modules[name]
        for key, value in saved.items():
            if vars(module).get(key) is not value:
                setattr(module, key, value)


@needs_fix
def test_batch_memcpy_copies_every_region(cpu_kernels):
    torch.manual_seed(0)
    src = torch.randint(0, 255, (3, 100), dtype=torch.uint8)
    dst = torch.zeros_like(src)
    sizes = [100, 37, 1]

    def ptrs(t):
        return torch.tensor([t[i].data_ptr() for i in range(3)], dtype=torch.int64)

    mamba_utils.batch_memcpy(ptrs(src), ptrs(dst), torch.tensor(sizes, dtype=torch.int64))
    for i, n in enumerate(sizes):
        assert torch.equal(dst[i, :n], src[i, :n])
        assert torch.count_nonzero(dst[i, n:]) == 0
