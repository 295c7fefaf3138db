"""vllm-overlay verify: check a built wheel against its RECORD, its provenance and the overlay."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_overlay.commands._options import add_index_url
from vllm_overlay.errors import BuildError, OverlayError, UsageError
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay.project import Project, find_project
from vllm_overlay.util import info
from vllm_overlay.wheel.build import expectation_for
from vllm_overlay.wheel.provenance import read_from_wheel
from vllm_overlay.wheel.verify import verify_wheel

HELP = "verify a built wheel: zip, RECORD, METADATA, provenance, the overlay's files, install"
DESCRIPTION = """\
Check a wheel built by `vllm-overlay build` (every build runs the same checks):

  zip         the archive reads, no member twice, every CRC holds
  record      every member's sha256 and size match RECORD, and RECORD lists every member
  dist-info   exactly one .dist-info, named for the file name's version
  metadata    METADATA's Version is the file name's
  provenance  the .dist-info/vllm_overlay.json record is there and agrees with METADATA and
              vllm/_version.py
  changes     (in a project) the changed members are the patched tree's files, files that
              are not wheel content (tests/) are absent, the record names this overlay
  official    (repack) every other member is byte-identical to the official wheel's;
              (precompiled) the compiled members are
  install     `pip install --no-deps --target` into a temporary directory works and
              importlib.metadata reports the wheel's version there

A failed check names the member and what differs; the exit status is then 1.
"""


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("wheel", type=Path, metavar="WHEEL")
    p.add_argument(
        "--standalone",
        action="store_true",
        help="check the wheel on its own, without comparing it with the project's overlay",
    )
    p.add_argument("--no-install", action="store_true", help="skip the pip install check")
    add_index_url(p)


def _project() -> Project | None:
    try:
        return find_project()
    except OverlayError:
        return None


def run(args: argparse.Namespace) -> int:
    path: Path = args.wheel
    if not path.is_file():
        raise UsageError(f"{path}: no such file")
    expect = None
    if not args.standalone:
        project = _project()
        if project is None:
            info("no overlay project here: checking the wheel on its own (--standalone)")
        else:
            try:
                doc = read_from_wheel(path)
            except BuildError:
                doc = None  # verify_wheel reports what is wrong with it
            expect = expectation_for(project, doc, settings=Settings.from_options(args))
    result = verify_wheel(path, expect, install=not args.no_install)
    for check in result.passed:
        print(f"ok  {check}")
    for note in result.notes:
        print(f"note: {note}")
    print(f"{path}: verified ({result.version})")
    return 0
