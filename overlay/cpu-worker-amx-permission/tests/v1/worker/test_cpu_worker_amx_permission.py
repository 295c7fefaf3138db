# SPDX-License-Identifier: Apache-2.0
"""The CPU worker asks Linux for AMX before any kernel runs.

Added by vllm-overlay (our own change). vLLM's CPU kernels built for AMX (the CPU
attention's "amx" ISA, chosen for bf16 with a block size that is a multiple of 32) run
AMX tile instructions, which Linux allows a process only after it asks
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, what ``torch.cpu._init_amx``
does). vLLM 0.32.0 never asks: on an AMX machine a worker process dies of SIGILL in
``cpu_attention_with_kv_cache`` at the first step of a dense bf16 model unless some
other library happened to ask first. ``CPUWorker.init_device`` now asks, first thing.

The first tests make the machine an AMX one (the probe says yes, the request is
recorded) and stop the worker at its distributed setup, so they run anywhere. The last
asks the kernel, in a fresh process, whether the permission is held after
``init_device``; it runs only on a machine with AMX. Running on an unpatched tree: set
``VLLM_OVERLAY_TREE=pristine``; the tests that need the fix are then
``xfail(strict=True)``.
"""

import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest
import torch

from vllm.platforms import current_platform

_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")
if _TREE not in ("patched", "pristine"):
    raise ValueError(
        f"VLLM_OVERLAY_TREE={_TREE!r}: expected 'patched' (the default) or 'pristine'"
    )

needs_fix = pytest.mark.xfail(
    _TREE == "pristine",
    reason="needs the CPU worker to ask for AMX before its kernels run",
    strict=True,
)

pytestmark = pytest.mark.skipif(
    not current_platform.is_cpu(), reason="the CPU worker"
)


class _Stopped(Exception):
    """Raised where the worker would set up torch.distributed: the test ends there."""


def _init_device_until_distributed(monkeypatch, events: list[str]) -> None:
    """Run the real CPUWorker.init_device on a bare worker up to its distributed setup."""
    from vllm.v1.worker import cpu_worker

    def stop(*args, **kwargs):
        events.append("distributed")
        raise _Stopped

    monkeypatch.setattr(cpu_worker, "init_worker_distributed_environment", stop)
    # init_device replaces torch.set_num_threads and sets VLLM_DIST_IDENT: put both back.
    monkeypatch.setattr(torch, "set_num_threads", torch.set_num_threads)
    monkeypatch.setenv("VLLM_DIST_IDENT", "")
    worker = cpu_worker.CPUWorker.__new__(cpu_worker.CPUWorker)
    worker.vllm_config = SimpleNamespace(speculative_config=None)
    worker.distributed_init_method = "file:///tmp/vllm-overlay-amx-test"
    worker.rank = worker.local_rank = 0
    with pytest.raises(_Stopped):
        worker.init_device()


def _machine(monkeypatch, events: list[str], amx: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: events.append("init_amx") or True)


@needs_fix
def test_an_amx_machine_is_asked_for_before_distributed_setup(monkeypatch):
    events: list[str] = []
    _machine(monkeypatch, events, amx=True)
    _init_device_until_distributed(monkeypatch, events)
    assert events == ["init_amx", "distributed"]


def test_a_machine_without_amx_is_not_asked(monkeypatch):
    events: list[str] = []
    _machine(monkeypatch, events, amx=False)
    _init_device_until_distributed(monkeypatch, events)
    assert events == ["distributed"]


# In a fresh process (the test's own may hold the permission from an earlier kernel):
# init_device as above, then the kernel's answer to ARCH_GET_XCOMP_PERM.
_HELD_AFTER_INIT = textwrap.dedent(
    """
    import ctypes, json, sys
    import pytest
    sys.path.insert(0, sys.argv[1])
    import test_cpu_worker_amx_permission as t

    def held():
        libc = ctypes.CDLL(None, use_errno=True)
        bits = ctypes.c_uint64(0)
        # SYS_arch_prctl (x86_64) = 158; ARCH_GET_XCOMP_PERM = 0x1022
        if libc.syscall(158, 0x1022, ctypes.byref(bits)) != 0:
            raise OSError(ctypes.get_errno(), "arch_prctl(ARCH_GET_XCOMP_PERM)")
        return bool(bits.value & (1 << 18))  # XFEATURE_XTILEDATA

    before = held()
    mp = pytest.MonkeyPatch()
    t._init_device_until_distributed(mp, [])
    mp.undo()
    print(json.dumps({"before": before, "after": held()}))
    """
)


@needs_fix
@pytest.mark.skipif(
    not (sys.platform.startswith("linux") and torch.cpu._is_amx_tile_supported()),
    reason="this machine has no AMX tiles (needs Linux on a CPU with AMX)",
)
def test_the_worker_process_holds_the_amx_permission():
    import json

    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run(
        [sys.executable, "-c", _HELD_AFTER_INIT, here],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    held = json.loads(out.stdout.strip().splitlines()[-1])
    assert held == {"before": False, "after": True}
