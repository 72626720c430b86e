"""Workers and clients that outlive the server: SIGKILLed and restarted on the same port and
database while they work, busy (503 Retry-After), or taking a lease away from them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apsw
import msgspec
import pytest

from nulltickets.client import ApiError, AsyncClient, Client, Retry, RetryEvent
from tests.conftest import unique, wait_for
from tests.server import Server, alive, server_command

pytestmark = [pytest.mark.e2e, pytest.mark.process]

STEPS = 3

# The agent: it resumes from its checkpoint, and for each step appends "perform" to a log before
# doing it and "done" once the step is checkpointed. A step logged "done" that is performed
# again was redone. The first attempt of every third task crashes after its first step, so
# that a later attempt (often after a restart of the server) has to resume from the checkpoint.
AGENT = f"""
import json, os, subprocess, sys, time
task = json.load(sys.stdin)
with open(os.environ["NULLTICKETS_CHECKPOINT_FILE"]) as f:
    start = json.load(f).get("step", 0)
log = open(os.environ["AGENT_LOG"], "a", buffering=1)
cli = {json.dumps(server_command())}
for step in range(start + 1, {STEPS} + 1):
    log.write(f"{{task['id']}} perform {{step}} {{os.environ['NULLTICKETS_FENCE']}}\\n")
    time.sleep(0.05)
    subprocess.run([*cli, "checkpoint", json.dumps({{"step": step}})], check=True,
                   stdout=subprocess.DEVNULL)
    log.write(f"{{task['id']}} done {{step}} {{os.environ['NULLTICKETS_FENCE']}}\\n")
    if int(task["title"][1:]) % 3 == 0 and os.environ["NULLTICKETS_ATTEMPT"] == "1":
        print("crashed on purpose", file=sys.stderr)
        os._exit(4)
