"""The stops part of a server session: requests whose end the engine records as an abort
although the client is still there (vllm/v1/engine/core.py's TODO: the core does not know a
client's abort from a stop criterion met).

- **A stop string.** The frontend finds it in the text (``output_processor``) and aborts the
  request in the core: FINISHED_ABORTED. A first request, without a stop, gives the model's
  greedy text for the prompt; the second, the same prompt with one word of that text as its
  stop string, ends there (``finish_reason`` "stop"), its prompt computed by construction
  (the word comes after it).
- **A pause with mode "abort"** (``/pause?mode=abort``, what RL trainers call between weight
  updates): every request in flight is finished as FINISHED_ABORTED. The request asks for
  far more tokens than it can generate before the pause (``max_model_len`` less its prompt);
  the pause is sent once the server counts a generated token (``vllm:generation_tokens_total``
  above what it was), so its prompt is computed by construction; then ``/resume``.

The reply to an aborted request carries no ``kv_transfer_params`` (the frontend answers it
before the core frees it), on 0.34.0 as released too. So the client finds its file as a
collector that scans the storage directory does: by its ``X-Request-Id`` in the file names.
A follow-up request makes the engine step (the connector hears of a finished request at the
next step); then the client waits for the worker's ``.lock`` to be released (the write has
ended, or the lock was discarded) and reads the file as speculators does
(``server.read_locked``), if there is one. ``files`` go to the reference check. What the
client got is recorded, not asserted here.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from engine import fulldisk, server
from engine.sessions import prompts

TOKENS = {"stop-string": 24, "paused": 40}
GENERATED = "vllm:generation_tokens_total"


def _path(reply: server.Reply) -> str | None:
    body = reply.body if isinstance(reply.body, dict) else {}
    return (body.get("kv_transfer_params") or {}).get("hidden_states_path")


def _finish(reply: server.Reply) -> str | None:
    body = reply.body if isinstance(reply.body, dict) else {}
    choices = body.get("choices") or [{}]
    return choices[0].get("finish_reason")


def _text(reply: server.Reply) -> str:
    body = reply.body if isinstance(reply.body, dict) else {}
    return (body.get("choices") or [{}])[0].get("text") or ""


def _client(srv: server.Server, name: str, prompt: list[int], reply: server.Reply,
            saved: Path) -> dict:  # fmt: skip
    """What the client got, and its file, found by its request id, read as speculators
    reads it."""
    c = {"name": name, "prompt": prompt, "status": reply.status, "finish": _finish(reply),
         "path": _path(reply)}  # fmt: skip
    follow = srv.complete(prompts(43, 8)[0], timeout=600)  # the engine's next step
    if _path(follow):
        server.read_locked(_path(follow), saved / f"{name}-follow-up.safetensors")
    stem = f"stops-{name}"
    locks = [p for p in srv.storage.iterdir() if stem in p.name and p.name.endswith(".lock")]
    c["locks"] = [p.name for p in locks]
    c["lock_released"] = all(fulldisk.written(str(p)[: -len(".lock")]) for p in locks)
    found = [p for p in srv.storage.iterdir() if stem in p.name and p.suffix == ".safetensors"]
    c["found"] = [p.name for p in found]
    if len(found) == 1:
        kept = saved / f"{name}.safetensors"
        server.read_locked(str(found[0]), kept)
        c["kept"] = str(kept)
    return c


def stop_word(text: str) -> str | None:
    """A word of ``text`` (the third or later) that no earlier part of it contains: the text
    stops there, not sooner."""
    words = text.split()
    for i in range(2, len(words)):
        before = " ".join(words[:i])
        if words[i] not in before:
            return words[i]
    return None


def _stop_string(srv: server.Server, saved: Path) -> dict:
    (prompt,) = prompts(41, TOKENS["stop-string"])
    first = srv.complete(prompt, max_tokens=12, temperature=0.0, ignore_eos=True, timeout=600)
    out: dict = {"greedy_text": _text(first), "greedy_status": first.status}
    if _path(first):
        server.read_locked(_path(first), saved / "greedy.safetensors")
    word = stop_word(_text(first))
    out["stop"] = word
    if word is None:
        return out
    reply = srv.complete(prompt, max_tokens=12, temperature=0.0, ignore_eos=True, stop=[word],
                         headers={"X-Request-Id": "stops-stop-string"}, timeout=600)  # fmt: skip
    out["text"] = _text(reply)
    out["client"] = _client(srv, "stop-string", prompt, reply, saved)
    return out


def _paused(srv: server.Server, saved: Path, max_model_len: int) -> dict:
    (prompt,) = prompts(42, TOKENS["paused"])
    before = srv.metric(GENERATED) or 0.0
    box: dict = {}

    def send() -> None:
        box["reply"] = srv.complete(prompt, max_tokens=max_model_len - len(prompt) - 8,
                                    temperature=0.0, ignore_eos=True,
                                    headers={"X-Request-Id": "stops-paused"}, timeout=900)  # fmt: skip

    thread = threading.Thread(target=send)
    thread.start()
    deadline = time.monotonic() + 600  # a bound on a hang, not a time the machine must meet
    generating = False
    while thread.is_alive() and time.monotonic() < deadline:
        if (srv.metric(GENERATED) or 0.0) > before:
            generating = True
            break
        time.sleep(0.2)
    out: dict = {"generating_when_paused": generating}
    out["pause_status"] = srv.request("POST", "/pause?mode=abort", timeout=300).status
    thread.join(timeout=900)
    out["resume_status"] = srv.request("POST", "/resume", timeout=300).status
    if "reply" in box:
        out["client"] = _client(srv, "paused", prompt, box["reply"], saved)
    return out


def run_stops(srv: server.Server, where: Path, *, max_model_len: int) -> dict:
    """The part (see the module docstring); its figures, and ``files`` for the check."""
    saved = where / "saved"
    saved.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    out = {"stop-string": _stop_string(srv, saved), "paused": _paused(srv, saved, max_model_len)}
    out["healthy_after"] = srv.healthy()
    out["storage_left"] = server.everything_under(srv.storage)
    out["seconds"] = round(time.monotonic() - t0, 1)
    clients = [out[k]["client"] for k in ("stop-string", "paused") if "client" in out[k]]
    out["files"] = [{"name": c["name"], "kept": c["kept"], "prompt": c["prompt"]}
                    for c in clients if "kept" in c]  # fmt: skip
    return out
