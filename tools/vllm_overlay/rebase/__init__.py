"""Moving the overlay to a new vLLM release: the public face (``engine`` holds the work)."""

from vllm_overlay.rebase.engine import DROPPED, STOP_COMMIT, STOP_KINDS, abort, start

__all__ = ["DROPPED", "STOP_COMMIT", "STOP_KINDS", "abort", "start"]
