"""Rebase: moving the overlay to a new vLLM release."""
