"""vllm-overlay build: the overlay's vLLM wheel, verified, in dist/."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_overlay.commands._options import add_index_url
from vllm_overlay.errors import UsageError
from vllm_overlay.overlay.project import find_project
from vllm_overlay.util import info
from vllm_overlay.wheel.build import DEFAULT_PLATFORM, STRATEGIES, BuildOptions, build
from vllm_overlay.wheel.setupbuild import LAUNCHERS, SRC_DIR_VARS, TARGET_DEVICES, SourceSettings

HELP = "build the vLLM wheel with the overlay (repack, precompiled or source) and verify it"
DESCRIPTION = f"""\
Build vLLM <release>+ovl.<revision>.g<digest> with the overlay, verify it, and put it in
--out (default dist/). The wheel's path is the last line printed.

strategies (--strategy, default auto):
  repack       the official wheel pinned in upstream.lock with the changed Python files
               put in; every other member copied byte for byte (seconds)
  precompiled  vLLM's setup.py on the patched tree with the official wheel's kernels
               (VLLM_USE_PRECOMPILED=1); needs --python with a CUDA torch (a minute)
  source       the full CMake/nvcc build on a build machine (hours; see docs/building.md)
  auto         repack when every changed path is Python the wheel carries; precompiled
               when setup.py inputs (requirements/, setup.py, package data) change;
               source when csrc/, cmake/, CMakeLists.txt or rust/ change. It says which.

The same inputs give a byte-identical wheel; when --out already holds the wheel of these
inputs, nothing is done. A file of the same name with other content is never replaced.

The version keeps the release (`vllm==X.Y.Z` is satisfied) and adds a local label that
changes with the overlay and sorts by overlay.toml's `revision`. vLLM hashes
vllm.__version__ into NIXL handshakes and its compile cache: to mix with stock nodes, pass
--keep-release-version (vllm.__version__ stays the release; the wheel's version does not).

source-build settings are vLLM's own: TORCH_CUDA_ARCH_LIST, MAX_JOBS, NVCC_THREADS,
CMAKE_BUILD_TYPE, the compiler launcher (sccache with a shared remote cache scales past one
machine; its SCCACHE_* settings pass through), and local directories for the dependencies
CMake would otherwise clone (--src-dir NAME=DIR, NAME one of
{", ".join(SRC_DIR_VARS)}; --fetchcontent-dir).
--dry-run prints the strategy, the exact environment and command, and the preflight result.
"""


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", choices=STRATEGIES, default="auto", help="default: auto")
    p.add_argument("--out", type=Path, default=Path("dist"), help="output directory (dist)")
    p.add_argument(
        "--keep-release-version",
        action="store_true",
        help="keep vllm.__version__ at the release (for clusters mixing with stock vLLM)",
    )
    p.add_argument(
        "--platform",
        default=DEFAULT_PLATFORM,
        help=f"which official wheel to start from (default {DEFAULT_PLATFORM})",
    )
    p.add_argument(
        "--python",
        metavar="PATH",
        help="interpreter of the build environment for precompiled/source "
        "(default: the one running vllm-overlay)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan; build nothing")
    add_index_url(p)
    s = p.add_argument_group("source builds")
    s.add_argument(
        "--cuda-arch-list", metavar="LIST", help='TORCH_CUDA_ARCH_LIST, e.g. "9.0a 10.0a"'
    )
    s.add_argument("--max-jobs", type=int, metavar="N", help="MAX_JOBS (compile jobs)")
    s.add_argument("--nvcc-threads", type=int, metavar="N", help="NVCC_THREADS")
    s.add_argument(
        "--cmake-build-type", default="Release", metavar="TYPE", help="CMAKE_BUILD_TYPE (Release)"
    )
    s.add_argument("--launcher", choices=LAUNCHERS, default="auto", help="compiler launcher")
    s.add_argument(
        "--src-dir",
        action="append",
        default=[],
        metavar="NAME=DIR",
        help=f"build a dependency from DIR ({', '.join(SRC_DIR_VARS)})",
    )
    s.add_argument("--fetchcontent-dir", type=Path, metavar="DIR", help="FETCHCONTENT_BASE_DIR")
    s.add_argument(
        "--target-device",
        choices=TARGET_DEVICES,
        default="cuda",
        help="empty: a wheel without kernels, to check the build driver on a machine "
        "without CUDA (its version says .empty)",
    )


def _src_dirs(items: list[str]) -> dict[str, Path]:
    out = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or name not in SRC_DIR_VARS or not path:
            raise UsageError(
                f"--src-dir {item!r}: expected NAME=DIR with NAME one of {', '.join(SRC_DIR_VARS)}"
            )
        out[name] = Path(path).absolute()
    return out


def options(args: argparse.Namespace) -> BuildOptions:
    settings = SourceSettings(
        cuda_arch_list=args.cuda_arch_list,
        max_jobs=args.max_jobs,
        nvcc_threads=args.nvcc_threads,
        cmake_build_type=args.cmake_build_type,
        launcher=args.launcher,
        src_dirs=_src_dirs(args.src_dir),
        fetchcontent_dir=args.fetchcontent_dir.absolute() if args.fetchcontent_dir else None,
        target_device=args.target_device,
    )
    return BuildOptions(
        strategy=args.strategy,
        out=args.out,
        keep_release_version=args.keep_release_version,
        platform=args.platform,
        index_url=args.index_url,
        python=args.python or sys.executable,
        source=settings,
        dry_run=args.dry_run,
    )


def run(args: argparse.Namespace) -> int:
    result = build(find_project(), options(args))
    if args.dry_run:
        print(result.dry_run_text)
        return 0
    assert result.path is not None
    if result.up_to_date:
        info(f"up to date: {result.path.name} was built from these same inputs; nothing to do")
    else:
        checks = ", ".join(result.verified.passed) if result.verified else "none"
        info(f"built {result.path.name} ({result.strategy}, {result.seconds:.1f} s)")
        info(f"verified: {checks}")
    print(result.path)
    return 0
