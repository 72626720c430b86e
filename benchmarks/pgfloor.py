"""The machine's floor on PostgreSQL: what one statement costs at the least, on the benchmark's
own cluster, before any of nulltickets' work. One connection from the benchmark's process
(psycopg, prepared statements, autocommit), nothing else running: `n` times a `SELECT` of one
parameter, then `n` times an `INSERT` of one row into a table of its own, each its own
transaction with `synchronous_commit` on (its commit waits for the WAL's flush), as every
statement of the agent's cycle is in `full`. For each: the client's CPU (this process: the
driver and the kernel's side of the socket), PostgreSQL's (its backend's, read from /proc) and
the wall time, per statement. A cycle of three requests cannot cost PostgreSQL less than three
such commits, nor the server less than three such round trips.

Then the same rows again, `BATCH` to a statement (one `INSERT` of an array, one commit): the
cost per row of statements that would each carry several agents' requests at once, which is
how a PostgreSQL of few cores could go below the floor of one commit per request."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from benchmarks.pgcluster import PostgresServer

WARMUP = 100
# Rows to a statement in the batched insert.
BATCH = 8


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
    """{"select": {...}, "insert_commit": {...}, "insert_batch": {...}}, each with
    client_cpu_us, postgres_cpu_us and wall_us per row (a row is a statement of its own but in
    insert_batch), the statements it ran and their rows."""
    import psycopg

    with psycopg.connect(cluster.dsn(cluster.create_database()), autocommit=True) as conn:
        conn.execute("SET synchronous_commit = on")
        conn.execute("CREATE TABLE floor (id BIGSERIAL PRIMARY KEY, v TEXT NOT NULL)")
        backend = conn.info.backend_pid
        work: dict[str, tuple[str, tuple[Any, ...], int]] = {
            "select": ("SELECT %s::int", (1,), 1),
            "insert_commit": ("INSERT INTO floor (v) VALUES (%s)", ("x",), 1),
            "insert_batch": (
                "INSERT INTO floor (v) SELECT unnest(%s::text[])",
                (["x"] * BATCH,),
                BATCH,
            ),
        }
        result: dict[str, Any] = {}
        for name, (sql, args, rows) in work.items():
            statements = max(1, n // rows)
            for _ in range(WARMUP):
                conn.execute(sql, args, prepare=True)
            cpu0, pg0, wall0 = time.process_time(), _cpu_s(backend), time.perf_counter()
            for _ in range(statements):
                conn.execute(sql, args, prepare=True)
            cpu1, pg1, wall1 = time.process_time(), _cpu_s(backend), time.perf_counter()
            done = statements * rows
            result[name] = {
                "statements": statements,
                "rows": done,
                "client_cpu_us": round(1e6 * (cpu1 - cpu0) / done, 1),
                "postgres_cpu_us": round(1e6 * (pg1 - pg0) / done, 1),
                "wall_us": round(1e6 * (wall1 - wall0) / done, 1),
            }
    return result


def describe(floor: dict[str, Any]) -> str:
    """One sentence of the floor's figures, for the table's notes."""
    s, i = floor["select"], floor["insert_commit"]
    b = floor.get("insert_batch")  # figures recorded before it was measured have none
    batched = (
        ""
        if b is None
        else (
            f" The same {b['rows']:,} rows committed {b['rows'] // b['statements']} to a "
            f"statement ({b['statements']:,} statements) cost {b['client_cpu_us']:.0f} us and "
            f"{b['postgres_cpu_us']:.0f} us a row ({b['wall_us']:.0f} us wall): requests "
            "carried several to a statement are the way below that floor."
        )
    )
    return (
        "The machine's floor (benchmarks/pgfloor.py: one connection, no concurrency, "
        f"{s['statements']:,} statements each): a prepared `SELECT` costs "
        f"{s['client_cpu_us']:.0f} us of the client's CPU and {s['postgres_cpu_us']:.0f} us of "
        f"PostgreSQL's ({s['wall_us']:.0f} us wall); an `INSERT` committed with "
        f"`synchronous_commit` on {i['client_cpu_us']:.0f} us and {i['postgres_cpu_us']:.0f} us "
        f"({i['wall_us']:.0f} us wall). A cycle's three requests, each one statement that "
        f"commits, cost PostgreSQL at least {3 * i['postgres_cpu_us'] / 1000:.2f} ms of CPU here."
        + batched
    )
