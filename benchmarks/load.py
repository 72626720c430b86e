"""The load client: agents that loop claim -> event -> transition over keep-alive connections.

Two implementations of the same agent loop. The native one (loadgen.c, built here with the
system's C compiler) spends a few microseconds per request; the Python one (one asyncio loop
per process, raw streams, pre-encoded requests) spends tens, which on a 2-core machine is CPU
the server under test no longer has. The native one is used whenever it can be built. Every
client process reports the tasks it completed, its latencies per endpoint and its own CPU time.
"""

from __future__ import annotations

import asyncio
import hashlib
import multiprocessing
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

ENDPOINTS = ("claim", "event", "transition")


@dataclass
class AgentReport:
    completed: list[str] = field(default_factory=list)
    latencies: dict[str, list[float]] = field(default_factory=lambda: {e: [] for e in ENDPOINTS})
    errors: dict[str, int] = field(default_factory=dict)
    cpu_s: float = 0.0


class Conn:
    """One keep-alive HTTP/1.1 connection speaking just enough of the protocol."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, port: int) -> Conn:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def post(self, path: str, body: bytes, token: str | None = None) -> tuple[int, bytes]:
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        head = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"{auth}Content-Length: {len(body)}\r\n\r\n"
        )
        self.writer.write(head.encode() + body)
        raw = await self.reader.readuntil(b"\r\n\r\n")
        status = int(raw[9:12])
        length = 0
        for line in raw.split(b"\r\n")[1:]:
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        payload = await self.reader.readexactly(length) if length else b""
        return status, payload

    def close(self) -> None:
        self.writer.close()


class Claimed(msgspec.Struct):
    class _Task(msgspec.Struct):
        id: str

    class _Run(msgspec.Struct):
        id: str

    task: _Task
    run: _Run
    lease_token: str


async def agent(port: int, name: str, role: str, trigger: str, report: AgentReport) -> None:
    conn = await Conn.open(port)
    claim_body = msgspec.json.encode({"agent_id": name, "agent_role": role})
    event_body = b'{"kind":"progress","data":{"step":1}}'
    move_body = msgspec.json.encode({"trigger": trigger})
    decode = msgspec.json.Decoder(Claimed).decode
    lat = report.latencies
    clock = time.perf_counter
    try:
        while True:
            t0 = clock()
            status, body = await conn.post("/leases/claim", claim_body)
            t1 = clock()
            lat["claim"].append(t1 - t0)
            if status == 204:
                return
            if status != 200:
                report.errors[f"claim {status}"] = report.errors.get(f"claim {status}", 0) + 1
                await asyncio.sleep(0.01)
                continue
            claimed = decode(body)
            run, token = claimed.run.id, claimed.lease_token
            status, _ = await conn.post(f"/runs/{run}/events", event_body, token)
            t2 = clock()
            lat["event"].append(t2 - t1)
            if status != 201:
                report.errors[f"event {status}"] = report.errors.get(f"event {status}", 0) + 1
            status, _ = await conn.post(f"/runs/{run}/transition", move_body, token)
            lat["transition"].append(clock() - t2)
            if status == 200:
                report.completed.append(claimed.task.id)
            else:
                key = f"transition {status}"
                report.errors[key] = report.errors.get(key, 0) + 1
    finally:
        conn.close()


def _process(port: int, names: list[str], role: str, trigger: str, start: float) -> AgentReport:
    report = AgentReport()
    cpu0 = time.process_time()

    async def main() -> None:
        # Start together so that every process measures the same stretch of time.
        await asyncio.sleep(max(0.0, start - time.time()))
        await asyncio.gather(*(agent(port, n, role, trigger, report) for n in names))

    asyncio.run(main())
    report.cpu_s = time.process_time() - cpu0
    return report


SOURCE = Path(__file__).with_name("loadgen.c")


def native_client() -> Path | None:
    """The built native client (cached by the hash of its source), or None without a compiler
    or when NULLTICKETS_BENCH_CLIENT=python asks for the Python one."""
    if os.environ.get("NULLTICKETS_BENCH_CLIENT") == "python" or os.name != "posix":
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    binary = Path(tempfile.gettempdir()) / f"nulltickets-loadgen-{digest}"
    if not binary.exists():
        partial = binary.with_suffix(f".{os.getpid()}.tmp")
        built = subprocess.run(
            [compiler, "-O2", "-o", str(partial), str(SOURCE)], capture_output=True, text=True
        )
        if built.returncode != 0:
            print(f"native load client did not build, using the Python one:\n{built.stderr}")
            return None
        partial.replace(binary)
    return binary


def _native(
    binary: Path, ports: list[int], shares: list[int], role: str, trigger: str
) -> tuple[list[AgentReport], float]:
    """Run the native client processes, the k-th against ports[k]; returns their reports and
    the agreed start time."""
    start = time.time() + 0.5  # every process connects, then waits for this moment
    procs = [
        subprocess.Popen(
            [str(binary), str(port), str(n), role, trigger, repr(start), f"agent{k}"],
            stdout=subprocess.PIPE,
        )
        for k, (port, n) in enumerate(zip(ports, shares, strict=True))
    ]
    reports = []
    for proc in procs:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise RuntimeError(f"native load client failed with exit status {proc.returncode}")
        raw = msgspec.json.decode(out)
        reports.append(
            AgentReport(
                completed=raw["completed"],
                latencies={e: [us / 1e6 for us in raw["latencies_us"][e]] for e in ENDPOINTS},
                errors=raw["errors"],
                cpu_s=raw["cpu_s"],
            )
        )
    return reports, start


def run_agents(
    port: int | list[int], agents: int, role: str, trigger: str, processes: int
) -> tuple[AgentReport, float]:
    """Run `agents` agents spread over `processes` client processes until the queue is empty.
    Given several ports (servers on one database), the processes take them in turn, so the
    agents are split evenly across the servers. Returns the merged report and the wall time."""
    ports = port if isinstance(port, list) else [port]
    processes = max(1, min(max(processes, len(ports)), agents))
    process_ports = [ports[i % len(ports)] for i in range(processes)]
    binary = native_client()
    if binary is not None:
        shares = [len(range(i, agents, processes)) for i in range(processes)]
        reports, start = _native(binary, process_ports, shares, role, trigger)
        wall = time.time() - start
    else:
        names = [f"agent-{i}" for i in range(agents)]
        name_shares = [names[i::processes] for i in range(processes)]
        ctx = multiprocessing.get_context("spawn")
        start = time.time() + 1.5  # spawn and import time, outside the measured stretch
        with ctx.Pool(processes) as pool:
            results = [
                pool.apply_async(_process, (p, s, role, trigger, start))
                for p, s in zip(process_ports, name_shares, strict=True)
            ]
            reports = [r.get() for r in results]
        wall = time.time() - start
    merged = AgentReport()
    for r in reports:
        merged.completed += r.completed
        for e in ENDPOINTS:
            merged.latencies[e] += r.latencies[e]
        for k, v in r.errors.items():
            merged.errors[k] = merged.errors.get(k, 0) + v
        merged.cpu_s += r.cpu_s
    return merged, wall
