"""Row locks on PostgreSQL come in one order, a task's row before its lease's, and whoever ends
a run holds its task's row: writers on two connections (two servers) wait for each other
instead of deadlocking. Each test runs the statements of two units of work, in the order the
service runs them, on connections of its own."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import psycopg

from tests.conftest import unique, wait_for
from tests.postgres.sql import all_rows, make_pipeline, make_task, one, run
from tests.postgres.test_claims import NOW, claim
from tests.server import Server

Conn = psycopg.Connection[Any]


def leased_task(dsn: str) -> tuple[str, str]:
    """A task claimed by agent `a` (lease of 60 s from NOW): (task id, run id)."""
    with psycopg.connect(dsn) as conn:
        role = unique("coder")
        task_id = make_task(conn, make_pipeline(conn, role))
        conn.commit()
        claimed, _ = claim(conn, role, "a")
        assert claimed == task_id
        (run_id,) = one(conn, "latest_run", task_id=task_id)[:1]
        conn.commit()
        return task_id, str(run_id)


def waits_for_a_lock(dsn: str, conn: Conn) -> bool:
    with psycopg.connect(dsn, autocommit=True) as admin:
        row = admin.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
            (conn.info.backend_pid,),
        ).fetchone()
    return row is not None and row[0] == "Lock"


def test_a_cancel_waits_for_a_transition_of_the_task_instead_of_deadlocking(pg_dsn: str) -> None:
    task_id, run_id = leased_task(pg_dsn)
    with psycopg.connect(pg_dsn) as transition, psycopg.connect(pg_dsn) as cancel:
        lease = one(transition, "lock_lease_by_run", run_id=run_id)
        assert lease is not None
        cancelled: dict[str, Any] = {}

        def cancel_task() -> None:  # Service.cancel's writes
            try:
                live = one(cancel, "live_lease_of_task", task_id=task_id)
                if live is not None:
                    lease_id, live_run, _expires = live
                    run(cancel, "end_run", id=live_run, status="cancelled", usage_json="{}",
                        error_text="cancelled", now=NOW + 2)  # fmt: skip
                    run(cancel, "delete_lease", id=lease_id)
                run(cancel, "cancel_task", id=task_id, reason=None, next_eligible_at_ms=0,
                    now=NOW + 2)  # fmt: skip
                cancel.commit()
                cancelled["revoked"] = live
            except psycopg.Error as exc:
                cancelled["error"] = exc

        thread = threading.Thread(target=cancel_task)
        thread.start()
        wait_for("the cancel to wait for the transition", lambda: waits_for_a_lock(pg_dsn, cancel))
        try:  # Service.transition's writes, under the lease it locked
            ended = run(transition, "end_run", id=run_id, status="completed", usage_json="{}",
                        error_text=None, now=NOW + 1)  # fmt: skip
            moved = run(transition, "move_task", id=task_id, stage="done",
                        task_version=lease[8], now=NOW + 1)  # fmt: skip
            run(transition, "delete_lease", id=lease[0])
            transition.commit()
        finally:
            thread.join(30)
        assert "error" not in cancelled, cancelled["error"]
        assert (ended, moved) == (1, 1)
        assert cancelled["revoked"] is None  # the transition ended the run: nothing to revoke
        assert one(transition, "run_status", id=run_id) == ("completed",)


def test_a_reaper_passes_over_an_expired_lease_whose_task_is_locked(pg_dsn: str) -> None:
    task_id, _run_id = leased_task(pg_dsn)
    expired = NOW + 120_000
    with psycopg.connect(pg_dsn) as holder, psycopg.connect(pg_dsn) as reaper:
        # A writer that holds the task row (a claim that chose it, a lease-protected write):
        # the reaper would wait for it in UPDATE tasks while holding the lease.
        holder.execute("SELECT 1 FROM tasks WHERE id = %s FOR UPDATE", (task_id,))
        assert all_rows(reaper, "expired_leases", now=expired, limit=10) == []
        reaper.rollback()
        holder.rollback()
        assert [r[2] for r in all_rows(reaper, "expired_leases", now=expired, limit=10)] == [
            task_id
        ]


def test_a_cancel_that_waited_for_a_transition_into_the_terminal_stage_is_refused(
    postgres: Any, tmp_path: Path
) -> None:
    """Through the server: a cancel arriving while a write holds the task's lease waits for
    it; when that write moved the task into its terminal stage, the task is finished and the
    cancel answers 409 task_finished instead of cancelling a done task."""
    dsn = postgres.dsn(postgres.create_database())
    server = Server(tmp_path / "unused.db", dsn=dsn).start(timeout=60)
    client = server.client()
    try:
        role = unique("coder")
        definition = {
            "initial": "todo",
            "states": {"todo": {"agent_role": role}, "done": {"terminal": True}},
            "transitions": [{"from": "todo", "to": "done", "trigger": "complete"}],
        }
        pipeline = client.post("/pipelines", {"name": unique("p"), "definition": definition})
        assert pipeline.status == 201, pipeline.body
        task = client.post(
            "/tasks", {"pipeline_id": pipeline.json["id"], "title": "t", "description": "d"}
        )
        assert task.status == 201, task.body
        claimed = client.post("/leases/claim", {"agent_id": "a", "agent_role": role})
        assert claimed.status == 200, claimed.body
        run_id = claimed.json["run"]["id"]
        task_id = task.json["id"]
        with psycopg.connect(dsn) as writer:  # a transition in flight, as another server runs it
            lease = one(writer, "lock_lease_by_run", run_id=run_id)
            assert lease is not None
            answer: dict[str, Any] = {}

            def cancel() -> None:
                other = server.client()
                try:
                    answer["r"] = other.post(f"/tasks/{task_id}/cancel", {"reason": "r"})
                finally:
                    other.close()

            thread = threading.Thread(target=cancel)
            thread.start()
            wait_for("the cancel to wait for the lease", lambda: lock_waiters(dsn) > 0)
            run(writer, "end_run", id=run_id, status="completed", usage_json="{}",
                error_text=None, now=NOW + 1)  # fmt: skip
            run(writer, "move_task", id=task_id, stage="done", task_version=lease[8], now=NOW + 1)
            run(writer, "delete_lease", id=lease[0])
            writer.commit()
            thread.join(30)
        r = answer["r"]
        assert (r.status, r.json["error"]["code"]) == (409, "task_finished"), r.body
        after = client.get(f"/tasks/{task_id}").json
        assert after["stage"] == "done"
        assert after.get("cancelled_at_ms") is None, after
    finally:
        client.close()
        server.stop()


def lock_waiters(dsn: str) -> int:
    """Sessions of this database waiting for a lock."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        row = admin.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND wait_event_type = 'Lock'"
        ).fetchone()
    return int(row[0]) if row else 0
