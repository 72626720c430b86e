"""Retention against a real server: the background pruning (`--retention`), the operator's
`nulltickets prune` (export file, vacuum), and claims that go on while a large prune runs."""

from __future__ import annotations

import base64
import json
import re
import threading
import time
from pathlib import Path
from typing import Any

import apsw
import pytest

from nulltickets.service.retention import Export, Pruner
from nulltickets.storage.factory import open_database
from tests.cli import one_line, run_cli
from tests.conftest import create_pipeline, now_ms, unique, wait_for
from tests.server import Client, Server

pytestmark = [pytest.mark.e2e]

SHORT = {
    "initial": "todo",
    "states": {"todo": {"agent_role": "coder"}, "done": {"terminal": True}},
    "transitions": [{"from": "todo", "to": "done", "trigger": "finish"}],
}


def pipeline(client: Client) -> tuple[str, str]:
    role = unique("coder")
    definition = {**SHORT, "states": {"todo": {"agent_role": role}, "done": {"terminal": True}}}
    return create_pipeline(client, definition), role


def new_task(client: Client, pipeline_id: str, description: str = "") -> str:
    r = client.post(
        "/tasks", {"pipeline_id": pipeline_id, "title": unique("t"), "description": description}
    )
    assert r.status == 201, r.body
    return str(r.json["id"])


def claim(client: Client, role: str) -> dict[str, Any]:
    r = client.post("/leases/claim", {"agent_id": "agent", "agent_role": role})
    assert r.status == 200, (r.status, r.body)
    return dict(r.json)


def work(client: Client, role: str, *, finish: bool = True) -> tuple[str, str]:
    """Claim the next task of `role`, record an event, finish it (or leave it running)."""
    got = claim(client, role)
    run_id, token = got["run"]["id"], got["lease_token"]
    r = client.post(f"/runs/{run_id}/events", {"kind": "progress", "data": {"n": 1}}, token=token)
    assert r.status in (200, 201), r.body
    if finish:
        r = client.post(
            f"/runs/{run_id}/transition",
            {"trigger": "finish", "usage": {"tokens": 3}},
            token=token,
        )
        assert r.status == 200, r.body
    return str(got["task"]["id"]), str(run_id)


def exists(client: Client, task_id: str) -> bool:
    r = client.get(f"/tasks/{task_id}")
    assert r.status in (200, 404), r.body
    return r.status == 200


def metric(client: Client, name: str, text: str | None = None, **labels: str) -> float:
    """A sample of /metrics (of `text`, a scrape already read, when given)."""
    if text is None:
        text = client.get("/metrics").body.decode()
    label = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name + (f"{{{label}}}" if label else "")) + r" ([0-9.e+]+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def db_target(server: Server) -> str:
    return server.dsn if server.dsn is not None else str(server.db)


# --- the background job ------------------------------------------------------------------------


def test_the_background_job_prunes_finished_tasks_and_nothing_live(make_server: Any) -> None:
    server = make_server(args=["--retention", "1s", "--prune-interval", "0.1s"])
    client = server.client()
    p, role = pipeline(client)
    new_task(client, p)
    finished, _ = work(client, role)
    new_task(client, p)
    running, running_run = work(client, role, finish=False)
    queued = new_task(client, p)
    wait_for("the finished task to be pruned", lambda: not exists(client, finished))
    # Counted once the batch's transaction is back (a moment after the task is gone).
    wait_for(
        "the pruned rows to be counted",
        lambda: metric(client, "nulltickets_pruned_rows_total", table="events") >= 1,
    )
    assert metric(client, "nulltickets_pruned_rows_total", table="tasks") >= 1
    assert metric(client, "nulltickets_pruned_rows_total", table="runs") >= 1
    # The batch that deleted them was timed before its rows were counted; the passes that find
    # nothing more are no batches.
    text = client.get("/metrics").body.decode()
    batches = metric(client, "nulltickets_prune_batch_duration_seconds_count", text=text)
    assert batches >= 1
    assert metric(client, "nulltickets_prune_batch_duration_seconds_sum", text=text) > 0
    inf = metric(client, "nulltickets_prune_batch_duration_seconds_bucket", le="+Inf", text=text)
    assert inf == batches
    # Two more whole passes, each older than the retention for every task here: the running
    # and the queued task stay, with the running one's run and event.
    passes = metric(client, "nulltickets_prune_passes_total")
    wait_for(
        "two more passes", lambda: metric(client, "nulltickets_prune_passes_total") >= passes + 2
    )
    assert metric(client, "nulltickets_prune_batch_duration_seconds_count") == batches
    assert exists(client, running) and exists(client, queued)
    r = client.get(f"/runs/{running_run}/events")
    assert r.status == 200, r.body
    assert [e["kind"] for e in (r.json["items"] if isinstance(r.json, dict) else r.json)] == [
        "progress"
    ]


