"""A fleet on one tracker: thousands of agents waiting for work, hundreds of event streams
open, and a few agents working beside them (tests/e2e/test_fleet.py and `make bench`'s fleet
section).

The crowd is one asyncio loop on a thread of its own holding every connection: each waiting
agent a long-poll claim (`wait_ms`) for a role nobody else works on, each watcher an event
stream of the crowd's pipeline, spread over the servers given (several on one PostgreSQL
database: the crowd split across them). The working agents are threads, each on its own
connection, looping create -> claim -> heartbeat -> event -> read -> transition on a role of
their own, with a pause between cycles as an agent working on a task has; every request is
timed. Midway a task is created for the crowd, and the crowd's answers say which one took it
and when. Memory per waiter and per stream is the growth of the servers' resident memory as the
crowd arrives, divided among it.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Each working agent pauses this long between its cycles (a real agent works on its task).
THINK_S = 0.02
# Connections the crowd opens at a time, and how long it waits for the servers to count them.
BATCH = 200
SETTLE_TIMEOUT_S = 60.0
# A request of a working agent that takes longer than this has hung.
HANG_S = 10.0


def definition(role: str) -> dict[str, Any]:
    return {
        "initial": "todo",
        "states": {"todo": {"agent_role": role}, "done": {"terminal": True}},
        "transitions": [{"from": "todo", "to": "done", "trigger": "finish"}],
    }


def raise_open_files(needed: int) -> int:
    """Raise this process's open-files limit to its hard limit; the limit now. Raises
    RuntimeError naming the shortfall when even that is below `needed`."""
    import resource

    from nulltickets.server.capacity import raise_file_limit

    files = raise_file_limit()  # as the server does: to the hard limit (macOS: its own cap)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        raise RuntimeError(f"a fleet of this size needs {needed} open files; the limit is {soft}")
    return files


def rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


# --- one request at a time, over a kept-alive connection --------------------------------------


class Http:
    def __init__(self, port: int, timeout: float = HANG_S) -> None:
        self.port, self.timeout = port, timeout
        self.conn: http.client.HTTPConnection | None = None

    def request(
        self, method: str, path: str, body: Any = None, token: str | None = None
    ) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = None if body is None else json.dumps(body).encode()
        for attempt in range(2):
            reused = self.conn is not None
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
            try:
                self.conn.request(method, path, body=data, headers=headers)
                r = self.conn.getresponse()
                payload = r.read()
                if r.will_close:
                    self.close()
                return r.status, payload
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                self.close()
                # A kept-alive connection the server closed while it was idle: a read may
                # be sent again on a new one.
                if attempt or not reused or method != "GET":
                    raise
            except BaseException:
                self.close()
                raise
        raise AssertionError("unreachable")

    def json(self, method: str, path: str, body: Any = None, expect: int = 200) -> Any:
        status, payload = self.request(method, path, body)
        if status != expect:
            raise RuntimeError(f"{method} {path} answered {status}: {payload[:200]!r}")
        return json.loads(payload) if payload else None

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples `name` with these labels in /metrics."""
        _, text = self.request("GET", "/metrics")
        total = 0.0
        for line in text.decode().splitlines():
            if not line.startswith(name):
                continue
            series, _, value = line.rpartition(" ")
            head, _, rest = series.partition("{")
            if head != name:
                continue
            found = dict(pair.split("=", 1) for pair in rest.rstrip("}").split(",") if "=" in pair)
            if all(found.get(k) == f'"{v}"' for k, v in labels.items()):
                total += float(value)
        return total

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None


# --- the crowd --------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    sent: float  # time.monotonic() when the claim was sent
    at: float  # ... and when its answer's head arrived
    headers: dict[str, str]
    body: bytes


