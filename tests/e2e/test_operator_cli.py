"""The operator's commands, run as a person runs them, against a real server and real files:
tasks list/show/requeue/cancel, runs tail, backup, doctor."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apsw
import pytest

from tests.cli import one_line, run_cli
from tests.conftest import claimed, create_pipeline, make_task, pipeline_with_roles, wait_for
from tests.fixtures.reference import build_reference_db
from tests.server import Client, Server, server_command

pytestmark = [pytest.mark.e2e, pytest.mark.process]

HEADER = "ID  STAGE  STATE  PRIORITY  UPDATED  TITLE"


def cli(server: Server, *args: str, home: Path, **kw: Any) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, "--base", server.base, home=home, **kw)


def ok_json(result: subprocess.CompletedProcess[str]) -> Any:
    assert result.returncode == 0, result
    assert result.stderr == ""
    return json.loads(result.stdout)


def header_words(line: str) -> list[str]:
    return line.split()


# --- tasks list --------------------------------------------------------------------------------


def test_tasks_list_on_a_fresh_server_prints_an_empty_table(
    fresh_server: Server, tmp_path: Path
) -> None:
    result = cli(fresh_server, "tasks", "list", home=tmp_path)
    assert result.returncode == 0, result
    assert header_words(result.stdout) == header_words(HEADER)
    assert result.stdout.count("\n") == 1
    assert ok_json(cli(fresh_server, "tasks", "list", "--json", home=tmp_path)) == []


def move_to_review(client: Client, role: str) -> str:
    c = claimed(client, role)
    r = client.post(
        f"/runs/{c['run']['id']}/transition",
        {"trigger": "submit"},
        token=c["lease_token"],
    )
    assert r.status == 200, r.body
    return str(c["task"]["id"])


def test_tasks_list_filters_by_stage_pipeline_and_role(
    shared_server: Server, client: Client, tmp_path: Path
) -> None:
    pipeline, coder, reviewer = pipeline_with_roles(client)
    ids = [make_task(client, pipeline, title=f"task {i}") for i in range(3)]
    in_review = move_to_review(client, coder)  # the most urgent: the oldest, ids[0]
    assert in_review == ids[0]

    def listed(*args: str) -> list[str]:
        found = ok_json(cli(shared_server, "tasks", "list", "--json", *args, home=tmp_path))
        return [t["id"] for t in found]

    assert listed("--pipeline", pipeline) == ids  # oldest first
    assert listed("--pipeline", pipeline, "--stage", "review") == [in_review]
    assert listed("--role", reviewer) == [in_review]
    assert listed("--role", coder) == ids[1:]
    assert listed("--role", coder, "--stage", "review") == []
    assert listed("--pipeline", pipeline, "--limit", "2") == ids[:2]

    table = cli(shared_server, "tasks", "list", "--pipeline", pipeline, home=tmp_path)
    assert table.returncode == 0
    lines = table.stdout.splitlines()
    assert header_words(lines[0]) == header_words(HEADER)
    assert [line.split()[0] for line in lines[1:]] == ids
    assert lines[1].split()[1] == "review" and lines[1].endswith("task 0")


def test_tasks_list_follows_the_pages_up_to_the_limit(fresh_server: Server, tmp_path: Path) -> None:
    client = fresh_server.client()
    pipeline = create_pipeline(client)
    ids: list[str] = []
    for start in range(0, 1003, 340):  # a bulk body stays under the body limit
        count = min(340, 1003 - start)
        tasks = [
            {"pipeline_id": pipeline, "title": f"t{start + i}", "description": ""}
            for i in range(count)
        ]
        r = client.post("/tasks/bulk", {"tasks": tasks})
        assert r.status == 201, r.body
        ids.extend(r.json["ids"])
    everything = ok_json(
        cli(fresh_server, "tasks", "list", "--json", "--limit", "1002", home=tmp_path)
    )
    listed = [t["id"] for t in everything]
    assert len(listed) == len(set(listed)) == 1002 and set(listed) <= set(ids)
    order = [t["id"] for t in sorted(everything, key=lambda t: (t["created_at_ms"], t["id"]))]
    assert listed == order  # oldest first across the pages
    default = ok_json(cli(fresh_server, "tasks", "list", "--json", home=tmp_path))
    assert [t["id"] for t in default] == listed[:100]
    client.close()


def test_a_bad_limit_is_one_line(shared_server: Server, tmp_path: Path) -> None:
    result = cli(shared_server, "tasks", "list", "--limit", "0", home=tmp_path)
    assert result.returncode == 1
    assert one_line(result) == "--limit must be a positive integer, got '0'"


# --- tasks show --------------------------------------------------------------------------------


def test_tasks_show_gives_stage_runs_events_checkpoint_and_failures(
    shared_server: Server, client: Client, tmp_path: Path
) -> None:
    pipeline, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline, title="show me")
    first = claimed(client, coder)
    token = first["lease_token"]
    run = first["run"]["id"]
    assert (
        client.put(f"/runs/{run}/checkpoint", {"checkpoint": {"step": 2}}, token=token).status
        == 200
    )
    assert client.post(f"/runs/{run}/fail", {"error": "boom: exit 3"}, token=token).status == 200
    second = claimed(client, coder)
    assert second["task"]["id"] == task_id
    run2, token2 = second["run"]["id"], second["lease_token"]
    for pct in (10, 20):
        r = client.post(
            f"/runs/{run2}/events", {"kind": "progress", "data": {"pct": pct}}, token=token2
        )
        assert r.status == 201, r.body

    text = cli(shared_server, "tasks", "show", task_id, home=tmp_path)
    assert text.returncode == 0, text
    out = text.stdout
    assert f"task        {task_id}" in out
    assert "stage       todo" in out
    assert f"latest run  {run2} attempt 2 running" in out
    assert 'checkpoint  {"step":2}' in out
    assert "attempt 1  failed" in out and "boom: exit 3" in out
    assert 'progress  {"pct":20}' in out
    assert "submit -> review" in out

    doc = ok_json(cli(shared_server, "tasks", "show", task_id, "--json", home=tmp_path))
    assert doc["task"]["id"] == task_id and doc["task"]["latest_run"]["id"] == run2
    assert doc["task"]["checkpoint"] == {"step": 2}
    assert [f["error"] for f in doc["task"]["previous_failures"]] == ["boom: exit 3"]
    assert [e["data"] for e in doc["last_events"]] == [{"pct": 10}, {"pct": 20}]


def test_tasks_show_of_an_unknown_task_is_one_line(shared_server: Server, tmp_path: Path) -> None:
    result = cli(shared_server, "tasks", "show", "no-such-task", home=tmp_path)
    assert result.returncode == 1
    assert one_line(result) == "the server answered 404 task_not_found: Task not found."


def test_client_commands_send_the_token(make_server: Any, tmp_path: Path) -> None:
    server = make_server(token="s3cret")
    denied = cli(server, "tasks", "list", home=tmp_path)
    assert denied.returncode == 1 and "401 unauthorized" in one_line(denied)
    assert ok_json(cli(server, "tasks", "list", "--json", "--token", "s3cret", home=tmp_path)) == []
    from_env = cli(
        server, "tasks", "list", "--json", home=tmp_path, env={"NULLTICKETS_TOKEN": "s3cret"}
    )
    assert ok_json(from_env) == []


# --- requeue and cancel (POST /tasks/{id}/requeue and /cancel) ---------------------------------


def dead_letter(client: Client, role: str, pipeline: str) -> str:
    task_id = make_task(client, pipeline, retry_policy={"max_attempts": 1})
    c = claimed(client, role)
    assert c["task"]["id"] == task_id
    r = client.post(f"/runs/{c['run']['id']}/fail", {"error": "typo"}, token=c["lease_token"])
    assert r.status == 200, r.body
    assert client.post("/leases/claim", {"agent_id": "x", "agent_role": role}).status == 204
    return task_id


def test_tasks_requeue_makes_a_dead_lettered_task_claimable(
    shared_server: Server, client: Client, tmp_path: Path
) -> None:
    pipeline, coder, _ = pipeline_with_roles(client)
    task_id = dead_letter(client, coder, pipeline)
    args = ["tasks", "requeue", task_id, "--reset-attempts", "--reason", "typo fixed", "--json"]
    task = ok_json(cli(shared_server, *args, home=tmp_path))
    assert task["id"] == task_id and task["stage"] == "todo"
    again = claimed(client, coder)
    assert again["task"]["id"] == task_id


def test_tasks_cancel_means_never_claimed_again(
    shared_server: Server, client: Client, tmp_path: Path
) -> None:
    pipeline, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline)
    text = cli(shared_server, "tasks", "cancel", task_id, "--reason", "not needed", home=tmp_path)
    assert text.returncode == 0, text
    assert f"task        {task_id}" in text.stdout
    assert "cancelled   " in text.stdout and ": not needed" in text.stdout
    assert client.post("/leases/claim", {"agent_id": "x", "agent_role": coder}).status == 204
    shown = cli(shared_server, "tasks", "show", task_id, home=tmp_path)
    assert "task events" in shown.stdout and "  cancelled  " in shown.stdout
    doc = ok_json(cli(shared_server, "tasks", "show", task_id, "--json", home=tmp_path))
    assert [e["kind"] for e in doc["task_events"]] == ["cancelled"]
    assert doc["task"]["cancel_reason"] == "not needed"


def test_tasks_cancel_while_a_worker_holds_the_lease_ends_its_tail(
    shared_server: Server, client: Client, tmp_path: Path
) -> None:
    pipeline, coder, _ = pipeline_with_roles(client)
    task_id = make_task(client, pipeline)
    c = claimed(client, coder)
    run, token = c["run"]["id"], c["lease_token"]
    client.post(f"/runs/{run}/events", {"kind": "progress"}, token=token)
    with tailing(shared_server, run, tmp_path) as proc:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["kind"] == "progress"
        done = cli(shared_server, "tasks", "cancel", task_id, "--json", home=tmp_path)
        assert ok_json(done)["id"] == task_id
        assert json.loads(proc.stdout.readline())["kind"] == "cancelled"
        assert proc.wait(30) == 0
    r = client.post(f"/leases/{c['lease_id']}/heartbeat", token=token)
    assert (r.status, r.error_code) == (409, "task_cancelled")


def test_requeue_of_an_unknown_task_is_one_line(shared_server: Server, tmp_path: Path) -> None:
    result = cli(shared_server, "tasks", "requeue", "no-such-task", home=tmp_path)
    assert result.returncode == 1
    assert one_line(result).startswith("the server answered 404")


# --- runs tail ---------------------------------------------------------------------------------


def _interruptible() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def tailing(server: Server, run_id: str, home: Path) -> Iterator[subprocess.Popen[str]]:
    """`nulltickets runs tail RUN_ID --json` in the background; killed at the end if still on."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("NULLTICKETS_")}
    with subprocess.Popen(
        [*server_command(), "runs", "tail", run_id, "--base", server.base, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "NULLTICKETS_HOME": str(home)},
        # As from a terminal: a test run started in the background (`make test &`) inherits
        # SIGINT ignored, and Python then leaves it ignored.
        preexec_fn=_interruptible,
    ) as proc:
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.kill()


