"""A fleet on one server: 5,000 agents long-polling for work and 500 event streams open while
16 agents work, all over real sockets (benchmarks/fleet.py holds the crowd on one asyncio loop).

Nothing the working agents send hangs or fails; a task created for the crowd is answered at
once, wakes one waiter per server (not thousands) and is taken by exactly one; every waiter
gets its answer when its wait is up, none refused; every stream sees the crowd task move on.
With NULLTICKETS_TEST_BACKEND=postgres, the same with two servers on one database and the crowd
split across them. Past limits set low, the extra claims and streams are answered at once and
the working agents do not notice. Memory per waiter and per stream is printed; the timing
figures (p99 beside the same agents with nobody waiting) are `make bench`'s fleet section.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from benchmarks.fleet import (
    HANG_S,
    Crowd,
    Http,
    definition,
    finish,
    raise_open_files,
    run,
    settle,
    work,
)

from nulltickets.domain.commands import MAX_WAIT_MS
from nulltickets.server.capacity import STREAM_BYTES, WAITER_BYTES
from tests.conftest import TEST_BACKEND, unique
from tests.server import Server, granian_workers

pytestmark = [pytest.mark.process, pytest.mark.e2e, pytest.mark.slow]

WAITERS = 5_000
STREAMS = 500
AGENTS = 16
WAIT_MS = 20_000  # each waiter's wait: it answers 204 when this is up
WORK_S = 6.0  # how long the agents work beside the crowd


@pytest.fixture
def fleet_servers(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[list[Server]]:
    """One server on SQLite; on PostgreSQL two servers on one new database."""
    servers: list[Server] = []
    try:
        if TEST_BACKEND == "postgres":
            postgres = request.getfixturevalue("postgres")
            dsn = postgres.dsn(postgres.create_database())
            for i in range(2):
                servers.append(Server(tmp_path / f"fleet{i}.db", dsn=dsn).start(timeout=60))
        else:
            servers.append(Server(tmp_path / "fleet.db").start())
        yield servers
    finally:
        for server in servers:
            server.stop()


def make_pipeline(admin: Http, role: str) -> str:
    body = {"name": unique("fleet"), "definition": definition(role)}
    return str(admin.json("POST", "/pipelines", body, 201)["id"])


def workers_of(servers: list[Server]) -> Callable[[], list[int]]:
    return lambda: [pid for server in servers for pid in granian_workers(server)]


@pytest.mark.skipif(sys.platform == "win32", reason="the test raises its open-files limit")
def test_a_fleet_waits_while_agents_work(fleet_servers: list[Server]) -> None:
    raise_open_files(WAITERS + STREAMS + 1024)
    ports = [s.port for s in fleet_servers]
    fleet = run(
        ports,
        workers_of(fleet_servers),
        waiters=WAITERS,
        streams=STREAMS,
        agents=AGENTS,
        seconds=WORK_S,
        wait_ms=WAIT_MS,
    )
    crowd = fleet.crowd
    assert crowd is not None
    try:
        finish(fleet, ports, timeout=WAIT_MS / 1000 + 30)
    finally:
        crowd.close()
    print(
        f"\n{len(ports)} server(s): {fleet.kib_per_waiter:.1f} KiB per waiting claim, "
        f"{fleet.kib_per_stream:.1f} KiB per event stream; the crowd's task answered in "
        f"{fleet.created_answered_s:.3f} s, taken after {fleet.taken_s:.3f} s; "
        f"{fleet.working.cycles} cycles by {AGENTS} agents"
    )

    # The working agents: every request answered, none failed, none near a hang.
    assert fleet.working.failures == [], fleet.working.failures[:5]
    assert fleet.working.cycles >= AGENTS
    assert max(fleet.working.all()) < HANG_S

    # The crowd's task: answered, woke one waiter per server, taken by exactly one.
    assert fleet.task_id is not None and fleet.created_answered_s is not None
    assert fleet.taken_s is not None, "no waiter took the crowd's task"
    assert fleet.wakeups == len(ports), fleet.wakeups
    assert crowd.failures == [], crowd.failures[:5]
    assert crowd.answered() == WAITERS
    won = [a for a in crowd.answers if a.status == 200]
    assert len(won) == 1, [a.status for a in won]
    assert json.loads(won[0].body)["task"]["id"] == fleet.task_id
    # Every other waiter waited its whole wait (none was refused) and then got its 204.
    others = [a for a in crowd.answers if a.status != 200]
    assert {a.status for a in others} == {204}
    assert min(a.at - a.sent for a in others) >= WAIT_MS / 1000 - 0.5
    assert not any("retry-after" in a.headers for a in others)

    # Every stream is alive: each saw the crowd task's transition.
    assert fleet.stream_frames_after_transition == STREAMS

    # What the limits are derived from is about what a waiter and a stream really cost.
    assert fleet.kib_per_waiter is not None and fleet.kib_per_stream is not None
    assert fleet.kib_per_waiter < 2 * WAITER_BYTES / 1024
    assert fleet.kib_per_stream < 2 * STREAM_BYTES / 1024


LIMIT_WAITERS = 40
LIMIT_STREAMS = 4
EXTRA = 20


def test_past_the_limits_claims_and_streams_are_answered_at_once(make_server: Any) -> None:
    server: Server = make_server(
        args=["--max-waiters", str(LIMIT_WAITERS), "--max-streams", str(LIMIT_STREAMS)]
    )
    assert f"up to {LIMIT_WAITERS} waiting claims and {LIMIT_STREAMS} event streams" in (
        server.output()
    )
    c = server.client()
    admin = Http(server.port)
    coder, other_coder = unique("coder"), unique("other")
    pipeline_id = make_pipeline(admin, coder)
    other_pipeline = make_pipeline(admin, other_coder)
    full = Crowd([server.port], coder, pipeline_id, LIMIT_WAITERS, LIMIT_STREAMS, MAX_WAIT_MS)
    extra = Crowd([server.port], coder, pipeline_id, EXTRA, 0, 15_000)
    try:
        full.start_waiters()
        full.start_streams()
        settle([admin], "nulltickets_long_poll_waiters", LIMIT_WAITERS, "waiting claims")
        settle([admin], "nulltickets_sse_clients", LIMIT_STREAMS, "event streams")

        # Extra long-poll claims: tried once, then 204 at once with Retry-After.
        extra.start_waiters()
        deadline = time.monotonic() + HANG_S
        while extra.answered() < EXTRA and time.monotonic() < deadline:
            time.sleep(0.05)
        assert extra.failures == []
        assert extra.answered() == EXTRA
        for answer in extra.answers:
            assert answer.status == 204
            assert answer.at - answer.sent < 5.0  # at once, not after its 15 s wait
            assert 1 <= int(answer.headers["retry-after"]) <= 5

        # One more stream: 503 overloaded, with Retry-After, in the envelope.
        r = c.get(f"/events/stream?pipeline_id={pipeline_id}")
        assert r.status == 503, r.body
        assert r.error_code == "overloaded"
        assert "retry-after" in r.headers

        # An extra claim when there is work gets it at once: only the wait is refused.
        new = {"pipeline_id": other_pipeline, "title": unique("t"), "description": ""}
        task = c.post("/tasks", new)
        assert task.status == 201, task.body
        r = c.post(
            "/leases/claim", {"agent_id": "late", "agent_role": other_coder, "wait_ms": 15_000}
        )
        assert r.status == 200, r.body
        assert r.json["task"]["id"] == task.json["id"]

        # Working agents, meanwhile: every request admitted and answered.
        report = work([server.port], other_pipeline, other_coder, 4, 2.0)
        assert report.failures == [], report.failures[:5]
        assert report.cycles >= 4
        assert max(report.all()) < HANG_S

        refused = admin.metric("nulltickets_admissions_total", kind="long_poll", result="refused")
        assert refused == EXTRA + 1
        assert admin.metric("nulltickets_admissions_total", kind="event_stream", result="refused")
        assert admin.metric("nulltickets_waiting_limit", kind="long_poll") == LIMIT_WAITERS
        # The crowd that was admitted is untouched: a waiter answered by now (a slow machine
        # can take longer than a wait) was answered 204 when its own wait was up, not before.
        for answer in list(full.answers):
            assert answer.status == 204
            assert answer.at - answer.sent >= MAX_WAIT_MS / 1000 - 0.5
    finally:
        extra.close()
        full.close()
        admin.close()
        c.close()
