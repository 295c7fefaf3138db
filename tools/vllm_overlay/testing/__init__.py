"""Testing: vLLM's suite on the patched and the pristine tree, its pytest plugin, JUnit,
failure causes, and the proofs a rebase runs. The environments it runs in are
``vllm_overlay.envs``."""