def test_runs_tail_follows_events_until_the_run_ends(
    shared_server: Server, client: Client, tmp_path: Path
) -> None:
    pipeline, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline)
    c = claimed(client, coder)
    run, token = c["run"]["id"], c["lease_token"]
    client.post(f"/runs/{run}/events", {"kind": "progress", "data": {"pct": 1}}, token=token)
    with tailing(shared_server, run, tmp_path) as proc:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())  # it printed what was there
        assert (first["kind"], first["data"]) == ("progress", {"pct": 1})
        client.post(f"/runs/{run}/events", {"kind": "progress", "data": {"pct": 2}}, token=token)
        second = json.loads(proc.stdout.readline())  # and then what came
        assert second["data"] == {"pct": 2}
        r = client.post(f"/runs/{run}/transition", {"trigger": "submit"}, token=token)
        assert r.status == 200, r.body
        last = json.loads(proc.stdout.readline())
        assert last["kind"] == "transition"
        assert proc.wait(30) == 0
        assert proc.stdout.read() == ""


def test_runs_tail_stops_on_sigint(shared_server: Server, client: Client, tmp_path: Path) -> None:
    pipeline, coder, _ = pipeline_with_roles(client)
    make_task(client, pipeline)
    c = claimed(client, coder)
    run, token = c["run"]["id"], c["lease_token"]
    client.post(f"/runs/{run}/events", {"kind": "progress"}, token=token)
    with tailing(shared_server, run, tmp_path) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert json.loads(proc.stdout.readline())["kind"] == "progress"  # it is polling now
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 130
        assert "Traceback" not in proc.stderr.read()