# Exit status 0: the task moves along the stage's only transition.
"""


def pipeline(api: Client, role: str) -> str:
    return api.create_pipeline(
        unique("pipe"),
        {
            "initial": "todo",
            "states": {"todo": {"agent_role": role}, "done": {"terminal": True}},
            "transitions": [{"from": "todo", "to": "done", "trigger": "complete"}],
        },
    )


def start_worker(
    server: Server, role: str, command: list[str], *flags: str, log: Path, **env: str
) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [
                *server_command(),
                "worker",
                "--role",
                role,
                "--base",
                server.base,
                *flags,
                "--",
                *command,
            ],
            stdout=subprocess.DEVNULL,
            stderr=out,
            env={**os.environ, **env},
        )


def retries(logs: list[Path]) -> int:
    """How many times the workers logged that a call to the server failed and is retried."""
    return sum(p.read_text().count("retrying") for p in logs)


def done_count(api: Client, pipeline_id: str) -> int:
    return len(api.list_tasks(stage="done", pipeline_id=pipeline_id, limit=1000).items)


def runs_of(db: Path, task_id: str) -> list[str]:
    conn = apsw.Connection(str(db), flags=apsw.SQLITE_OPEN_READONLY)
    try:
        rows = conn.execute("SELECT id FROM runs WHERE task_id = ? ORDER BY attempt", (task_id,))
        return [row[0] for row in rows]
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_three_workers_finish_60_tasks_exactly_once_while_the_server_is_killed_three_times(
    tmp_path: Path,
) -> None:
    server = Server(tmp_path / "survive.db").start()
    api = Client(server.base, retry=Retry(timeout=120))
    workers: list[subprocess.Popen[bytes]] = []
    try:
        role = unique("coder")
        pipeline_id = pipeline(api, role)
        ids = api.create_tasks(
            [{"pipeline_id": pipeline_id, "title": f"t{i}", "description": ""} for i in range(60)]
        )
        agent, log = tmp_path / "agent.py", tmp_path / "agent.log"
        agent.write_text(AGENT)
        log.touch()
        logs = [tmp_path / f"worker{i}.log" for i in range(3)]
        workers = [
            start_worker(
                server,
                role,
                [sys.executable, str(agent)],
                "--agent-id",
                f"w{i}",
                "--lease-ttl-ms",
                "60000",
                "--wait-ms",
                "2000",
                log=logs[i],
                AGENT_LOG=str(log),
            )
            for i in range(3)
        ]
        total = len(ids) * STEPS
        for restart in range(1, 4):
            # Kill it while steps are being checkpointed, not between two tasks.
            wait_for(
                f"{restart}/4 of the steps",
                lambda n=restart: log.read_text().count(" done ") >= total * n // 4,
                timeout=240,
            )
            seen = retries(logs)
            server.kill()
            # Down until a worker has met the closed port (not only a dropped connection, which
            # a fresh one to the restarted server could hide): a fixed pause is over before any
            # worker calls when a faster server (the standalone binary) is back within it.
            wait_for(
                f"a worker to retry while the server is down ({restart}/3)",
                lambda n=seen: retries(logs) > n,
                timeout=120,
            )
            server.start()
        wait_for("every task to be done", lambda: done_count(api, pipeline_id) == 60, 300)

        for w, worker_log in zip(workers, logs, strict=True):
            assert w.poll() is None, f"a worker exited:\n{worker_log.read_text()[-3000:]}"
        assert any("retrying" in p.read_text() for p in logs), "no worker saw the server down"

        failures = 0
        for task_id in ids:
            task = api.get_task(task_id)
            failures += len(task.previous_failures)
            assert task.stage == "done"
            assert task.task_version == 2  # moved exactly once
            assert msgspec.json.decode(task.checkpoint) == {"step": STEPS}
            transitions = 0
            for run_id in runs_of(server.db, task_id):
                events = api.list_events(run_id, limit=1000).items
                transitions += sum(e.kind == "transition" for e in events)
            assert transitions == 1, task_id
        assert failures >= len(ids) // 3  # the crashes happened, and were resumed from

        done: set[tuple[str, str]] = set()
        for line in log.read_text().splitlines():
            task_id, what, step, _fence = line.split()
            if what == "perform":
                assert (task_id, step) not in done, f"step {step} of {task_id} was redone"
            else:
                done.add((task_id, step))
        assert done == {(t, str(s)) for t in ids for s in range(1, STEPS + 1)}

        for w in workers:
            w.send_signal(signal.SIGTERM)
        for w, worker_log in zip(workers, logs, strict=True):
            assert w.wait(30) == 0, worker_log.read_text()[-3000:]
    finally:
        for w in workers:
            if w.poll() is None:
                w.kill()
                w.wait()
        api.close()
        server.stop()


# --- the client --------------------------------------------------------------------------------


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[Server]:
    server = Server(tmp_path / "own.db").start()
    yield server
    server.stop()


def restart_later(server: Server, delay: float) -> threading.Thread:
    """SIGKILL the server now and start it again on the same port after `delay` seconds."""
    server.kill()

    def start() -> None:
        time.sleep(delay)
        server.start()

    thread = threading.Thread(target=start)
    thread.start()
    return thread


def test_a_client_survives_a_server_restart_and_applies_a_write_made_meanwhile_once(
    own_server: Server,
) -> None:
    retries: list[RetryEvent] = []
    with Client(own_server.base, on_retry=retries.append) as api:
        role = unique("coder")
        pipeline_id = pipeline(api, role)
        api.create_task(pipeline_id, "before")
        restarting = restart_later(own_server, 1.0)
        task_id = api.create_task(pipeline_id, "during")  # sent while nothing listens
        restarting.join()
        assert retries, "the call never met the server down"
        assert api.get_task(task_id).title == "during"
        titles = [t.title for t in api.list_tasks(pipeline_id=pipeline_id).items]
        assert sorted(titles) == ["before", "during"]
        # The same connection object keeps working across a second restart mid-use.
        restart_later(own_server, 0.3).join()
        assert api.health().status == "ok"


class Proxy:
    """A TCP proxy in front of the server that can lose answers: the first `drop` requests
    whose request line contains `match` reach the server, which answers, and then the
    connection is cut before the answer gets back. With `tls`, it speaks TLS to the client."""

    def __init__(self, server: Server, match: str = "", drop: int = 0, tls: Any = None) -> None:
        self.server, self.match, self.drop, self.tls = server, match, drop, tls
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.dropped = 0
        self.closing = False
        self.open: set[socket.socket] = set()
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.closing = True
        self.listener.close()

    def cut(self) -> None:
        """A network partition: nothing gets through any more, open connections included."""
        self.closing = True
        with contextlib.suppress(OSError):  # wakes the accept() in progress, refuses the rest
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        for sock in list(self.open):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _accept(self) -> None:
        while not self.closing:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            if self.closing:
                conn.close()
                return
            if self.tls is not None:
                try:
                    conn = self.tls.wrap_socket(conn, server_side=True)
                except OSError:
                    conn.close()
                    continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        upstream = socket.create_connection(("127.0.0.1", self.server.port))
        self.open |= {conn, upstream}
        down, up = conn.makefile("rb"), upstream.makefile("rb")
        try:
            while True:
                request = _message(down)
                if request is None:
                    return
                upstream.sendall(request)
                answer = _message(up)
                if answer is None:
                    return
                if self.match in request.split(b"\r\n", 1)[0].decode() and (
                    self.dropped < self.drop
                ):
                    self.dropped += 1
                    return  # the server has answered; the client never hears it
                conn.sendall(answer)
        except OSError:
            return
        finally:
            self.open -= {conn, upstream}
            for f in (down, up, conn, upstream):
                with contextlib.suppress(OSError):
                    f.close()


def _message(stream: Any) -> bytes | None:
    """One HTTP/1.1 message with a Content-Length body (or none), as raw bytes."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        line = stream.readline()
        if not line:
            return None
        head += line
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head + (stream.read(length) if length else b"")


