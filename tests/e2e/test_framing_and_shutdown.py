"""What supervisors and Zig clients need from the process and the wire: every bodiless answer ends
at once for a client that reads to EOF, SIGTERM stops the server within a bound (also with long
polls waiting or a stuck worker), no worker outlives its parent, and a port in use is refused."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import unique
from tests.server import (
    Client,
    Server,
    alive,
    descendants,
    free_port,
    granian_main,
    granian_workers,
    server_command,
    signal_another_thread,
    wait_stopped,
)

pytestmark = [pytest.mark.e2e, pytest.mark.process]

# Zig's std.http client reads a 204 without Content-Length until the connection closes; the
# server's idle timeout (10 s) was what ended it before. After the head, EOF must follow at once.
EOF_AFTER_HEAD_S = 0.1


def read_to_eof(port: int, method: str, path: str, body: Any = None) -> tuple[bytes, float, float]:
    """Send one request the way nullboiler does (fresh connection, JSON content type) and read
    until the server closes. Returns the raw answer, seconds to its head and seconds to EOF."""
    payload = b"" if body is None else json.dumps(body).encode()
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=15) as s:
        start = time.monotonic()
        s.sendall(head + payload)
        data, at_head = b"", None
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
            if at_head is None and b"\r\n\r\n" in data:
                at_head = time.monotonic()
        end = time.monotonic()
    assert at_head is not None, data
    return data, at_head - start, end - at_head


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/leases/claim", {"agent_id": "zig", "agent_role": "nobody-{u}"}),
        ("POST", "/leases/claim", {"agent_id": "zig", "agent_role": "nobody-{u}", "wait_ms": 50}),
        ("PUT", "/store/ns-{u}/key", {"value": {"a": 1}}),
        ("DELETE", "/store/ns-{u}/key", None),
        ("DELETE", "/store/ns-{u}", None),
    ],
    ids=["claim-empty", "claim-long-poll-empty", "store-put", "store-delete", "namespace-delete"],
)
def test_every_204_ends_at_once_for_a_client_that_reads_to_eof(
    shared_server: Server, method: str, path: str, body: Any
) -> None:
    u = unique()
    path = path.replace("{u}", u)
    if body is not None:
        body = json.loads(json.dumps(body).replace("{u}", u))
    answer, to_head, head_to_eof = read_to_eof(shared_server.port, method, path, body)
    assert answer.startswith(b"HTTP/1.1 204"), answer
    assert b"connection: close" in answer.lower()
    assert head_to_eof < EOF_AFTER_HEAD_S, (to_head, head_to_eof)


def test_answers_with_a_body_keep_the_connection_alive(shared_server: Server) -> None:
    with socket.create_connection(("127.0.0.1", shared_server.port), timeout=5) as s:
        for _ in range(2):  # two requests on one connection
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            data = b""
            while b"\r\n\r\n" not in data:
                data += s.recv(65536)
            head, _, rest = data.partition(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            while len(rest) < length:
                rest += s.recv(65536)
            assert head.startswith(b"HTTP/1.1 200")
            assert b"connection: close" not in head.lower()


# --- shutdown -------------------------------------------------------------------------------


def _healthy(server: Server) -> bool:
    c = server.client()
    try:
        return c.get("/health").status == 200
    finally:
        c.close()


def _wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return not alive(pid)


def _left_alive(pids: list[int], timeout: float) -> list[int]:
    """Those of `pids` still alive when each was waited for, in turn, up to `timeout`; each
    of them is then killed, so a failing test leaves no process behind."""
    left = [pid for pid in pids if not _wait_gone(pid, timeout)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    s = Server(tmp_path / "shutdown.db").start()
    yield s
    s.kill()


def test_sigterm_with_fifty_waiting_long_polls_answers_them_and_exits_within_two_seconds(
    server: Server,
) -> None:
    role = unique("idle")
    answers: list[bytes] = []
    lock = threading.Lock()

    def long_poll() -> None:
        body = {"agent_id": unique("a"), "agent_role": role, "wait_ms": 30_000}
        answer, _, _ = read_to_eof(server.port, "POST", "/leases/claim", body)
        with lock:
            answers.append(answer)

    threads = [threading.Thread(target=long_poll) for _ in range(50)]
    for t in threads:
        t.start()
    # Wait until all fifty are waiting inside the server (GET /ops/queue counts no waiters, so
    # use the log line the shutdown writes and the clients' own count instead of a sleep).
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _waiting_connections(server.port) < 50:
        time.sleep(0.05)
    assert _waiting_connections(server.port) >= 50
    time.sleep(0.3)  # the last ones reach their wait after their first attempt
    assert server.proc is not None
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code = server.proc.wait(10)
    took = time.monotonic() - started
    for t in threads:
        t.join(10)
    assert code == 0, server.output()
    assert took < 2.0, took
    assert len(answers) == 50
    assert all(a.startswith(b"HTTP/1.1 204") for a in answers), answers[:3]
    assert "answering 50 waiting claims" in server.output()


def _waiting_connections(port: int) -> int:
    """Established connections to the server's port (the long polls), from /proc/net/tcp."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                count += 1
    return count


