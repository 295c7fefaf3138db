"""Environments: the cached virtualenvs vLLM runs in, and the cache they live in.

- ``envbuild``: the one builder (recipe hash, staging, lock, marker written last; the
  superseded environment of the same slot retired) and ``build_venv``, its install skeleton;
- ``testenv``: vLLM's tests from a source tree; ``enginenv``: a built wheel installed, to
  run the engine; ``clientenv``: a pipeline that talks to ``vllm serve`` (no vLLM in it);
- ``childenv``: the clean environment every child Python starts from; ``installer``: uv or
  pip behind one interface;
- ``cache``: what the cache holds, its size cap, and pruning (``vllm-overlay cache``).
"""
