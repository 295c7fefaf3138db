"""Test-only Triton backend for vllm-overlay's engine tests; never part of a wheel we ship.

vLLM's CPU build accepts Triton only when ``triton.backends`` has a backend named ``cpu``
(``vllm/triton_utils/importing.py``); with Triton, vLLM 0.32.0 runs Model Runner V2, the
runner every user of its CUDA build runs. vLLM's own CPU Triton (triton-cpu) is not
reachable here. This package registers a ``cpu`` backend through Triton's
``triton.backends`` entry point that compiles nothing: its driver is active only under
``TRITON_INTERPRET=1``, where Triton's interpreter runs every kernel on CPU tensors in
Python. The ``cpu`` key exists whether or not the interpreter is on, so the package belongs
only in an environment whose every process runs with ``TRITON_INTERPRET=1`` (the engine
tests' V2 environment, ``tests/engine/harness.py``).
"""