def test_the_background_job_exports_before_it_deletes(make_server: Any, tmp_path: Path) -> None:
    export = tmp_path / "background.jsonl"
    server = make_server(
        args=["--retention", "1s", "--prune-interval", "0.1s", "--retention-export", str(export)]
    )
    client = server.client()
    p, role = pipeline(client)
    new_task(client, p, description="keep a copy")
    finished, run_id = work(client, role)
    wait_for("the finished task to be pruned", lambda: not exists(client, finished))
    rows = [json.loads(line) for line in export.read_text().splitlines()]
    [task_row] = [r["row"] for r in rows if r["table"] == "tasks" and r["row"]["id"] == finished]
    assert task_row["description"] == "keep a copy"
    assert [r["row"]["id"] for r in rows if r["table"] == "runs"] == [run_id]
    assert export.stat().st_mode & 0o077 == 0


def test_an_export_file_that_cannot_be_written_stops_the_start(tmp_path: Path) -> None:
    result = run_cli(
        "serve", "--db", str(tmp_path / "x.db"), "--retention-export",
        str(tmp_path / "missing" / "x.jsonl"), home=tmp_path,
    )  # fmt: skip
    assert result.returncode == 1
    assert "--retention-export" in one_line(result)


def test_retention_off_keeps_everything(make_server: Any) -> None:
    server = make_server(args=["--retention", "off", "--prune-interval", "0.1s"])
    client = server.client()
    p, role = pipeline(client)
    new_task(client, p)
    finished, _ = work(client, role)
    time.sleep(0.5)  # several intervals: nothing runs at all
    assert exists(client, finished)
    text = client.get("/metrics").body.decode()
    assert "nulltickets_prune_passes_total" not in text
    assert "nulltickets_prune_batch_duration_seconds" not in text


@pytest.mark.parametrize("value", ["soon", "-1s", "0.0s"])
def test_a_bad_retention_is_one_line(tmp_path: Path, value: str) -> None:
    result = run_cli("serve", "--db", str(tmp_path / "x.db"), f"--retention={value}", home=tmp_path)
    assert result.returncode == 1
    assert "--retention" in one_line(result)


# --- nulltickets prune -------------------------------------------------------------------------


