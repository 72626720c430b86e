"""Suite 1 on PostgreSQL: the server crash test with the server on a PostgreSQL database of a
cluster of the test's own, and its sibling where PostgreSQL itself is SIGKILLed and restarted.

With the server SIGKILLed at random moments under agent processes, nothing an agent was told
succeeded is lost, every task is in one stage, none was completed twice, and no lease or run
is orphaned (the same checks as on SQLite, read from PostgreSQL). With PostgreSQL SIGKILLed
instead, the server stays up and answers 503 storage_unavailable with Retry-After while the
database is gone (never a 500, never a hang), and once PostgreSQL has recovered every
acknowledged write is there.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.pgserver import PostgresServer, PostgresUnavailable, start_postgres
from tests.reliability.helpers import Agent, Journals, start_agent
from tests.reliability.invariants import check_acknowledged, check_tasks
from tests.reliability.report import Recorder, scale
from tests.reliability.test_server_crash import (
    AGENTS,
    DEFINITION,
    LEASE_TTL_MS,
    acked,
    create_tasks,
    progressed,
)
from tests.server import Client, Server

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(sys.platform == "win32", reason="processes are killed with SIGKILL"),
]

CYCLES = scale(3, 15)
TASKS = scale(600, 3000)


@pytest.fixture
def cluster() -> Iterator[PostgresServer]:
    """A PostgreSQL of the test's own: this one gets killed."""
    try:
        server = start_postgres()
    except PostgresUnavailable as exc:
        pytest.fail(f"PostgreSQL is needed and unavailable: {exc}", pytrace=False)
    yield server
    server.stop()


def start_agents(tmp_path: Path, port: int, seed: int, stop: Path) -> list[Agent]:
    return [
        start_agent(
            tmp_path,
            f"agent-{i}",
            port,
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
            *(["--claim-key"] if i % 2 else []),
        )
        for i in range(AGENTS)
    ]


def check_everything(dsn: str, agents: list[Agent], task_ids: list[str]) -> dict[str, Any]:
    journals = Journals.of(agents)
    stats = journals.stats()
    problems, summary = check_tasks(dsn, DEFINITION)
    lost, checked = check_acknowledged(dsn, journals)
    from tests.reliability.helpers import open_db, rows

    with open_db(dsn) as conn:
        stored = {r[0] for r in rows(conn, "SELECT id FROM tasks")}
    assert [t for t in task_ids if t not in stored] == [], "acknowledged tasks lost"
    assert lost == [], lost[:20]
    assert problems == [], problems[:20]
    assert stats.get("server_errors", 0) == 0, journals.ops("server_error")[:5]
    assert summary["runs_completed"] > 0, summary
    return {"checked": checked, **summary, **stats}


def seed_tasks(server: Server) -> list[str]:
    admin = server.client()
    r = admin.post("/pipelines", {"name": "crash", "definition": DEFINITION})
    assert r.status == 201, r.body
    ids = create_tasks(admin, r.json["id"], TASKS)
    admin.close()
    return ids


@pytest.mark.slow
@pytest.mark.timeout(scale(300, 1200))
def test_sigkill_of_the_server_on_postgresql_loses_nothing_acknowledged(
    tmp_path: Path, cluster: PostgresServer, record: Recorder
) -> None:
    row = record(
        "server crash (PostgreSQL)",
        f"SIGKILL the server at random moments under {AGENTS} agent processes, restart it on "
        "the same PostgreSQL database",
        0,
        "kill/restart cycles",
    )
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    dsn = cluster.dsn(cluster.create_database())
    server = Server(tmp_path / "crash.db", dsn=dsn).start(timeout=60)
    stop = tmp_path / "stop"
    agents: list[Agent] = []
    try:
        task_ids = seed_tasks(server)
        agents = start_agents(tmp_path, server.port, seed, stop)
        wait_for("the agents to get going", lambda: acked(agents) >= 20, timeout=60)
        for cycle in range(CYCLES):
            before = acked(agents)
            time.sleep(rng.uniform(0.3, 2.0))
            wait_for(f"work between kills (cycle {cycle})", progressed(agents, before), 60)
            server.kill()
            time.sleep(rng.uniform(0.0, 0.5))
            server.start(timeout=60)
            row.tried = cycle + 1
        before = acked(agents)
        wait_for("work after the last restart", lambda: acked(agents) > before + 10, 60)
        stop.touch()
        for agent in agents:
            assert agent.wait(90) == 0, agent.output()
        server.kill()
        result = check_everything(dsn, agents, task_ids)
        row.detail = (
            f"{result['checked']} acknowledged answers checked, 0 lost; {result['tasks']} tasks "
            f"in one stage each, none completed twice; seed {seed}"
        )
    finally:
        stop.touch()
        for agent in agents:
            agent.kill()
        server.kill()