@dataclass
class Crowd:
    """`waiters` long-poll claims for `role` and `streams` event streams of `pipeline_id`,
    dealt round-robin to `ports`; `wait_ms` is each claim's wait."""

    ports: Sequence[int]
    role: str
    pipeline_id: str
    waiters: int
    streams: int
    wait_ms: int
    answers: list[Answer] = field(default_factory=list)
    frames: list[int] = field(default_factory=list)  # events each stream received
    failures: list[str] = field(default_factory=list)
    opened: threading.Event = field(default_factory=threading.Event)
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def start_waiters(self) -> None:
        """Open every long-poll claim; returns once each request is sent."""
        self._call(self._open_waiters())

    def start_streams(self) -> None:
        """Open every event stream; returns once each has its answer's head."""
        self.frames = [0] * self.streams
        self._call(self._open_streams())

    def answered(self) -> int:
        return len(self.answers)

    def close(self) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._cancel)
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        self.opened.set()
        try:
            loop.run_forever()
        finally:
            loop.close()

    def _call(self, coro: Any) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fleet-crowd", daemon=True)
            self._thread.start()
        self.opened.wait(10)
        assert self._loop is not None
        asyncio.run_coroutine_threadsafe(coro, self._loop).result(SETTLE_TIMEOUT_S)

    def _cancel(self) -> None:
        for task in self._tasks:
            task.cancel()
        assert self._loop is not None
        self._loop.call_later(0.5, self._loop.stop)

    async def _open_waiters(self) -> None:
        for start in range(0, self.waiters, BATCH):
            sent = [
                asyncio.get_running_loop().create_future()
                for _ in range(start, min(self.waiters, start + BATCH))
            ]
            for i, future in enumerate(sent, start):
                self._tasks.append(asyncio.ensure_future(self._claim(i, future)))
            await asyncio.gather(*sent)

    async def _claim(self, i: int, sent: asyncio.Future[None]) -> None:
        port = self.ports[i % len(self.ports)]
        body = json.dumps(
            {"agent_id": f"waiter-{i}", "agent_role": self.role, "wait_ms": self.wait_ms}
        ).encode()
        head = (
            "POST /leases/claim HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        writer = None
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head + body)
            await writer.drain()
            sent_at = time.monotonic()
            sent.set_result(None)
            raw = await reader.readuntil(b"\r\n\r\n")
            at = time.monotonic()
            status = int(raw[9:12])
            headers = {}
            for line in raw.decode("latin-1").split("\r\n")[1:]:
                name, sep, value = line.partition(":")
                if sep:
                    headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
            payload = await reader.readexactly(length) if length else b""
            self.answers.append(Answer(status, sent_at, at, headers, payload))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failures.append(f"waiter {i}: {type(exc).__name__}: {exc}")
        finally:
            if not sent.done():
                sent.set_result(None)
            if writer is not None:
                writer.close()

    async def _open_streams(self) -> None:
        for start in range(0, self.streams, BATCH):
            opened = [
                asyncio.get_running_loop().create_future()
                for _ in range(start, min(self.streams, start + BATCH))
            ]
            for i, future in enumerate(opened, start):
                self._tasks.append(asyncio.ensure_future(self._stream(i, future)))
            await asyncio.gather(*opened)

    async def _stream(self, i: int, opened: asyncio.Future[None]) -> None:
        port = self.ports[i % len(self.ports)]
        request = (
            f"GET /events/stream?pipeline_id={self.pipeline_id} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        ).encode()
        writer = None
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request)
            raw = await reader.readuntil(b"\r\n\r\n")
            if int(raw[9:12]) != 200:
                raise RuntimeError(f"answered {raw[:12]!r}")
            opened.set_result(None)
            tail = b""  # short of a whole "\nid: ": no frame is counted twice
            while chunk := await reader.read(65536):
                data = tail + chunk
                self.frames[i] += data.count(b"\nid: ")
                tail = data[-4:]
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.failures.append(f"stream {i}: {type(exc).__name__}: {exc}")
        finally:
            if not opened.done():
                opened.set_result(None)
            if writer is not None:
                writer.close()


# --- the working agents -----------------------------------------------------------------------


@dataclass
class Report:
    """Every working agent's requests: latency (s) by kind, and what failed."""

    latencies: dict[str, list[float]] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    cycles: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, seconds: float) -> None:
        with self.lock:
            self.latencies.setdefault(kind, []).append(seconds)

    def all(self) -> list[float]:
        return sorted(x for values in self.latencies.values() for x in values)


KINDS = ("create", "claim", "heartbeat", "event", "read", "transition")


