"""The machine's floor on PostgreSQL: what one statement costs at the least, on the benchmark's
own cluster, before any of nulltickets' work. One connection from the benchmark's process
(psycopg, prepared statements, autocommit), nothing else running: `n` times a `SELECT` of one
parameter, then `n` times an `INSERT` of one row into a table of its own, each its own
transaction with `synchronous_commit` on (its commit waits for the WAL's flush), as every
statement of the agent's cycle is in `full`. For each: the client's CPU (this process: the
driver and the kernel's side of the socket), PostgreSQL's (its backend's, read from /proc) and
the wall time, per statement. A cycle of three requests cannot cost PostgreSQL less than three
such commits, nor the server less than three such round trips."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from benchmarks.pgcluster import PostgresServer

WARMUP = 100


def _cpu_s(pid: int) -> float:
    """A process's CPU time so far, in seconds: the scheduler's nanoseconds where the kernel
    keeps them (/proc/PID/schedstat), else its user and system ticks."""
    try:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_floor(cluster: PostgresServer, n: int) -> dict[str, Any]:
    """{"select": {...}, "insert_commit": {...}}, each with client_cpu_us, postgres_cpu_us and
    wall_us per statement, and the statements it ran."""
    import psycopg

    with psycopg.connect(cluster.dsn(cluster.create_database()), autocommit=True) as conn:
        conn.execute("SET synchronous_commit = on")
        conn.execute("CREATE TABLE floor (id BIGSERIAL PRIMARY KEY, v TEXT NOT NULL)")
        backend = conn.info.backend_pid
        work = {
            "select": ("SELECT %s::int", (1,)),
            "insert_commit": ("INSERT INTO floor (v) VALUES (%s)", ("x",)),
        }
        result: dict[str, Any] = {}
        for name, (sql, args) in work.items():
            for _ in range(WARMUP):
                conn.execute(sql, args, prepare=True)
            cpu0, pg0, wall0 = time.process_time(), _cpu_s(backend), time.perf_counter()
            for _ in range(n):
                conn.execute(sql, args, prepare=True)
            cpu1, pg1, wall1 = time.process_time(), _cpu_s(backend), time.perf_counter()
            result[name] = {
                "statements": n,
                "client_cpu_us": round(1e6 * (cpu1 - cpu0) / n, 1),
                "postgres_cpu_us": round(1e6 * (pg1 - pg0) / n, 1),
                "wall_us": round(1e6 * (wall1 - wall0) / n, 1),
            }
    return result


def describe(floor: dict[str, Any]) -> str:
    """One sentence of the floor's figures, for the table's notes."""
    s, i = floor["select"], floor["insert_commit"]
    return (
        "The machine's floor (benchmarks/pgfloor.py: one connection, no concurrency, "
        f"{s['statements']:,} statements each): a prepared `SELECT` costs "
        f"{s['client_cpu_us']:.0f} us of the client's CPU and {s['postgres_cpu_us']:.0f} us of "
        f"PostgreSQL's ({s['wall_us']:.0f} us wall); an `INSERT` committed with "
        f"`synchronous_commit` on {i['client_cpu_us']:.0f} us and {i['postgres_cpu_us']:.0f} us "
        f"({i['wall_us']:.0f} us wall). A cycle's three requests, each one statement that "
        f"commits, cost PostgreSQL at least {3 * i['postgres_cpu_us'] / 1000:.2f} ms of CPU here."
    )
