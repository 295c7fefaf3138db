"""The backend's compiler: it compiles nothing (Triton's interpreter runs the kernels)."""

from __future__ import annotations

from triton.backends.compiler import BaseBackend, GPUTarget


class InterpreterOnlyBackend(BaseBackend):
    @staticmethod
    def supports_target(target: GPUTarget) -> bool:
        return target.backend == "cpu"

    def hash(self) -> str:
        return "vllm-overlay-triton-cpu-shim-1"

    def parse_options(self, options: dict) -> object:
        raise RuntimeError(
            "vllm-overlay's test-only Triton cpu backend compiles nothing: run with "
            "TRITON_INTERPRET=1 (Triton's interpreter)"
        )

    def add_stages(self, stages: dict, options: object, language) -> None:
        self.parse_options({})

    def load_dialects(self, context) -> None:
        return None

    def get_module_map(self) -> dict:
        return {}
