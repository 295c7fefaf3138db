"""GitPython's command object on the one runner: every git child starts in ``process.py``.

GitPython builds git's argument lists and parses what git prints; ``Git.execute``, the one
place it starts a child, is ours (docs/design.md, "Git layer"):

- a git that GitPython waits for (``repo.git.X(...)``, ``merge-base``, our ``run_git``) runs
  through ``process.run_bytes``: a process group of its own, ``GIT_TIMEOUT`` (or the caller's
  ``kill_after_timeout``), and SIGINT, SIGTERM then SIGKILL to the group when the time runs
  out or the tool is interrupted;
- a git it reads as a stream (a diff) runs to its end the same way and is handed over
  finished (``_Finished``);
- its persistent ``cat-file --batch`` readers (one pair per ``Repo``, fed object ids for as
  long as the ``Repo`` is open) start through ``process.start``, in a group of their own, and
  are stopped by ``process.stop`` when the ``Repo`` closes (``_GroupStop``). They have no time
  limit: a reader lives as long as its ``Repo``.
"""

from __future__ import annotations

import io
import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import Any

import git as gitpython
from git.exc import GitCommandError

from vllm_overlay import process
from vllm_overlay.errors import OverlayError
from vllm_overlay.process import BytesOutput

# Hang guards, not times a machine must meet (docs/design.md, "Git layer"): the slowest local
# git here, a checkout of vLLM's ~4,000 files, takes seconds; a depth-1 fetch is tens of MB.
GIT_TIMEOUT = 1800.0
NETWORK_TIMEOUT = 900.0


def _environ(g: gitpython.Git, env: Mapping[str, str] | None) -> dict[str, str]:
    """What GitPython gives its children: this environment, C messages, ``g``'s variables
    (``git_env``), then ``env``."""
    return {**os.environ, "LANGUAGE": "C", "LC_ALL": "C", **g.environment(), **(env or {})}


def _cwd(g: gitpython.Git) -> str | None:
    where = g.working_dir or os.getcwd()
    return str(where) if os.access(str(where), os.X_OK) else None


def run_in(
    g: gitpython.Git, argv: Sequence[str], input: bytes | None, env: Mapping[str, str] | None,
    timeout: float | None, hint: str = "",
) -> BytesOutput:  # fmt: skip
    """``argv`` (``git …``) through the one runner, in ``g``'s directory and environment."""
    return process.run_bytes(*argv, cwd=_cwd(g), env=_environ(g, env), check=False,
                             input=input, hint=hint, timeout=timeout)  # fmt: skip


class _Finished:
    """A git that ran to its end, shaped as the ``Popen`` GitPython reads a stream from."""

    def __init__(self, args: Sequence[str], out: BytesOutput) -> None:
        self.args, self.returncode, self.stdin = list(args), out.returncode, None
        self.stdout = io.BytesIO(out.stdout)
        self.stderr = io.BytesIO(out.stderr.encode(errors="surrogateescape"))

    def poll(self) -> int:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode

    def terminate(self) -> None:
        pass


class _GroupStop:
    """A running git as GitPython's wrapper sees it (every attribute the ``Popen``'s), whose
    ``terminate`` is the runner's stop: its group gets SIGINT, SIGTERM, then SIGKILL."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self._proc = proc

    def __getattr__(self, name: str) -> Any:
        return getattr(self._proc, name)

    def terminate(self) -> None:
        process.stop(self._proc)


class Git(gitpython.Git):
    """GitPython's command object with every child started by the one runner (the module's
    docstring): GitPython builds the argument list and reads the result, process.py runs it."""

    def execute(  # type: ignore[override]
        self,
        command: str | Sequence[Any],
        istream: Any = None,
        with_extended_output: bool = False,
        with_exceptions: bool = True,
        as_process: bool = False,
        output_stream: Any = None,
        stdout_as_string: bool = True,
        kill_after_timeout: float | None = None,
        with_stdout: bool = True,
        universal_newlines: bool = False,
        shell: bool | None = None,
        env: Mapping[str, str] | None = None,
        max_chunk_size: int = io.DEFAULT_BUFFER_SIZE,
        strip_newline_in_stdout: bool = True,
        **subprocess_kwargs: Any,
    ) -> Any:
        argv = [command] if isinstance(command, str) else [os.fspath(c) for c in command]
        if shell or subprocess_kwargs:
            raise OverlayError(f"git layer: no shell, no Popen options ({argv[:3]}…)")
        if as_process and istream == subprocess.PIPE:  # a persistent cat-file --batch
            proc = process.start(argv, cwd=_cwd(self), env=_environ(self, env), stdin=istream)
            return self.AutoInterrupt(_GroupStop(proc), argv)
        data = istream.read() if hasattr(istream, "read") else None
        timeout = GIT_TIMEOUT if kill_after_timeout is None else kill_after_timeout
        out = run_in(self, argv, data, env, timeout)
        if as_process:  # GitPython reads it as a stream: the whole of it, finished
            return self.AutoInterrupt(_Finished(argv, out), argv)
        stdout: Any = out.stdout if with_stdout else b""
        if output_stream is not None:
            output_stream.write(stdout)
            stdout = output_stream
        elif strip_newline_in_stdout and stdout.endswith(b"\n"):
            stdout = stdout[:-1]
        if isinstance(stdout, bytes) and (stdout_as_string or universal_newlines):
            stdout = stdout.decode(errors="surrogateescape")
        stderr = out.stderr.removesuffix("\n")
        if with_exceptions and out.returncode != 0:
            raise GitCommandError(argv, out.returncode, stderr, stdout)
        return (out.returncode, stdout, stderr) if with_extended_output else stdout


class GitRepo(gitpython.Repo):
    """``git.Repo`` whose git children are ``Git``'s."""

    GitCommandWrapperType = Git
