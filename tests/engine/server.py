"""``vllm serve`` from an engine environment, and the clients the engine tests point at it.

The server is started as our users start it, configured as speculators' launch script
configures it (``--speculative-config`` with ``extract_hidden_states``, ``--kv-transfer-config``
with the hidden-states connector), on loopback, from the ``vllm`` command of the engine
environment (our CPU wheel installed). The clients here use the standard library only (the
test process has no vLLM and no torch): HTTP/1.1 requests, requests left open to be read
or abandoned when the test says, a file read under the connector's ``.lock`` as speculators reads it.
"""

from __future__ import annotations

import contextlib
import fcntl
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

START_TIMEOUT = 600  # seconds for the server to answer /health (an engine start is 0.5-3 min)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Reply:
    status: int
    body: dict | str
    seconds: float


@dataclass
class OpenRequest:
    """A request on its own connection, its reply not read yet (``Server.open``)."""

    request_id: str
    conn: http.client.HTTPConnection
    started: float

    def reply(self) -> Reply:
        """Wait for the reply (OSError, TimeoutError as the socket raises them)."""
        try:
            resp = self.conn.getresponse()
            raw = resp.read().decode("utf-8", "replace")
        finally:
            self.conn.close()
        try:
            parsed: dict | str = json.loads(raw)
        except json.JSONDecodeError:
            parsed = raw
        return Reply(resp.status, parsed, time.monotonic() - self.started)

    def leave(self) -> None:
        """Disconnect as a client that gives up does: the server sees the socket close."""
        sock = self.conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.conn.close()


@dataclass
class Server:
    port: int
    storage: Path
    log: Path
    proc: subprocess.Popen
    model: str
    start_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def request(
        self,
        method: str,
        path: str,
        body: dict | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 300,
    ) -> Reply:
        t0 = time.monotonic()
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=data, headers=hdrs)
            resp = conn.getresponse()
            raw = resp.read().decode("utf-8", "replace")
        finally:
            conn.close()
        try:
            parsed: dict | str = json.loads(raw)
        except json.JSONDecodeError:
            parsed = raw
        return Reply(resp.status, parsed, time.monotonic() - t0)

    def complete(self, prompt: list[int], *, headers=None, timeout=300, **extra) -> Reply:
        """``/v1/completions`` with token ids and ``max_tokens=1``, as speculators sends it."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1, **extra}
        return self.request("POST", "/v1/completions", body, headers, timeout)

    def open(self, prompt: list[int], *, request_id: str, timeout: float = 900) -> OpenRequest:
        """Send ``/v1/completions`` (``max_tokens=1``, as ``complete``) and leave the reply
        unread: the caller reads it (``reply``) or leaves (``leave``) when the test says."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": 1}
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        started = time.monotonic()
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json", "X-Request-Id": request_id})  # fmt: skip
        return OpenRequest(request_id, conn, started)

    def healthy(self) -> bool:
        try:
            return self.request("GET", "/health", timeout=10).status == 200
        except OSError:
            return False

    def metric(self, name: str) -> float | None:
        """A gauge of the server's /metrics (summed over its label sets)."""
        reply = self.request("GET", "/metrics", timeout=30)
        total = None
        for line in str(reply.body).splitlines():
            if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
                total = (total or 0.0) + float(line.rsplit(" ", 1)[1])
        return total


def serve_args(model: str, port: int, layers: list[int], storage: Path, engine: dict,
               connector: dict | None = None) -> list[str]:  # fmt: skip
    """The command line: speculators' launch configuration plus the engine settings."""
    kv = {
        "kv_connector": "ExampleHiddenStatesConnector",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(storage)},
    }
    kv.update(connector or {})
    spec = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
    }
    args = ["serve", model, "--host", "127.0.0.1", "--port", str(port),
            "--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv)]  # fmt: skip
    for key, value in engine.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is False:
            args.append("--no-" + key.replace("_", "-"))
        else:
            args += [flag, str(value)]
    return args


@contextlib.contextmanager
def serving(env, model: str, where: Path, *, layers: list[int], engine: dict,
            connector: dict | None = None, env_vars: dict[str, str] | None = None):  # fmt: skip
    """Start ``vllm serve`` of ``env`` (an EngineEnv), wait until it answers, yield a
    Server; stop it (SIGINT, then SIGKILL of its process group) on the way out. A server
    that does not come up raises RuntimeError with its log's tail."""
    where.mkdir(parents=True, exist_ok=True)
    storage = where / "shared" / "hidden_states"
    storage.mkdir(parents=True, exist_ok=True)
    port = free_port()
    environ = env.environ(where / "work")
    environ.update(env_vars or {})
    log = where / "server.log"
    cmd = [str(env.python.parent / "vllm"), *serve_args(model, port, layers, storage, engine,
                                                      connector)]  # fmt: skip
    (where / "command.json").write_text(json.dumps(cmd, indent=2))
    t0 = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=where, env=environ, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    server = Server(port=port, storage=storage, log=log, proc=proc, model=model)
    try:
        while not server.healthy():
            if proc.poll() is not None or time.monotonic() - t0 > START_TIMEOUT:
                raise RuntimeError(
                    f"vllm serve did not come up (rc {proc.poll()}); its log {log}:\n"
                    + log.read_text()[-6000:]
                )
            time.sleep(1)
        server.start_seconds = round(time.monotonic() - t0, 1)
        yield server
    finally:
        _stop(proc)
        shutil.rmtree(environ["VLLM_RPC_BASE_PATH"], ignore_errors=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # EngineCore and its workers too
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def read_locked(path: str, dest: Path, *, timeout: float = 60) -> None:
    """Read the connector's file as speculators does: wait for the writer's LOCK_EX on the
    ``.lock`` to go, keep a copy at ``dest``, remove the file and its ``.lock``."""
    lock = path + ".lock"
    deadline = time.monotonic() + timeout
    if os.path.exists(lock):
        fd = os.open(lock, os.O_RDWR)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{lock} still locked after {timeout} s") from None
                    time.sleep(0.05)
        finally:
            os.close(fd)
        os.remove(lock)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(path, dest)


def everything_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))
