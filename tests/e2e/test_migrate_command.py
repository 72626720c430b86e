"""`nulltickets migrate --from FILE --to postgresql://...`: a tracker's SQLite file, filled
through the API, copied into PostgreSQL; then a server on the copy answers every read as the
SQLite server did, and goes on working (new ids come after the copied ones)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.conftest import unique
from tests.e2e.test_traces import json_export
from tests.pgserver import PostgresServer
from tests.server import PIPELINE, Client, Server, server_command

pytestmark = [pytest.mark.e2e, pytest.mark.process]


def migrate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*server_command(), "migrate", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def fill(c: Client) -> dict[str, Any]:
    """One of everything, through the API; what to read back afterwards."""
    pipeline = c.post("/pipelines", {"name": unique("pipe"), "definition": PIPELINE}).json["id"]
    first = c.post("/tasks", {"pipeline_id": pipeline, "title": "first", "description": "d"})
    a = first.json["id"]
    b = c.post(
        "/tasks",
        {"pipeline_id": pipeline, "title": "second", "description": "", "dependencies": [a]},
    ).json["id"]
    keyed = c.post(
        "/tasks",
        {"pipeline_id": pipeline, "title": "keyed", "description": "", "priority": 5},
        headers={"Idempotency-Key": "plan-1"},
    )
    assert keyed.status == 201, keyed.body
    assert c.post(f"/tasks/{b}/assignments", {"agent_id": "agent-b"}).status in (200, 201)
    lease = c.post("/leases/claim", {"agent_id": "agent-a", "agent_role": "coder"}).json
    run, token = lease["run"]["id"], lease["lease_token"]
    assert c.post(f"/runs/{run}/events", {"kind": "note", "data": {"n": 1}}, token=token).status
    cp = c.put(f"/runs/{run}/checkpoint", {"checkpoint": {"step": 2, "b": [1]}}, token=token)
    assert cp.status == 200, cp.body
    assert c.post("/v1/traces", json_export(run, lease["task"]["id"], ["0a0b0c0d0e0f0102"])).status
    art = c.post(
        "/artifacts",
        {"task_id": lease["task"]["id"], "run_id": run, "kind": "log", "uri": "file:///x"},
    )
    assert art.status == 201, art.body
    moved = c.post(
        f"/runs/{run}/transition",
        {"trigger": "submit", "usage": {"tokens": 3}},
        token=token,
    )
    assert moved.status == 200, moved.body
    assert c.put("/store/notes/k1", {"value": {"z": 1, "a": "Crème brûlée"}}).status in (200, 204)
    assert c.put("/store/notes/k2", {"value": [1, 2, 3]}).status in (200, 204)
    cancelled = c.post(f"/tasks/{keyed.json['id']}/cancel", {"reason": "not needed"})
    assert cancelled.status == 200, cancelled.body
    return {
        "pipeline": pipeline,
        "tasks": [a, b, keyed.json["id"]],
        "run": run,
        "keyed_body": keyed.body,
    }


READS = [
    "/pipelines",
    "/pipelines/{pipeline}",
    "/tasks?limit=100",
    "/tasks/{t0}",
    "/tasks/{t1}",
    "/tasks/{t2}",
    "/tasks/{t0}/checkpoint",
    "/tasks/{t1}/dependencies",
    "/tasks/{t1}/assignments",
    "/tasks/{t2}/events",
    "/runs/{run}/events",
    "/runs/{run}/spans",
    "/artifacts?task_id={t0}",
    "/store/notes",
    "/store/notes/k1",
]


def read_all(c: Client, made: dict[str, Any]) -> dict[str, Any]:
    names = {
        "pipeline": made["pipeline"],
        "run": made["run"],
        **{f"t{i}": t for i, t in enumerate(made["tasks"])},
    }
    answers = {}
    for path in READS:
        r = c.get(path.format(**names))
        assert r.status == 200, (path, r.body)
        answers[path] = r.json
    return answers


def test_a_sqlite_tracker_moves_to_postgresql_and_reads_back_the_same(
    tmp_path: Path, postgres: PostgresServer
) -> None:
    source = tmp_path / "tracker.db"
    sqlite_server = Server(source).start()
    c = sqlite_server.client()
    made = fill(c)
    before = read_all(c, made)
    hits_before = c.get("/store/search?q=creme").json
    c.close()
    sqlite_server.stop()

    dsn = postgres.dsn(postgres.create_database())
    done = migrate("--from", str(source), "--to", dsn)
    assert done.returncode == 0, done.stderr
    assert "counts verified" in done.stdout and done.stderr == ""

    pg_server = Server(tmp_path / "pg.db", dsn=dsn).start()
    try:
        c = pg_server.client()
        assert read_all(c, made) == before
        hits = c.get("/store/search?q=creme").json
        assert [h["key"] for h in hits] == [h["key"] for h in hits_before] == ["k1"]
        # The idempotency record came along: the same request is answered as before.
        again = c.post(
            "/tasks",
            {"pipeline_id": made["pipeline"], "title": "keyed", "description": "", "priority": 5},
            headers={"Idempotency-Key": "plan-1"},
        )
        assert (again.status, again.body) == (201, made["keyed_body"])
        # And it goes on: a new claim, a new event, after the copied ids.
        lease = c.post("/leases/claim", {"agent_id": "agent-c", "agent_role": "coder"})
        assert lease.status == 200, lease.body
        run, token = lease.json["run"]["id"], lease.json["lease_token"]
        event = c.post(f"/runs/{run}/events", {"kind": "note", "data": {}}, token=token)
        assert event.status == 201, event.body
        old_ids = [e["id"] for e in before["/runs/{run}/events"]["items"]]
        assert event.json["id"] > max(old_ids)
        c.close()
    finally:
        pg_server.stop()

    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT count(*) FROM otlp_spans").fetchone()
    assert rows == (1,)


def test_a_target_with_data_is_refused_unless_replaced(
    tmp_path: Path, postgres: PostgresServer
) -> None:
    source = tmp_path / "tracker.db"
    server = Server(source).start()
    c = server.client()
    fill(c)
    c.close()
    server.stop()
    dsn = postgres.dsn(postgres.create_database())
    assert migrate("--from", str(source), "--to", dsn).returncode == 0

    refused = migrate("--from", str(source), "--to", dsn)
    assert refused.returncode == 1
    assert refused.stderr.count("\n") == 1 and "already holds data" in refused.stderr
    assert "--replace" in refused.stderr

    replaced = migrate("--from", str(source), "--to", dsn, "--replace")
    assert replaced.returncode == 0, replaced.stderr
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM tasks").fetchone() == (3,)


def test_errors_are_one_line(tmp_path: Path, postgres: PostgresServer) -> None:
    missing = migrate("--from", str(tmp_path / "none.db"), "--to", postgres.dsn("postgres"))
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1
    assert "no SQLite database" in missing.stderr
    not_pg = migrate("--from", str(tmp_path / "none.db"), "--to", str(tmp_path / "other.db"))
    assert not_pg.returncode == 1 and "postgresql://" in not_pg.stderr
    from tests.pgserver import free_port

    source = tmp_path / "tracker.db"
    Server(source).start().stop()
    down = migrate("--from", str(source), "--to", f"postgresql://u:pw@127.0.0.1:{free_port()}/x")
    assert down.returncode == 1 and down.stderr.count("\n") == 1
    assert "pw" not in down.stderr and "cannot open PostgreSQL database" in down.stderr
