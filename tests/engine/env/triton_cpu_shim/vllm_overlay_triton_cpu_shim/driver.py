"""The backend's driver: active only under ``TRITON_INTERPRET=1``, on the CPU."""

from __future__ import annotations

import os

from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase


class InterpreterOnlyDriver(DriverBase):
    @classmethod
    def is_active(cls) -> bool:
        return os.environ.get("TRITON_INTERPRET") == "1"

    def map_python_to_cpp_type(self, ty: str) -> str:
        raise RuntimeError("vllm-overlay's test-only Triton cpu backend compiles nothing")

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cpu", 0, 0)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_benchmarker(self):
        raise RuntimeError("vllm-overlay's test-only Triton cpu backend benchmarks nothing")

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0

    def set_current_device(self, device) -> None:
        return None
