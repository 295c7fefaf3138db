"""The output directory and the scratch space of a build: finding a wheel already built from
the same inputs, placing a new one without ever replacing another file, and a private
temporary directory under ``.work/build``."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from vllm_overlay.errors import BuildError
from vllm_overlay.util import link_new
from vllm_overlay.wheel.provenance import read_from_wheel


def up_to_date(out: Path, distribution: str, version: str, key: str) -> Path | None:
    """A wheel of ``distribution`` ``version`` in ``out`` whose provenance has build key
    ``key`` (built from exactly these inputs), if there is one."""
    for path in sorted(out.glob(f"{distribution}-{version}-*.whl")):
        try:
            doc = read_from_wheel(path)
        except BuildError:
            continue
        if doc is not None and doc.get("build_key") == key:
            return path
    return None


def describe_difference(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> str:
    if old is None:
        return "it has no vllm-overlay provenance record"
    keys = sorted(k for k in set(old) | set(new) if k != "build_key" and old.get(k) != new.get(k))
    return "its provenance differs in: " + ", ".join(keys) if keys else "other bytes"


def refusal(dest: Path, provenance: Mapping[str, Any]) -> BuildError:
    """The error for ``dest``, a file that exists and was not built from these inputs."""
    try:
        old = read_from_wheel(dest)
    except BuildError:
        old = None
    return BuildError(
        f"{dest} already exists and was not built from these inputs "
        f"({describe_difference(old, provenance)}). It is never overwritten: a version "
        "must not name two different wheels. Move it away (or build into another --out), "
        "or bump `revision` in overlay/overlay.toml if the overlay changed."
    )


def place(tmp: Path, dest: Path, provenance: Mapping[str, Any]) -> bool:
    """Put ``tmp`` at ``dest`` without ever replacing another file; False if identical."""
    try:
        return link_new(tmp, dest)
    except FileExistsError:
        raise refusal(dest, provenance) from None


@contextlib.contextmanager
def scratch(work_dir: Path) -> Iterator[Path]:
    """A private temporary directory under ``<work_dir>/build``, removed afterwards (also on
    ^C); leftovers of a killed build are removed first."""
    root = work_dir / "build"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob("tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)  # left by a killed build
    tmp = Path(tempfile.mkdtemp(prefix="tmp-", dir=root))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
