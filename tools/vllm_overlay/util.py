"""Small shared helpers: hashing, atomic writes, link-into-place, locks, the cache and uv."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from vllm_overlay.errors import BusyError, OverlayError, UsageError


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` so that readers see the old or the new file, never half."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def link_new(src: str | os.PathLike[str], dest: str | os.PathLike[str]) -> bool:
    """Put ``src``'s bytes at ``dest`` unless ``dest`` exists: the one "link into place, never
    replace" for published and built files.

    True when placed; False when ``dest`` already holds the same bytes; ``FileExistsError``
    when it holds other bytes. A hard link is atomic and fails if ``dest`` appeared meanwhile;
    across file systems a complete copy beside ``dest`` is linked in instead; where there are
    no hard links at all, that copy is renamed after a last look (the caller's lock keeps
    others out). ``src`` is left as it is.
    """
    src, dest = Path(src), Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
        return True
    except FileExistsError:
        return _same_or_refuse(src, dest)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
    fd, side = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb") as fo, open(src, "rb") as fi:
            shutil.copyfileobj(fi, fo, 1 << 22)
            fo.flush()
            os.fsync(fo.fileno())
        os.chmod(side, os.stat(src).st_mode & 0o777)
        try:
            os.link(side, dest)
        except FileExistsError:
            return _same_or_refuse(src, dest)
        except OSError:  # no hard links here: rename, after one more look
            if dest.exists():
                return _same_or_refuse(src, dest)
            os.rename(side, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(side)
    return True


def _same_or_refuse(src: Path, dest: Path) -> bool:
    if sha256_file(dest) == sha256_file(src):
        return False
    raise FileExistsError(errno.EEXIST, "exists with other bytes", str(dest))


def atomic_write_text(path: str | os.PathLike[str], text: str, mode: int = 0o644) -> None:
    atomic_write_bytes(path, text.encode(), mode)


LOCK_TIMEOUT_ENV = "VLLM_OVERLAY_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 300.0  # seconds a lock is waited for before giving up
_LOCK_POLL = 0.2
_lock_timeout: float | None = None  # --lock-timeout of this invocation; None: env or default


def set_lock_timeout(seconds: float | None) -> None:
    """How long locks wait in this process (``--lock-timeout``); None: env or default."""
    global _lock_timeout
    _lock_timeout = seconds


def lock_timeout() -> float:
    """Seconds a busy lock is waited for: --lock-timeout, else $VLLM_OVERLAY_LOCK_TIMEOUT,
    else DEFAULT_LOCK_TIMEOUT. 0 gives up at once."""
    if _lock_timeout is not None:
        return _lock_timeout
    env = os.environ.get(LOCK_TIMEOUT_ENV, "").strip()
    if not env:
        return DEFAULT_LOCK_TIMEOUT
    try:
        seconds = float(env)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise UsageError(
            f"{LOCK_TIMEOUT_ENV}={env!r}: give the seconds to wait for a lock (0 or more)."
        )
    return seconds


def _lock_holder(fd: int) -> str:
    """The pid the holder wrote into the lock file, or "unknown" (it may not have yet)."""
    try:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    except OSError:
        return "unknown"
    return text if text.isdigit() else "unknown"


def _acquire(
    fd: int, op: int, lock_path: Path, what: str, limit: float,
    unless: Callable[[], bool] | None = None,
) -> bool:  # fmt: skip
    """flock ``fd`` with ``op`` (LOCK_EX or LOCK_SH), waiting up to ``limit`` seconds and
    saying once for what; BusyError after that. True once locked; False, without the lock,
    as soon as ``unless()`` holds while it waits."""
    deadline = time.monotonic() + limit
    said = False
    while True:
        try:
            fcntl.flock(fd, op | fcntl.LOCK_NB)
            return True
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
        if unless is not None and unless():
            return False
        holder = _lock_holder(fd)
        left = deadline - time.monotonic()
        if left <= 0:
            raise BusyError(
                f"another vllm-overlay process is using {what} (held by pid {holder}, "
                f"lock {lock_path}); gave up after waiting {limit:g} s. Wait for it to "
                "finish, or give it longer with --lock-timeout SECONDS (or "
                f"{LOCK_TIMEOUT_ENV}), then run this again."
            )
        if not said:
            info(
                f"waiting for {what}, held by pid {holder} (lock {lock_path}; giving up "
                f"after {limit:g} s, see --lock-timeout)"
            )
            said = True
        time.sleep(min(_LOCK_POLL, left))


@contextlib.contextmanager
def exclusive_lock(
    lock_path: str | os.PathLike[str], what: str, *, timeout: float | None = None,
    unless: Callable[[], bool] | None = None,
) -> Iterator[bool]:  # fmt: skip
    """Hold an exclusive flock on ``lock_path`` (created if missing), waiting for it.

    The holder's pid is written into the lock file while it holds it (emptied again, with
    its old times, on release). A second process says once that it is
    "waiting for <what>, held by pid N" and waits up to ``timeout`` seconds (default:
    ``lock_timeout()``), then gives up with ``BusyError``; it never races on the same files.

    ``unless``: for a cache entry that a process builds and then holds shared for its whole
    run (``hold``), a check that the entry is there: a process waiting to build it stops
    waiting as soon as it holds, without the lock, instead of waiting for the builder's run to
    end. Yields True when the lock is held, False when ``unless`` ended the wait.
    """
    lock_path = Path(lock_path)
    limit = lock_timeout() if timeout is None else timeout
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        if not _acquire(fd, fcntl.LOCK_EX, lock_path, what, limit, unless):
            yield False
            return
        before = os.fstat(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        try:
            yield True
        finally:
            # Released, the lock file is as it was (empty, same times): a no-op leaves no trace.
            os.ftruncate(fd, 0)
            os.utime(fd, ns=(before.st_atime_ns, before.st_mtime_ns))
    finally:
        os.close(fd)


def shared_lock(
    lock_path: str | os.PathLike[str], what: str, *, timeout: float | None = None
) -> int:
    """A shared flock on ``lock_path``, as an open descriptor the caller closes to release it:
    "in use" (any number of holders) against ``exclusive_lock``'s "being changed" (one). A
    holder of the exclusive lock is waited for as ``exclusive_lock`` waits."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        _acquire(fd, fcntl.LOCK_SH, lock_path, what, lock_timeout() if timeout is None else timeout)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def lock_if_free(lock_path: str | os.PathLike[str]) -> Iterator[bool]:
    """The exclusive flock on ``lock_path`` if nobody holds it (shared or exclusive) now:
    yields True holding it, False without waiting where it is taken (the entry is in use)."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            yield False
            return
        yield True
    finally:
        os.close(fd)


# lock path -> descriptor holding its shared lock: the cache entries this process uses.
_held: dict[Path, int] = {}


def hold(lock_path: str | os.PathLike[str], what: str) -> None:
    """Mark a cache entry in use by this process until it exits (or ``release``): a shared
    lock on the entry's lock, which its writer and a prune take exclusively (a prune passes
    the entry by). Waits, as ``exclusive_lock`` does, while a writer holds it."""
    lock = Path(lock_path)
    if lock not in _held:
        _held[lock] = shared_lock(lock, what)


def release(lock_path: str | os.PathLike[str]) -> None:
    """Stop holding an entry (``hold``): this process's own shared lock would block the
    exclusive one it takes to rebuild the entry."""
    fd = _held.pop(Path(lock_path), None)
    if fd is not None:
        os.close(fd)


def touch(path: str | os.PathLike[str]) -> None:
    """Record a use of the cache entry at ``path``: its modification time is its last use."""
    with contextlib.suppress(OSError):
        os.utime(path)


def project_root(start: Path | None = None) -> Path:
    """The overlay project: the nearest directory above ``start`` holding overlay/overlay.toml."""
    env = os.environ.get("VLLM_OVERLAY_PROJECT")
    if env:
        return Path(env).resolve()
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "overlay" / "overlay.toml").is_file() or (d / "upstream.lock").is_file():
            return d
    raise OverlayError(
        f"no overlay project found at or above {here}: expected overlay/overlay.toml. "
        "Run vllm-overlay from the project checkout, or pass --project DIR."
    )


def cache_dir() -> Path:
    """Where downloads and derived trees live: $VLLM_OVERLAY_CACHE, else the user cache dir."""
    env = os.environ.get("VLLM_OVERLAY_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "vllm-overlay"


def info(msg: str) -> None:
    """Progress and status for people: stderr, so stdout stays machine-readable."""
    print(msg, file=sys.stderr, flush=True)


# --- uv ----------------------------------------------------------------------------------

INSTALLER_ENV = "VLLM_OVERLAY_INSTALLER"  # "pip" forces pip even where uv is installed


def find_uv() -> str | None:
    """The uv executable: the one installed with this tool, else uv on PATH, else None."""
    if os.environ.get(INSTALLER_ENV, "").strip().lower() == "pip":
        return None
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        pass
    beside = Path(sys.executable).parent / "uv"
    if beside.is_file() and os.access(beside, os.X_OK):
        return os.fspath(beside)
    return shutil.which("uv")
