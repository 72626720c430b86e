"""Run the real server as a subprocess on a free port, and talk to it over real sockets.

`NULLTICKETS_BINARY` names an executable to test instead of `python -m nulltickets`.
`NULLTICKETS_TEST_TIME_SCALE` (default 1) multiplies the waits for a server to start, answer
and stop: build/emulated.sh sets it for a binary running under QEMU, where every instruction
is translated.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TIME_SCALE = float(os.environ.get("NULLTICKETS_TEST_TIME_SCALE", "1"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_command() -> list[str]:
    binary = os.environ.get("NULLTICKETS_BINARY")
    return [binary] if binary else [sys.executable, "-m", "nulltickets"]


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def error_code(self) -> str:
        """The envelope's code; fails the test if the body is not the error envelope."""
        doc = self.json
        assert set(doc) == {"error"}, doc
        assert set(doc["error"]) >= {"code", "message"}, doc
        return str(doc["error"]["code"])


@dataclass
class Client:
    """A keep-alive HTTP/1.1 client. Not thread-safe: one per thread or process."""

    host: str
    port: int
    token: str | None = None
    timeout: float = 30.0 * TIME_SCALE
    _conn: http.client.HTTPConnection | None = field(default=None, repr=False)

    def request(
        self,
        method: str,
        path: str,
        json_body: Any = None,
        *,
        body: bytes | str | None = None,
        headers: dict[str, str] | None = None,
        token: str | None = None,
    ) -> Response:
        hdrs = dict(headers or {})
        bearer = token if token is not None else self.token
        if bearer is not None and "Authorization" not in hdrs:
            hdrs["Authorization"] = f"Bearer {bearer}"
        if json_body is not None:
            body = json.dumps(json_body)
            hdrs.setdefault("Content-Type", "application/json")
        data = body.encode() if isinstance(body, str) else body
        for attempt in range(2):
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            try:
                self._conn.request(method, path, body=data, headers=hdrs)
                r = self._conn.getresponse()
                payload = r.read()
                return Response(r.status, {k.lower(): v for k, v in r.getheaders()}, payload)
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def get(self, path: str, **kw: Any) -> Response:
        return self.request("GET", path, **kw)

    def post(self, path: str, json_body: Any = None, **kw: Any) -> Response:
        return self.request("POST", path, json_body, **kw)

    def put(self, path: str, json_body: Any = None, **kw: Any) -> Response:
        return self.request("PUT", path, json_body, **kw)

    def delete(self, path: str, **kw: Any) -> Response:
        return self.request("DELETE", path, **kw)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __del__(self) -> None:
        # A test that failed before its close() leaves its client to the collector: closed
        # here, its socket cannot fail a later test with an unraisable ResourceWarning.
        self.close()


class Server:
    """One server process on its own port and database file; with `dsn`, on that PostgreSQL
    database instead (`db` then only places the server's log and home)."""

    def __init__(
        self,
        db: Path,
        *,
        token: str | None = None,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        dsn: str | None = None,
    ) -> None:
        self.db = db
        self.dsn = dsn
        self.token = token
        self.port = free_port()
        self.args = args or []
        self.env = env
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = db.with_suffix(".log")

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        target = self.dsn if self.dsn is not None else str(self.db)
        cmd = [*server_command(), "serve", "--port", str(self.port), "--db", target]
        if self.token is not None:
            cmd += ["--token", self.token]
        return cmd + self.args

    def start(self, timeout: float = 20.0 * TIME_SCALE) -> Server:
        # A home of its own, so a developer's ~/.nulltickets/config.json never leaks in.
        env = {**os.environ, "NULLTICKETS_HOME": str(self.db.parent / "home"), **(self.env or {})}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.cwd
            )
        self.wait_healthy(timeout)
        return self

    def wait_healthy(self, timeout: float = 20.0 * TIME_SCALE) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                    s.sendall(
                        b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
                    )
                    if s.recv(64).startswith(b"HTTP/1.1 200"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def client(self, token: str | None = None) -> Client:
        return Client("127.0.0.1", self.port, token=token)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0 * TIME_SCALE) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code

    def kill(self) -> list[int]:
        """SIGKILL the server and every process below it (supervisor and worker; under a
        standalone binary granian's worker is a grandchild). Returns the processes killed.

        The tree is frozen from the top first (SIGSTOP, and each process seen stopped before
        its children are listed): a supervisor killed while it starts a new worker, after its
        children were listed, would leave that worker running on, holding the database."""
        killed: list[int] = []
        if self.proc is not None and self.proc.poll() is None:
            frozen = [self.proc.pid]
            for pid in frozen:  # grows while it runs: each stopped process's children
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
                wait_stopped(pid)
                frozen.extend(c for c in _children(pid) if c not in frozen)
            for pid in frozen:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.wait()
            killed = frozen
        self.proc = None
        return killed