# --- backup ------------------------------------------------------------------------------------


@pytest.mark.sqlite_file
def test_backup_while_agents_write_gives_a_copy_a_server_can_serve(
    fresh_server: Server, tmp_path: Path
) -> None:
    client = fresh_server.client()
    pipeline, coder, _ = pipeline_with_roles(client)
    stop = threading.Event()
    created: list[str] = []
    errors: list[BaseException] = []

    def agent(n: int) -> None:
        c = fresh_server.client()
        try:
            while not stop.is_set():
                created.append(make_task(c, pipeline, title=f"agent {n}"))
                got = c.post("/leases/claim", {"agent_id": f"a{n}", "agent_role": coder})
                if got.status == 200:
                    run, token = got.json["run"]["id"], got.json["lease_token"]
                    c.post(f"/runs/{run}/events", {"kind": "step"}, token=token)
                    c.post(f"/runs/{run}/transition", {"trigger": "submit"}, token=token)
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=agent, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    try:
        wait_for("the agents to write", lambda: len(created) >= 20, timeout=60)
        before = set(created)
        dest = tmp_path / "copy.db"
        result = run_cli("backup", str(dest), "--db", str(fresh_server.db), home=tmp_path)
        assert result.returncode == 0, result
        assert result.stdout.startswith(f"backup of {fresh_server.db} written to {dest}")
        # Counted from the backup's end, not from `before`: the agents go on creating tasks
        # while the command starts and copies. Of five more, at most one per agent can have
        # been sent before the copy was taken; the others cannot be in it.
        done = len(created)
        wait_for("more writes after the backup", lambda: len(created) >= done + 5, 60)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not errors, errors

    conn = apsw.Connection(str(dest), flags=apsw.SQLITE_OPEN_READONLY)
    assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    copied = {row[0] for row in conn.execute("SELECT id FROM tasks")}
    conn.close()
    assert before <= copied < set(created)  # everything before it, and not what came after

    restored = Server(dest).start()  # restore = serve the copy
    try:
        c = restored.client()
        served = c.get(f"/tasks?pipeline_id={pipeline}&limit=1000")
        assert served.status == 200
        assert {t["id"] for t in served.json["items"]} >= before
        some = sorted(before)[0]
        assert c.get(f"/tasks/{some}").status == 200
        c.close()
    finally:
        restored.stop()
        client.close()


