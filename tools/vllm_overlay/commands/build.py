"""vllm-overlay build (placeholder until implemented)."""

from __future__ import annotations

import argparse

from vllm_overlay.errors import OverlayError

HELP = "(not implemented yet)"


def configure(parser: argparse.ArgumentParser) -> None:
    pass


def run(args: argparse.Namespace) -> int:
    raise OverlayError("vllm-overlay build is not implemented yet")
