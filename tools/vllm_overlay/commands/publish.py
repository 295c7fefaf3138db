"""vllm-overlay publish: put built wheels on an internal package index."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit
from urllib.request import url2pathname

from vllm_overlay.errors import TestBuildError, UninstallableWheelError, UsageError
from vllm_overlay.index.auth import redact
from vllm_overlay.index.static import publish_to_directory
from vllm_overlay.index.upload import ServerIndex, server_index, upload_to_server
from vllm_overlay.index.wheels import PublishResult, WheelFile, read_wheels
from vllm_overlay.wheel.provenance import test_build_of
from vllm_overlay.wheel.verify import check_installable

HELP = "publish wheels to a static index directory or an index server"

DESCRIPTION = """\
Publish built wheels to an internal package index. --to decides where:

  a directory (or file:// URL)  a static PEP 503 + PEP 691 index: packages/ holds the wheels
                                and their PEP 658 .metadata files, simple/ the pages; serve
                                it with any web server or copy it to a bucket.
  an http:// or https:// URL    an index server (pypiserver, devpi, Artifactory) through the
                                standard upload API (twine). The simple API is read from
                                URL/simple/ unless --simple-url says otherwise.

A test build (`build --test-build`, version +ovl….test) is refused. Every wheel is first
checked as an installer would (member names inside the install,
RECORD complete with hashes and sizes, one .dist-info with WHEEL); one bad wheel stops
the whole publish before anything is written. A published file is never overwritten: the same file again is skipped, another file
under a published name is refused. Server credentials come from the URL's user part,
VLLM_OVERLAY_INDEX_USERNAME / VLLM_OVERLAY_INDEX_PASSWORD, TWINE_USERNAME /
TWINE_PASSWORD, ~/.netrc or keyring, and are never printed. See docs/publishing.md.

examples:
  vllm-overlay publish dist/*.whl --to /srv/pypi
  vllm-overlay publish dist/*.whl --to https://pypi.internal.example/
  vllm-overlay publish dist/*.whl --to https://devpi.internal.example/team/prod/ \\
      --simple-url https://devpi.internal.example/team/prod/+simple/
"""

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


@dataclass(frozen=True)
class PublishReport:
    """Where the wheels went and what happened to each."""

    index: str  # the directory, or the upload URL without credentials
    kind: Literal["directory", "server"]
    results: list[PublishResult]

    def count(self, action: str) -> int:
        return sum(1 for r in self.results if r.action == action)


def index_directory(to: str) -> Path | None:
    """The directory ``--to`` names, or None when it names a server."""
    parts = urlsplit(to)
    if parts.scheme in ("http", "https"):
        return None
    if parts.scheme == "file" and to.startswith("file:"):
        if parts.netloc not in ("", "localhost"):
            raise UsageError(f"--to {to}: a file:// URL must name a local path (file:///srv/pypi).")
        return Path(url2pathname(parts.path))
    if _SCHEME.match(to):
        raise UsageError(
            f"--to {redact(to)}: only directories, file:// and http(s):// URLs are "
            "supported. To publish to a bucket, publish to a directory and sync it "
            "(see docs/publishing.md)."
        )
    return Path(to)


def shippable(wheels: Sequence[WheelFile]) -> list[WheelFile]:
    """``wheels`` if none is a test build (``build --test-build``: this machine's one
    extension, no oneDNN; made for the engine tests); else refuse them all, naming each."""
    tests = [f"{w.path.name}: {why}" for w in wheels if (why := test_build_of(w.path))]
    if tests:
        raise TestBuildError(
            "refusing to publish test builds (made for the engine tests on the machine that "
            "built them, never for users):\n"
            + "\n".join(f"  - {t}" for t in tests)
            + "\nNothing was published. Publish the full build: `make build-wheel` "
            "(`vllm-overlay build`, without --test-build)."
        )
    return list(wheels)


def installable(wheels: Sequence[WheelFile]) -> list[WheelFile]:
    """``wheels`` if an installer would install every one; else refuse them all, naming each
    problem (before anything is written or uploaded)."""
    problems = [f"{w.path.name}: {p}" for w in wheels for p in check_installable(w.path)]
    if problems:
        shown = "\n".join(f"  - {p}" for p in problems[:25])
        more = f"\n  … and {len(problems) - 25} more" if len(problems) > 25 else ""
        raise UninstallableWheelError(
            f"refusing to publish: pip would not install these wheels ({len(problems)} "
            f"problem(s)):\n{shown}{more}\nNothing was published. Rebuild the wheels with "
            "`vllm-overlay build` and check them with `vllm-overlay verify`."
        )
    return list(wheels)


def publish(
    wheels: Sequence[str | os.PathLike[str]], to: str, *, simple_url: str | None = None
) -> PublishReport:
    """Publish ``wheels`` to the static index directory or index server ``to``."""
    directory = index_directory(to)
    if directory is not None and simple_url:
        raise UsageError("--simple-url applies to an index server; --to names a directory.")
    server: ServerIndex | None = None
    if directory is None:
        server = server_index(to, simple_url)
    checked = installable(shippable(read_wheels(wheels)))
    if server is not None:
        return PublishReport(server.upload_url, "server", upload_to_server(checked, server))
    assert directory is not None
    return PublishReport(str(directory), "directory", publish_to_directory(checked, directory))


def _text(report: PublishReport) -> str:
    width = max(len(r.action) for r in report.results)
    lines = [f"{r.action:<{width}} {r.filename} ({r.detail})" for r in report.results]
    lines.append(
        f"{report.count('published')} published, {report.count('skipped')} skipped: {report.index}"
    )
    return "\n".join(lines)


def _json(report: PublishReport) -> str:
    doc = {
        "index": report.index,
        "kind": report.kind,
        "published": report.count("published"),
        "skipped": report.count("skipped"),
        "files": [asdict(r) for r in report.results],
    }
    return json.dumps(doc, indent=2, sort_keys=True)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("wheels", nargs="+", metavar="WHEEL", help="wheel files to publish")
    parser.add_argument(
        "--to",
        required=True,
        metavar="DIR|URL",
        help="a directory (static index) or an http(s):// index server upload URL",
    )
    parser.add_argument(
        "--simple-url",
        metavar="URL",
        help="the server's simple API, to check what is already there (default: URL/simple/)",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON report on stdout")


def run(args: argparse.Namespace) -> int:
    report = publish(args.wheels, args.to, simple_url=args.simple_url)
    print(_json(report) if args.json else _text(report))
    return 0