def agent(port: int, pipeline_id: str, role: str, name: str, until: float, report: Report) -> None:
    """One working agent: create -> claim -> heartbeat -> event -> read -> transition, then a
    pause, until `until`."""
    c = Http(port)
    clock = time.perf_counter

    def call(
        kind: str, method: str, path: str, body: Any, ok: int, token: str | None = None
    ) -> Any:
        t0 = clock()
        try:
            status, payload = c.request(method, path, body, token)
        except Exception as exc:
            report.failures.append(f"{name} {kind}: {type(exc).__name__}: {exc}")
            return None
        report.add(kind, clock() - t0)
        if status != ok and not (kind == "claim" and status == 204):
            report.failures.append(f"{name} {kind}: {status} {payload[:200]!r}")
            return None
        return json.loads(payload) if payload else None

    try:
        while time.monotonic() < until:
            task = {"pipeline_id": pipeline_id, "title": f"{name} work", "description": ""}
            call("create", "POST", "/tasks", task, 201)
            claimed = call(
                "claim", "POST", "/leases/claim", {"agent_id": name, "agent_role": role}, 200
            )
            if claimed is not None:
                token, run = claimed["lease_token"], claimed["run"]["id"]
                call(
                    "heartbeat", "POST", f"/leases/{claimed['lease_id']}/heartbeat", {}, 200, token
                )
                event = {"kind": "progress", "data": {"step": 1}}
                call("event", "POST", f"/runs/{run}/events", event, 201, token)
                call("read", "GET", f"/tasks/{claimed['task']['id']}", None, 200)
                call(
                    "transition",
                    "POST",
                    f"/runs/{run}/transition",
                    {"trigger": "finish"},
                    200,
                    token,
                )
                with report.lock:
                    report.cycles += 1
            time.sleep(THINK_S)
    finally:
        c.close()


def work(ports: Sequence[int], pipeline_id: str, role: str, agents: int, seconds: float) -> Report:
    """`agents` working agents dealt round-robin to `ports`, for `seconds`."""
    report = Report()
    until = time.monotonic() + seconds
    threads = [
        threading.Thread(
            target=agent,
            args=(ports[i % len(ports)], pipeline_id, role, f"worker-{i}", until, report),
            daemon=True,
        )
        for i in range(agents)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 4 * HANG_S)
    return report


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(report: Report) -> dict[str, Any]:
    every = report.all()
    return {
        "cycles": report.cycles,
        "requests": len(every),
        "failures": len(report.failures),
        "p50_ms": round(pct(every, 0.50) * 1000, 2),
        "p99_ms": round(pct(every, 0.99) * 1000, 2),
        "max_ms": round((every[-1] if every else 0.0) * 1000, 2),
        "p99_ms_by_kind": {
            k: round(pct(report.latencies.get(k, []), 0.99) * 1000, 2) for k in KINDS
        },
    }


# --- the scenario -----------------------------------------------------------------------------


