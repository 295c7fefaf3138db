"""vllm-overlay: carry a reviewed overlay of fixes on a pinned vLLM release."""

__version__ = "0.1.0"
