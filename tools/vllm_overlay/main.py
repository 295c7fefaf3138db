"""The vllm-overlay command line: argparse and dispatch only.

Each command lives in ``vllm_overlay.commands.<name>`` and exports ``HELP`` (one line),
``DESCRIPTION`` (the --help text), ``configure(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
import traceback
from collections.abc import Sequence

from vllm_overlay import __version__
from vllm_overlay.errors import OverlayError

# Order is the order --help lists them in: the pipeline, then the work-area verbs.
COMMANDS = (
    "lock",
    "fetch",
    "apply",
    "edit",
    "export",
    "status",
    "build",
    "verify",
    "inspect",
    "testenv",
    "suite",
    "publish",
    "rebase",
    "outlook",
    "track",
)

EPILOG = """\
The pipeline: lock -> fetch -> apply -> build -> verify -> suite -> publish; rebase moves the
overlay to a new vLLM release. Downloads are cached under $VLLM_OVERLAY_CACHE
(default ~/.cache/vllm-overlay), keyed by sha256. The package index comes from pip's own
configuration (PIP_INDEX_URL, pip.conf) unless --index-url is given.
Exit status: 0 success, 1 an expected failure (the message says what to do), 2 usage error.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vllm-overlay",
        description="Carry a reviewed overlay of fixes on a pinned vLLM release.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"vllm-overlay {__version__}")
    parser.add_argument(
        "--project",
        metavar="DIR",
        help="the overlay project (default: the nearest directory holding overlay/overlay.toml)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        mod = importlib.import_module(f"vllm_overlay.commands.{name}")
        p = sub.add_parser(
            name,
            help=mod.HELP,
            description=getattr(mod, "DESCRIPTION", mod.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.configure(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.project:
        os.environ["VLLM_OVERLAY_PROJECT"] = os.path.abspath(args.project)
    try:
        return int(args._run(args) or 0)
    except OverlayError as e:
        print(f"vllm-overlay {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("vllm-overlay: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # stdout was closed early (`vllm-overlay status | head`): not an error of ours.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except Exception:
        fd, log = tempfile.mkstemp(prefix="vllm-overlay-crash-", suffix=".log")
        with os.fdopen(fd, "w") as f:
            traceback.print_exc(file=f)
        traceback.print_exc()
        print(
            f"vllm-overlay: an unexpected error occurred (a bug); the traceback is in {log}. "
            "Please report it with that file.",
            file=sys.stderr,
        )
        return 3


if __name__ == "__main__":
    raise SystemExit(main())
