"""`python -m benchmarks.soak`: agents cycle (create -> claim -> event -> transition) against a
real server with a short retention, and the database's size is printed as it goes: with
retention it levels off instead of growing with every cycle.

    python -m benchmarks.soak --cycles 500000 --retention 30s --prune-interval 2s
    python -m benchmarks.soak --db postgresql://... --minutes 10

Every `--every` seconds one line: cycles so far, cycles/s, claim p50/p99 in that interval, the
rows pruned in it, and the size (SQLite: the file and its WAL, pages and free pages;
PostgreSQL: pg_database_size). Ends after `--cycles` cycles or `--minutes`, whichever comes
first, with a JSON summary on the last line. No figure is asserted.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PIPELINE = {
    "initial": "todo",
    "states": {"todo": {"agent_role": "soak"}, "done": {"terminal": True}},
    "transitions": [{"from": "todo", "to": "done", "trigger": "finish"}],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Http:
    """One keep-alive connection; JSON in, (status, JSON) out."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def call(
        self, method: str, path: str, body: Any = None, token: str | None = None
    ) -> tuple[int, Any]:
        headers = {"content-type": "application/json"}
        if token is not None:
            headers["authorization"] = f"Bearer {token}"
        data = None if body is None else json.dumps(body).encode()
        self.conn.request(method, path, body=data, headers=headers)
        resp = self.conn.getresponse()
        raw = resp.read()
        return resp.status, (json.loads(raw) if raw and raw[:1] in b"{[" else raw)


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cycles = 0
        self.errors = 0
        self.claims: list[float] = []

    def take(self) -> tuple[int, list[float]]:
        with self.lock:
            claims, self.claims = self.claims, []
            return self.cycles, claims


def agent(port: int, pipeline_id: str, stats: Stats, stop: threading.Event, bulk: int) -> None:
    while not stop.is_set():
        try:
            cycles(Http(port), pipeline_id, stats, stop, bulk)
        except (OSError, http.client.HTTPException):
            if not stop.is_set():
                with stats.lock:
                    stats.errors += 1
                time.sleep(0.1)


def cycles(client: Http, pipeline_id: str, stats: Stats, stop: threading.Event, bulk: int) -> None:
    while not stop.is_set():
        status, _ = client.call(
            "POST",
            "/tasks/bulk",
            {"tasks": [{"pipeline_id": pipeline_id, "title": "soak", "description": ""}] * bulk},
        )
        if status != 201:
            with stats.lock:
                stats.errors += 1
            continue
        for _ in range(bulk):
            started = time.perf_counter()
            status, got = client.call(
                "POST", "/leases/claim", {"agent_id": "soak", "agent_role": "soak"}
            )
            took = time.perf_counter() - started
            if status != 200:
                with stats.lock:
                    stats.errors += status != 204
                continue
            run, token = got["run"]["id"], got["lease_token"]
            client.call("POST", f"/runs/{run}/events", {"kind": "step", "data": {"n": 1}}, token)
            status, _ = client.call(
                "POST",
                f"/runs/{run}/transition",
                {"trigger": "finish", "usage": {"tokens": 100}},
                token,
            )
            with stats.lock:
                stats.claims.append(took)
                if status == 200:
                    stats.cycles += 1
                else:
                    stats.errors += 1


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def pruned(port: int) -> int:
    status, text = Http(port).call("GET", "/metrics")
    if status != 200:
        return 0
    return sum(
        int(float(v))
        for v in re.findall(rb"^nulltickets_pruned_rows_total\{[^}]*\} (\S+)$", text, re.M)
    )


def size(db: str) -> dict[str, int]:
    if db.startswith(("postgresql://", "postgres://")):
        import psycopg

        with psycopg.connect(db) as pg:
            row = pg.execute("SELECT pg_database_size(current_database())").fetchone()
        return {"bytes": int(row[0]) if row else 0}
    import apsw

    conn = apsw.Connection(db, flags=apsw.SQLITE_OPEN_READONLY)
    try:
        pages = int(conn.pragma("page_count"))
        free = int(conn.pragma("freelist_count"))
        (count,) = conn.execute("SELECT count(*) FROM tasks").fetchall()[0]
        tasks = int(str(count))
    finally:
        conn.close()
    wal = Path(db + "-wal")
    return {
        "bytes": os.path.getsize(db),
        "wal_bytes": wal.stat().st_size if wal.exists() else 0,
        "pages": pages,
        "free_pages": free,
        "tasks": tasks,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    p.add_argument("--db", help="SQLite file or postgresql:// URL (default: a temporary file)")
    p.add_argument("--cycles", type=int, default=500_000)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--bulk", type=int, default=20, help="tasks each agent creates at once")
    p.add_argument("--retention", default="30s")
    p.add_argument("--prune-interval", default="2s")
    p.add_argument("--durability", default="normal")
    p.add_argument("--every", type=float, default=30.0, help="seconds between lines")
    args = p.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="nulltickets-soak-"))
    db = args.db or str(workdir / "soak.db")
    port = free_port()
    cmd = [
        sys.executable, "-m", "nulltickets", "serve", "--port", str(port), "--db", db,
        "--retention", args.retention, "--prune-interval", args.prune_interval,
        "--durability", args.durability,
    ]  # fmt: skip
    env = {**os.environ, "NULLTICKETS_HOME": str(workdir / "home")}
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 (open for the server's lifetime)
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if Http(port).call("GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"the server did not start: see {workdir / 'server.log'}")
            time.sleep(0.1)
        status, made = Http(port).call(
            "POST", "/pipelines", {"name": f"soak-{port}", "definition": PIPELINE}
        )
        assert status == 201, made
        stats = Stats()
        for _ in range(args.agents):
            t = threading.Thread(
                target=agent, args=(port, made["id"], stats, stop, args.bulk), daemon=True
            )
            t.start()
            threads.append(t)
        started = time.monotonic()
        last_cycles, last_at, last_pruned = 0, started, 0
        figures: list[dict[str, Any]] = []
        print(f"soak: {args.agents} agents, retention {args.retention}, database {db}", flush=True)
        while True:
            time.sleep(args.every)
            now = time.monotonic()
            cycles, claims = stats.take()
            total_pruned = pruned(port)
            row = {
                "minutes": round((now - started) / 60, 2),
                "cycles": cycles,
                "cycles_per_s": round((cycles - last_cycles) / (now - last_at), 1),
                "claim_p50_ms": round(pct(claims, 0.5) * 1000, 2),
                "claim_p99_ms": round(pct(claims, 0.99) * 1000, 2),
                "pruned_rows": total_pruned - last_pruned,
                "errors": stats.errors,
                **size(db),
            }
            figures.append(row)
            print(json.dumps(row), flush=True)
            last_cycles, last_at, last_pruned = cycles, now, total_pruned
            if cycles >= args.cycles or now - started >= args.minutes * 60:
                break
        print(json.dumps({"summary": figures[-1], "lines": len(figures)}), flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    if args.db is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
