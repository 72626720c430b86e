"""`nulltickets worker` and the commands a running agent calls, as separate processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.conftest import create_pipeline, unique
from tests.server import Client, Server, alive, descendants, server_command

STEPS = 4

# The agent every worker runs: it resumes from the checkpoint, logs each step it performs and
# each step it checkpoints, and crashes at random (between a step and its checkpoint, or after).
AGENT = f"""
import json, os, random, subprocess, sys
task = json.load(sys.stdin)
with open(os.environ["NULLTICKETS_CHECKPOINT_FILE"]) as f:
    done = json.load(f).get("step", 0)
log = open(os.environ["AGENT_LOG"], "a", buffering=1)
cli = {json.dumps(server_command())}
for step in range(done + 1, {STEPS} + 1):
    log.write(f"{{task['id']}} perform {{step}}\\n")
    if random.random() < 0.15:
        sys.exit(3)  # crashed after the work, before the checkpoint: the step is redone
    subprocess.run([*cli, "checkpoint", json.dumps({{"step": step}})], check=True,
                   stdout=subprocess.DEVNULL)
    log.write(f"{{task['id']}} ckpt {{step}}\\n")
    if random.random() < 0.1:
        print("agent crashed", file=sys.stderr)
        os._exit(4)
print("nulltickets:trigger=complete")
"""

PIPELINE = {
    "initial": "todo",
    "states": {"todo": {}, "done": {"terminal": True}},
    "transitions": [{"from": "todo", "to": "done", "trigger": "complete"}],
}


def role_pipeline(client: Client) -> tuple[str, str]:
    role = unique("worker")
    definition = json.loads(json.dumps(PIPELINE))
    definition["states"]["todo"]["agent_role"] = role
    return create_pipeline(client, definition), role


def worker(
    server: Server, role: str, command: list[str], *extra: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [
            *server_command(),
            "worker",
            "--role",
            role,
            "--base",
            server.base,
            *extra,
            "--",
            *command,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )


def test_workers_finish_a_crashing_backlog_exactly_once_without_redoing_checkpointed_steps(
    fresh_server: Server, tmp_path: Path
) -> None:
    client = fresh_server.client()
    pipeline, role = role_pipeline(client)
    # Retried at once (a retry delay of 0): with the default backoff, a task crashing three
    # times in a row would wait, and the workers, which stop when idle, could stop first.
    retry = {"retry_delay_ms": 0}
    tasks = [
        {"pipeline_id": pipeline, "title": f"t{i}", "description": "", "retry_policy": retry}
        for i in range(50)
    ]
    r = client.post("/tasks/bulk", {"tasks": tasks})
    ids = r.json["ids"]
    agent, log = tmp_path / "agent.py", tmp_path / "agent.log"
    agent.write_text(AGENT)
    command = [sys.executable, str(agent)]
    workers = [
        worker(
            fresh_server,
            role,
            command,
            "--exit-when-idle",
            "--wait-ms",
            "3000",
            "--agent-id",
            f"w{i}",
            env={"AGENT_LOG": str(log)},
        )
        for i in range(3)
    ]
    for w in workers:
        _, err = w.communicate(timeout=240)
        assert w.returncode == 0, err.decode()[-2000:]

    failures = 0
    for task_id in ids:
        task = client.get(f"/tasks/{task_id}").json
        assert task["stage"] == "done", task
        assert task["task_version"] == 2  # moved exactly once
        assert task["checkpoint"] == {"step": STEPS}
        failures += len(task["previous_failures"])
        runs = task["latest_run"]["attempt"]
        transitions = 0
        # Every run of the task: exactly one of them completed with a transition.
        for run in _runs_of(fresh_server, task_id):
            events = client.get(f"/runs/{run}/events?limit=1000").json["items"]
            transitions += sum(e["kind"] == "transition" for e in events)
        assert transitions == 1
        assert runs == len(task["previous_failures"]) + 1
    assert failures > 0, "no agent crashed: the random crashes did not happen"

    # No step that was checkpointed was ever performed again.
    checkpointed: set[tuple[str, str]] = set()
    for line in log.read_text().splitlines():
        task_id, what, step = line.split()
        if what == "perform":
            assert (task_id, step) not in checkpointed, f"step {step} of {task_id} redone"
        else:
            checkpointed.add((task_id, step))
    assert {(t, str(s)) for t in ids for s in range(1, STEPS + 1)} == checkpointed
    client.close()


def _runs_of(server: Server, task_id: str) -> list[str]:
    if server.dsn is not None:  # the server runs on PostgreSQL
        import psycopg

        with psycopg.connect(server.dsn) as pg:
            found = pg.execute(
                "SELECT id FROM runs WHERE task_id = %s ORDER BY attempt", (task_id,)
            ).fetchall()
        return [row[0] for row in found]
    import apsw

    conn = apsw.Connection(str(server.db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        rows = conn.execute("SELECT id FROM runs WHERE task_id = ? ORDER BY attempt", (task_id,))
        return [row[0] for row in rows]
    finally:
        conn.close()


def _wait_for(predicate: Any, timeout: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_sigterm_releases_the_task_without_counting_a_failure(
    client: Client, shared_server: Server, tmp_path: Path
) -> None:
    pipeline, role = role_pipeline(client)
    task_id = client.post(
        "/tasks",
        {
            "pipeline_id": pipeline,
            "title": "t",
            "description": "",
            "retry_policy": {"max_attempts": 1},
        },
    ).json["id"]
    started = tmp_path / "started"
    sleeper = [
        sys.executable,
        "-c",
        f"import time, pathlib; pathlib.Path({str(started)!r}).touch(); time.sleep(60)",
    ]
    w = worker(shared_server, role, sleeper, "--agent-id", "sleepy")
    _wait_for(started.exists)
    w.send_signal(signal.SIGTERM)
    _, err = w.communicate(timeout=30)
    assert w.returncode == 0, err.decode()
    task = client.get(f"/tasks/{task_id}").json
    assert task["latest_run"]["status"] == "released"
    assert task["previous_failures"] == [] and task["dead_letter_reason"] is None
    again = client.post("/leases/claim", {"agent_id": "next", "agent_role": role})
    assert again.status == 200 and again.json["task"]["id"] == task_id


def test_sigkill_of_the_workers_pid_leaves_no_process_of_it_running(
    client: Client, shared_server: Server, tmp_path: Path
) -> None:
    """What a supervisor does to a stuck worker: SIGKILL of the pid it started (under the
    standalone binary, the onefile bootstrap). The worker below it and the command it runs must
    go too, or an orphaned command works on a task whose lease expires and is claimed again."""
    pipeline, role = role_pipeline(client)
    client.post("/tasks", {"pipeline_id": pipeline, "title": "t", "description": ""})
    pid_file = tmp_path / "command.pid"
    sleeper = [
        sys.executable,
        "-c",
        f"import os, time, pathlib; pathlib.Path({str(pid_file)!r}).write_text(str(os.getpid()));"
        " time.sleep(120)",
    ]
    w = worker(shared_server, role, sleeper, "--agent-id", "killed")
    _wait_for(lambda: pid_file.exists() and pid_file.read_text() != "")
    command = int(pid_file.read_text())
    below = descendants(w.pid)
    assert command in below, (command, below)
    w.kill()
    w.communicate(timeout=30)
    _wait_for(lambda: not any(alive(pid) for pid in below), timeout=20)


def test_sigterm_while_waiting_for_work_exits_promptly_and_claims_nothing(
    client: Client, shared_server: Server
) -> None:
    pipeline, role = role_pipeline(client)
    w = worker(shared_server, role, [sys.executable, "-c", "pass"], "--wait-ms", "30000")
    assert w.stderr is not None
    first = w.stderr.readline()  # written once its signal handlers are in place
    assert b"claiming tasks for role" in first, first
    time.sleep(0.3)  # and then it goes into its long-poll claim
    started = time.monotonic()
    w.send_signal(signal.SIGTERM)
    _, err = w.communicate(timeout=20)
    assert w.returncode == 0, err.decode()
    assert time.monotonic() - started < 5
    # The claim it abandoned must not grab a task created afterwards.
    task_id = client.post(
        "/tasks", {"pipeline_id": pipeline, "title": "t", "description": ""}
    ).json["id"]
    claim = client.post("/leases/claim", {"agent_id": "other", "agent_role": role})
    assert claim.status == 200 and claim.json["task"]["id"] == task_id
    assert claim.json["run"]["attempt"] == 1


def test_a_failing_command_fails_the_attempt_with_the_tail_of_its_stderr(
    client: Client, shared_server: Server
) -> None:
    pipeline, role = role_pipeline(client)
    task_id = client.post(
        "/tasks",
        {
            "pipeline_id": pipeline,
            "title": "t",
            "description": "",
            "retry_policy": {"max_attempts": 1},
        },
    ).json["id"]
    failing = [
        sys.executable,
        "-c",
        "import sys; print('x' * 9000, file=sys.stderr); print('the real reason', "
        "file=sys.stderr); sys.exit(7)",
    ]
    w = worker(shared_server, role, failing, "--exit-when-idle", "--wait-ms", "500")
    w.communicate(timeout=30)
    task = client.get(f"/tasks/{task_id}").json
    assert task["dead_letter_reason"] == "max_attempts_exceeded"
    [failure] = task["previous_failures"]
    assert failure["status"] == "failed"
    assert "status 7" in failure["error"] and failure["error"].rstrip().endswith("the real reason")
    assert len(failure["error"]) < 5000


def test_pause_releases_everything_an_agent_holds(client: Client) -> None:
    pipeline, role = role_pipeline(client)
    for _ in range(2):
        client.post("/tasks", {"pipeline_id": pipeline, "title": "t", "description": ""})
    agent = unique("agent")
    for _ in range(2):
        assert client.post("/leases/claim", {"agent_id": agent, "agent_role": role}).status == 200
    base = f"http://127.0.0.1:{client.port}"
    out = subprocess.run(
        [*server_command(), "pause", "--agent-id", agent, "--base", base],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["released"]) == 2
    again = subprocess.run(
        [*server_command(), "pause", "--agent-id", agent, "--base", base],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert json.loads(again.stdout)["released"] == []


def test_checkpoint_outside_a_worker_says_what_is_missing() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NULLTICKETS_")}
    out = subprocess.run(
        [*server_command(), "checkpoint", '{"a": 1}'],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert out.returncode == 1
    assert "NULLTICKETS_RUN_ID is not set" in out.stderr
