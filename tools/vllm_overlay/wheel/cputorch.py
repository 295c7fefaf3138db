"""The CPU build against the index's torch, which is torch's CUDA build.

vLLM 0.33.0 and later build and run their CPU project against ``torch==X+cpu``
(``requirements/build/cpu.txt``, ``requirements/cpu.txt``), which only PyTorch's own index
serves. The package index serves ``torch==X`` for Linux x86_64 as the CUDA build: the same
sources and C++ ABI for the CPU libraries (``libtorch_cpu``, ``libc10``, ``libtorch``), plus
the CUDA ones. It imports and runs on a machine without a GPU. Where a release's build
environment pins it (its constraints file names ``torch==X`` with no ``+cpu``), two things
make it the CPU build's torch:

- **CMake.** The CUDA build's CMake package (``share/cmake/Caffe2/Caffe2Config.cmake``) stops
  ``find_package(Torch)`` unless it finds a CUDA toolkit ("Your installed Caffe2 version
  uses CUDA but I cannot find the CUDA libraries"), and its ``torch`` target links
  ``libtorch_cuda``. The CPU kernels use neither. ``Torch_DIR`` names a small package
  config of ours (written into the build root): it defines the one CUDA target the package
  looks for first (``torch::cudart``, empty, so it does not go looking for a toolkit),
  includes torch's own config, and then links ``torch`` with its CPU libraries only, as the
  ``+cpu`` build's config does. The compile commands are those of a ``+cpu`` build; the
  extension needs only the CPU libraries, so it loads under either torch build.
  A build argument (``-DTorch_DIR``, recorded in ``build_settings.cmake_args``), no edit of
  vLLM's files; made only where the constraints pin the CUDA build.
- **Requirements.** ``torch==X+cpu`` in the tree's CPU requirements becomes ``torch==X``, so
  the wheel asks for a torch the index serves (the ``+cpu`` build also satisfies it: PEP
  440 ignores the local label where the specifier has none). An overlay change, scoped to
  every vllm-cpu source build: ``vllm-cpu-torch-from-the-index``.

Both go when the build environment can pin ``torch==X+cpu`` (an index that serves it): the
constraints file then names it, the argument is not passed, and the change drops.
"""

from __future__ import annotations

import re
from pathlib import Path

from packaging.version import InvalidVersion, Version

from vllm_overlay.errors import BuildError
from vllm_overlay.util import atomic_write_text

TORCH_DIR = "torch-cmake"  # under the build root: our TorchConfig.cmake
_PIN = re.compile(r"(?im)^\s*torch\s*==\s*([^\s;#]+)")
_CPU_REQ = re.compile(r"(?m)^(\s*torch\s*==\s*[0-9][^\s;#+]*)\+cpu\b")

CMAKE_ARG = (
    f"-DTorch_DIR=<build root>/{TORCH_DIR}: our TorchConfig.cmake, torch's CUDA build found "
    "without a CUDA toolkit (an empty torch::cudart) and linked with its CPU libraries only "
    "(the build environment pins the index's torch, which is the CUDA build)"
)


def pinned_torch(constraints_text: str) -> str | None:
    """The torch version a build environment's constraints file pins (None: none)."""
    m = _PIN.search(constraints_text)
    return m.group(1) if m else None


def is_cuda_torch(constraints: Path) -> bool:
    """Whether the build environment of ``constraints`` pins torch's CUDA build (a torch
    with no ``+cpu`` label; the index serves no other for Linux)."""
    if not constraints.is_file():
        return False
    pin = pinned_torch(constraints.read_text())
    if pin is None:
        return False
    try:
        local = Version(pin).local or ""
    except InvalidVersion:
        return False
    return "cpu" not in local


def index_requirement(text: str) -> str:
    """Requirement lines with ``torch==X+cpu`` as ``torch==X``: what a tree with the
    ``vllm-cpu-torch-from-the-index`` change asks for."""
    return _CPU_REQ.sub(r"\1", text)


def config_text(torch_config: Path) -> str:
    return (
        "# Written by vllm-overlay (wheel/cputorch.py): torch's CUDA build as the CPU build's\n"
        "# torch. Found without a CUDA toolkit, linked with its CPU libraries only.\n"
        "if(NOT TARGET torch::cudart)\n"
        "  add_library(torch::cudart INTERFACE IMPORTED)\n"
        "endif()\n"
        f'include("{torch_config}")\n'
        "set_property(TARGET torch PROPERTY INTERFACE_LINK_LIBRARIES torch_cpu_library)\n"
        'list(FILTER TORCH_LIBRARIES EXCLUDE REGEX "cuda|nvrtc")\n'
    )


def write_config(root: Path) -> Path:
    """Our ``TorchConfig.cmake`` in ``root/torch-cmake``, including torch's own through the
    build root's ``env`` link (the same path at every build); returns its directory."""
    found = sorted((root / "env").glob("lib/python*/site-packages/torch/share/cmake/Torch"))
    if not found:
        raise BuildError(
            f"the build environment ({root / 'env'}) has no torch CMake package "
            "(site-packages/torch/share/cmake/Torch); install the torch its constraints pin."
        )
    rel = found[0].relative_to(root)
    real = root / rel / "TorchConfig.cmake"
    out = root / TORCH_DIR
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "TorchConfig.cmake", config_text(real))
    return out
