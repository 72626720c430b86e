"""Many servers, one tracker: three `nulltickets serve` processes on one PostgreSQL database.

16 agents (threads, each speaking HTTP to one server, moving to another when theirs is gone)
work through the tasks while one server is SIGKILLed mid-run. Then every task is done exactly
once, every transition an agent was told succeeded is in the database, and the leases the
killed server's agents held are reclaimed by the others once they expire. A long-poll on one
server wakes within 1 s of a task created through another. Two servers' claims, events,
transitions and reaper passes meet no deadlock in PostgreSQL.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.conftest import unique, wait_for
from tests.finishing_agent import FinishingAgent
from tests.pgserver import PostgresServer
from tests.server import Client, Server

pytestmark = [
    pytest.mark.process,
    pytest.mark.e2e,
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform == "win32", reason="a server is killed with SIGKILL"),
]

AGENTS = 16
TASKS = 240
HELD = 4  # leases taken on the doomed server and never given back
LEASE_TTL_MS = 2000
WAKE_WITHIN_S = 1.0  # the bound for a cross-server wake-up


def definition(role: str) -> dict[str, Any]:
    return {
        "initial": "todo",
        "states": {"todo": {"agent_role": role}, "done": {"terminal": True}},
        "transitions": [{"from": "todo", "to": "done", "trigger": "finish"}],
    }


@pytest.fixture
def servers(postgres: PostgresServer, tmp_path: Path) -> Iterator[list[Server]]:
    dsn = postgres.dsn(postgres.create_database())
    started: list[Server] = []
    try:
        for i in range(3):
            started.append(Server(tmp_path / f"server{i}.db", dsn=dsn).start(timeout=60))
        yield started
    finally:
        for server in started:
            server.stop()


def dsn_of(server: Server) -> str:
    assert server.dsn is not None
    return server.dsn


class Worker(FinishingAgent):
    """An agent: when its server is gone it moves to the next one, as a load balancer would
    send it."""

    def __init__(self, name: str, role: str, servers: list[Server], first: int) -> None:
        super().__init__(name, role, LEASE_TTL_MS)
        self.servers = servers
        self.at = first

    def client(self) -> Client:
        server = self.servers[self.at % len(self.servers)]
        return Client("127.0.0.1", server.port, timeout=15)

    def lost(self) -> None:
        self.at += 1


def rows(dsn: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql).fetchall()  # type: ignore[arg-type]


def test_three_servers_sixteen_agents_one_killed_every_task_done_once(
    servers: list[Server],
) -> None:
    role = unique("coder")
    admin = servers[1].client()
    r = admin.post("/pipelines", {"name": unique("pipe"), "definition": definition(role)})
    assert r.status == 201, r.body
    pipeline_id = r.json["id"]
    tasks = [
        {"pipeline_id": pipeline_id, "title": f"t{i}", "description": ""} for i in range(TASKS)
    ]
    created: list[str] = []
    for start in range(0, TASKS, 60):
        r = admin.post("/tasks/bulk", {"tasks": tasks[start : start + 60]})
        assert r.status == 201, r.body
        created += r.json["ids"]
    admin.close()

    # Leases taken through the server about to die, by agents that die with it.
    doomed = servers[0].client()
    held = []
    for i in range(HELD):
        r = doomed.post(
            "/leases/claim",
            {"agent_id": f"doomed-{i}", "agent_role": role, "lease_ttl_ms": LEASE_TTL_MS},
        )
        assert r.status == 200, r.body
        held.append(r.json["task"]["id"])
    doomed.close()

    workers = [Worker(f"agent-{i}", role, servers, i % 3) for i in range(AGENTS)]
    for w in workers:
        w.start()
    dsn = dsn_of(servers[0])

    def done() -> int:
        return int(rows(dsn, "SELECT count(*) FROM tasks WHERE stage = 'done'")[0][0])

    wait_for("a tenth of the tasks done", lambda: done() >= TASKS // 10, timeout=120)
    servers[0].kill()  # mid-run: its agents move to the others
    wait_for("every task done", lambda: done() == TASKS, timeout=240, interval=0.2)
    for w in workers:
        w.stop_when_idle.set()
    for w in workers:
        w.join(60)
    assert [u for w in workers for u in w.unexpected] == []

    # Every task done exactly once: one completed run each, and it is in the final stage.
    completed = Counter(
        task_id for (task_id,) in rows(dsn, "SELECT task_id FROM runs WHERE status = 'completed'")
    )
    assert completed == Counter(created)
    assert rows(dsn, "SELECT count(*) FROM runs WHERE status = 'running'") == [(0,)]
    assert rows(dsn, "SELECT count(*) FROM leases") == [(0,)]
    # No acknowledged write lost, none acknowledged twice.
    acknowledged = [entry for w in workers for entry in w.acknowledged]
    assert len({task for task, _ in acknowledged}) == len(acknowledged)
    kept = set(rows(dsn, "SELECT task_id, id FROM runs WHERE status = 'completed'"))
    assert set(acknowledged) <= kept
    # The killed server's leases expired and were reclaimed by the others: the doomed run went
    # stale, and the task was finished later (perhaps after more expiries, on a slow machine).
    for task_id in held:
        found = rows(dsn, f"SELECT status FROM runs WHERE task_id = '{task_id}' ORDER BY attempt")
        statuses = [s for (s,) in found]
        assert statuses[-1] == "completed" and set(statuses[:-1]) == {"stale"}, (
            task_id,
            statuses,
        )


def poll(server: Server, role: str, agent: str, answered: dict[str, Any]) -> None:
    c = server.client()
    r = c.post("/leases/claim", {"agent_id": agent, "agent_role": role, "wait_ms": 20_000})
    answered["at"] = time.monotonic()
    answered["response"] = r
    c.close()


def test_a_long_poll_on_one_server_wakes_within_a_second_of_work_created_on_another(
    servers: list[Server],
) -> None:
    role = unique("coder")
    creator = servers[0].client()
    r = creator.post("/pipelines", {"name": unique("pipe"), "definition": definition(role)})
    assert r.status == 201, r.body
    pipeline_id = r.json["id"]
    for attempt in range(3):
        answered: dict[str, Any] = {}
        thread = threading.Thread(
            target=poll, args=(servers[2], role, f"poller-{attempt}", answered)
        )
        thread.start()
        time.sleep(1.0)  # the long-poll reaches its server and waits (it finds nothing first)
        assert "response" not in answered, answered
        r = creator.post("/tasks", {"pipeline_id": pipeline_id, "title": "t", "description": ""})
        created_at = time.monotonic()
        assert r.status == 201, r.body
        thread.join(30)
        response = answered["response"]
        assert response.status == 200, response.body
        assert response.json["task"]["id"] == r.json["id"]
        assert answered["at"] - created_at < WAKE_WITHIN_S
    creator.close()


CYCLE_TASKS = 600  # at about one deadlock per 50 cycles before the fix, a run without is rare
ABANDONED = 12  # claims with a short lease, never finished: the reapers end them mid-run
SHORT_TTL_MS = 300


class Cycler(threading.Thread):
    """An agent doing the whole cycle on one server: claim, event, transition."""

    def __init__(self, name: str, role: str, server: Server) -> None:
        super().__init__(name=name, daemon=True)
        self.role = role
        self.server = server
        self.finished: list[str] = []
        self.unexpected: list[str] = []
        self.stop_when_idle = threading.Event()

    def run(self) -> None:
        client = Client("127.0.0.1", self.server.port, timeout=30)
        claim = {"agent_id": self.name, "agent_role": self.role, "lease_ttl_ms": 60_000}
        while True:
            r = client.post("/leases/claim", claim)
            if r.status == 204:
                if self.stop_when_idle.is_set():
                    client.close()
                    return
                time.sleep(0.05)  # the abandoned tasks come back once reaped
                continue
            if r.status != 200:
                self.unexpected.append(f"claim {r.status} {r.body[:200]!r}")
                continue
            run_id, token = r.json["run"]["id"], r.json["lease_token"]
            r = client.post(f"/runs/{run_id}/events", {"kind": "progress"}, token=token)
            if r.status != 201:
                self.unexpected.append(f"event {r.status} {r.body[:200]!r}")
            r = client.post(f"/runs/{run_id}/transition", {"trigger": "finish"}, token=token)
            if r.status == 200:
                self.finished.append(run_id)
            else:
                self.unexpected.append(f"transition {r.status} {r.body[:200]!r}")


def deadlocks(dsn: str) -> int:
    found = rows(dsn, "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
    return int(found[0][0])


def deadlock_reports(postgres: PostgresServer) -> str:
    """What the cluster's log says of the deadlocks it found: the cycle, statement by
    statement (each report runs from its ERROR line to its STATEMENT line)."""
    lines = postgres.log.read_text(errors="replace").splitlines()
    kept: list[str] = []
    inside = False
    for line in lines:
        if "deadlock detected" in line:
            inside = True
        if inside:
            kept.append(line)
            inside = "STATEMENT:" not in line
    return "\n".join(kept[-400:])


def test_two_servers_claims_and_lease_writes_never_deadlock(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    """Claims, events, transitions and reaper passes of 16 agents split over two servers on
    one database take their row locks in one order, so PostgreSQL never finds a deadlock
    (each would cost deadlock_timeout and a retry of the unit of work)."""
    name = postgres.create_database()
    with postgres.admin() as conn:  # the waits behind a deadlock, in the cluster's log
        conn.execute(f'ALTER DATABASE "{name}" SET log_lock_waits = on')
    dsn = postgres.dsn(name)
    started = [Server(tmp_path / f"server{i}.db", dsn=dsn).start(timeout=60) for i in range(2)]
    try:
        role = unique("coder")
        admin = started[0].client()
        r = admin.post("/pipelines", {"name": unique("pipe"), "definition": definition(role)})
        assert r.status == 201, r.body
        pipeline_id = r.json["id"]
        created: list[str] = []
        for start in range(0, CYCLE_TASKS, 100):
            batch = [
                {"pipeline_id": pipeline_id, "title": f"t{i}", "description": ""}
                for i in range(start, min(start + 100, CYCLE_TASKS))
            ]
            r = admin.post("/tasks/bulk", {"tasks": batch})
            assert r.status == 201, r.body
            created += r.json["ids"]
        admin.close()
        before = deadlocks(dsn)

        # Leases that expire while the agents work, one every 100 ms: every claim's reaper pass,
        # on either server, ends them and the tasks come back to be claimed. Taken before the
        # agents start: taken among them, a claim found nothing left once they were quick.
        abandoned = [started[i % 2].client() for i in range(2)]
        for i in range(ABANDONED):
            ttl = SHORT_TTL_MS + 100 * i
            claim = {"agent_id": f"gone-{i}", "agent_role": role, "lease_ttl_ms": ttl}
            r = abandoned[i % 2].post("/leases/claim", claim)
            assert r.status == 200, r.body
        for c in abandoned:
            c.close()
        agents = [Cycler(f"agent-{i}", role, started[i % 2]) for i in range(AGENTS)]
        for agent in agents:
            agent.start()

        def done() -> int:
            return int(rows(dsn, "SELECT count(*) FROM tasks WHERE stage = 'done'")[0][0])

        wait_for("every task done", lambda: done() == CYCLE_TASKS, timeout=300, interval=0.2)
        for agent in agents:
            agent.stop_when_idle.set()
        for agent in agents:
            agent.join(60)
    finally:
        for server in started:
            server.stop()  # their sessions end: PostgreSQL counts what they met in its stats
    assert [u for agent in agents for u in agent.unexpected] == []
    completed = Counter(
        task_id for (task_id,) in rows(dsn, "SELECT task_id FROM runs WHERE status = 'completed'")
    )
    assert completed == Counter(created)
    assert sorted(run for agent in agents for run in agent.finished) == sorted(
        run_id for (run_id,) in rows(dsn, "SELECT id FROM runs WHERE status = 'completed'")
    )
    assert rows(dsn, "SELECT count(*) FROM runs WHERE status = 'running'") == [(0,)]
    assert rows(dsn, "SELECT count(*) FROM runs WHERE status = 'stale'") == [(ABANDONED,)]
    found = deadlocks(dsn) - before
    assert found == 0, f"{found} deadlocks:\n{deadlock_reports(postgres)}"
