"""Suite 2, agent crashes: agents SIGKILLed in the middle of a task lose their lease only after its
TTL, the task comes back to the pool counted as a failed attempt, a poison task that kills every
agent that touches it ends dead-lettered with its reason, and two agents racing for one transition
have exactly one winner."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.reliability.helpers import (
    Agent,
    Journals,
    assert_storage_healthy,
    open_db,
    percentile,
    rows,
    start_agent,
)
from tests.reliability.invariants import check_acknowledged, check_tasks
from tests.reliability.report import REPO, Recorder, scale
from tests.server import Client, Server

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        sys.platform == "win32", reason="agents and servers are killed with SIGKILL"
    ),
]

REAP_INTERVAL_S = 0.5

DEFINITION: dict[str, Any] = {
    "initial": "todo",
    "states": {
        "todo": {"agent_role": "worker"},
        "done": {"terminal": True},
        "dead": {"terminal": True},
    },
    "transitions": [{"from": "todo", "to": "done", "trigger": "submit"}],
}


def setup_pipeline(client: Client, name: str) -> str:
    r = client.post("/pipelines", {"name": name, "definition": DEFINITION})
    assert r.status == 201, r.body
    return str(r.json["id"])


def add_tasks(client: Client, pipeline_id: str, titles: list[str], **policy: Any) -> list[str]:
    tasks = [
        {"pipeline_id": pipeline_id, "title": t, "description": "", "retry_policy": policy}
        for t in titles
    ]
    r = client.post("/tasks/bulk", {"tasks": tasks})
    assert r.status == 201, r.body
    return list(r.json["ids"])


def stage_counts(client: Client) -> dict[str, int]:
    r = client.get("/health")
    assert r.status == 200, r.body
    return {s["stage"]: s["count"] for s in r.json["tasks_by_stage"]}


def last_op(agent: Agent) -> dict[str, Any]:
    entries = agent.entries()
    return entries[-1] if entries else {}


# --- agents killed mid-task --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(scale(150, 900))
def test_a_killed_agents_task_returns_after_its_ttl_as_a_failed_attempt(
    tmp_path: Path, record: Recorder
) -> None:
    kills = scale(6, 40)
    ttl_ms = 1000
    row = record(
        "agent crash",
        "SIGKILL an agent in the middle of a task (heartbeating, TTL 1 s); its task must come "
        "back only after the lease expired, counted as a failed attempt",
        0,
        "agents killed",
    )
    server = Server(tmp_path / "agents.db").start()
    agents: list[Agent] = []
    stop = tmp_path / "stop"
    client = server.client()
    try:
        pipeline_id = setup_pipeline(client, "agents")
        task_ids = add_tasks(
            client, pipeline_id, [f"t{i}" for i in range(kills * 2 + 6)], max_attempts=20
        )

        def spawn() -> Agent:
            agent = start_agent(
                tmp_path,
                f"agent-{len(agents)}",
                server.port,
                "--roles",
                "worker",
                "--work-ms",
                "600",
                "--heartbeat",
                "--lease-ttl-ms",
                str(ttl_ms),
                "--stop-file",
                str(stop),
            )
            agents.append(agent)
            return agent

        live = [spawn() for _ in range(3)]
        victims: list[dict[str, Any]] = []
        for n in range(kills):

            def working(live: list[Agent] = live) -> Agent | None:
                for agent in live:
                    if last_op(agent).get("op") == "working":
                        return agent
                return None

            victim = wait_for(f"an agent in the middle of a task (kill {n})", working, 30, 0.01)
            victim.kill()
            killed_at = time.time() * 1000
            entries = victim.entries()
            run_id = entries[-1]["run"]
            known_expiry = max(
                e["expires"] for e in entries if e.get("run") == run_id and "expires" in e
            )
            victims.append(
                {
                    "run": run_id,
                    "task": entries[-1]["task"],
                    "expiry": known_expiry,
                    "at": killed_at,
                }
            )
            live.remove(victim)
            live.append(spawn())
            row.tried = n + 1

        wait_for(
            "every task to be done",
            lambda: stage_counts(client).get("done", 0) == len(task_ids),
            timeout=scale(60, 300),
            interval=0.2,
        )
        stop.touch()
        for agent in live:
            assert agent.wait(30) == 0, agent.output()
        server.stop()

        back_after: list[float] = []
        with open_db(server.db) as conn:
            for v in victims:
                [(status, attempt)] = rows(
                    conn, "SELECT status, attempt FROM runs WHERE id = ?", (v["run"],)
                )
                assert status == "stale", (v, status)
                events = {
                    kind: (ts, json.loads(data))
                    for kind, ts, data in rows(
                        conn,
                        "SELECT kind, ts_ms, data_json FROM events WHERE run_id = ?",
                        (v["run"],),
                    )
                }
                assert "lease_expired" in events and "retry_scheduled" in events, (v, events)
                expired_at = events["lease_expired"][0]
                failed_so_far = rows(
                    conn,
                    "SELECT count(*) FROM runs WHERE task_id = ? AND attempt <= ?"
                    " AND status IN ('failed', 'stale')",
                    (v["task"], attempt),
                )[0][0]
                assert events["retry_scheduled"][1]["failed_attempts"] == failed_so_far, events
                # Not before the lease it last heard of ran out; promptly after the real expiry
                # (an unanswered heartbeat may have moved it by one TTL).
                assert expired_at >= v["expiry"], (v, expired_at)
                assert expired_at <= v["expiry"] + ttl_ms + REAP_INTERVAL_S * 1000 + 2000, (
                    v,
                    expired_at,
                )
                [(started,)] = rows(
                    conn,
                    "SELECT started_at_ms FROM runs WHERE task_id = ? AND attempt = ?",
                    (v["task"], attempt + 1),
                )
                assert started >= expired_at, (v, started, expired_at)
                back_after.append((started - v["at"]) / 1000)

        journals = Journals.of(agents)
        problems, summary = check_tasks(server.db, DEFINITION)
        lost, checked = check_acknowledged(server.db, journals)
        assert problems == [] and lost == [], (problems[:10], lost[:10])
        assert journals.stats().get("server_errors", 0) == 0
        assert_storage_healthy(server.db)
        row.detail = (
            f"every killed agent's run went stale with a lease_expired event and counted as a "
            f"failed attempt; the task was claimed again {min(back_after):.1f}-"
            f"{max(back_after):.1f} s after the kill (p50 {percentile(back_after, 50):.1f} s, "
            f"TTL {ttl_ms / 1000:.0f} s), never before its lease expired; all "
            f"{len(task_ids)} tasks done; {checked} acknowledged answers kept"
        )
        row.extra.update(summary)
    finally:
        stop.touch()
        client.close()
        for agent in agents:
            agent.kill()
        server.kill()


# --- a poison task -----------------------------------------------------------------------------


@pytest.mark.timeout(scale(120, 600))
def test_a_poison_task_that_kills_every_agent_ends_dead_lettered(
    tmp_path: Path, record: Recorder
) -> None:
    rounds = scale(1, 5)
    max_attempts = 3
    row = record(
        "agent crash",
        f"a poison task that SIGKILLs every agent that claims it (max_attempts {max_attempts}, "
        "TTL 0.5 s) next to healthy tasks",
        0,
        "poison tasks",
    )
    server = Server(tmp_path / "poison.db").start()
    agents: list[Agent] = []
    stop = tmp_path / "stop"
    client = server.client()
    try:
        pipeline_id = setup_pipeline(client, "poison")
        poison = add_tasks(
            client,
            pipeline_id,
            [f"poison pill {i}" for i in range(rounds)],
            max_attempts=max_attempts,
            dead_letter_stage="dead",
        )
        healthy = add_tasks(client, pipeline_id, [f"healthy {i}" for i in range(10)])

        def spawn() -> Agent:
            agent = start_agent(
                tmp_path,
                f"agent-{len(agents)}",
                server.port,
                "--roles",
                "worker",
                "--poison",
                "poison",
                "--lease-ttl-ms",
                "500",
                "--think-ms",
                "50",
                "--stop-file",
                str(stop),
            )
            agents.append(agent)
            return agent

        live = [spawn(), spawn()]
        deadline = time.monotonic() + scale(60, 300)
        while stage_counts(client).get("dead", 0) < rounds or (
            stage_counts(client).get("done", 0) < len(healthy)
        ):
            assert time.monotonic() < deadline, (stage_counts(client), len(agents))
            assert len(agents) <= 2 + rounds * max_attempts, "more agents died than attempts"
            for agent in list(live):
                if agent.proc.poll() is not None:
                    live.remove(agent)
                    live.append(spawn())
            time.sleep(0.1)
        stop.touch()
        for agent in live:
            agent.wait(30)
        server.stop()

        journals = Journals.of(agents)
        poisoned = journals.ops("poisoned")
        assert len(poisoned) == rounds * max_attempts, poisoned
        with open_db(server.db) as conn:
            for task_id in poison:
                [(stage, reason, next_at)] = rows(
                    conn,
                    "SELECT stage, dead_letter_reason, next_eligible_at_ms FROM tasks WHERE id = ?",
                    (task_id,),
                )
                assert (stage, reason) == ("dead", "max_attempts_exceeded")
                statuses = rows(
                    conn, "SELECT status FROM runs WHERE task_id = ? ORDER BY attempt", (task_id,)
                )
                assert statuses == [("stale",)] * max_attempts
                [(data,)] = rows(
                    conn,
                    "SELECT e.data_json FROM events AS e JOIN runs AS r ON r.id = e.run_id"
                    " WHERE r.task_id = ? AND e.kind = 'dead_letter'",
                    (task_id,),
                )
                assert json.loads(data) == {
                    "reason": "max_attempts_exceeded",
                    "failed_attempts": max_attempts,
                    "from_stage": "todo",
                    "dead_letter_stage": "dead",
                }
                assert next_at >= 2**62
        problems, _ = check_tasks(server.db, DEFINITION)
        assert problems == [], problems[:10]
        assert_storage_healthy(server.db)
        row.tried = rounds
        row.detail = (
            f"{len(poisoned)} agents died on {rounds} poison task(s); each ended in `dead` with "
            f"dead_letter_reason max_attempts_exceeded after {max_attempts} stale runs; "
            f"{len(healthy)} healthy tasks done meanwhile"
        )
    finally:
        stop.touch()
        client.close()
        for agent in agents:
            agent.kill()
        server.kill()


# --- racing for one transition -----------------------------------------------------------------


def race(port: int, racers: list[tuple[str, str, int | None]]) -> list[dict[str, Any]]:
    """Racer processes, one per (run, lease token, expected fence), send the transition
    `submit` with expected_task_version 1 at the same moment."""
    start_at = time.time() + 0.8
    procs = []
    for run_id, token, fence in racers:
        cmd = [sys.executable, "-m", "tests.reliability.racer", str(port), run_id, token]
        cmd += [f"{start_at:.6f}", "1", *([] if fence is None else [str(fence)])]
        procs.append(
            subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    answers = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
        answers.append(json.loads(out))
    return answers


def claim(client: Client, agent: str, ttl_ms: int = 60_000) -> dict[str, Any]:
    c = client.post(
        "/leases/claim", {"agent_id": agent, "agent_role": "worker", "lease_ttl_ms": ttl_ms}
    )
    assert c.status == 200, c.body
    return dict(c.json)


@pytest.mark.timeout(scale(120, 600))
def test_two_agents_holding_one_lease_race_for_a_transition_with_one_winner(
    tmp_path: Path, record: Recorder
) -> None:
    """Twins: one lease in two processes (an agent and the copy a supervisor restarted)."""
    rounds = scale(6, 60)
    row = record(
        "agent crash",
        "two agent processes holding the same lease send the same transition with "
        "expected_task_version at the same moment",
        0,
        "races",
    )
    server = Server(tmp_path / "twins.db").start()
    client = server.client()
    outcomes: dict[str, int] = {}
    try:
        pipeline_id = setup_pipeline(client, "twins")
        for n in range(rounds):
            [task_id] = add_tasks(client, pipeline_id, [f"race {n}"])
            lease = claim(client, "twin")
            assert lease["task"]["id"] == task_id
            run_id = lease["run"]["id"]
            twin = (run_id, lease["lease_token"], None)
            answers = race(server.port, [twin, twin])
            winners = [a for a in answers if a["status"] == 200]
            [loser] = [a for a in answers if a["status"] != 200]
            assert len(winners) == 1, answers
            # The loser lost at the version check (409), or found the lease already released by
            # the winner's transition (404: contract 8.2 checks the lease first).
            assert (loser["status"], loser["code"]) in (
                (409, "task_version_mismatch"),
                (404, "not_found"),
            ), answers
            key = f"{loser['status']} {loser['code']}"
            outcomes[key] = outcomes.get(key, 0) + 1
            details = client.get(f"/tasks/{task_id}").json
            assert (details["stage"], details["task_version"]) == ("done", 2), details
            events = client.get(f"/runs/{run_id}/events").json["items"]
            assert [e["kind"] for e in events] == ["transition"], events
            row.tried = n + 1
        server.stop()
        assert_storage_healthy(server.db)
        row.detail = "exactly one 200 every time; the other got " + ", ".join(
            f"{k} x{v}" for k, v in sorted(outcomes.items())
        )
    finally:
        client.close()
        server.kill()


@pytest.mark.timeout(scale(120, 600))
def test_a_zombie_and_the_new_holder_race_for_a_transition_and_the_zombie_gets_409(
    tmp_path: Path, record: Recorder
) -> None:
    """The zombie's lease expired and the task was claimed again; both agents send the same
    transition with expected_task_version 1 and the fence of their own claim."""
    rounds = scale(6, 60)
    row = record(
        "agent crash",
        "an agent whose lease expired (zombie) and the agent that claimed the task after it send "
        "the same transition (expected_task_version, expected_fence) at the same moment",
        0,
        "races",
    )
    server = Server(tmp_path / "zombie.db").start()
    client = server.client()
    try:
        pipeline_id = setup_pipeline(client, "zombie")
        for n in range(rounds):
            [task_id] = add_tasks(client, pipeline_id, [f"race {n}"], max_attempts=100)
            zombie = claim(client, "zombie", ttl_ms=200)
            if "fence" not in zombie:
                pytest.skip("this server has no fences (expected_fence)")
            holder = wait_for(
                "the zombie's lease to expire and the task to be claimable",
                lambda: (
                    (
                        c := client.post(
                            "/leases/claim", {"agent_id": "holder", "agent_role": "worker"}
                        )
                    ).status
                    == 200
                    and c.json
                ),
                timeout=10,
            )
            assert holder["task"]["id"] == task_id
            answers = race(
                server.port,
                [
                    (zombie["run"]["id"], zombie["lease_token"], zombie["fence"]),
                    (holder["run"]["id"], holder["lease_token"], holder["fence"]),
                ],
            )
            assert answers[1]["status"] == 200, answers
            assert (answers[0]["status"], answers[0]["code"]) == (409, "lease_superseded"), answers
            details = client.get(f"/tasks/{task_id}").json
            assert (details["stage"], details["task_version"]) == ("done", 2), details
            row.tried = n + 1
        server.stop()
        assert_storage_healthy(server.db)
        row.detail = "the new holder won every time; the zombie got 409 lease_superseded every time"
    finally:
        client.close()
        server.kill()