@dataclass
class Fleet:
    """What one run of the scenario saw."""

    waiters: int
    streams: int
    servers: int
    working: Report
    crowd: Crowd | None
    task_id: str | None = None  # the crowd's task
    created_answered_s: float | None = None  # its POST /tasks, answered after
    taken_s: float | None = None  # its creation until a waiter's 200 arrived
    kib_per_waiter: float | None = None
    kib_per_stream: float | None = None
    wakeups: float = 0.0  # waiting claims woken, on every server, by the crowd's task
    stream_frames_after_transition: int = 0  # streams that saw the crowd task's transition

    def figures(self) -> dict[str, Any]:
        return {
            "servers": self.servers,
            "waiters": self.waiters,
            "streams": self.streams,
            "agents": summary(self.working),
            "created_answered_ms": _ms(self.created_answered_s),
            "taken_ms": _ms(self.taken_s),
            "kib_per_waiter": _round(self.kib_per_waiter),
            "kib_per_stream": _round(self.kib_per_stream),
            "wakeups": self.wakeups,
        }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def settle(clients: Sequence[Http], name: str, total: int, what: str) -> None:
    """Wait until the servers' gauge `name` adds up to `total`."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    seen = -1.0
    while time.monotonic() < deadline:
        seen = sum(c.metric(name) for c in clients)
        if seen >= total:
            return
        time.sleep(0.1)
    raise RuntimeError(f"the servers count {seen:.0f} {what}, not {total}")


def run(
    ports: Sequence[int],
    pids: Callable[[], Sequence[int]],
    *,
    waiters: int,
    streams: int,
    agents: int = 16,
    seconds: float = 6.0,
    wait_ms: int = 20_000,
) -> Fleet:
    """The scenario on the servers at `ports` (`pids`: their processes, for their memory)."""
    clients = [Http(port, timeout=60) for port in ports]
    admin = clients[0]
    tag = uuid.uuid4().hex[:8]
    crowd_role, work_role = f"crowd-{tag}", f"work-{tag}"
    crowd_pipeline = admin.json(
        "POST", "/pipelines", {"name": f"crowd-{tag}", "definition": definition(crowd_role)}, 201
    )["id"]
    work_pipeline = admin.json(
        "POST", "/pipelines", {"name": f"work-{tag}", "definition": definition(work_role)}, 201
    )["id"]
    crowd = None
    fleet = Fleet(waiters, streams, len(ports), Report(), None)
    try:
        if waiters or streams:
            crowd = fleet.crowd = Crowd(
                ports, crowd_role, crowd_pipeline, waiters, streams, wait_ms
            )
            base = sum(rss_kib(p) for p in pids())
            crowd.start_waiters()
            settle(clients, "nulltickets_long_poll_waiters", waiters, "waiting claims")
            with_waiters = sum(rss_kib(p) for p in pids())
            if waiters:
                fleet.kib_per_waiter = (with_waiters - base) / waiters
            crowd.start_streams()
            settle(clients, "nulltickets_sse_clients", streams, "event streams")
            if streams:
                fleet.kib_per_stream = (sum(rss_kib(p) for p in pids()) - with_waiters) / streams
        woken = sum(c.metric("nulltickets_long_poll_wakeups_total") for c in clients)
        reports: list[Report] = []
        worker = threading.Thread(
            target=lambda: reports.append(work(ports, work_pipeline, work_role, agents, seconds)),
            daemon=True,
        )
        worker.start()
        if crowd is not None and waiters:
            time.sleep(seconds / 3)
            task = {"pipeline_id": crowd_pipeline, "title": "for the crowd", "description": ""}
            started = time.monotonic()
            fleet.task_id = admin.json("POST", "/tasks", task, 201)["id"]
            fleet.created_answered_s = time.monotonic() - started
            deadline = started + HANG_S
            while time.monotonic() < deadline:
                taken = [a for a in crowd.answers if a.status == 200]
                if taken:
                    fleet.taken_s = taken[0].at - started
                    break
                time.sleep(0.001)
        worker.join(seconds + 5 * HANG_S)
        fleet.working = reports[0] if reports else Report(failures=["the agents did not finish"])
        if crowd is not None and waiters:
            fleet.wakeups = (
                sum(c.metric("nulltickets_long_poll_wakeups_total") for c in clients) - woken
            )
        return fleet
    finally:
        for c in clients:
            c.close()


def finish(fleet: Fleet, ports: Sequence[int], timeout: float) -> None:
    """Let the crowd's waits run out (every waiter answered), move the crowd's task on (every
    stream sees it), then close the crowd."""
    crowd = fleet.crowd
    if crowd is None:
        return
    deadline = time.monotonic() + timeout
    while crowd.answered() + len(crowd.failures) < crowd.waiters and time.monotonic() < deadline:
        time.sleep(0.1)
    won = [a for a in crowd.answers if a.status == 200]
    if len(won) == 1 and crowd.streams:
        lease = json.loads(won[0].body)
        c = Http(ports[0])
        try:
            status, body = c.request(
                "POST",
                f"/runs/{lease['run']['id']}/transition",
                {"trigger": "finish"},
                lease["lease_token"],
            )
            if status != 200:
                crowd.failures.append(f"the crowd's transition: {status} {body[:200]!r}")
        finally:
            c.close()
        until = time.monotonic() + HANG_S
        while time.monotonic() < until and min(crowd.frames, default=1) < 1:
            time.sleep(0.05)
        fleet.stream_frames_after_transition = sum(1 for n in crowd.frames if n >= 1)
    crowd.close()


# --- make bench, section fleet ------------------------------------------------------------------


def measure(
    servers: Sequence[Any], waiters: int, streams: int, agents: int, seconds: float
) -> dict[str, Any]:
    """One run on running BenchServers: the figures, the crowd finished and closed."""
    ports = [s.port for s in servers]
    fleet = run(
        ports,
        lambda: [p for s in servers for p in s.pids],
        waiters=waiters,
        streams=streams,
        agents=agents,
        seconds=seconds,
        wait_ms=int(seconds * 1000) + 15_000,
    )
    try:
        finish(fleet, ports, timeout=seconds + 30)
    finally:
        if fleet.crowd is not None:
            fleet.crowd.close()
    figures = fleet.figures()
    if fleet.crowd is not None:
        answers = fleet.crowd.answers
        figures["crowd_answered"] = len(answers)
        figures["crowd_took"] = sum(1 for a in answers if a.status == 200)
        figures["crowd_failures"] = len(fleet.crowd.failures)
        figures["streams_saw_transition"] = fleet.stream_frames_after_transition
    return figures


def fleet_rows(work_dir: Path, quick: bool) -> dict[str, Any]:
    """Each engine: the same working agents with nobody waiting, then beside the crowd (after a
    short run of theirs that is not counted, so that neither side pays for a cold server); on
    PostgreSQL two servers on one database, the crowd and the agents split across them."""
    from benchmarks.harness import BenchServer

    waiters, streams = (500, 50) if quick else (5_000, 500)
    agents, seconds = 16, (3.0 if quick else 10.0)
    raise_open_files(waiters + streams + 1024)
    result: dict[str, Any] = {"waiters": waiters, "streams": streams, "agents": agents}
    rows = []

    def pair(engine: str, servers: Sequence[Any]) -> None:
        measure(servers, 0, 0, agents, seconds / 4)  # warm-up: caches, first collections
        alone = measure(servers, 0, 0, agents, seconds)
        crowded = measure(servers, waiters, streams, agents, seconds)
        rows.append({"engine": engine, "servers": len(servers), "alone": alone, "crowd": crowded})
        a, c = alone["agents"], crowded["agents"]
        print(
            f"  {engine}, {len(servers)} server(s): agents' p99 {a['p99_ms']:.1f} ms alone, "
            f"{c['p99_ms']:.1f} ms beside {waiters:,} waiters and {streams} streams; the "
            f"crowd's task answered in {crowded['created_answered_ms']} ms, taken after "
            f"{crowded['taken_ms']} ms; {crowded['kib_per_waiter']} KiB per waiter, "
            f"{crowded['kib_per_stream']} KiB per stream",
            flush=True,
        )

    with BenchServer(work_dir / "fleet.db") as server:
        pair("sqlite", [server])

    from benchmarks.pgcluster import PostgresUnavailable, start_postgres

    try:
        import psycopg  # noqa: F401  (the driver the servers need)

        cluster = start_postgres()
    except (ImportError, PostgresUnavailable) as exc:
        result["postgres_not_measured"] = str(exc).splitlines()[0] if str(exc) else repr(exc)
    else:
        try:
            dsn = cluster.dsn(cluster.create_database())
            with contextlib.ExitStack() as stack:
                servers = [
                    stack.enter_context(BenchServer(dsn, log=work_dir / f"fleet-pg-{k}.log"))
                    for k in range(2)
                ]
                pair("postgresql", servers)
        finally:
            cluster.stop()
    result["rows"] = rows
    return result


def render(r: dict[str, Any]) -> list[str]:
    """The fleet section's table: the same agents alone and beside the crowd, side by side."""
    lines = [
        "",
        f"A fleet: {r['agents']} agents working (create, claim, heartbeat, event, read, "
        f"transition; {THINK_S * 1000:.0f} ms between cycles) alone, then beside "
        f"{r['waiters']:,} waiting long-poll claims and {r['streams']:,} open event streams",
        "",
        "| engine | servers | agents' p50 / p99 ms alone | with the crowd | p99 ratio | "
        "cycles alone / with | crowd's task answered ms | taken ms | woken | "
        "KiB per waiter | KiB per stream |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in r.get("rows", []):
        a, c = row["alone"]["agents"], row["crowd"]["agents"]
        ratio = c["p99_ms"] / a["p99_ms"] if a["p99_ms"] else 0.0
        crowd = row["crowd"]
        lines.append(
            f"| {row['engine']} | {row['servers']} | {a['p50_ms']:.2f} / {a['p99_ms']:.2f} | "
            f"{c['p50_ms']:.2f} / {c['p99_ms']:.2f} | {ratio:.2f} | "
            f"{a['cycles']} / {c['cycles']} | {crowd['created_answered_ms']} | "
            f"{crowd['taken_ms']} | {crowd['wakeups']:.0f} | {crowd['kib_per_waiter']} | "
            f"{crowd['kib_per_stream']} |"
        )
    if "postgres_not_measured" in r:
        lines.append(f"\nPostgreSQL not measured: {r['postgres_not_measured']}")
    return lines