def program_process(pid: int) -> int:
    """The process that runs our code for a command started as `pid`: `pid` itself, or under
    a standalone binary the child of its onefile bootstrap."""
    if not os.environ.get("NULLTICKETS_BINARY"):
        return pid
    deadline = time.monotonic() + 10
    while not (children := _children(pid)):
        assert time.monotonic() < deadline, f"the bootstrap {pid} started no child"
        time.sleep(0.02)
    return children[0]


def granian_main(server: Server) -> int:
    """granian's main process: the server's own process (under a binary, the bootstrap's
    child)."""
    assert server.proc is not None
    return program_process(server.proc.pid)


def granian_workers(server: Server) -> list[int]:
    """The server's worker processes: the children of granian's main process."""
    return _children(granian_main(server))


def signal_another_thread(pid: int, signum: int) -> int:
    """Send `signum` to a thread of process `pid` other than its main thread (the first one
    started after it), as the kernel does with a signal for the process when the main thread
    cannot take it; returns that thread's id. Needs Linux and a libc with tgkill."""
    import ctypes

    import pytest

    tgkill = getattr(ctypes.CDLL(None, use_errno=True), "tgkill", None)
    if not sys.platform.startswith("linux") or tgkill is None:
        pytest.skip("a signal to one thread of another process needs Linux's tgkill")
    others = sorted(int(t.name) for t in Path(f"/proc/{pid}/task").iterdir() if t.name != str(pid))
    assert others, f"process {pid} has no thread but its main one"
    if tgkill(pid, others[0], signum) != 0:
        raise OSError(ctypes.get_errno(), f"tgkill({pid}, {others[0]}, {signum})")
    return others[0]


def alive(pid: int) -> bool:
    """Whether process `pid` is running: a zombie (dead, not yet reaped) is not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    try:  # a zombie still answers kill(0): read its state where /proc exists
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return not sys.platform.startswith("linux")  # gone meanwhile; elsewhere, kill(0) said so


def wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Until every thread of `pid` is stopped, or it is gone (Linux; elsewhere a short pause).
    A signal's stop is not immediate, and a process counts as stopped only once all its
    threads are."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            states = [
                (task / "stat").read_text().split(") ", 1)[1][0]
                for task in Path(f"/proc/{pid}/task").iterdir()
            ]
        except (OSError, IndexError):
            if not sys.platform.startswith("linux"):
                time.sleep(0.05)
            return
        if all(state in "TtZX" for state in states):
            return
        time.sleep(0.002)


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, children first."""
    found = _children(pid)
    return found + [d for c in found for d in descendants(c)]


def _children(pid: int) -> list[int]:
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return []
    return [int(p) for p in out.split()]


# The Task object's keys, in the original's order (contract §4.2).
TASK_FIELDS = [
    "id",
    "pipeline_id",
    "stage",
    "title",
    "description",
    "priority",
    "metadata",
    "task_version",
    "next_eligible_at_ms",
    "retry_delay_ms",
    "max_attempts",
    "dead_letter_stage",
    "dead_letter_reason",
    "created_at_ms",
    "updated_at_ms",
]

PIPELINE = {
    "initial": "todo",
    "states": {
        "todo": {"agent_role": "coder"},
        "review": {"agent_role": "reviewer"},
        "done": {"terminal": True},
        "dead": {"terminal": True},
    },
    "transitions": [
        {
            "from": "todo",
            "to": "review",
            "trigger": "submit",
            "instructions": "review it",
            "required_gates": ["tests"],
        },
        {"from": "review", "to": "done", "trigger": "approve"},
        {"from": "review", "to": "todo", "trigger": "reject"},
    ],
}
