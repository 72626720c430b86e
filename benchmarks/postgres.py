"""The agent cycle on PostgreSQL: one `nulltickets serve --db postgresql://...`, and two servers
on the same database with the agents split across them. The cluster is a throwaway one of its
own (benchmarks/pgcluster.py), with fsync on; the servers run with `--durability normal`
(synchronous_commit off on their connections), like the SQLite cycle rows. Each run gets a new
database and fresh servers."""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.cycle import measure, median_run
from benchmarks.harness import BenchServer
from benchmarks.pgcluster import PostgresServer, PostgresUnavailable, start_postgres

SERVERS = (1, 2)


def unavailable_rows(agents_list: tuple[int, ...], reason: str) -> list[dict[str, Any]]:
    """The rows of a section that could not run: each says why instead of giving a figure."""
    return [
        {"engine": "postgresql", "servers": n, "agents": a, "not_measured": reason}
        for a in agents_list
        for n in SERVERS
    ]


def run(
    cluster: PostgresServer, work: Path, agents: int, servers: int, tasks: int
) -> dict[str, Any]:
    dsn = cluster.dsn(cluster.create_database())
    with ExitStack() as stack:
        running = [
            stack.enter_context(
                BenchServer(dsn, log=work / f"pg-{agents}-{servers}-{k}-{dsn[-8:]}.log")
            )
            for k in range(servers)
        ]
        result = measure(running, agents, tasks)
    return {"engine": "postgresql", "durability": "normal", **result}


def postgres_rows(
    work: Path, agents_list: tuple[int, ...], tasks: int, rounds: int
) -> tuple[list[dict[str, Any]], str | None]:
    """Every (agents, servers) row, the median of `rounds` runs, and the cluster's version;
    when PostgreSQL (or its driver) is not there, rows that say so and no version."""
    try:
        import psycopg  # noqa: F401  (the driver the servers need)
    except ImportError:
        reason = "no PostgreSQL driver: pip install 'nulltickets[postgres]'"
        return unavailable_rows(agents_list, reason), None
    try:
        cluster = start_postgres()
    except PostgresUnavailable as exc:
        return unavailable_rows(agents_list, str(exc)), None
    try:
        with cluster.admin() as conn:
            row = conn.execute("SHOW server_version").fetchone()
        version = str(row[0]) if row else None
        rows = []
        for agents in agents_list:
            for servers in SERVERS:
                try:
                    runs = [run(cluster, work, agents, servers, tasks) for _ in range(rounds)]
                except RuntimeError as exc:  # a server that did not start: say so, go on
                    rows += unavailable_rows((agents,), str(exc))[servers - 1 : servers]
                    continue
                rows.append(median_run(runs))
                print(
                    f"  {agents:>3} agents, {servers} server{'s' if servers > 1 else ''}: "
                    f"{rows[-1]['cycles_per_s']:>8.0f} cycles/s",
                    flush=True,
                )
        return rows, version
    finally:
        cluster.stop()
