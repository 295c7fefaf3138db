"""The one error family of vllm-overlay.

Every expected failure is an ``OverlayError``: the CLI prints its message (no traceback)
and exits 1. A message names what was expected, what was found, and what to do next.
"""

from __future__ import annotations


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


class BuildError(OverlayError):
    """A wheel could not be built or failed verification."""


class PublishError(OverlayError):
    """A wheel could not be published."""


class UninstallableWheelError(PublishError):
    """A wheel an installer would refuse (unsafe member names, RECORD, .dist-info, WHEEL)."""


class TestBuildError(PublishError):
    """A test build (``build --test-build``: one extension, no oneDNN) asked to be published."""

    __test__ = False  # not a test class, whatever pytest's collector thinks of its name


class SuiteError(OverlayError):
    """The test suite could not be run or found new failures."""


class RebaseError(OverlayError):
    """A rebase stopped: conflict, collision, or an upstream fix that does not hold."""


class ResolutionNotProvenError(RebaseError):
    """A person's resolution of a stop fails the change's tests: it is not recorded."""


class ChangeImportError(OverlayError):
    """An upstream change could not be imported: bad patch, unreachable host, or a stop."""


def missing_program(program: object, error: OSError) -> OverlayError:
    """The error for a child process whose program does not exist (``process``, the one
    runner, and the git layer's GitPython)."""
    return OverlayError(
        f"{program} is not installed or not on PATH ({error}). Install it and try again."
    )
