"""The storage core without HTTP: claim -> event -> transition cycles per second, in-process,
for each core implementation that can be loaded here."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec

from benchmarks.harness import PIPELINE
from nulltickets import core
from nulltickets.domain.clock import wall_ms as now_ms
from nulltickets.domain.commands import AppendEvent, Claim, CreatePipeline, CreateTask, MoveTask
from nulltickets.domain.tokens import lease_token_hash
from nulltickets.service import Tracker
from nulltickets.storage.backend import Backend
from nulltickets.storage.sqlite.database import SqliteDatabase


def _run(db_path: Path, cycles: int) -> float:
    database = SqliteDatabase(str(db_path), durability="normal")  # CPU, not fsync
    database.open()
    tracker = Tracker()
    definition = msgspec.Raw(msgspec.json.encode(PIPELINE))

    def setup(b: Backend) -> None:
        pipeline = tracker.create_pipeline(b, CreatePipeline("core", definition), now_ms())
        for _ in range(cycles):
            tracker.add_task(b, CreateTask(pipeline, "t", ""), now_ms())

    database.write_sync(setup)
    claim, move = Claim("agent", "worker"), MoveTask("complete")
    event = AppendEvent("progress", msgspec.Raw(b'{"step":1}'))

    def cycle(b: Backend) -> None:
        now = now_ms()
        claimed = tracker.claim(b, claim, now)
        assert claimed is not None
        token_hash = lease_token_hash(claimed.lease_token)
        tracker.append_event(b, claimed.run.id, token_hash, event, now)
        lease = b.lease_by_run(claimed.run.id)
        assert lease is not None
        tracker.transition(b, lease, move, now)

    started = time.perf_counter()
    for _ in range(cycles):
        database.write_sync(cycle)
    elapsed = time.perf_counter() - started
    database.close()
    return cycles / elapsed


def _measure(db: str, cycles: int) -> None:
    """Entry point of the measuring subprocess: prints `<implementation> <cycles/s>`."""
    print(core.IMPLEMENTATION, _run(Path(db), cycles))


def core_cycles(work: Path, cycles: int) -> dict[str, Any]:
    """One transaction per cycle (the worst case for the commit path), once with the compiled
    core (when it was built) and once interpreted, each in a process of its own."""
    rates: dict[str, float] = {}
    for pure in (False, True):
        env = {**os.environ, "NULLTICKETS_PURE_PYTHON": "1" if pure else ""}
        db = work / f"core-{'python' if pure else 'default'}.db"
        code = f"from benchmarks.core import _measure; _measure({str(db)!r}, {cycles})"
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        name, rate = out.stdout.split()
        rates[name] = round(float(rate), 1)
    ratio = round(rates["compiled"] / rates["python"], 3) if "compiled" in rates else None
    return {"cycles_per_s": rates, "ratio": ratio, "note": "one commit per cycle, normal"}
