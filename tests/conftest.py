"""Shared fixtures: an isolated environment, a synthetic upstream with a real index server on
loopback, an overlay project pinned to it, and an in-process CLI runner."""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from isolation import REAL_HOME, isolate  # noqa: E402,F401
from synthetic import ADDED_TEST, CONNECTOR, IndexServer, Upstream, make_upstream, release_files  # noqa: E402
from vllm_overlay.main import main  # noqa: E402

# Fixtures shared by unit and integration tests.
pytest_plugins = [
    "expected_skips",  # under CI=true a skip it does not list fails the run
    "fixtures_publish",
    "fixtures_build",
    "fixtures_cpusource",
    "engine.fixtures_engine",
]


def pytest_addoption(parser):
    parser.addoption(
        "--releases",
        action="store_true",
        help="also run the tests marked `releases` (further real vLLM releases, each in a test "
        "environment of its own): `make test-releases`",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--releases"):
        return
    from expected_skips import RELEASES_REASON  # (a plugin: pytest imports it first)

    skip = pytest.mark.skip(reason=RELEASES_REASON)
    for item in items:
        if item.get_closest_marker("releases"):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def isolated_env(tmp_path_factory, monkeypatch, request):
    """No test reads or writes the real $HOME or cache; git runs without user config.

    Tests marked ``network`` keep the real cache (~/.cache/vllm-overlay) so the real release
    artifacts are downloaded once per machine.
    """
    network = request.node.get_closest_marker("network") is not None
    isolate(monkeypatch, tmp_path_factory, network)
    yield


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def real_tree(tmp_path_factory) -> Path:
    """The pristine pinned vLLM tree (upstream.lock), as `vllm-overlay apply` makes it; made
    once per session (network tests only: it reads the real cache)."""
    from vllm_overlay.overlay.checkout import apply_overlay
    from vllm_overlay.pin.lockfile import read_lock

    with pytest.MonkeyPatch.context() as mp:
        isolate(mp, tmp_path_factory, network=True)
        dest = tmp_path_factory.mktemp("real-tree") / "vllm"
        return apply_overlay(read_lock(REPO / "upstream.lock"), None, dest).checkout


@pytest.fixture(scope="session")
def real_testenv(real_tree, tmp_path_factory):
    """The CPU test environment of the pinned release (pinned by the project's constraints/),
    built or found once per session and shared by every integration test that runs vLLM's
    tests."""
    from vllm_overlay.envs.testenv import ensure_testenv

    with pytest.MonkeyPatch.context() as mp:
        isolate(mp, tmp_path_factory, network=True)
        mp.setenv("VLLM_OVERLAY_PROJECT", str(REPO))  # its constraints/ pin the set
        return ensure_testenv(real_tree)


@dataclass
class Result:
    rc: int
    out: str
    err: str


def run_cli(*args: str | os.PathLike[str], cwd: Path | None = None) -> Result:
    """Run vllm-overlay in-process (as the console script would) and capture its output."""
    out, err = io.StringIO(), io.StringIO()
    old = os.getcwd()
    try:
        if cwd:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                rc = main([str(a) for a in args])
            except SystemExit as e:  # argparse usage errors
                rc = e.code if isinstance(e.code, int) else 2
    finally:
        os.chdir(old)
    return Result(rc, out.getvalue(), err.getvalue())


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def upstream(tmp_path_factory) -> Upstream:
    return make_upstream(tmp_path_factory.mktemp("synthetic"))


@pytest.fixture
def index(upstream: Upstream):
    with IndexServer(upstream.repo.parent / "dist") as srv:
        yield srv


def unified(path: str, old: str, new: str) -> str:
    return "".join(
        difflib.unified_diff(
            old.splitlines(keepends=True),
            new.splitlines(keepends=True),
            fromfile=f"a/{path}",
            tofile=f"b/{path}",
        )
    )


FIXED_CONNECTOR_SNIPPET = (
    "        self._block_size = cache_config.block_size\n",
    "        # Use the hidden-states group's own block size.\n"
    "        self._block_size = getattr(cache_config, 'group_block_size', cache_config.block_size)\n",
)

OVERLAY_TOML = '''\
# One [[change]] per fix we carry on top of upstream vLLM.
[[change]]
id = "group-block-size"
title = "Read the hidden-states block size from its own group"
why = """Synthetic stand-in for the hybrid hidden-states fix."""
origin = "https://github.com/vllm-project/vllm/pull/46301"
origin_kind = "backport"
bugs = ["https://github.com/vllm-project/speculators/issues/613"]
drop_when = "vllm>=1.3.0"
files = [
    "{connector}",
    "{added}",
]
tests = ["{added}"]
'''

ADDED_TEST_BODY = """\
def test_group_block_size():
    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        Connector,
    )

    class C:
        block_size = 528
        group_block_size = 22

    assert Connector(C()).slots([1])[0] == 22
"""


CID = "group-block-size"


@dataclass
class Proj:
    root: Path
    upstream: Upstream
    index: IndexServer

    @property
    def lock(self) -> Path:
        return self.root / "upstream.lock"

    @property
    def overlay(self) -> Path:
        return self.root / "overlay"

    def change_file(self, rel: str, change: str = CID) -> Path:
        return change_file(self.overlay, rel, change)

    def pin(self, version: str = "1.0.0") -> Result:
        commit = self.upstream.releases[version].commit
        return run_cli(
            "lock", "--version", version, "--commit", commit, "--index-url", self.index.url,
            cwd=self.root,
        )  # fmt: skip


def change_file(overlay: Path, rel: str, change: str = CID) -> Path:
    """``overlay/<change>/<rel>``: a change's patch (``PATH.patch``) or added file (``PATH``)."""
    return overlay / change / rel


def write_overlay(root: Path, version: str = "1.0.0", *, legacy: bool = False) -> None:
    """The one-change overlay; ``legacy``: in the older one-change-per-file layout."""
    ov = root / "overlay"
    ov.mkdir(parents=True, exist_ok=True)
    (ov / "overlay.toml").write_text(OVERLAY_TOML.format(connector=CONNECTOR, added=ADDED_TEST))
    old = release_files(version)[CONNECTOR]
    new = old.replace(*FIXED_CONNECTOR_SNIPPET)
    assert new != old
    where = ov if legacy else ov / CID
    for rel, text in (
        (CONNECTOR + ".patch", unified(CONNECTOR, old, new)),
        (ADDED_TEST, ADDED_TEST_BODY),
    ):
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        (where / rel).write_text(text)


# Lock texts pinned by the real `vllm-overlay lock` in this process, by (upstream, version).
# The lock records no index URL, so the next project pinned to the same release gets the
# same file without pinning again; the lock command itself is tests/unit/test_lock_and_fetch.py.
_PINNED: dict[tuple[str, str], str] = {}


def _pin(p: Proj, version: str) -> None:
    key = (str(p.upstream.repo), version)
    if key in _PINNED:
        p.lock.write_text(_PINNED[key])
        return
    res = p.pin(version)
    assert res.rc == 0, res.err
    _PINNED[key] = p.lock.read_text()


@pytest.fixture
def project(tmp_path: Path, upstream: Upstream, index: IndexServer) -> Proj:
    """An overlay project with one change (a patch and an added test) pinned to 1.0.0."""
    root = tmp_path / "project"
    root.mkdir()
    write_overlay(root)
    p = Proj(root=root, upstream=upstream, index=index)
    _pin(p, "1.0.0")
    # Start every test from an empty cache and a fresh request log.
    shutil.rmtree(os.environ["VLLM_OVERLAY_CACHE"], ignore_errors=True)
    index.requests.clear()
    return p


@contextlib.contextmanager
def pinned_project(upstream: Upstream, root: Path, version: str = "1.0.0"):
    """An overlay project at ``root`` pinned to ``upstream``'s ``version``, with its own index."""
    with IndexServer(upstream.repo.parent / "dist") as srv:
        root.mkdir()
        write_overlay(root)
        p = Proj(root=root, upstream=upstream, index=srv)
        _pin(p, version)
        yield p


def pip_install_target(wheel: Path, target: Path) -> None:
    """A real `pip install --no-deps --target`, offline and ignoring the user's pip config."""
    subprocess.run(
        [sys.executable, "-m", "pip", "--isolated", "install", "-q", "--no-deps", "--no-index",
         "--no-compile", "--target", str(target), str(wheel)],
        check=True,
    )  # fmt: skip


def git_out(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.strip()


def tree_snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root (including .git internals) -> bytes: to prove nothing changed."""
    snap = {}
    if not root.exists():
        return snap
    for dirpath, _dirs, files in os.walk(root):
        for f in files:
            p = Path(dirpath) / f
            if p.is_symlink():
                snap[str(p.relative_to(root))] = b"->" + os.readlink(p).encode()
            else:
                snap[str(p.relative_to(root))] = p.read_bytes()
    return snap