def probe_while_down(port: int, answers: list[tuple[int, str, float, str]], done: Any) -> None:
    """Requests against the server while PostgreSQL is gone: each must be answered, quickly,
    with the error envelope."""
    client = Client("127.0.0.1", port, timeout=30)
    while not done.is_set():
        started = time.monotonic()
        try:
            r = client.post("/tasks", {"pipeline_id": "x", "title": "t", "description": ""})
        except OSError as exc:
            answers.append((0, type(exc).__name__, time.monotonic() - started, ""))
            client.close()
            continue
        code = r.json["error"]["code"] if r.status >= 400 else ""
        answers.append(
            (r.status, code, time.monotonic() - started, r.headers.get("retry-after", ""))
        )
        time.sleep(0.1)
    client.close()


@pytest.mark.slow
@pytest.mark.timeout(scale(300, 1200))
def test_sigkill_of_postgresql_keeps_acknowledged_writes_and_answers_503_meanwhile(
    tmp_path: Path, cluster: PostgresServer, record: Recorder
) -> None:
    row = record(
        "PostgreSQL crash",
        f"SIGKILL PostgreSQL itself under {AGENTS} agent processes, restart it after a while",
        0,
        "kill/restart cycles of PostgreSQL",
    )
    seed = random.randrange(2**32)
    dsn = cluster.dsn(cluster.create_database())
    server = Server(tmp_path / "crash.db", dsn=dsn).start(timeout=60)
    stop = tmp_path / "stop"
    agents: list[Agent] = []
    answers: list[tuple[int, str, float, str]] = []
    try:
        task_ids = seed_tasks(server)
        agents = start_agents(tmp_path, server.port, seed, stop)
        wait_for("the agents to get going", lambda: acked(agents) >= 20, timeout=60)
        for cycle in range(2):
            before = acked(agents)
            wait_for(f"work before the kill (cycle {cycle})", progressed(agents, before), 60)
            cluster.kill()
            done = threading.Event()
            prober = threading.Thread(target=probe_while_down, args=(server.port, answers, done))
            prober.start()
            wait_for("a few answers while PostgreSQL is down", lambda: len(answers) >= 3, 60)
            time.sleep(1.0)
            done.set()
            prober.join(60)
            cluster.restart()
            assert server.proc is not None and server.proc.poll() is None, server.output()
            row.tried = cycle + 1
        before = acked(agents)
        wait_for("work after PostgreSQL is back", lambda: acked(agents) > before + 10, 60)
        stop.touch()
        for agent in agents:
            assert agent.wait(90) == 0, agent.output()
        # While PostgreSQL was down: 503 storage_unavailable with Retry-After, in seconds.
        assert answers, "no request was tried while PostgreSQL was down"
        assert {(status, code) for status, code, _, _ in answers} == {
            (503, "storage_unavailable")
        }, answers
        assert all(after for _, _, _, after in answers), answers
        assert max(took for _, _, took, _ in answers) < 10, answers
        result = check_everything(dsn, agents, task_ids)
        row.detail = (
            f"{result['checked']} acknowledged answers checked, 0 lost; {len(answers)} requests "
            f"while PostgreSQL was down, all 503 storage_unavailable; seed {seed}"
        )
    finally:
        stop.touch()
        for agent in agents:
            agent.kill()
        server.kill()
