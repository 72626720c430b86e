"""What watching costs: idle Server-Sent Events streams, and a Prometheus scrape."""

from __future__ import annotations

import asyncio
import http.client
import multiprocessing
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import BenchServer
from benchmarks.seed import seed_database


async def _watch_many(port: int, clients: int, seconds: float) -> int:
    """Keep `clients` GET /events/stream open for `seconds`; count the bytes they received."""
    streams = []
    for _ in range(clients):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /events/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        streams.append((reader, writer))
    received = 0

    async def drain(reader: asyncio.StreamReader) -> None:
        nonlocal received
        while chunk := await reader.read(4096):
            received += len(chunk)

    tasks = [asyncio.ensure_future(drain(r)) for r, _ in streams]
    await asyncio.sleep(seconds)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for _, w in streams:
        w.close()
    return received


def _client(port: int, clients: int, seconds: float, queue: Any) -> None:
    queue.put(asyncio.run(_watch_many(port, clients, seconds)))


def idle_sse(work: Path, clients: int = 200, seconds: float = 10.0) -> dict[str, Any]:
    """Server CPU while `clients` event streams are open and nothing happens (the same
    measure as idle_long_poll: the streams' heartbeats are all they cost)."""
    with BenchServer(work / "idle-sse.db") as server:
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_client, args=(server.port, clients, seconds + 2.0, queue))
        proc.start()
        time.sleep(2.0)  # streams open and waiting
        cpu0, t0 = server.cpu_s(), time.monotonic()
        time.sleep(seconds)
        cpu, wall = server.cpu_s() - cpu0, time.monotonic() - t0
        proc.join(60)
        received = queue.get(timeout=5)
    return {
        "clients": clients,
        "seconds": round(wall, 2),
        "server_cpu_percent_of_one_core": round(100 * cpu / wall, 2),
        "bytes_received": received,
    }


def metrics_cost(work: Path, calls: int = 200, done: int = 10_000) -> dict[str, Any]:
    """p50 of GET /metrics on a database with `done` finished tasks and a few waiting."""
    db = work / "metrics.db"
    seed_database(db, done=done, waiting=20)
    latencies: list[float] = []
    size = 0
    with BenchServer(db) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        for _ in range(calls):
            t0 = time.perf_counter()
            conn.request("GET", "/metrics")
            r = conn.getresponse()
            body = r.read()
            latencies.append(time.perf_counter() - t0)
            if r.status != 200:
                raise RuntimeError(f"/metrics answered {r.status}")
            size = len(body)
        conn.close()
    latencies.sort()
    return {
        "calls": calls,
        "finished_tasks": done,
        "p50_ms": round(latencies[len(latencies) // 2] * 1000, 3),
        "bytes": size,
    }