@pytest.mark.sqlite_file
def test_backup_refuses_to_overwrite_without_force(fresh_server: Server, tmp_path: Path) -> None:
    dest = tmp_path / "copy.db"
    dest.write_text("precious")
    result = run_cli("backup", str(dest), "--db", str(fresh_server.db), home=tmp_path)
    assert result.returncode == 1
    assert one_line(result) == f"{dest} already exists; pass --force to overwrite it"
    assert dest.read_text() == "precious"
    forced = run_cli("backup", str(dest), "--db", str(fresh_server.db), "--force", home=tmp_path)
    assert forced.returncode == 0, forced
    assert dest.read_bytes().startswith(b"SQLite format 3\x00")


def test_backup_of_a_missing_database_is_one_line(tmp_path: Path) -> None:
    result = run_cli(
        "backup", str(tmp_path / "c.db"), "--db", str(tmp_path / "no.db"), home=tmp_path
    )
    assert result.returncode == 1
    assert one_line(result) == f"database {tmp_path / 'no.db'} does not exist"


@pytest.mark.sqlite_file
def test_backup_finds_the_database_as_serve_does(fresh_server: Server, tmp_path: Path) -> None:
    dest = tmp_path / "copy.db"
    env = {"NULLTICKETS_DB": str(fresh_server.db)}
    result = run_cli("backup", str(dest), home=tmp_path, env=env)
    assert result.returncode == 0, result
    assert dest.is_file()


# --- doctor ------------------------------------------------------------------------------------


def doctor(db: Path, home: Path) -> tuple[int, dict[str, Any]]:
    result = run_cli("doctor", "--db", str(db), "--json", home=home)
    assert result.stderr == "", result.stderr
    return result.returncode, json.loads(result.stdout)


def expected_version() -> int:
    from nulltickets.storage.sqlite.connection import migrations

    return len(migrations())


@pytest.mark.sqlite_file
def test_doctor_on_a_healthy_database_in_use_and_not(fresh_server: Server, tmp_path: Path) -> None:
    status, report = doctor(fresh_server.db, tmp_path)
    assert status == 0, report
    assert report["integrity"] == "ok" and report["ok"] is True
    assert report["schema_version"] == report["expected_version"] == expected_version()
    assert report["contents"] == "nulltickets"
    assert report["application_id"] == 0x4E544B54
    assert report["in_use"] is True  # the server has it open
    assert report["on_start"] == "nothing to migrate: serve it as it is"
    fresh_server.stop()
    status, report = doctor(fresh_server.db, tmp_path)
    assert status == 0 and report["in_use"] is False

    text = run_cli("doctor", "--db", str(fresh_server.db), home=tmp_path)
    assert text.returncode == 0
    assert "integrity    ok" in text.stdout and "status       ok" in text.stdout