@pytest.mark.process
def test_prune_exports_then_deletes_exactly_the_old_finished_history(
    make_server: Any, tmp_path: Path
) -> None:
    server = make_server(args=["--retention", "off"])
    client = server.client()
    p, role = pipeline(client)
    new_task(client, p, description="old")
    finished, finished_run = work(client, role)
    new_task(client, p)
    running, running_run = work(client, role, finish=False)
    queued = new_task(client, p)
    time.sleep(5.2)
    new_task(client, p)
    recent, _ = work(client, role)  # finished well within the 5 s before the prune
    export = tmp_path / "pruned.jsonl"
    result = run_cli(
        "prune", "--older-than", "5s", "--export", str(export), "--db", db_target(server),
        "--json", home=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["deleted"]["tasks"] == 1 and report["deleted"]["runs"] == 1
    assert report["deleted"]["events"] >= 1
    assert not exists(client, finished)
    assert exists(client, running) and exists(client, queued) and exists(client, recent)
    r = client.get(f"/runs/{running_run}/events")
    assert r.status == 200 and len(r.json["items"] if isinstance(r.json, dict) else r.json) == 1
    # The export: every deleted row, whole, one JSON object a line, readable by its owner only.
    assert export.stat().st_mode & 0o077 == 0
    lines = [json.loads(line) for line in export.read_text().splitlines()]
    assert report["exported"] == len(lines)
    tables = {line["table"] for line in lines}
    assert {"tasks", "runs", "events"} <= tables
    [task_row] = [line["row"] for line in lines if line["table"] == "tasks"]
    assert task_row["id"] == finished and task_row["description"] == "old"
    assert task_row["stage"] == "done"
    [run_row] = [line["row"] for line in lines if line["table"] == "runs"]
    assert run_row["id"] == finished_run and run_row["status"] == "completed"
    events = [line["row"] for line in lines if line["table"] == "events"]
    assert {e["run_id"] for e in events} == {finished_run}
    assert "progress" in {e["kind"] for e in events}
    assert all(line["row"].get("task_id") in (None, finished) for line in lines)
    assert running not in export.read_text() and recent not in export.read_text()
    # The text report, and nothing left to do the second time.
    again = run_cli("prune", "--older-than", "1h", "--db", db_target(server), home=tmp_path)
    assert again.returncode == 0 and "nothing older" in again.stdout, again


def test_prune_refuses_a_bad_duration_in_one_line(tmp_path: Path) -> None:
    result = run_cli(
        "prune", "--older-than", "a while", "--db", str(tmp_path / "x.db"), home=tmp_path
    )
    assert result.returncode == 1
    assert "--older-than" in one_line(result)
    result = run_cli("prune", "--db", str(tmp_path / "x.db"), home=tmp_path)
    assert result.returncode == 2 and "--older-than" in result.stderr
    result = run_cli("prune", "--older-than", "1d", "--db", str(tmp_path / "x.db"), home=tmp_path)
    assert result.returncode == 1 and "does not exist" in one_line(result)
    assert not (tmp_path / "x.db").exists()


def test_the_export_encodes_bytes_as_base64() -> None:
    from nulltickets.service.retention import _encode

    assert json.loads(_encode({"b": b"\x00\xff"}))["b"] == base64.b64encode(b"\x00\xff").decode()


# --- claims go on while a large prune runs -----------------------------------------------------


@pytest.mark.process
def test_claims_keep_succeeding_while_a_large_prune_runs(make_server: Any, tmp_path: Path) -> None:
    """The server claims and finishes tasks in a thread while a prune of 600 finished tasks
    (with an export: an fsync per batch) runs from another process's connection, as
    `nulltickets prune` does: every claim succeeds, and some complete while it runs."""
    server = make_server(args=["--retention", "off"])
    client = server.client()
    old, old_role = pipeline(client)
    body = {"tasks": [{"pipeline_id": old, "title": "x", "description": "d" * 500}] * 50}
    for _ in range(12):
        r = client.post("/tasks/bulk", body)
        assert r.status == 201, r.body
    for _ in range(600):
        work(client, old_role)
    live, live_role = pipeline(client)
    cutoff = now_ms() + 1  # every old task finished before it (and live ones finished since)
    done = threading.Event()
    outcomes: list[tuple[int, float]] = []  # (status, when it came back)

    def claims() -> None:
        c = server.client()
        while not done.is_set():
            new_task(c, live)
            r = c.post("/leases/claim", {"agent_id": "b", "agent_role": live_role})
            outcomes.append((r.status, time.monotonic()))
            if r.status == 200:
                t = c.post(
                    f"/runs/{r.json['run']['id']}/transition",
                    {"trigger": "finish"},
                    token=r.json["lease_token"],
                )
                outcomes.append((t.status, time.monotonic()))
        c.close()

    thread = threading.Thread(target=claims)
    thread.start()
    export = Export(str(tmp_path / "x.jsonl"))
    database = open_database(db_target(server), readers=1)
    try:
        wait_for("claims to start", lambda: len(outcomes) >= 4)
        started = time.monotonic()
        report = Pruner(database, export, batch=20).prune(cutoff, vacuum=False)
        ended = time.monotonic()
    finally:
        done.set()
        thread.join()
        database.close()
        export.close()
    assert report.deleted["tasks"] >= 600 and report.batches >= 30
    assert export.lines == report.exported > 600 * 3  # each task, its run and its event
    assert [s for s, _ in outcomes if s != 200] == []  # none refused, none failed
    assert any(started < at < ended for _, at in outcomes)  # claims went on meanwhile


# --- SQLite gives the file back ---------------------------------------------------------------


def pages(path: Path) -> tuple[int, int, int]:
    conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        return (
            int(conn.pragma("page_count")),
            int(conn.pragma("freelist_count")),
            int(conn.pragma("auto_vacuum")),
        )
    finally:
        conn.close()


@pytest.mark.process
@pytest.mark.sqlite_file
@pytest.mark.parametrize("made_before_retention", [False, True])
def test_prune_with_vacuum_gives_the_file_back(
    make_server: Any, tmp_path: Path, made_before_retention: bool
) -> None:
    db = tmp_path / "s0.db"
    if made_before_retention:  # a file an earlier version made: no incremental vacuum yet
        conn = apsw.Connection(str(db))
        conn.pragma("journal_mode", "wal")
        conn.close()
    server = make_server(args=["--retention", "off"])
    assert server.db == db
    client = server.client()
    p, role = pipeline(client)
    body = {"tasks": [{"pipeline_id": p, "title": "x", "description": "d" * 4000}] * 10}
    for _ in range(30):
        assert client.post("/tasks/bulk", body).status == 201
    for _ in range(300):
        work(client, role)
    server.stop()
    full, _, mode = pages(db)
    assert mode == (0 if made_before_retention else 2)
    result = run_cli(
        "prune", "--older-than", "0s", "--vacuum", "--db", str(db), "--json", home=tmp_path
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["deleted"]["tasks"] == 300
    assert report["vacuum_switched"] is made_before_retention
    after, free, mode = pages(db)
    assert mode == 2 and free == 0
    assert after < full // 2, (full, after)  # 300 tasks of 4 kB each: most of the file
    # The pages are given back, not only free for reuse: the file itself is smaller.
    assert report["pages_after"] == after and report["free_pages"] == 0


@pytest.mark.process
@pytest.mark.parametrize(
    ("args", "said"),
    [
        ([], "retention 30d: finished tasks older than that are deleted with their history"),
        (["--retention", "12h"], "retention 12h: finished tasks older than that are deleted"),
        (["--retention", "off"], "retention off: finished tasks and their history are kept"),
    ],
)
def test_the_start_says_what_retention_deletes(tmp_path: Path, args: list[str], said: str) -> None:
    """A server that deletes history says so when it starts, the default included."""
    server = Server(tmp_path / "tracker.db", args=args).start()
    try:
        assert said in server.output()
    finally:
        server.stop()