def test_a_write_whose_answer_is_lost_is_replayed_not_applied_twice(
    own_server: Server,
) -> None:
    with Client(own_server.base) as api:
        role = unique("coder")
        pipeline_id = pipeline(api, role)
        api.create_task(pipeline_id, "t")
        claimed = api.claim("a1", role)
        assert claimed is not None
    proxy = Proxy(own_server, match="/events", drop=1)
    retries: list[RetryEvent] = []
    try:
        with Client(f"http://127.0.0.1:{proxy.port}", on_retry=retries.append) as api:
            event_id = api.event(claimed.run.id, claimed.lease_token, "progress", {"pct": 1})
            assert proxy.dropped == 1 and len(retries) == 1
            items = api.list_events(claimed.run.id).items
            assert [e.id for e in items if e.kind == "progress"] == [event_id]
            # Without a key the client cannot know whether the server applied it: no retry.
            proxy.drop += 1
        with Client(f"http://127.0.0.1:{proxy.port}", idempotency_keys=False) as api:
            with pytest.raises(OSError, match="not repeated"):
                api.event(claimed.run.id, claimed.lease_token, "progress", {"pct": 2})
            kinds = [e.kind for e in api.list_events(claimed.run.id).items]
            assert kinds == ["progress", "progress"]  # applied once, never repeated
    finally:
        proxy.close()


def test_a_claim_whose_answer_is_lost_hands_back_the_same_lease_not_a_leaked_one(
    own_server: Server,
) -> None:
    with Client(own_server.base) as api:
        role = unique("coder")
        task_id = api.create_task(pipeline(api, role), "t")
    proxy = Proxy(own_server, match="/leases/claim", drop=1)
    try:
        with Client(f"http://127.0.0.1:{proxy.port}") as api:
            claimed = api.claim("a1", role)
            assert proxy.dropped == 1
            assert claimed is not None and claimed.task.id == task_id
            assert claimed.run.attempt == 1
            # The token of the replayed claim is the live one.
            api.heartbeat(claimed.lease_id, claimed.lease_token, expected_fence=claimed.fence)
            assert api.claim("a2", role) is None
            api.transition(claimed.run.id, claimed.lease_token, "complete")
            assert api.get_task(task_id).previous_failures == []
    finally:
        proxy.close()


def test_the_async_client_replays_a_write_whose_answer_is_lost(own_server: Server) -> None:
    with Client(own_server.base) as api:
        role = unique("coder")
        api.create_task(pipeline(api, role), "t")
        claimed = api.claim("a1", role)
        assert claimed is not None
    proxy = Proxy(own_server, match="/checkpoint", drop=1)

    async def main() -> list[str]:
        async with AsyncClient(f"http://127.0.0.1:{proxy.port}") as aapi:
            await aapi.checkpoint(claimed.run.id, claimed.lease_token, {"step": 1})
            await aapi.event(claimed.run.id, claimed.lease_token, "after")
            page = await aapi.list_events(claimed.run.id)
            return [e.kind for e in page.items]

    try:
        kinds = asyncio.run(main())
        assert proxy.dropped == 1
        assert kinds == ["checkpoint", "after"]  # the lost checkpoint was written once
        with Client(own_server.base) as api:
            assert msgspec.json.decode(api.get_checkpoint(claimed.task.id).checkpoint) == {
                "step": 1
            }
    finally:
        proxy.close()