def test_doctor_on_the_originals_database_says_it_will_migrate(tmp_path: Path) -> None:
    db = build_reference_db(tmp_path / "reference.db")
    status, report = doctor(db, tmp_path)
    assert status == 0, report
    assert (report["schema_version"], report["contents"]) == (0, "original")
    assert report["on_start"] == (
        f"adopt the original's database and migrate it from 0 to {expected_version()}"
    )
    assert Server(db).start().stop() == 0  # and the server does
    assert doctor(db, tmp_path)[1]["on_start"] == "nothing to migrate: serve it as it is"


def test_doctor_on_an_older_schema_says_from_which_version(tmp_path: Path) -> None:
    from nulltickets.storage.sqlite.connection import migrations

    db = tmp_path / "old.db"
    conn = apsw.Connection(str(db))
    for number, _name, sql in migrations()[:3]:
        conn.execute(sql).fetchall()
        conn.pragma("user_version", number)
    conn.pragma("application_id", 0x4E544B54)
    conn.close()
    status, report = doctor(db, tmp_path)
    assert status == 0, report
    assert report["on_start"] == f"migrate from version 3 to {expected_version()}"


def test_doctor_on_a_newer_schema_says_the_server_refuses(
    fresh_server: Server, tmp_path: Path
) -> None:
    fresh_server.stop()
    conn = apsw.Connection(str(fresh_server.db))
    conn.pragma("user_version", 99)
    conn.close()
    status, report = doctor(fresh_server.db, tmp_path)
    assert status == 1
    assert report["on_start"].startswith("refuse to start: schema version 99 is newer")


def corrupt_table(db: Path, table: str, dest: Path) -> Path:
    """A copy of `db` with the root page of `table` overwritten (its header left intact)."""
    conn = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    (root,) = conn.execute("SELECT rootpage FROM sqlite_schema WHERE name = ?", (table,)).fetchone()
    page = conn.pragma("page_size")
    conn.close()
    raw = bytearray(db.read_bytes())
    start = (root - 1) * page
    raw[start + 16 : start + page - 16] = b"\xa5" * (page - 32)
    dest.write_bytes(bytes(raw))
    return dest


@pytest.fixture
def filled_db(fresh_server: Server) -> Path:
    client = fresh_server.client()
    pipeline = create_pipeline(client)
    for _ in range(40):
        make_task(client, pipeline, description="x" * 500)
    client.close()
    fresh_server.stop()
    return fresh_server.db


@pytest.mark.sqlite_file
def test_doctor_on_a_corrupt_table(filled_db: Path, tmp_path: Path) -> None:
    corrupt = corrupt_table(filled_db, "tasks", tmp_path / "corrupt.db")
    status, report = doctor(corrupt, tmp_path)
    assert status == 1
    assert report["integrity"] != "ok" and report["ok"] is False
    assert any(p.startswith("integrity_check failed") for p in report["problems"]), report
    text = run_cli("doctor", "--db", str(corrupt), home=tmp_path)
    assert text.returncode == 1 and "status       needs attention" in text.stdout


@pytest.mark.sqlite_file
def test_doctor_on_a_file_corrupt_throughout(filled_db: Path, tmp_path: Path) -> None:
    raw = bytearray(filled_db.read_bytes())
    page = 4096
    for offset in range(page, len(raw) - page, page):  # every page but the first and last
        raw[offset + 100 : offset + 400] = b"\xa5" * 300
    corrupt = tmp_path / "corrupt.db"
    corrupt.write_bytes(bytes(raw))
    status, report = doctor(corrupt, tmp_path)
    assert status == 1 and report["ok"] is False
    assert report["on_start"].startswith(f"refuse to start: database {corrupt} is corrupt")


def test_doctor_on_a_file_that_is_not_a_database(tmp_path: Path) -> None:
    path = tmp_path / "notes.db"
    path.write_text("not a database\n" * 400)
    status, report = doctor(path, tmp_path)
    assert status == 1
    assert report["on_start"] == f"refuse to start: {path} is not an SQLite database"


def test_doctor_on_a_missing_file_says_it_will_be_created(tmp_path: Path) -> None:
    status, report = doctor(tmp_path / "new.db", tmp_path)
    assert status == 0
    assert (
        report["on_start"]
        == f"create a new database and migrate it to version {expected_version()}"
    )
    assert not (tmp_path / "new.db").exists()
