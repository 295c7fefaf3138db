"""vllm-overlay testenv: build (or show) the CPU environment vLLM's tests run in."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_overlay import util
from vllm_overlay.envs import clientenv, enginenv, freeze, testenv
from vllm_overlay.envs.envbuild import RecipeJson
from vllm_overlay.errors import UsageError
from vllm_overlay.overlay.project import find_project

HELP = "build or show the environment vLLM's tests run in (from a tree, or a built wheel)"
DESCRIPTION = """\
Build, or find in the cache, the virtualenv in which vLLM's own tests run from a source
tree (--tree: vLLM comes from the tree through PYTHONPATH; it is not installed in the env),
or the engine environment with a built wheel installed (--wheel: our vllm-cpu wheel, for
the engine tests; see docs/engine.md).

It holds a CPU build of torch (see docs/testenv.md for which and why), the requirement
lines of the tree's requirements/common.txt, pytest and the test tooling vLLM's tests
import, a generated plugin that selects vLLM's CPU platform, and a config-only Hugging
Face cache for the models the unit tests read configs of. It lives under
$VLLM_OVERLAY_CACHE/testenv/<recipe hash> and is rebuilt only when its recipe changes.

It is built with uv (installed with this tool) where uv is there, else with pip, and holds
exactly the packages pinned in the project's constraints/testenv-<name>-<version>.txt for
the tree's release; without that file the requirements are resolved freely (and it says so).
--freeze resolves freely and writes that file (commit it). See docs/testenv.md.

With --wheel the environment holds the wheel and its requirements (torch's +cpu pin replaced
by the same release from the index), pinned by constraints/engine-<dist>-<version>.txt, plus
any --extra local package (the engine tests' probe plugin) and --with requirement from the
index, pinned (hs-connectors==0.9.0); --freeze writes that file.

Prints the environment's directory (with --freeze: the constraints file) on stdout.
"""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--tree",
        metavar="DIR",
        type=Path,
        help="the vLLM source tree whose requirements/common.txt the environment follows "
        "(required until the pinned checkout can be found by default)",
    )
    parser.add_argument(
        "--wheel",
        metavar="WHEEL",
        type=Path,
        help="build the engine environment of this built wheel instead (e.g. dist/vllm_cpu-…whl)",
    )
    parser.add_argument(
        "--extra",
        metavar="DIR",
        type=Path,
        action="append",
        default=[],
        help="with --wheel: a local package to install beside it (repeatable)",
    )
    parser.add_argument(
        "--with",
        dest="with_",
        metavar="NAME==VERSION",
        action="append",
        default=[],
        help="with --wheel: a package from the index to install beside it, pinned (repeatable)",
    )
    parser.add_argument(
        "--client",
        metavar="NAME==VERSION",
        help="build the client environment of this pipeline instead (speculators==0.9.0: "
        "no vLLM in it; it talks to `vllm serve`); --freeze pins it, with the engine "
        "environment's torch",
    )
    parser.add_argument(
        "--rebuild", action="store_true", help="build it anew even when a complete one exists"
    )
    parser.add_argument(
        "--freeze",
        action="store_true",
        help="resolve the requirements freely, build that environment, and write the set it "
        "got to the project's constraints/testenv-<name>-<version>.txt (commit it)",
    )
    parser.add_argument(
        "--print-recipe",
        action="store_true",
        help="print the recipe and its hash as JSON; build nothing",
    )


def run(args: argparse.Namespace) -> int:
    if args.client is not None:
        return _client(args)
    if args.wheel is not None:
        return _engine(args)
    tree: Path | None = args.tree
    if tree is None:
        raise UsageError("pass --tree DIR: the vLLM source tree the tests will run from.")
    if not tree.is_dir():
        raise UsageError(f"--tree {tree}: not a directory. Pass the root of a vLLM source tree.")
    if args.print_recipe:
        return _print_recipe(testenv.recipe(tree))
    if args.freeze:
        print(freeze.freeze_testenv(tree, find_project(), rebuild=args.rebuild))
        return 0
    env = testenv.ensure_testenv(tree, rebuild=args.rebuild)
    util.info(f"testenv: python {env.python}, torch {env.torch_version}")
    print(env.path)
    return 0


def _engine(args: argparse.Namespace) -> int:
    wheel: Path = args.wheel
    if args.tree is not None:
        raise UsageError("pass --tree DIR or --wheel WHEEL, not both.")
    if not wheel.is_file() or wheel.suffix != ".whl":
        raise UsageError(f"--wheel {wheel}: not a wheel file (a built dist/*.whl).")
    for extra in args.extra:
        if not (extra / "pyproject.toml").is_file():
            raise UsageError(f"--extra {extra}: not a package directory (no pyproject.toml).")
    if args.print_recipe:
        return _print_recipe(enginenv.recipe(wheel, args.extra, requirements=args.with_))
    if args.freeze:
        print(freeze.freeze_engine(wheel, args.extra, args.with_, find_project(),
                                   rebuild=args.rebuild))  # fmt: skip
        return 0
    env = enginenv.ensure_engine_env(
        wheel, args.extra, requirements=args.with_, rebuild=args.rebuild
    )
    util.info(f"enginenv: python {env.python}, vllm {env.vllm_version}, torch {env.torch_version}")
    print(env.path)
    return 0


def _client(args: argparse.Namespace) -> int:
    if args.tree is not None or args.wheel is not None:
        raise UsageError("pass --client REQ alone (not with --tree or --wheel).")
    if args.print_recipe:
        return _print_recipe(clientenv.recipe(args.client, pinned=not args.freeze))
    if args.freeze:
        print(freeze.freeze_client(args.client, find_project(), rebuild=args.rebuild))
        return 0
    env = clientenv.ensure_client_env(args.client, rebuild=args.rebuild)
    print(env.path)
    return 0


def _print_recipe(rec: RecipeJson) -> int:
    """--print-recipe: the recipe and its hash as JSON; nothing is built."""
    doc = {"hash": rec.hash, "recipe": json.loads(rec.to_json())}
    sys.stdout.write(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return 0
