"""Databases with large backlogs, seeded in-process, and the latencies measured on them."""

from __future__ import annotations

import http.client
import json
import time
import uuid
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.harness import PIPELINE, BenchServer
from nulltickets.domain.clock import wall_ms as now_ms
from nulltickets.domain.commands import CreatePipeline
from nulltickets.service import Tracker
from nulltickets.storage.backend import Backend, NewTask
from nulltickets.storage.factory import open_database


def seed_database(db: Path | str, *, done: int, waiting: int, history: bool = False) -> str:
    """A pipeline todo -> done (role `worker`) with `done` finished and `waiting` ready tasks,
    in a SQLite file or a PostgreSQL database (`db` a URL). With `history`, each finished task
    has the run that completed it and every waiting task one failed attempt, as a server that
    worked through them would have left them."""
    database = open_database(str(db))
    tracker = Tracker()
    definition = msgspec.Raw(msgspec.json.encode(PIPELINE))

    def job(b: Backend) -> str:
        now = now_ms()
        pipeline = tracker.create_pipeline(b, CreatePipeline("bench", definition), now)
        start = now - 86_400_000
        # Through the Backend protocol (any backend), one prepared statement for every row.
        stages = ["done"] * done + ["todo"] * waiting
        runs: list[tuple[str, str, int]] = []
        for i, stage in enumerate(stages):
            task = str(uuid.uuid4())
            b.insert_task(NewTask(task, pipeline, stage, "seeded", start + i))
            if history:
                run = str(uuid.uuid4())
                b.insert_run(run, task, "seeded", "worker", start + i, str(uuid.uuid4()))
                runs.append((run, stage, start + i))
        # Ended once all are in: PostgreSQL plans the statement for a table of their size (it
        # keeps the plan it made first, and a plan made for an empty table reads every row).
        for run, stage, at in runs:
            ended, error = ("completed", None) if stage == "done" else ("failed", "seeded")
            b.end_run(run, ended, "{}", error, at)
        return pipeline

    try:
        return database.write_sync(job)
    finally:
        database.close()


def _post(
    conn: http.client.HTTPConnection, path: str, body: Any, token: str | None = None
) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    conn.request("POST", path, body=json.dumps(body), headers=headers)
    r = conn.getresponse()
    payload = r.read()
    return r.status, (json.loads(payload) if payload else None)


def measure_claims(db: Path, claims: int) -> dict[str, float]:
    """Claim latency of one agent doing claim -> transition `claims` times on `db`."""
    latencies: list[float] = []
    with BenchServer(db) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        for _ in range(claims):
            t0 = time.perf_counter()
            status, claimed = _post(
                conn, "/leases/claim", {"agent_id": "b", "agent_role": "worker"}
            )
            latencies.append(time.perf_counter() - t0)
            if status != 200:
                raise RuntimeError(f"claim answered {status}")
            _post(
                conn,
                f"/runs/{claimed['run']['id']}/transition",
                {"trigger": "complete"},
                claimed["lease_token"],
            )
        conn.close()
    latencies.sort()
    return {
        "claims": claims,
        "claim_p50_ms": round(latencies[len(latencies) // 2] * 1000, 3),
        "claim_p95_ms": round(latencies[int(len(latencies) * 0.95)] * 1000, 3),
    }


def measure_ops_queue(db: Path | str, calls: int, log: Path | None = None) -> dict[str, float]:
    latencies: list[float] = []
    with BenchServer(db, log=log) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        for _ in range(calls):
            t0 = time.perf_counter()
            conn.request("GET", "/ops/queue")
            r = conn.getresponse()
            r.read()
            latencies.append(time.perf_counter() - t0)
            if r.status != 200:
                raise RuntimeError(f"/ops/queue answered {r.status}")
        conn.close()
    latencies.sort()
    return {"calls": calls, "p50_ms": round(latencies[len(latencies) // 2] * 1000, 3)}
