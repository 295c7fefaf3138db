"""The vllm-overlay command line: argparse and dispatch only.

Each command lives in ``vllm_overlay.commands.<name>`` and exports ``HELP`` (one line),
``DESCRIPTION`` (the --help text), ``configure(parser)`` and ``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import os
import sys
import tempfile
import traceback
from collections.abc import Sequence

from vllm_overlay import __version__, util
from vllm_overlay.envs import cache
from vllm_overlay.errors import OverlayError
from vllm_overlay.index.auth import redact

# Order is the order --help lists them in: the pipeline, then the work-area verbs.
COMMANDS = (
    "lock",
    "fetch",
    "apply",
    "edit",
    "export",
    "import",
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
    "upstream",
    "cache",
)

MODULES = {"import": "import_"}  # verbs whose module name is a Python keyword

EPILOG = """\
The pipeline: lock -> fetch -> apply (edit, export; import starts a change from upstream
work) -> build -> verify -> suite -> publish. Carrying it forward: rebase walks the overlay
to a newer vLLM release through every release in between (drops proven where they happen,
conflicts asked once, where they first happen), outlook shows that walk for every newer
release without writing anything, track runs it on a branch (what the daily workflow runs); upstream prepares a change of
ours for upstream, proven.
cache shows and prunes the cache.

Downloads and environments are cached under $VLLM_OVERLAY_CACHE (default
~/.cache/vllm-overlay), keyed by content; --cache-max-size caps it. The package index comes
from pip's own configuration (PIP_INDEX_URL, pip.conf) unless --index-url is given.
Processes sharing a cache or a project wait for each other's locks (up to --lock-timeout
seconds). Exit status: 0 success, 1 an expected failure (the message says what to do),
2 usage error.
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
    parser.add_argument(
        "--lock-timeout",
        metavar="SECONDS",
        type=_seconds,
        help="how long to wait for a cache or project lock another vllm-overlay process holds "
        f"before giving up (default: ${util.LOCK_TIMEOUT_ENV}, else "
        f"{util.DEFAULT_LOCK_TIMEOUT:g}; 0 gives up at once)",
    )
    parser.add_argument(
        "--cache-max-size",
        metavar="SIZE",
        type=_size,
        help="keep the cache under SIZE (20G, 500M): builds remove the least recently used "
        f"entries past it (default: ${cache.MAX_SIZE_ENV}, else no cap)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        mod = importlib.import_module(f"vllm_overlay.commands.{MODULES.get(name, name)}")
        p = sub.add_parser(
            name,
            help=mod.HELP,
            description=getattr(mod, "DESCRIPTION", mod.HELP),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.configure(p)
        p.set_defaults(_run=mod.run)
    return parser


@functools.cache
def _parser() -> argparse.ArgumentParser:
    """The parser, built once per process (parsing leaves it as it was)."""
    return build_parser()


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (0 or more)")
    return value


def _size(text: str) -> int:
    try:
        return cache.parse_size(text)
    except OverlayError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if args.project:
        os.environ["VLLM_OVERLAY_PROJECT"] = os.path.abspath(args.project)
    util.set_lock_timeout(args.lock_timeout)
    cache.set_max_size(args.cache_max_size)
    try:
        return int(args._run(args) or 0)
    except OverlayError as e:
        print(f"vllm-overlay {args.command}: error: {redact(str(e))}", file=sys.stderr)
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
