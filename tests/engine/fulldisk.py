"""The full-disk part of a server session: ``vllm serve`` writing hidden states to a storage
directory that fills up (hidden-states-connector-atomic-files).

A tmpfs of ``DISK["size"]`` is mounted over the server's storage directory (the session's
earlier parts have read and removed every file there). ``requests`` clients each send a
prompt of ``tokens`` tokens at once; only once every reply has come and every write has
ended (each ``.lock`` released) does any client read its file, so no file is removed while
another is written: at most ``size // file size`` files fit, and the rest of the writes meet
a full disk, by construction. Each client then reads its path as speculators does
(``server.read_locked``); a file it gets must be whole (its safetensors header and every
tensor it names are there: no torn file) and right against the reference. Then space has
returned (the clients removed what they read): ``after`` more requests, one at a time, must
each be saved whole and right. Nothing may be left in the directory: no file, no lock, no
temporary. The worker logs each failed write with its request id; the server goes on.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine import server
from engine.sessions import ROW_BYTES, prompts

# 12 files of 200 tokens x 3 layers x 256 x 2 bytes (307,200 bytes of rows each) on 512 KiB:
# one fits, at least 11 writes fail.
DISK = {"size": 512 * 1024, "requests": 12, "tokens": 200, "after": 3}
ID = re.compile(r"disk-(?:after-)?\d+")
FAILED = "Hidden-states write failed for req_id="


def expected_failure(line: str) -> bool:
    """A server log line that reports a full-disk request's failed write (this part's own)."""
    return FAILED in line and ID.search(line) is not None


def whole(path: Path) -> bool:
    """The file is a whole safetensors file: its header's length, the header, and every byte
    of data the header names are there (a torn write is shorter)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return False
        (n,) = struct.unpack("<Q", raw)
        header = f.read(n)
    if len(header) < n:
        return False
    try:
        entries = json.loads(header)
    except ValueError:
        return False
    end = max((e["data_offsets"][1] for k, e in entries.items() if k != "__metadata__"),
              default=0)  # fmt: skip
    return os.path.getsize(path) == 8 + n + end


def _mount(storage: Path, size: int) -> str | None:
    """Mount a tmpfs of ``size`` bytes over ``storage``; the error, or None."""
    out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(storage)],
                         capture_output=True, text=True, check=False)  # fmt: skip
    return None if out.returncode == 0 else f"mount: rc {out.returncode}: {out.stderr.strip()}"


def written(path: str, timeout: float = 300) -> bool:
    """Wait until the worker's write of ``path`` has ended (its ``.lock`` no longer held),
    without taking the lock from a reader. False if it is still held after ``timeout``."""
    import fcntl

    try:
        fd = os.open(path + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return True
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.05)
    finally:
        os.close(fd)


def _send(srv: server.Server, name: str, prompt: list[int]) -> dict:
    reply = srv.complete(prompt, headers={"X-Request-Id": name}, timeout=900)
    params = reply.body.get("kv_transfer_params") if isinstance(reply.body, dict) else None
    return {"name": name, "prompt": prompt, "status": reply.status,
            "path": (params or {}).get("hidden_states_path")}  # fmt: skip


def _read(c: dict, saved: Path) -> None:
    """Read the client's file as speculators does; its outcome: whole, missing or torn."""
    kept = saved / f"{c['name']}.safetensors"
    try:
        server.read_locked(c["path"], kept)
    except FileNotFoundError:
        c["outcome"] = "missing"
        return
    c["outcome"] = "whole" if whole(kept) else "torn"
    c["kept"] = str(kept)


def run_full_disk(srv: server.Server, where: Path, *, size: int, requests: int, tokens: int,
                  after: int) -> dict:  # fmt: skip
    """The part (see the module docstring); its figures, and ``files`` for the check."""
    storage, saved = srv.storage, where / "saved"
    saved.mkdir(parents=True, exist_ok=True)
    out: dict = {"requests": requests, "size": size, "file_bytes": tokens * ROW_BYTES,
                 "storage_before": server.everything_under(storage)}  # fmt: skip
    out["mount_error"] = _mount(storage, size)
    if out["mount_error"]:
        return out
    t0 = time.monotonic()
    try:
        plan = [(f"disk-{i}", p) for i, p in enumerate(prompts(31, *[tokens] * requests))]
        with ThreadPoolExecutor(requests) as pool:
            clients = list(pool.map(lambda a: _send(srv, *a), plan))
        out["all_written"] = all(written(c["path"]) for c in clients if c["path"])
        for c in clients:
            if c["path"]:
                _read(c, saved)
        out["healthy_after"] = srv.healthy()
        # Space has returned: what the clients read, they removed. One request at a time,
        # each read (and removed) before the next is sent.
        later = []
        for i, p in enumerate(prompts(32, *[tokens] * after)):
            later.append(_send(srv, f"disk-after-{i}", p))
            if later[-1]["path"]:
                _read(later[-1], saved)
        out["storage_left"] = server.everything_under(storage)
    finally:
        subprocess.run(["umount", "-l", str(storage)], capture_output=True, check=False)
    out["seconds"] = round(time.monotonic() - t0, 1)
    out["clients"], out["later"] = clients, later
    out["outcomes"] = {k: sum(1 for c in clients if c.get("outcome") == k)
                       for k in ("whole", "missing", "torn")}  # fmt: skip
    out["later_outcomes"] = {k: sum(1 for c in later if c.get("outcome") == k)
                             for k in ("whole", "missing", "torn")}  # fmt: skip
    text = srv.log.read_text(errors="replace")
    out["failures_logged"] = sorted({ID.search(ln).group(0) for ln in text.splitlines()
                                     if expected_failure(ln)})  # fmt: skip
    out["files"] = [{"name": c["name"], "kept": c["kept"], "prompt": c["prompt"]}
                    for c in clients + later if c.get("outcome") == "whole"]  # fmt: skip
    return out