def test_a_stuck_worker_does_not_keep_the_server_from_exiting(server: Server) -> None:
    assert server.proc is not None
    workers = granian_workers(server)
    assert workers
    for pid in workers:
        os.kill(pid, signal.SIGSTOP)  # stuck: it can handle nothing, not even SIGTERM
    try:
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(10)  # container runtimes kill after 10 s: we must be out before
        took = time.monotonic() - started
    finally:
        for pid in workers:
            if alive(pid):
                os.kill(pid, signal.SIGCONT)
    assert took < 8, took
    assert not _left_alive(workers, 5)
    assert "refused to gracefully stop" in server.output()


def test_sigkill_of_the_main_process_alone_leaves_no_worker_serving(server: Server) -> None:
    assert server.proc is not None
    workers = descendants(server.proc.pid)  # granian's worker (and, in the binary, its main)
    assert granian_workers(server)
    os.kill(server.proc.pid, signal.SIGKILL)  # what a person or nullhub does to the main pid
    server.proc.wait()
    assert not _left_alive(workers, 10), "a worker outlived its parent"
    # The port is free again: a new server starts there and is the only one answering.
    again = Server(server.db)
    again.port = server.port
    again.start()
    try:
        assert _healthy(again)
    finally:
        again.stop()


def test_stop_signals_that_keep_coming_never_hang_a_worker_in_its_shutdown(server: Server) -> None:
    """Each stop signal, the kernel's when the parent dies and the parent watch all begin the
    worker's shutdown; only the first may set granian's stop. A third set blocked for good
    while holding the GIL, so even the exit deadline's thread could not run: the worker served
    on as an orphan. A client stuck in its body holds the shutdown open while they come."""
    assert server.proc is not None
    (worker,) = granian_workers(server)
    with socket.create_connection(("127.0.0.1", server.port), timeout=15) as stuck:
        stuck.sendall(
            b"POST /tasks HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: 100\r\n\r\n{"
        )
        os.kill(server.proc.pid, signal.SIGKILL)  # the kernel's SIGTERM and the watch follow
        server.proc.wait()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            time.sleep(0.1)
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, sig)
        assert not _left_alive([worker], 10), "the worker hung in its shutdown"
    # Its own deadline ended it (the client never finished): its thread ran, so nothing held
    # the GIL. The kernel's backstop would have ended it without this line.
    assert "shutdown took longer than" in server.output(), server.output()


@pytest.mark.skipif(
    not os.environ.get("NULLTICKETS_BINARY"),
    reason="the onefile bootstrap is the standalone binary's (make test-binary runs this)",
)
def test_a_hung_main_process_does_not_hold_the_binarys_sigterm(server: Server) -> None:
    """The binary is three processes: the onefile bootstrap (the pid a supervisor knows),
    granian's main process and its worker. With the main process hung, SIGTERM to the
    bootstrap still ends all three within the server's own bound."""
    assert server.proc is not None
    bootstrap = server.proc.pid
    processes = [bootstrap, *descendants(bootstrap)]  # children first: granian's main next
    assert len(processes) == 3, processes
    main = processes[1]
    os.kill(main, signal.SIGSTOP)  # hung: it handles nothing, not even SIGTERM
    try:
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(30)
        took = time.monotonic() - started
        assert took < 9, took  # container runtimes kill after 10 s
        assert not (left := _left_alive(processes, 5)), left
    finally:
        if alive(main):
            os.kill(main, signal.SIGCONT)
    assert _nothing_serves(server.port)
    _serves_again(server)


