"""Suite 1, server crash under load: agent processes work claim -> events -> transition or fail
while the server is SIGKILLed at random moments and restarted on the same file. Then every task
is in exactly one stage, none was completed twice, everything an agent was told succeeded is in
the file (durability full), no lease or run is orphaned, and SQLite's and FTS5's own integrity
checks pass.

`make test` runs 5 kill/restart cycles; `make soak` (NULLTICKETS_SOAK=1) runs 25.
"""

from __future__ import annotations

import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.reliability.helpers import (
    Agent,
    Journals,
    assert_storage_healthy,
    open_db,
    rows,
    start_agent,
)
from tests.reliability.invariants import check_acknowledged, check_tasks
from tests.reliability.report import Recorder, scale
from tests.server import Client, Server

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        sys.platform == "win32", reason="agents and servers are killed with SIGKILL"
    ),
]

CYCLES = scale(5, 25)
AGENTS = 4
TASKS = scale(1500, 6000)
LEASE_TTL_MS = 3000
MAX_BODY = 60_000

DEFINITION: dict[str, Any] = {
    "initial": "todo",
    "states": {
        "todo": {"agent_role": "coder"},
        "review": {"agent_role": "reviewer"},
        "done": {"terminal": True},
        "dead": {"terminal": True},
    },
    "transitions": [
        {"from": "todo", "to": "review", "trigger": "submit"},
        {"from": "review", "to": "done", "trigger": "approve"},
    ],
}


def create_tasks(client: Client, pipeline_id: str, count: int) -> list[str]:
    """`count` tasks in bulk; every third may fail three times before it is dead-lettered."""
    ids: list[str] = []
    chunk: list[dict[str, Any]] = []

    def flush() -> None:
        r = client.post("/tasks/bulk", {"tasks": chunk})
        assert r.status == 201, r.body
        ids.extend(r.json["ids"])
        chunk.clear()

    for i in range(count):
        task: dict[str, Any] = {"pipeline_id": pipeline_id, "title": f"t{i}", "description": ""}
        if i % 3 == 0:
            task["retry_policy"] = {"max_attempts": 3, "dead_letter_stage": "dead"}
        if chunk and len(json.dumps({"tasks": [*chunk, task]})) > MAX_BODY:
            flush()
        chunk.append(task)
    flush()
    return ids


def progressed(agents: list[Agent], before: int) -> Callable[[], bool]:
    return lambda: acked(agents) > before


def acked(agents: list[Agent]) -> int:
    ops = ("claim", "event", "transition", "fail", "put", "delete")
    return sum(1 for a in agents for e in a.entries() if e.get("op") in ops)


@pytest.mark.slow
@pytest.mark.timeout(scale(240, 1200))
def test_sigkill_under_load_loses_nothing_acknowledged(tmp_path: Path, record: Recorder) -> None:
    row = record(
        "server crash",
        f"SIGKILL the server at random moments under {AGENTS} agent processes "
        "(claim -> events -> transition/fail -> store), restart on the same file "
        "(durability full)",
        0,
        "kill/restart cycles",
    )
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    server = Server(tmp_path / "crash.db", args=["--durability", "full"]).start()
    agents: list[Agent] = []
    stop = tmp_path / "stop"
    try:
        admin = server.client()
        r = admin.post("/pipelines", {"name": "crash", "definition": DEFINITION})
        assert r.status == 201, r.body
        task_ids = create_tasks(admin, r.json["id"], TASKS)
        admin.close()

        for i in range(AGENTS):
            agents.append(
                start_agent(
                    tmp_path,
                    f"agent-{i}",
                    server.port,
                    "--roles",
                    "coder,reviewer" if i % 2 else "reviewer,coder",
                    "--events",
                    "2",
                    "--fail-ratio",
                    "0.1",
                    "--store",
                    "--think-ms",
                    "10",
                    "--lease-ttl-ms",
                    str(LEASE_TTL_MS),
                    "--stop-file",
                    str(stop),
                    "--retry-s",
                    "60",
                    "--seed",
                    str(seed + i),
                    # Half the agents claim with an Idempotency-Key too: a claim whose answer
                    # the crash swallowed is replayed, not claimed again.
                    *(["--claim-key"] if i % 2 else []),
                )
            )
        wait_for("the agents to get going", lambda: acked(agents) >= 20, timeout=30)

        downtime: list[float] = []
        for cycle in range(CYCLES):
            before = acked(agents)
            time.sleep(rng.uniform(0.3, 2.0))
            wait_for(f"work between kills (cycle {cycle})", progressed(agents, before), 30)
            killed = time.monotonic()
            server.kill()
            time.sleep(rng.uniform(0.0, 0.5))
            server.start()
            downtime.append(time.monotonic() - killed)
            row.tried = cycle + 1
            assert all(a.proc.poll() is None for a in agents), [a.output() for a in agents]

        before = acked(agents)
        wait_for("work after the last restart", lambda: acked(agents) > before + 10, 30)
        stop.touch()
        for agent in agents:
            assert agent.wait(90) == 0, agent.output()
        # One last crash: the file is checked as a crash left it.
        server.kill()

        journals = Journals.of(agents)
        stats = journals.stats()
        health = assert_storage_healthy(server.db)
        problems, summary = check_tasks(server.db, DEFINITION)
        lost, checked = check_acknowledged(server.db, journals)
        with open_db(server.db) as conn:
            stored = {r[0] for r in rows(conn, "SELECT id FROM tasks")}
        missing_tasks = [t for t in task_ids if t not in stored]
        assert missing_tasks == [], f"{len(missing_tasks)} acknowledged tasks lost"
        assert lost == [], lost[:20]
        assert problems == [], problems[:20]
        assert stats.get("server_errors", 0) == 0, journals.ops("server_error")[:5]
        assert summary["runs_completed"] > 0 and summary.get("runs_failed", 0) > 0, summary

        # Restarted once more, the server expires what the crash left leased, and ends clean.
        server.start()
        wait_for(
            "the leases the crash left to expire",
            lambda: leases_and_running(server.db) == (0, 0),
            timeout=LEASE_TTL_MS / 1000 + 20,
            interval=0.2,
        )
        assert server.stop() in (0, -15, 143)
        problems_after, summary_after = check_tasks(server.db, DEFINITION)
        assert problems_after == [], problems_after[:20]
        assert_storage_healthy(server.db)

        row.tried = CYCLES
        row.detail = (
            f"{checked} acknowledged answers checked, 0 lost; {summary['tasks']} tasks in one "
            f"stage each, none completed twice; {summary['runs']} runs "
            f"({summary.get('runs_stale', 0)} stale after restarts, "
            f"{summary_after.get('runs_stale', 0)} after the final expiry); "
            "no orphan lease or run; "
            f"integrity_check {health['integrity'][0]}, foreign_key_check clean, "
            f"FTS5 integrity-check {health['fts']}; downtime per cycle "
            f"{min(downtime):.1f}-{max(downtime):.1f} s; seed {seed}"
        )
        row.extra.update(
            acknowledged=checked,
            seed=seed,
            connection_errors=stats.get("connection_errors", 0),
            **summary_after,
        )
    finally:
        stop.touch()
        for agent in agents:
            agent.kill()
        server.kill()


def leases_and_running(db: Path) -> tuple[int, int]:
    with open_db(db) as conn:
        leases = rows(conn, "SELECT count(*) FROM leases")[0][0]
        running = rows(conn, "SELECT count(*) FROM runs WHERE status = 'running'")[0][0]
    return int(leases), int(running)
