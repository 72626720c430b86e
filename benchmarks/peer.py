"""A peer on the same PostgreSQL cluster, for comparison: procrastinate, a job queue for Python
on PostgreSQL (the `bench` extra installs the version constraints.txt pins).

Its jobs are enqueued in one batch (`Task.batch_defer_async`, timed on its own), then
`agents` coroutines in this process, over one pool of as many connections, each loop
fetch -> complete with procrastinate's own job manager: `fetch_job` (its
`procrastinate_fetch_job_v2` function, one `FOR UPDATE SKIP LOCKED` claim) and `finish_job`
(`procrastinate_finish_job`), the calls its worker makes for each job, until none is left. The
job itself does nothing. There is no HTTP and no separate client: the process's CPU is the
queue's and its agents' together. `normal` opens its connections with
`synchronous_commit = off`, as nulltickets does; `full` leaves the cluster's `on`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from benchmarks.cycle import host_cpu, host_share, pct, per_cycle_ms

NAME = "procrastinate"
QUEUE = "bench"


def version() -> str | None:
    """The installed procrastinate's version, or None when it is not installed."""
    try:
        from importlib.metadata import version as installed

        import procrastinate  # noqa: F401

        return installed("procrastinate")
    except ImportError:
        return None


def run(
    dsn: str,
    agents: int,
    jobs: int,
    durability: str,
    postgres_cpu: Callable[[], float],
    warmup: int = 0,
) -> dict[str, Any]:
    """One run on a fresh database `dsn`: its schema, `jobs` jobs enqueued, then `agents`
    agents fetching and completing them. The row has the figures of a cycle row (a cycle is
    one job fetched and completed; its "claim" is the fetch), the process's CPU as the server's,
    and the cluster's CPU (`postgres_cpu`) over the same stretch. With `warmup`, the agents
    first work through that many jobs, unmeasured, as nulltickets' servers do in the same
    section (benchmarks.cycle.measure)."""
    return asyncio.run(_run(dsn, agents, jobs, durability, postgres_cpu, warmup))


async def _run(
    dsn: str,
    agents: int,
    jobs: int,
    durability: str,
    postgres_cpu: Callable[[], float],
    warmup: int,
) -> dict[str, Any]:
    import procrastinate
    from procrastinate.jobs import Status

    options = {} if durability == "full" else {"options": "-c synchronous_commit=off"}
    connector = procrastinate.PsycopgConnector(
        conninfo=dsn, min_size=agents, max_size=agents, kwargs=options
    )
    app = procrastinate.App(connector=connector)

    @app.task(name="noop", queue=QUEUE)
    async def noop() -> None:
        return None

    async with app.open_async():
        await app.schema_manager.apply_schema_async()
        manager = app.job_manager
        clock = time.perf_counter

        async def agent(
            worker_id: int, fetch: list[float], complete: list[float], done: list[int]
        ) -> None:
            while True:
                t0 = clock()
                job = await manager.fetch_job(queues=[QUEUE], worker_id=worker_id)
                t1 = clock()
                fetch.append(t1 - t0)
                if job is None:
                    return
                await manager.finish_job(job, Status.SUCCEEDED, delete_job=False)
                complete.append(clock() - t1)
                assert job.id is not None
                done.append(job.id)

        if warmup:  # the same agents over `warmup` jobs first, their figures dropped
            await noop.batch_defer_async(*({} for _ in range(warmup)))
            warming = await manager.register_worker()
            await asyncio.gather(*(agent(warming, [], [], []) for _ in range(agents)))
            await manager.unregister_worker(warming)
        t0 = time.perf_counter()
        ids = await noop.batch_defer_async(*({} for _ in range(jobs)))
        enqueue_s = time.perf_counter() - t0
        worker_id = await manager.register_worker()
        fetch: list[float] = []
        complete: list[float] = []
        done: list[int] = []

        cpu0, db0, host0 = time.process_time(), postgres_cpu(), host_cpu()
        start = clock()
        await asyncio.gather(*(agent(worker_id, fetch, complete, done) for _ in range(agents)))
        wall = clock() - start
        cpu, db_cpu = time.process_time() - cpu0, postgres_cpu() - db0
        host = host_share(host0, host_cpu())
        await manager.unregister_worker(worker_id)

    def quantiles(values: list[float]) -> dict[str, float]:
        return {
            q: round(pct(values, v), 3) for q, v in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
        }

    cycles = len(done)
    return {
        "engine": NAME,
        "durability": durability,
        "servers": 0,  # in-process: no server
        "agents": agents,
        "tasks": jobs,
        "warmup": warmup,
        "seconds": round(wall, 3),
        "cycles_per_s": round(cycles / wall, 1),
        "enqueue_per_s": round(jobs / enqueue_s, 1),
        "latency_ms": {"claim": quantiles(fetch), "complete": quantiles(complete)},
        "completed_exactly_once": sorted(done) == sorted(ids),
        "errors": {},
        "server_cpu_cores": round(cpu / wall, 2),
        "server_cpu_ms_per_cycle": per_cycle_ms(cpu, cycles),
        "postgres_cpu_cores": round(db_cpu / wall, 2),
        "postgres_cpu_ms_per_cycle": per_cycle_ms(db_cpu, cycles),
        "host": host,
    }
