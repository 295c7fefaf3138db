"""The one error family of vllm-overlay, and every exception class of the tool.

Every expected failure is an ``OverlayError``: the CLI prints its message (no traceback)
and exits 1. A message names what was expected, what was found, and what to do next. One
class per condition, each with a docstring; a stage's own conditions derive from its base
(``BuildError`` for the wheels, ``SuiteError`` for the tests, ``RebaseError`` for a rebase).
No module defines an exception class anywhere else (``tests/unit/test_house.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


class OverlayError(Exception):
    """An expected failure; the message tells the user what to do."""

    exit_code = 1


class UsageError(OverlayError):
    """The command line or the arguments do not make sense."""

    exit_code = 2


class CommandError(OverlayError):
    """A subprocess failed; carries the command, return code and output."""

    def __init__(
        self, cmd: tuple[str, ...], returncode: int, stdout: str, stderr: str, hint: str = ""
    ) -> None:
        self.cmd = cmd
        self.returncode = returncode
        self.stdout = stdout
        self.stderr = stderr
        self.hint = hint
        super().__init__(self._render())

    def _render(self) -> str:
        def block(name: str, text: str) -> str:
            text = text.rstrip()
            if not text:
                return f"{name}: (none)"
            lines = text.splitlines()
            if len(lines) > 40:
                lines = ["...", *lines[-40:]]
            return f"{name}:\n" + "\n".join("    " + line for line in lines)

        parts = [
            f"command failed: {' '.join(self.cmd)}",
            f"return code: {self.returncode}",
            block("stdout", self.stdout),
            block("stderr", self.stderr),
        ]
        if self.hint:
            parts.append(self.hint)
        return "\n".join(parts)


class CommandTimeout(CommandError):
    """A child ran past its time limit and was stopped (its process group: SIGINT, SIGTERM,
    then SIGKILL; ``process.stop``)."""


class LockFileError(OverlayError):
    """upstream.lock is missing, unreadable or inconsistent."""


class OverlayConfigError(OverlayError):
    """overlay/overlay.toml is invalid; the message points at the bad key."""


class IntegrityError(OverlayError):
    """A downloaded or cached file does not have the pinned sha256 or size."""


class IndexError_(OverlayError):
    """The package index is unreachable or lacks the file."""


class IndexAuthError(IndexError_):
    """The package index answered 401/403; the message says where credentials were sought."""


class DownloadError(OverlayError):
    """A download failed or was interrupted; nothing partial was kept."""


class BaseMismatchError(OverlayError):
    """An upstream file in the checkout differs from the hash pinned in upstream.lock."""


class PatchError(OverlayError):
    """A patch does not apply exactly."""


class CheckoutError(OverlayError):
    """The checkout is missing, dirty, or not one this tool made."""


class UnsafePathError(OverlayError):
    """An overlay path escapes the tree, is absolute, or passes through a symlink."""


class BusyError(OverlayError):
    """Another vllm-overlay process holds the lock on this cache or checkout."""


class ExportMismatchError(OverlayError):
    """export --check: the committed overlay differs from what export would write."""


class StaleCheckoutError(OverlayError):
    """export: the checkout has nothing of the user's, and overlay/ changed since it was
    applied (a pull, a merge): exporting it would only write the older changes back."""


class BuildError(OverlayError):
    """A wheel could not be built or failed verification."""


class PreflightError(BuildError):
    """The build environment cannot produce the wheel asked for; nothing was built."""


class WrongTargetError(BuildError):
    """vLLM's setup.py built something other than the CUDA wheel asked for (e.g. +cpu)."""


class VerifyError(BuildError):
    """A wheel failed verification; the message lists each failing member and check."""

    max_shown = 25  # problems listed; the rest are counted

    def __init__(self, path: Path, problems: Sequence[str]) -> None:
        self.path = path
        self.problems = list(problems)
        shown = self.problems[: self.max_shown]
        more = len(self.problems) - len(shown)
        text = "\n".join(f"  - {p}" for p in shown)
        if more:
            text += f"\n  … and {more} more"
        super().__init__(
            f"{path.name} failed verification ({len(self.problems)} problem(s)):\n{text}\n"
            "Do not publish this wheel. Rebuild it with `vllm-overlay build`; if the problem "
            "persists, it is a bug in the build (report it with this output)."
        )


class ZipFormatError(BuildError):
    """A zip archive is malformed or uses a feature this writer does not copy."""


class PublishError(OverlayError):
    """A wheel could not be published."""


class UninstallableWheelError(PublishError):
    """A wheel an installer would refuse (unsafe member names, RECORD, .dist-info, WHEEL)."""


class TestBuildError(PublishError):
    """A test build (``build --test-build``: one extension, no oneDNN) asked to be published."""

    __test__ = False  # not a test class, whatever pytest's collector thinks of its name


class BuildEnvError(OverlayError):
    """The build environment cannot be built from its constraints file."""


class EngineEnvError(OverlayError):
    """The engine environment of a wheel cannot be built (a pinned package is missing)."""


class ClientEnvError(OverlayError):
    """The client environment cannot be built (the requirement is not one pinned version, or
    the index lacks a package)."""


class SuiteError(OverlayError):
    """The test suite could not be run or found new failures."""


class JunitError(SuiteError):
    """A JUnit XML report is missing, unreadable or not pytest's."""


class CorruptBaseline(SuiteError):
    """A cached baseline that cannot be trusted; it is rebuilt."""


class RebaseError(OverlayError):
    """A rebase stopped: conflict, collision, or an upstream fix that does not hold."""


class ResolutionNotProvenError(RebaseError):
    """A person's resolution of a stop fails the change's tests: it is not recorded."""


class RebaseInProgressError(RebaseError):
    """A rebase is stopped in this project; it must be continued or aborted first."""


class NoRebaseError(RebaseError):
    """--continue or --abort without a rebase in progress."""


class ReleaseError(UsageError):
    """A release that cannot be a target (no sdist, yanked, not on the index)."""


class TrackError(OverlayError):
    """The tracking run could not start (the project is not in git, …)."""


class ChangeImportError(OverlayError):
    """An upstream change could not be imported: bad patch, unreachable host, or a stop."""


class UpstreamError(OverlayError):
    """A change of ours cannot be prepared for upstream (it overlaps an earlier change, names
    our overlay, or its proof failed: the tests, the hooks); the message names what."""


def missing_program(program: object, error: OSError) -> OverlayError:
    """The error for a child process whose program does not exist (``process``, the one
    runner, and the git layer's GitPython)."""
    return OverlayError(
        f"{program} is not installed or not on PATH ({error}). Install it and try again."
    )
