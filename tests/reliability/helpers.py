"""Shared pieces of the reliability suites: looking inside a database file, running agent
processes, and reading raw HTTP off a socket."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import apsw

from tests.reliability.report import REPO
from tests.server import Response

# --- numbers -----------------------------------------------------------------------------------


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile (pct in 0..100) of a non-empty list."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(pct / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


# --- responses ---------------------------------------------------------------------------------


def envelope(r: Response) -> str:
    """The error code of a response that must be the JSON error envelope."""
    assert r.headers.get("content-type", "").startswith("application/json"), (r.status, r.headers)
    doc = json.loads(r.body)
    assert isinstance(doc, dict) and list(doc) == ["error"], doc
    error = doc["error"]
    assert isinstance(error, dict) and {"code", "message"} <= set(error), doc
    assert isinstance(error["code"], str) and error["code"], doc
    assert isinstance(error["message"], str), doc
    return str(error["code"])


@dataclass
class Raw:
    """A response read off a raw socket; status 0 when the peer closed without answering."""

    status: int
    headers: dict[str, str]
    body: bytes

    def is_json_error(self) -> bool:
        if not self.headers.get("content-type", "").startswith("application/json"):
            return False
        try:
            doc = json.loads(self.body)
        except ValueError:
            return False
        return (
            isinstance(doc, dict)
            and list(doc) == ["error"]
            and isinstance(doc["error"], dict)
            and isinstance(doc["error"].get("code"), str)
            and isinstance(doc["error"].get("message"), str)
        )


def raw_request(port: int, data: bytes, timeout: float = 10.0) -> Raw:
    """Send `data` as is on a fresh connection and read one response."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        with contextlib.suppress(OSError):
            s.sendall(data)
        return read_raw(s, timeout)


def read_raw(s: socket.socket, timeout: float = 10.0) -> Raw:
    s.settimeout(timeout)
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                return Raw(0, {}, data)
            data += chunk
    except OSError:
        return Raw(0, {}, data)
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines[1:])}
    length = int(headers.get("content-length", "0") or 0)
    with contextlib.suppress(OSError):
        while len(body) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
    return Raw(int(lines[0].split()[1]), headers, body)


# --- the database file -------------------------------------------------------------------------


@contextlib.contextmanager
def open_db(path: Path | str) -> Iterator[Any]:
    """A short-lived connection of our own (recovers the WAL of a crashed server, like the
    server's next start would); a postgresql:// URL gets a PostgreSQL connection instead,
    which `rows` reads the same way."""
    if str(path).startswith("postgresql://"):
        import psycopg

        with psycopg.connect(str(path), autocommit=True) as pg:
            yield pg
        return
    conn = apsw.Connection(str(path))
    conn.set_busy_timeout(10_000)
    try:
        yield conn
    finally:
        conn.close()


def rows(conn: Any, sql: str, params: Any = ()) -> list[tuple[Any, ...]]:
    return [tuple(r) for r in conn.execute(sql, params).fetchall()]


def storage_health(path: Path) -> dict[str, Any]:
    """PRAGMA integrity_check, foreign_key_check and FTS5's integrity-check against the store."""
    with open_db(path) as conn:
        integrity = [r[0] for r in rows(conn, "PRAGMA integrity_check")]
        foreign = rows(conn, "PRAGMA foreign_key_check")
        try:
            # rank 1: also check the index against its external content table (the store).
            conn.execute("INSERT INTO store_fts(store_fts, rank) VALUES ('integrity-check', 1)")
            fts = "ok"
        except apsw.Error as exc:
            fts = f"{type(exc).__name__}: {exc}"
        return {"integrity": integrity, "foreign_keys": foreign, "fts": fts}


def assert_storage_healthy(path: Path) -> dict[str, Any]:
    health = storage_health(path)
    assert health["integrity"] == ["ok"], health
    assert health["foreign_keys"] == [], health
    assert health["fts"] == "ok", health
    return health


# --- agent processes ---------------------------------------------------------------------------


@dataclass
class Agent:
    """One agent process (tests/reliability/agent.py) and its journal of acknowledged work."""

    name: str
    journal: Path
    proc: subprocess.Popen[bytes]
    log: Path
    killed: bool = False

    def kill(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.killed = True
        self.proc.wait(10)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"agent {self.name} did not stop within {timeout:.0f}s") from None

    def entries(self) -> list[dict[str, Any]]:
        return read_journal(self.journal)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def read_journal(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a journal (a killed agent may leave half a line at the end)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def start_agent(workdir: Path, name: str, port: int, *args: str) -> Agent:
    journal = workdir / f"{name}.jsonl"
    log = workdir / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        "tests.reliability.agent",
        "--port",
        str(port),
        "--agent-id",
        name,
        "--journal",
        str(journal),
        *args,
    ]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    return Agent(name, journal, proc, log)


@dataclass
class Journals:
    """Every agent's journal, merged."""

    entries: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, agents: list[Agent]) -> Journals:
        merged: list[dict[str, Any]] = []
        for agent in agents:
            merged.extend({**e, "agent": agent.name} for e in agent.entries())
        return cls(merged)

    def ops(self, op: str) -> list[dict[str, Any]]:
        return [e for e in self.entries if e.get("op") == op]

    def stats(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for e in self.ops("exit"):
            for key, value in e.get("stats", {}).items():
                total[key] = total.get(key, 0) + int(value)
        return total