def _nothing_serves(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _serves_again(server: Server) -> None:
    """A new server starts on the port and database and is the only one answering."""
    again = Server(server.db)
    again.port = server.port
    again.start()
    try:
        assert _healthy(again)
    finally:
        assert again.stop() == 0


def test_sighup_to_the_main_process_stops_every_process_of_the_server(server: Server) -> None:
    """The original exits on SIGHUP; granian alone would respawn its worker and serve on."""
    assert server.proc is not None
    processes = [server.proc.pid, *descendants(server.proc.pid)]
    assert granian_workers(server)
    os.kill(server.proc.pid, signal.SIGHUP)
    server.proc.wait(10)
    assert not _left_alive(processes, 5), server.output()
    assert _nothing_serves(server.port)
    assert "Respawning" not in server.output()
    _serves_again(server)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_taken_by_another_thread_of_the_main_process_stops_the_server(
    server: Server, signum: int
) -> None:
    """The kernel gives a signal for a process to a thread other than the main one when the
    main thread cannot take it: stopped (`kill %1` on a stopped job sends SIGTERM, then
    SIGCONT), or with a signal already pending. granian's main thread waits without a timeout,
    so the server must act on the signal without it."""
    main = granian_main(server)
    processes = [main, *descendants(main)]
    assert len(processes) >= 2
    signal_another_thread(main, signum)
    assert not (left := _left_alive(processes, 10)), left
    assert _nothing_serves(server.port)
    _serves_again(server)


# Starts the server in a process group of its own inside this process's session (a shell's
# job), prints the server's pid, and exits when its stdin is closed.
JOB_CONTROL_SHELL = """
import subprocess, sys
server = subprocess.Popen(sys.argv[1:], process_group=0, stdout=sys.stderr)
print(server.pid, flush=True)
sys.stdin.read()
"""


def test_an_orphaned_stopped_process_group_ends_on_the_kernels_sighup(server: Server) -> None:
    """A shell's stopped job whose shell goes away: the kernel sends the job's process group
    SIGHUP and SIGCONT. The server must end, not serve on with parent pid 1."""
    port, db = server.port, server.db
    server.kill()  # the port and database are taken over by the job below
    serve = [*server_command(), "serve", "--port", str(port), "--db", str(db)]
    shell = subprocess.Popen(
        [sys.executable, "-c", JOB_CONTROL_SHELL, *serve],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
        env={**os.environ, "NULLTICKETS_HOME": str(db.parent / "home")},
    )
    assert shell.stdout is not None and shell.stdin is not None
    job = int(shell.stdout.readline())
    processes: list[int] = []
    try:
        deadline = time.monotonic() + 20
        while not _healthy_port(port):
            assert time.monotonic() < deadline, "the job's server did not start"
            time.sleep(0.05)
        processes = [job, *descendants(job)]
        assert len(processes) >= 2
        os.killpg(job, signal.SIGSTOP)  # Ctrl-Z: the whole job is stopped
        # The kernel hangs up an orphaned group only if one of its processes has stopped by
        # then, and a signal's stop is not immediate: wait for it, as a shell's `jobs` would.
        for pid in processes:
            wait_stopped(pid, 20)
        shell.stdin.close()  # the shell goes: its stopped job is orphaned
        shell.wait(10)
        assert all(_wait_gone(pid, 5) for pid in processes), [p for p in processes if alive(p)]
        assert _nothing_serves(port)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job, signal.SIGKILL)  # whatever of the job is left (a respawned worker)
        for pid in processes:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if shell.poll() is None:
            shell.kill()
            shell.wait()
        shell.stdout.close()
    _serves_again(server)


def _healthy_port(port: int) -> bool:
    with contextlib.suppress(OSError):
        client = Client("127.0.0.1", port, timeout=2)
        try:
            return client.get("/health").status == 200
        finally:
            client.close()
    return False


# --- the port ----------------------------------------------------------------------------------


def _serve_once(
    port: int, db: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*server_command(), "serve", "--port", str(port), "--db", str(db)],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "NULLTICKETS_HOME": str(db.parent / "home"), **(env or {})},
    )


def test_a_second_server_on_a_port_in_use_is_refused_in_one_line(
    server: Server, tmp_path: Path
) -> None:
    other = tmp_path / "other.db"
    done = _serve_once(server.port, other)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert f":{server.port}" in lines[0] and "in use" in lines[0]
    assert not other.exists(), "the refused server must not create its database"
    assert _healthy(server)  # the first one is untouched


def test_a_foreign_listener_on_the_port_is_refused_in_one_line(tmp_path: Path) -> None:
    port = free_port()
    with socket.socket() as foreign:
        foreign.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        foreign.bind(("127.0.0.1", port))
        foreign.listen()
        done = _serve_once(port, tmp_path / "t.db")
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "in use" in lines[0], done.stderr
    assert "Traceback" not in done.stderr


def test_the_probe_does_not_refuse_a_port_left_in_time_wait(tmp_path: Path) -> None:
    server = Server(tmp_path / "tw.db").start()
    port = server.port
    c = server.client()
    assert c.get("/health").status == 200  # a connection the server closes leaves TIME_WAIT
    c.close()
    server.stop()
    again = Server(tmp_path / "tw.db")
    again.port = port
    again.start()
    try:
        assert _healthy(again)
    finally:
        again.stop()
