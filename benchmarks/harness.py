"""Servers for benchmarks: a real process on a real socket and file, with its CPU and memory read
from /proc, and databases seeded in bulk."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from nulltickets.lifetime import end_with_this_process

PIPELINE = {
    "initial": "todo",
    "states": {"todo": {"agent_role": "worker"}, "done": {"terminal": True}},
    "transitions": [{"from": "todo", "to": "done", "trigger": "complete"}],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children(pid: int) -> list[int]:
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return []
    return [int(p) for p in out.split()]


def _proc_cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime


def _proc_peak_rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class BenchServer:
    """`nulltickets serve` on a free port. `db` is a SQLite file or a PostgreSQL URL (then `log`
    names the server's log file; a file's log sits beside it). `env` adds to the environment
    and `cmd` replaces the command that starts the server (default: $NULLTICKETS_BINARY, else
    this Python's `-m nulltickets`). With `token`, the server requires it and every request of this
    object carries it."""

    def __init__(
        self,
        db: Path | str,
        *,
        durability: str = "normal",
        extra: list[str] | None = None,
        log: Path | None = None,
        env: dict[str, str] | None = None,
        cmd: list[str] | None = None,
        token: str | None = None,
    ):
        self.db, self.port = db, free_port()
        self.token = token
        if log is None:
            assert isinstance(db, Path), "a server on a URL needs a log path"
            log = db.with_suffix(".log")
        self.log_path = log
        self.env = dict(env or {})
        if token is not None:  # through the environment: a command line is visible to all
            self.env["NULLTICKETS_TOKEN"] = token
        if cmd is None:
            binary = os.environ.get("NULLTICKETS_BINARY")
            cmd = [binary] if binary else [sys.executable, "-m", "nulltickets"]
        self.cmd = [
            *cmd,
            "serve",
            "--port",
            str(self.port),
            "--db",
            str(db),
            "--durability",
            durability,
            *(extra or []),
        ]
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> BenchServer:
        env = {**os.environ, "NULLTICKETS_HOME": str(self.log_path.parent / "home"), **self.env}
        self.log = open(self.log_path, "wb")
        # A benchmark stopped by a signal leaves no server running behind it.
        self.proc = subprocess.Popen(
            self.cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=end_with_this_process(),
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                self.get("/health")
                return self
            except OSError:
                time.sleep(0.05)
        exited = self.proc.poll() is not None
        if not exited:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()
        last = (self.output().strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(
            f"server {'exited at start' if exited else 'did not become healthy'}: {last}"
        )

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)
        self.log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    @property
    def pids(self) -> list[int]:
        """The server's processes: the one started and all below it (granian's worker, and
        under the standalone binary the onefile bootstrap's child and its worker)."""
        assert self.proc is not None
        found, below = [self.proc.pid], _children(self.proc.pid)
        while below:
            found += below
            below = [c for p in below for c in _children(p)]
        return found

    def cpu_s(self) -> float:
        return sum(_proc_cpu_s(p) for p in self.pids)

    def peak_rss_mb(self) -> float:
        """The largest peak resident set of the server's processes (the worker's)."""
        return max(_proc_peak_rss_mb(p) for p in self.pids)

    def fetch(self, method: str, path: str, body: Any = None) -> bytes:
        """The body of the answer to one request (`body` sent as JSON)."""
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.token}"} if self.token is not None else {}
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=data, method=method, headers=headers
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            payload: bytes = r.read()
        return payload

    def request(self, method: str, path: str, body: Any = None) -> Any:
        payload = self.fetch(method, path, body)
        return json.loads(payload) if payload else None

    def get(self, path: str) -> Any:
        return self.request("GET", path)

    def text(self, path: str) -> str:
        return self.fetch("GET", path).decode()

    def post(self, path: str, body: Any) -> Any:
        return self.request("POST", path, body)


def create_pipeline(server: BenchServer, role: str = "worker") -> str:
    definition = json.loads(json.dumps(PIPELINE).replace('"worker"', json.dumps(role)))
    return str(
        server.post(
            "/pipelines", {"name": f"bench-{uuid.uuid4().hex[:8]}", "definition": definition}
        )["id"]
    )


def bulk_load(server: BenchServer, pipeline_id: str, n: int, chunk: int = 400) -> list[str]:
    """Load tasks through POST /tasks/bulk, each request under the 64 KiB limit."""
    ids: list[str] = []
    for start in range(0, n, chunk):
        tasks = [
            {"pipeline_id": pipeline_id, "title": f"task {i}", "description": "bench"}
            for i in range(start, min(n, start + chunk))
        ]
        ids += server.post("/tasks/bulk", {"tasks": tasks})["ids"]
    return ids


def seed_finished(db: Path, pipeline_id: str, n: int, stage: str = "done") -> None:
    """Insert `n` tasks straight into the file (server stopped): history to claim around."""
    import apsw

    conn = apsw.Connection(str(db))
    now = int(time.time() * 1000) - 86_400_000
    with conn:
        conn.executemany(
            "INSERT INTO tasks (id, pipeline_id, stage, title, description, created_at_ms, "
            "updated_at_ms, task_version) VALUES (?, ?, ?, 'old', '', ?, ?, 2)",
            ((str(uuid.uuid4()), pipeline_id, stage, now + i, now + i) for i in range(n)),
        )
    conn.close()
