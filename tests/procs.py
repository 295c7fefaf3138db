"""Whether a process the test stopped is gone: the one wait the process tests share.

A signal is sent before it is handled: ``killpg`` returns while a killed grandchild may not
yet have run to its exit, most often on a loaded machine. So a test waits for the process to
go (reaped, or a zombie whose parent is gone too), bounded only against a stop that never
came: the grandchildren the tests build sleep for minutes, so a process still there after
``WITHIN`` seconds was not stopped."""

from __future__ import annotations

import time
from pathlib import Path

WITHIN = 60.0


def _state(pid: int) -> str | None:
    """The process's state letter from /proc (``None``: no such process)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def gone(pid: int, within: float = WITHIN) -> bool:
    """True once ``pid`` is reaped or a zombie; False if it still runs after ``within`` s."""
    end = time.monotonic() + within
    while _state(pid) not in (None, "Z"):
        if time.monotonic() > end:
            return False
        time.sleep(0.02)
    return True
