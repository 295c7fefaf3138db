"""vllm-overlay cache: what the download and environment cache holds; prune it."""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from vllm_overlay import util
from vllm_overlay.envs import cache
from vllm_overlay.errors import UsageError

HELP = "show what the cache holds (each kind, its size, its last use); prune it"
DESCRIPTION = f"""\
Show what the cache ($VLLM_OVERLAY_CACHE, default ~/.cache/vllm-overlay) holds: each kind
(release artifacts, upstream trees, test, engine and client environments, the engine tests'
models, outlook results, member hashes, suite baselines, uv's cache), its size and its last
use; --entries lists every entry, --json prints it for programs.

  vllm-overlay cache                       a line per kind
  vllm-overlay cache --entries             a line per entry (unused ones say why)
  vllm-overlay cache prune --unused        what no current recipe or lock uses
  vllm-overlay cache prune --older-than 30d
  vllm-overlay cache prune --max-size 20G  least recently used first, until it fits
  vllm-overlay cache prune --unused --dry-run

"Unused": an artifact or tree upstream.lock does not pin, an environment superseded in its
slot (a newer wheel's, a newer constraints file's) or built by an older format. Prune never
removes an entry another process is using (it takes the entry's lock without waiting, and
says which it passed by); an entry goes in one atomic rename, so a prune killed at any
point leaves nothing half-removed where a later run looks.

A size cap that builds respect: --cache-max-size SIZE (before the verb) or
${cache.MAX_SIZE_ENV}; after each environment build the least recently used entries go
until the cache fits. Building an environment for a new recipe retires the one it
supersedes in its slot, automatically.
"""

_AGE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*")
_AGE_UNITS = {"": 86400, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_age(text: str) -> float:
    """``30d``, ``12h``, ``2w``, ``90m``, ``45s``; a bare number is days."""
    m = _AGE.fullmatch(text)
    if m is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age: give e.g. 30d, 12h, 2w")
    return float(m.group(1)) * _AGE_UNITS[m.group(2)]


def _size(text: str) -> int:
    try:
        return cache.parse_size(text)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--entries", action="store_true", help="a line per entry")
    parser.add_argument("--json", action="store_true", help="print JSON on stdout")
    parser.add_argument(
        "--kind",
        action="append",
        choices=cache.KINDS,
        help="only entries of this kind (repeatable)",
    )
    sub = parser.add_subparsers(dest="action", metavar="ACTION")
    p = sub.add_parser(
        "prune",
        help="remove entries by age, by total size, or what nothing current uses",
        description="Remove cache entries: --unused, --older-than AGE, --max-size SIZE "
        "(any together; at least one). Entries in use by another process are kept.",
    )
    p.add_argument("--unused", action="store_true", help="what no current recipe or lock uses")
    p.add_argument(
        "--older-than", metavar="AGE", type=parse_age, help="last used longer ago (30d, 12h)"
    )
    p.add_argument(
        "--max-size",
        metavar="SIZE",
        type=_size,
        help="least recently used first until the cache fits in SIZE (20G, 500M)",
    )
    p.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    p.add_argument("--json", action="store_true", dest="json_", help="print JSON on stdout")
    p.add_argument("--kind", action="append", dest="kind_", choices=cache.KINDS,
                   help="only entries of this kind (repeatable)")  # fmt: skip


def _ago(t: float, now: float) -> str:
    if not t:
        return "-"
    s = max(0.0, now - t)
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s / n:.0f}{unit} ago"
    return f"{s:.0f}s ago"


def run(args: argparse.Namespace) -> int:
    if getattr(args, "action", None) == "prune":
        return _prune(args)
    kinds = args.kind or cache.KINDS
    entries = cache.inventory(kinds)
    if args.json:
        json.dump({"root": str(util.cache_dir()), "cap": cache.max_size(),
                   "on_disk": entries.on_disk, "entries": [e.to_json() for e in entries]},
                  sys.stdout, indent=1)  # fmt: skip
        print()
        return 0
    now = time.time()
    total = entries.on_disk
    cap = cache.max_size()
    linked = max(0, total - sum(e.size for e in entries))
    print(f"{util.cache_dir()}: {cache.format_size(total)} on disk"
          + (f" (cap {cache.format_size(cap)})" if cap is not None else ""))  # fmt: skip
    if linked:
        print(
            f"  sizes are what removing an entry frees; {cache.format_size(linked)} more is in "
            "files hard-linked from several places (uv links its cache into environments)"
        )
    if args.entries:
        for e in sorted(entries, key=lambda e: (e.kind, -e.last_use)):
            flag = f"  unused: {e.why}" if e.unused else (f"  {e.why}" if e.why else "")
            print(f"  {e.kind:13} {cache.format_size(e.size):>10}  {_ago(e.last_use, now):>9}  "
                  f"{e.path.name}{flag}")  # fmt: skip
        return 0
    print(
        f"  {'kind':13} {'entries':>7} {'size':>10} {'last use':>9} {'unused':>7} {'unused size':>11}"
    )
    for kind in kinds:
        mine = [e for e in entries if e.kind == kind]
        if not mine:
            continue
        unused = [e for e in mine if e.unused]
        print(f"  {kind:13} {len(mine):7} {cache.format_size(sum(e.size for e in mine)):>10} "
              f"{_ago(max(e.last_use for e in mine), now):>9} {len(unused):7} "
              f"{cache.format_size(sum(e.size for e in unused)):>11}")  # fmt: skip
    return 0


def _prune(args: argparse.Namespace) -> int:
    if not (args.unused or args.older_than is not None or args.max_size is not None):
        raise UsageError("cache prune: say what to remove: --unused, --older-than AGE, "
                         "--max-size SIZE (see vllm-overlay cache --help)")  # fmt: skip
    kinds = args.kind_ or args.kind or cache.KINDS
    res = cache.prune(
        older_than=args.older_than,
        max_total=args.max_size,
        unused=args.unused,
        kinds=kinds,
        dry_run=args.dry_run,
        progress=util.info,
    )
    if args.json_ or args.json:
        json.dump({
            "dry_run": args.dry_run,
            "chosen": [e.to_json() for e in res.chosen],
            "removed": [e.to_json() for e in res.removed],
            "in_use": [e.to_json() for e in res.in_use],
            "total_before": res.total_before,
            "total_after": res.total_after,
        }, sys.stdout, indent=1)  # fmt: skip
        print()
        return 0
    now = time.time()
    if args.dry_run:
        for e in res.chosen:
            why = f" ({e.why})" if e.unused and e.why else ""
            print(f"would remove {e.kind:13} {cache.format_size(e.size):>10}  "
                  f"{_ago(e.last_use, now):>9}  {e.path}{why}")  # fmt: skip
        print(f"{len(res.chosen)} entries, {cache.format_size(res.total_before - res.total_after)}"
              f": {cache.format_size(res.total_before)} -> {cache.format_size(res.total_after)} "
              "(dry run: nothing removed)")  # fmt: skip
        return 0
    for e in res.in_use:
        print(f"kept (in use by another process): {e.kind} {e.path}")
    print(f"removed {len(res.removed)} entries, "
          f"{cache.format_size(res.total_before - res.total_after)}: "
          f"{cache.format_size(res.total_before)} -> {cache.format_size(res.total_after)}")  # fmt: skip
    return 0
