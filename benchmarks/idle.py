"""What waiting costs: N agents long-polling a role that has no work, for a while."""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import BenchServer, create_pipeline
from benchmarks.load import Conn


async def _wait_many(port: int, agents: int, seconds: float) -> int:
    """Keep `agents` long-poll claims (wait_ms 30 s) open for `seconds`; count the answers."""
    conns = [await Conn.open(port) for _ in range(agents)]
    answers = 0
    deadline = time.monotonic() + seconds

    async def poll(conn: Conn, i: int) -> None:
        nonlocal answers
        body = f'{{"agent_id":"idle-{i}","agent_role":"idle-role","wait_ms":30000}}'.encode()
        while time.monotonic() < deadline:
            status, _ = await conn.post("/leases/claim", body)
            answers += 1
            if status not in (200, 204):
                raise RuntimeError(f"claim answered {status}")

    tasks = [asyncio.ensure_future(poll(c, i)) for i, c in enumerate(conns)]
    await asyncio.sleep(seconds)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for c in conns:
        c.close()
    return answers


def _client(port: int, agents: int, seconds: float, queue: Any) -> None:
    queue.put(asyncio.run(_wait_many(port, agents, seconds)))


def idle_long_poll(work: Path, agents: int = 200, seconds: float = 10.0) -> dict[str, Any]:
    with BenchServer(work / "idle.db") as server:
        create_pipeline(server, role="idle-role")
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_client, args=(server.port, agents, seconds + 2.0, queue))
        proc.start()
        time.sleep(2.0)  # connections open and waiting
        cpu0, t0 = server.cpu_s(), time.monotonic()
        time.sleep(seconds)
        cpu, wall = server.cpu_s() - cpu0, time.monotonic() - t0
        proc.join(60)
        answers = queue.get(timeout=5)
    return {
        "agents": agents,
        "seconds": round(wall, 2),
        "server_cpu_percent_of_one_core": round(100 * cpu / wall, 2),
        "claims_answered_while_waiting": answers,
    }