def test_the_client_speaks_https(own_server: Server, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    server_side = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_side.load_cert_chain(cert, key)
    proxy = Proxy(own_server, tls=server_side)
    trust = ssl.create_default_context(cafile=str(cert))
    base = f"https://localhost:{proxy.port}"
    try:
        with Client(base, ssl_context=trust) as api:
            assert api.health().status == "ok"
            api.store_put("tls", "k", [1, 2])
            assert msgspec.json.decode(api.store_get("tls", "k").value) == [1, 2]
        with Client(base, retry=Retry(max_attempts=1)) as api, pytest.raises(OSError):
            api.health()  # not trusted without the certificate

        async def main() -> str:
            async with AsyncClient(base, ssl_context=trust) as api:
                return (await api.health()).status

        assert asyncio.run(main()) == "ok"
    finally:
        proxy.close()


LOCKER = """
import sys, apsw
conn = apsw.Connection(sys.argv[1])
conn.execute("BEGIN EXCLUSIVE")
print("locked", flush=True)
sys.stdin.readline()
conn.execute("ROLLBACK")
"""


def test_a_busy_server_is_retried_after_its_retry_after(own_server: Server) -> None:
    seen: list[tuple[float, RetryEvent]] = []
    busy = threading.Event()

    def on_retry(event: RetryEvent) -> None:
        seen.append((time.monotonic(), event))
        busy.set()

    with Client(own_server.base, on_retry=on_retry) as api:
        api.store_put("busy", "before", 1)
        locker = subprocess.Popen(
            [sys.executable, "-c", LOCKER, str(own_server.db)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        assert locker.stdout is not None and locker.stdin is not None
        assert locker.stdout.readline().strip() == b"locked"
        result: list[Any] = []
        writer = threading.Thread(target=lambda: result.append(api.store_put("busy", "during", 2)))
        writer.start()
        try:
            assert busy.wait(60), "the write was never refused as busy"
        finally:
            locker.stdin.write(b"go\n")
            locker.stdin.close()
            locker.wait(10)
            locker.stdout.close()
        writer.join(60)
        finished = time.monotonic()
        assert result == [None]
        refused_at, event = seen[0]
        assert event.status == 503 and "storage_busy" in event.reason
        assert event.delay >= 1.0  # the server's Retry-After: 1
        assert finished - refused_at >= 1.0
        assert msgspec.json.decode(api.store_get("busy", "during").value) == 2


def test_an_error_answer_is_not_retried_and_carries_the_servers_code(
    own_server: Server,
) -> None:
    retries: list[RetryEvent] = []
    with Client(own_server.base, on_retry=retries.append) as api:
        with pytest.raises(ApiError) as caught:
            api.get_task("no-such-task")
        assert caught.value.status == 404 and caught.value.code in ("not_found", "task_not_found")
        assert retries == []


def test_the_async_client_runs_an_agent_loop_and_survives_a_restart(own_server: Server) -> None:
    async def main() -> None:
        async with AsyncClient(own_server.base, max_connections=4) as api:
            role = unique("coder")
            pipeline_id = await api.create_pipeline(
                unique("pipe"),
                {
                    "initial": "todo",
                    "states": {"todo": {"agent_role": role}, "done": {"terminal": True}},
                    "transitions": [{"from": "todo", "to": "done", "trigger": "complete"}],
                },
            )
            ids = await asyncio.gather(*(api.create_task(pipeline_id, f"t{i}") for i in range(8)))
            assert len(set(ids)) == 8
            claims = await asyncio.gather(*(api.claim(f"a{i}", role) for i in range(8)))
            assert {c.task.id for c in claims if c is not None} == set(ids)
            for c in claims:
                assert c is not None
                await api.checkpoint(c.run.id, c.lease_token, {"step": 1})
            await asyncio.to_thread(restart_later(own_server, 1.0).join)
            moved = await asyncio.gather(
                *(
                    api.transition(c.run.id, c.lease_token, "complete", expected_fence=c.fence)
                    for c in claims
                    if c is not None
                )
            )
            assert {m.new_stage for m in moved} == {"done"}
            page = await api.list_tasks(pipeline_id=pipeline_id, stage="done")
            assert len(page.items) == 8
            assert await api.claim("late", role, wait_ms=200) is None
            await api.store_put("async", "a/b", {"v": 1})
            [entry] = await api.store_list("async")
            assert entry.key == "a/b"
            await api.store_delete("async", "a/b")
            assert (await api.health()).status == "ok"

    asyncio.run(main())


# --- the worker --------------------------------------------------------------------------------


def sleeper(tmp_path: Path) -> list[str]:
    """A command that marks that it started, then waits; SIGTERM makes it mark that too."""
    script = tmp_path / "sleeper.py"
    script.write_text(
        "import pathlib, signal, sys, time\n"
        f"d = pathlib.Path({str(tmp_path)!r})\n"
        "def stop(*_):\n"
        "    (d / 'terminated').touch()\n"
        "    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "(d / 'started').touch()\n"
        "time.sleep(120)\n"
    )
    return [sys.executable, str(script)]


def test_a_worker_whose_lease_is_superseded_stops_its_command_and_leaves_the_task(
    own_server: Server, tmp_path: Path
) -> None:
    with Client(own_server.base) as api:
        role = unique("coder")
        task_id = api.create_task(pipeline(api, role), "t")
        log = tmp_path / "worker.log"
        w = start_worker(
            own_server,
            role,
            sleeper(tmp_path),
            "--once",
            "--agent-id",
            "first",
            "--lease-ttl-ms",
            "1500",
            log=log,
        )
        wait_for("the command to start", (tmp_path / "started").exists, 30)
        api.release_agent("first", "taken away")
        second = api.claim("second", role)
        assert second is not None and second.task.id == task_id
        assert w.wait(60) == 1, log.read_text()
        assert (tmp_path / "terminated").exists()
        assert "lease lost" in log.read_text()
        # The new holder's run is untouched: the first worker recorded nothing over it.
        task = api.get_task(task_id)
        assert task.latest_run is not msgspec.UNSET
        assert task.latest_run.id == second.run.id and task.latest_run.status == "running"
        api.transition(second.run.id, second.lease_token, "complete")


def test_a_worker_whose_task_is_cancelled_stops_its_command(
    own_server: Server, tmp_path: Path
) -> None:
    # Needs POST /tasks/{id}/cancel (the operator verbs).
    with Client(own_server.base) as api:
        role = unique("coder")
        task_id = api.create_task(pipeline(api, role), "t")
        log = tmp_path / "worker.log"
        w = start_worker(
            own_server, role, sleeper(tmp_path), "--once", "--lease-ttl-ms", "1500", log=log
        )
        wait_for("the command to start", (tmp_path / "started").exists, 30)
        try:
            api.cancel(task_id, "not needed")
            code = w.wait(60)
        finally:
            if w.poll() is None:
                w.kill()
                w.wait()
        assert code == 1, log.read_text()
        assert (tmp_path / "terminated").exists()
        assert "task_cancelled" in log.read_text()
        assert api.claim("other", role) is None


def test_max_tasks_and_once_stop_the_worker_with_a_clear_status(
    own_server: Server, tmp_path: Path
) -> None:
    with Client(own_server.base) as api:
        role = unique("coder")
        pipeline_id = pipeline(api, role)
        ids = [api.create_task(pipeline_id, f"t{i}") for i in range(4)]
        ok = [sys.executable, "-c", "pass"]  # status 0: along the only transition

        def run(*flags: str, command: list[str] = ok) -> tuple[int, str]:
            log = tmp_path / f"{unique('w')}.log"
            w = start_worker(own_server, role, command, "--wait-ms", "500", *flags, log=log)
            return w.wait(60), log.read_text()

        code, _ = run("--max-tasks", "2")
        assert code == 0 and done_count(api, pipeline_id) == 2
        code, _ = run("--once")
        assert code == 0 and done_count(api, pipeline_id) == 3

        failing = [
            sys.executable,
            "-c",
            "import sys; print('first line', file=sys.stderr); "
            "print('the real reason', file=sys.stderr); sys.exit(7)",
        ]
        code, out = run("--once", command=failing)
        assert code == 1
        assert "failed: command exited with status 7" in out and "the real reason" in out
        [failed] = [t for t in ids if api.get_task(t).stage == "todo"]
        [failure] = api.get_task(failed).previous_failures
        assert failure.error is not None and "the real reason" in failure.error

        code, out = run("--once", "--exit-when-idle")  # the failed task, tried again
        assert code == 0 and done_count(api, pipeline_id) == 4, out
        code, out = run("--once", "--exit-when-idle")  # nothing left
        assert code == 3, out


def test_a_command_that_does_not_exist_is_refused_before_anything_is_claimed(
    own_server: Server, tmp_path: Path
) -> None:
    with Client(own_server.base) as api:
        role = unique("coder")
        api.create_task(pipeline(api, role), "t")
        out = subprocess.run(
            [
                *server_command(),
                "worker",
                "--role",
                role,
                "--base",
                own_server.base,
                "--",
                "no-such-command-here",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2
        assert out.stderr.strip() == "nulltickets worker: command not found: no-such-command-here"
        claimed = api.claim("other", role)
        assert claimed is not None and claimed.run.attempt == 1


def test_a_worker_keeps_waiting_while_the_server_is_down_and_works_when_it_is_back(
    own_server: Server, tmp_path: Path
) -> None:
    with Client(own_server.base) as api:
        role = unique("coder")
        pipeline_id = pipeline(api, role)
        log = tmp_path / "worker.log"
        ok = [sys.executable, "-c", "pass"]  # status 0: along the only transition
        w = start_worker(own_server, role, ok, "--once", "--wait-ms", "1000", log=log)
        own_server.kill()
        wait_for("the worker to notice", lambda: "retrying" in log.read_text(), 30)
        assert w.poll() is None
        own_server.start()
        api.create_task(pipeline_id, "t")
        assert w.wait(60) == 0, log.read_text()
        assert done_count(api, pipeline_id) == 1
        assert json.dumps("CannotSendRequest") not in log.read_text()


def test_a_heartbeat_that_cannot_reach_the_server_is_retried_and_the_command_keeps_running(
    own_server: Server, tmp_path: Path
) -> None:
    go, started = tmp_path / "go", tmp_path / "started"
    waiter = [
        sys.executable,
        "-c",
        "import pathlib, time\n"
        f"pathlib.Path({str(started)!r}).touch()\n"
        f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.05)\n",
    ]
    with Client(own_server.base) as api:
        role = unique("coder")
        task_id = api.create_task(pipeline(api, role), "t")
        log = tmp_path / "worker.log"
        # A lease long enough to outlast a slow restart: a heartbeat every 10 s.
        w = start_worker(own_server, role, waiter, "--once", "--lease-ttl-ms", "30000", log=log)
        try:
            # Started: the check of the lease before the command is over, only beats remain.
            wait_for("the command to start", started.exists, 60)
            own_server.kill()
            wait_for("a heartbeat to fail", lambda: "heartbeat:" in log.read_text(), 60)
            own_server.start()
            wait_for("a heartbeat to succeed", lambda: "heartbeat reached" in log.read_text(), 60)
            go.touch()
            assert w.wait(60) == 0, log.read_text()
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{log.read_text()}") from exc
        finally:
            if w.poll() is None:
                w.kill()
                w.wait()
        task = api.get_task(task_id)
        assert task.stage == "done" and task.previous_failures == []


@pytest.mark.skipif(sys.platform == "win32", reason="process groups are POSIX's")
def test_a_worker_cut_off_from_the_server_ends_its_commands_group_once_its_lease_expires(
    own_server: Server, tmp_path: Path
) -> None:
    """Two agents on one task is what a lease prevents: a worker that cannot reach the server
    (a partition) keeps retrying its heartbeat, but once a whole lease TTL has passed since the
    last one the server accepted, the lease has expired there and another agent may claim the
    task. By then the first worker's command and everything it started must be gone."""
    pid_file = tmp_path / "sleep.pid"
    command = ["sh", "-c", f"sleep 300 & echo $! > '{pid_file}'; wait"]
    proxy = Proxy(own_server)
    log = tmp_path / "worker.log"
    with Client(own_server.base) as api:
        role = unique("coder")
        task_id = api.create_task(pipeline(api, role), "t")
        w = start_worker(
            own_server,
            role,
            command,
            "--once",
            "--lease-ttl-ms",
            "2000",
            "--base",  # the last --base wins: the worker goes through the proxy
            f"http://127.0.0.1:{proxy.port}",
            log=log,
        )
        try:
            sleeper = int(
                wait_for("the sleep's pid", lambda: pid_file.exists() and pid_file.read_text(), 30)
            )
            proxy.cut()
            second = wait_for(
                "the lease to expire and another agent to claim the task",
                lambda: api.claim("second", role),
                timeout=30,
                interval=0.1,
            )
            assert second.task.id == task_id and second.run.attempt == 2
            wait_for("the first command's sleep to be gone", lambda: not alive(sleeper), 5)
            assert w.wait(30) == 1, log.read_text()
        finally:
            proxy.close()
            if w.poll() is None:
                w.kill()
                w.wait()
        assert "lease expired, no heartbeat reached the server" in log.read_text()
        task = api.get_task(task_id)
        assert task.latest_run is not msgspec.UNSET and task.latest_run.id == second.run.id
        api.transition(second.run.id, second.lease_token, "complete")
