"""Transport robustness (Q23): a stalled or idle connection never holds up other clients, and
SIGTERM in the middle of traffic shuts the server down cleanly with an intact database."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from tests.conftest import create_pipeline, unique
from tests.server import Server, _children

pytestmark = [pytest.mark.e2e, pytest.mark.process]

PROMPT_S = 2.0


def raw_socket(server: Server) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", server.port), timeout=5)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def assert_still_open_and_silent(s: socket.socket) -> None:
    """The server has neither answered nor closed the stalled connection."""
    s.setblocking(False)
    try:
        data = s.recv(1)
    except BlockingIOError:
        return
    finally:
        s.setblocking(True)
    raise AssertionError(f"stalled connection got {data!r} (b'' means closed)")


def read_response(s: socket.socket, timeout: float = 5.0) -> tuple[int, bytes]:
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, body


def timed_health(server: Server) -> float:
    c = server.client()
    c.timeout = 10
    try:
        start = time.monotonic()
        r = c.get("/health")
        elapsed = time.monotonic() - start
    finally:
        c.close()
    assert r.status == 200, r.body
    assert r.json["status"] == "ok"
    return elapsed


@contextlib.contextmanager
def sockets(server: Server, count: int) -> Iterator[list[socket.socket]]:
    opened = [raw_socket(server) for _ in range(count)]
    try:
        yield opened
    finally:
        for s in opened:
            s.close()


def test_half_sent_headers_do_not_block_other_clients(fresh_server: Server) -> None:
    with sockets(fresh_server, 1) as [slow]:
        slow.sendall(b"POST /pipelines HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty")
        time.sleep(0.2)  # let the server start reading it
        assert timed_health(fresh_server) < PROMPT_S
        assert_still_open_and_silent(slow)


def test_half_sent_request_line_does_not_block_other_clients(fresh_server: Server) -> None:
    with sockets(fresh_server, 1) as [slow]:
        slow.sendall(b"GET /hea")
        time.sleep(0.2)
        assert timed_health(fresh_server) < PROMPT_S
        assert_still_open_and_silent(slow)


def test_half_sent_body_does_not_block_reads_or_writes(fresh_server: Server) -> None:
    client = fresh_server.client()
    body = json.dumps(
        {
            "name": unique("slow"),
            "definition": {
                "initial": "a",
                "states": {"a": {"agent_role": "r"}, "b": {"terminal": True}},
                "transitions": [{"from": "a", "to": "b", "trigger": "go"}],
            },
        }
    ).encode()
    head = (
        b"POST /pipelines HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    half = len(body) // 2
    with sockets(fresh_server, 1) as [slow]:
        slow.sendall(head + body[:half])
        time.sleep(0.2)
        assert timed_health(fresh_server) < PROMPT_S
        # Writes go through too while the stalled request holds a half-read body.
        start = time.monotonic()
        pipeline_id = create_pipeline(client)
        r = client.post("/tasks", {"pipeline_id": pipeline_id, "title": "t", "description": ""})
        assert r.status == 201, r.body
        assert time.monotonic() - start < PROMPT_S
        assert_still_open_and_silent(slow)
        # The stalled client was only slow, not dead: finishing the body completes its request.
        slow.sendall(body[half:])
        status, answer = read_response(slow)
    assert status == 201, answer
    assert "id" in json.loads(answer)
    client.close()


def test_many_stalled_bodies_do_not_block_other_clients(fresh_server: Server) -> None:
    head = (
        b"POST /tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 1000\r\n\r\n{"pipeline_id": '
    )
    with sockets(fresh_server, 20) as slow:
        for s in slow:
            s.sendall(head)
        time.sleep(0.2)
        for _ in range(5):
            assert timed_health(fresh_server) < PROMPT_S
        for s in slow:
            assert_still_open_and_silent(s)


def test_fifty_idle_connections_do_not_stop_a_normal_client(fresh_server: Server) -> None:
    with sockets(fresh_server, 50) as idle:
        time.sleep(0.2)
        client = fresh_server.client()
        client.timeout = 10
        start = time.monotonic()
        pipeline_id = create_pipeline(client)
        for i in range(20):
            r = client.post(
                "/tasks", {"pipeline_id": pipeline_id, "title": f"t{i}", "description": ""}
            )
            assert r.status == 201, r.body
            assert client.get(f"/tasks/{r.json['id']}").status == 200
        assert time.monotonic() - start < 2 * PROMPT_S
        client.close()
        assert timed_health(fresh_server) < PROMPT_S
        for s in idle:
            assert_still_open_and_silent(s)


def test_each_new_connection_is_served_while_others_idle(fresh_server: Server) -> None:
    with sockets(fresh_server, 50):
        for _ in range(10):
            assert timed_health(fresh_server) < PROMPT_S


def integrity_check(server: Server) -> str:
    """SQLite's integrity_check of the server's file; on PostgreSQL, that the database answers
    (PostgreSQL checks its own pages)."""
    if server.dsn is not None:
        import psycopg

        with psycopg.connect(server.dsn) as pg:
            pg.execute("SELECT count(*) FROM tasks").fetchone()
        return "ok"
    db = server.db
    code = (
        "import sys, apsw\n"
        "c = apsw.Connection(sys.argv[1])\n"
        "print(c.execute('PRAGMA integrity_check').fetchall()[0][0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(db)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def count_tasks(server: Server, pipeline_id: str) -> int:
    if server.dsn is not None:
        import psycopg

        with psycopg.connect(server.dsn) as pg:
            row = pg.execute(
                "SELECT count(*) FROM tasks WHERE pipeline_id = %s", (pipeline_id,)
            ).fetchone()
        assert row is not None
        return int(row[0])
    db = server.db
    code = (
        "import sys, apsw\n"
        "c = apsw.Connection(sys.argv[1])\n"
        "print(c.execute('SELECT count(*) FROM tasks WHERE pipeline_id = ?',"
        " (sys.argv[2],)).fetchall()[0][0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(db), pipeline_id],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return int(out.stdout)


@pytest.mark.slow
def test_sigterm_under_load_shuts_down_cleanly(fresh_server: Server) -> None:
    admin = fresh_server.client()
    pipeline_id = create_pipeline(admin)
    admin.close()
    acked: list[str] = []
    errors: list[str] = []
    stop = threading.Event()
    lock = threading.Lock()

    def writer(n: int) -> None:
        c = fresh_server.client()
        c.timeout = 10
        i = 0
        while not stop.is_set():
            try:
                r = c.post(
                    "/tasks",
                    {"pipeline_id": pipeline_id, "title": f"w{n}-{i}", "description": "x" * 200},
                )
            except OSError:
                return  # the server went away: expected once SIGTERM lands
            i += 1
            with lock:
                if r.status == 201:
                    acked.append(r.json["id"])
                elif r.status >= 500:
                    errors.append(f"{r.status} {r.body[:200]!r}")
        c.close()

    threads = [threading.Thread(target=writer, args=(n,), daemon=True) for n in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(acked) < 200 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(acked) >= 200, "the writers made no progress"

    proc = fresh_server.proc
    assert proc is not None
    workers = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(20)
    finally:
        stop.set()
        for t in threads:
            t.join(15)
    fresh_server.proc = None
    assert code in (0, 128 + signal.SIGTERM, -signal.SIGTERM), fresh_server.output()
    assert errors == []
    for pid in workers:  # no orphaned worker keeps the database open
        wait_gone(pid)

    assert integrity_check(fresh_server) == "ok"
    # Every task the server acknowledged survived the shutdown.
    assert count_tasks(fresh_server, pipeline_id) >= len(acked)

    restarted = Server(fresh_server.db, dsn=fresh_server.dsn).start()
    try:
        c = restarted.client()
        for task_id in acked[-20:]:
            assert c.get(f"/tasks/{task_id}").status == 200
        c.close()
    finally:
        assert restarted.stop() in (0, 128 + signal.SIGTERM, -signal.SIGTERM)


def wait_gone(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return  # a zombie holds no files
        except FileNotFoundError:
            return
        time.sleep(0.05)
    raise AssertionError(f"worker {pid} still running after the server exited")


def test_sigterm_with_idle_connections_exits_promptly(fresh_server: Server) -> None:
    with sockets(fresh_server, 10):
        time.sleep(0.1)
        start = time.monotonic()
        code = fresh_server.stop(timeout=15)
        elapsed = time.monotonic() - start
    assert code in (0, 128 + signal.SIGTERM, -signal.SIGTERM)
    assert elapsed < 5, f"shutdown took {elapsed:.1f}s"
    assert integrity_check(fresh_server) == "ok"


@pytest.mark.slow
def test_sigterm_with_a_stalled_request_still_exits_cleanly(fresh_server: Server) -> None:
    """A half-sent request may hold shutdown up to the header read timeout (10 s), no longer."""
    with sockets(fresh_server, 1) as [stalled]:
        stalled.sendall(b"GET /health HTTP/1.1\r\nHo")
        time.sleep(0.1)
        start = time.monotonic()
        code = fresh_server.stop(timeout=15)
        elapsed = time.monotonic() - start
    assert code in (0, 128 + signal.SIGTERM, -signal.SIGTERM)
    assert elapsed < 12, f"shutdown took {elapsed:.1f}s"
    assert integrity_check(fresh_server) == "ok"


def test_one_connection_serves_several_requests(fresh_server: Server) -> None:
    with sockets(fresh_server, 1) as [s]:
        for _ in range(3):
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            status, body = read_response(s)
            assert status == 200
            assert json.loads(body)["status"] == "ok"
