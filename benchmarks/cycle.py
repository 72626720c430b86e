"""The HTTP agent cycle (claim -> event -> transition): one run against one or more servers on
one database, and the median of several runs."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.harness import BenchServer, bulk_load, create_pipeline
from benchmarks.load import ENDPOINTS, run_agents


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def host_cpu() -> list[int] | None:
    """The machine's CPU time by kind since boot (Linux's /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def host_share(before: list[int] | None, after: list[int] | None) -> dict[str, float]:
    """The shares of the machine's CPU time between two host_cpu() readings that were idle and
    that the hypervisor gave to others (steal): a run's figures mean little when steal is high."""
    if not before or not after or len(after) < 8:
        return {}
    delta = [b - a for a, b in zip(before, after, strict=False)]
    total = sum(delta[:8]) or 1
    return {"idle": round(delta[3] / total, 3), "steal": round(delta[7] / total, 3)}


def mean_of(metrics: str, name: str) -> float | None:
    """The mean of the Prometheus histogram `name` in `metrics` (its _sum over its _count)."""
    found: dict[str, float] = {}
    for line in metrics.splitlines():
        for part in ("_sum", "_count"):
            if line.startswith(f"{name}{part} "):
                found[part] = float(line.split()[-1])
    if not found.get("_count"):
        return None
    return found["_sum"] / found["_count"]


def per_cycle_ms(cpu_s: float, cycles: int) -> float | None:
    """CPU milliseconds per completed cycle, or None when none completed."""
    return round(cpu_s * 1000 / cycles, 3) if cycles else None


def measure(
    servers: list[BenchServer],
    agents: int,
    tasks: int,
    *,
    postgres_cpu: Callable[[], float] | None = None,
    warmup: int = 0,
) -> dict[str, Any]:
    """Load `tasks` tasks through the first server, then let `agents` agents, split evenly
    across the servers, work through them. Server CPU is the sum over the servers, peak memory
    the largest of any. With `postgres_cpu` (the database's CPU seconds so far), the
    database's CPU over the same stretch comes with it. With `warmup`, the same agents first
    work through that many tasks, unmeasured: what a server does once, on its first requests
    (its connections to PostgreSQL and their statements' plans, its caches), is left out of a
    run that measures what it does for as long as it runs."""
    pipeline = create_pipeline(servers[0])
    if warmup:
        bulk_load(servers[0], pipeline, warmup)
        run_agents([s.port for s in servers], agents, "worker", "complete", 4)
    ids = bulk_load(servers[0], pipeline, tasks)
    cpu0 = sum(s.cpu_s() for s in servers)
    db0 = postgres_cpu() if postgres_cpu else 0.0
    host0 = host_cpu()
    report, wall = run_agents([s.port for s in servers], agents, "worker", "complete", 4)
    host = host_share(host0, host_cpu())
    server_cpu = sum(s.cpu_s() for s in servers) - cpu0
    db_cpu = postgres_cpu() - db0 if postgres_cpu else None
    peak = max(s.peak_rss_mb() for s in servers)
    completed = report.completed
    requests = sum(len(report.latencies[e]) for e in ENDPOINTS)
    latency_sum = sum(sum(report.latencies[e]) for e in ENDPOINTS)
    cpus = os.cpu_count() or 1
    client_cores = report.cpu_s / wall
    database: dict[str, Any] = {}
    if db_cpu is not None:
        database = {
            "postgres_cpu_cores": round(db_cpu / wall, 2),
            "postgres_cpu_ms_per_cycle": per_cycle_ms(db_cpu, len(completed)),
        }
    return {
        "agents": agents,
        "servers": len(servers),
        "tasks": tasks,
        "warmup": warmup,
        "seconds": round(wall, 3),
        "cycles_per_s": round(len(completed) / wall, 1),
        "requests_per_s": round(requests / wall, 1),
        "latency_ms": {
            e: {
                q: round(pct(report.latencies[e], v), 3)
                for q, v in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
            }
            for e in ENDPOINTS
        },
        "request_mean_ms": round(latency_sum / max(requests, 1) * 1000, 3),
        "completed_exactly_once": sorted(completed) == sorted(ids),
        "errors": report.errors,
        "server_cpu_cores": round(server_cpu / wall, 2),
        "client_cpu_cores": round(client_cores, 2),
        "server_cpu_ms_per_cycle": per_cycle_ms(server_cpu, len(completed)),
        "client_cpu_ms_per_cycle": per_cycle_ms(report.cpu_s, len(completed)),
        **database,
        "client_bound": client_cores > 0.5 * cpus,
        "server_peak_rss_mb": round(peak, 1),
        "host": host,
    }


def cycle_tasks(agents: int, quick: bool) -> int:
    """Enough tasks for several seconds of load at each concurrency."""
    return max(agents * 20, 200) if quick else min(20_000, max(3_000, agents * 1_500))


def cycle(
    workdir: Path,
    agents: int,
    tasks: int,
    durability: str,
    *,
    env: dict[str, str] | None = None,
    cmd: list[str] | None = None,
    warmup: int = 0,
) -> dict[str, Any]:
    """One run on a new SQLite file and a fresh server (`env` and `cmd` as for BenchServer,
    `warmup` as for `measure`). With `full`, the server's own means of its WAL syncs and of
    each batch's wait for one (GET /metrics) come with it, where the server has them."""
    db = workdir / f"cycle-{agents}-{durability}-{uuid.uuid4().hex[:8]}.db"
    with BenchServer(db, durability=durability, env=env, cmd=cmd) as server:
        result = measure([server], agents, tasks, warmup=warmup)
        if durability == "full":
            metrics = server.text("/metrics")
            for key, name in (
                ("wal_sync_ms_mean", "nulltickets_wal_sync_duration_seconds"),
                ("durable_wait_ms_mean", "nulltickets_durable_wait_seconds"),
            ):
                mean = mean_of(metrics, name)
                if mean is not None:
                    result[key] = round(mean * 1000, 3)
    return {"engine": "sqlite", "durability": durability, **result}


def cycle_rounds(
    workdir: Path, agents: int, tasks: int, durability: str, rounds: int
) -> dict[str, Any]:
    """`rounds` runs of the cycle, each on a fresh server and database. The figures are those
    of the median run (by cycles/s): a shared machine's speed drifts by several percent from
    one run to the next. Every run's cycles/s is kept, and every run must complete each task
    exactly once."""
    return median_run([cycle(workdir, agents, tasks, durability) for _ in range(rounds)])


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median cycles/s, carrying every run's cycles/s, whether all of them
    completed each task exactly once, and the highest peak memory of any."""
    ordered = sorted(runs, key=lambda r: r["cycles_per_s"])
    result = dict(ordered[(len(ordered) - 1) // 2])  # the lower median when even
    result["rounds_cycles_per_s"] = [r["cycles_per_s"] for r in runs]
    result["completed_exactly_once"] = all(r["completed_exactly_once"] for r in runs)
    result["server_peak_rss_mb"] = max(r["server_peak_rss_mb"] for r in runs)
    return result
