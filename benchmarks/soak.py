"""`python -m benchmarks.soak`: agents cycle (create -> claim -> event -> transition) against a
real server with a short retention, and the database's size is printed as it goes: with
retention it levels off instead of growing with every cycle.

    python -m benchmarks.soak --cycles 500000 --retention 30s --prune-interval 2s
    python -m benchmarks.soak --db postgresql://... --minutes 10
    python -m benchmarks.soak --postgres --minutes 2     # a throwaway cluster of its own
    python -m benchmarks.soak --postgres --rate 200 --minutes 5   # a fleet with time to spare

Every `--every` seconds one line: cycles so far, cycles/s, claim p50/p99 in that interval, the
rows pruned in it, the failed requests by kind (`error_kinds`: "claim 503 service_unavailable"), and
the size (SQLite: the file and its WAL, pages and free pages;
PostgreSQL: pg_database_size). Ends after `--cycles` cycles or `--minutes`, whichever comes
first, with a JSON summary on the last line. No figure is asserted.

Whether pruning holds claims up: a thread reads the server's /metrics every `--watch` seconds;
from the first poll that sees rows pruned to the one that sees the pass end, a prune pass was
running. Each claim that overlapped such a stretch counts as "pruning", every other as "idle",
and each line and the summary give claim p50/p99/max of both (`claims_pruning`,
`claims_idle`): unchanged while pruning means the two agree. The summary adds the server's
prune batches (`prune_batches`: how many, their mean time and the bucket bound of their p99,
from nulltickets_prune_batch_duration_seconds). `--retention off` runs the same load without
any pass, for a baseline of its own.

By default the agents go as fast as the server answers, so the machine has no time to spare and
a pass's work is taken from the claims'. `--rate N` paces them to N cycles a second in all, the
load of a fleet whose agents spend most of their time on their own work: whether pruning then
holds claims up is whether it fits in the time the server has left.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.cycle import mean_of

PIPELINE = {
    "initial": "todo",
    "states": {"todo": {"agent_role": "soak"}, "done": {"terminal": True}},
    "transitions": [{"from": "todo", "to": "done", "trigger": "finish"}],
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Http:
    """One keep-alive connection; JSON in, (status, JSON) out."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)

    def call(
        self, method: str, path: str, body: Any = None, token: str | None = None
    ) -> tuple[int, Any]:
        headers = {"content-type": "application/json"}
        if token is not None:
            headers["authorization"] = f"Bearer {token}"
        data = None if body is None else json.dumps(body).encode()
        self.conn.request(method, path, body=data, headers=headers)
        resp = self.conn.getresponse()
        raw = resp.read()
        return resp.status, (json.loads(raw) if raw and raw[:1] in b"{[" else raw)


Claim = tuple[float, float]  # (monotonic start, seconds it took)


class Stats:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cycles = 0
        # Failed requests by kind: "claim 503 service_unavailable", "exception TimeoutError".
        self.errors: Counter[str] = Counter()
        self.claims: list[Claim] = []

    def failures(self) -> dict[str, Any]:
        with self.lock:
            return {"errors": sum(self.errors.values()), "error_kinds": dict(self.errors)}

    def failed(self, what: str, status: int, body: Any) -> None:
        error = body.get("error") if isinstance(body, dict) else None
        code = error.get("code") if isinstance(error, dict) else None
        with self.lock:
            self.errors[f"{what} {status} {code or ''}".rstrip()] += 1

    def take(self) -> tuple[int, list[Claim]]:
        with self.lock:
            claims, self.claims = self.claims, []
            return self.cycles, claims


class PruneWatch:
    """When prune passes ran, from the server's counters: a pass runs from the poll before the
    one that first sees its rows deleted until the poll that sees the pass counted (its vacuum
    included). A pass that found nothing (one indexed query) is not counted as pruning."""

    def __init__(self, port: int, every: float) -> None:
        self.port, self.every = port, every
        self.lock = threading.Lock()
        self.windows: list[tuple[float, float]] = []  # (from, to) passes ran, monotonic
        self.running_since: float | None = None  # a pass seen running since then
        self.polled_at = time.monotonic()  # what happened before this is known
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        client: Http | None = None
        rows, passes = -1, -1
        while not self.stop.wait(self.every):
            try:
                client = client or Http(self.port)
                now_rows, now_passes = counters(client)
            except (OSError, http.client.HTTPException):
                client = None
                continue
            now = time.monotonic()
            with self.lock:
                if rows >= 0 and now_rows > rows and self.running_since is None:
                    self.running_since = self.polled_at
                if now_passes > passes and self.running_since is not None:
                    self.windows.append((self.running_since, now))
                    self.running_since = None
                self.polled_at = now
            rows, passes = now_rows, now_passes

    def split(self, claims: list[Claim]) -> tuple[list[float], list[float], list[Claim]]:
        """(pruning, idle, later): seconds of the claims that overlapped a pass, of those that
        did not, and the claims that ended after the last poll (to split at the next call)."""
        with self.lock:
            until = self.polled_at
            windows = list(self.windows)
            if self.running_since is not None:
                windows.append((self.running_since, until))
        first = min((start for start, _ in claims), default=until)
        windows = [(a, b) for a, b in windows if b >= first]
        pruning: list[float] = []
        idle: list[float] = []
        later: list[Claim] = []
        for start, took in claims:
            end = start + took
            if end > until:
                later.append((start, took))
            elif any(a <= end and start <= b for a, b in windows):
                pruning.append(took)
            else:
                idle.append(took)
        return pruning, idle, later


class Pacer:
    """Start times `1 / rate` seconds apart, handed out in turn to whichever agent asks. A
    start missed (the server was slower than the rate) is not made up: after a stall the
    agents go on at the rate, not in a burst."""

    def __init__(
        self,
        rate: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if rate <= 0:
            raise ValueError("the rate must be more than 0 cycles a second")
        self.gap = 1.0 / rate
        self.clock, self.sleep = clock, sleep
        self.lock = threading.Lock()
        self.next: float | None = None

    def wait(self) -> float:
        """Sleep until this caller's start time; return it."""
        with self.lock:
            now = self.clock()
            start = now if self.next is None or self.next < now else self.next
            self.next = start + self.gap
        if start > now:
            self.sleep(start - now)
        return start


@dataclass(frozen=True)
class Load:
    """What every agent of the soak shares: its pipeline, its figures, when to stop, how many
    tasks it creates at once, and the pace (None: as fast as the server answers)."""

    pipeline_id: str
    stats: Stats
    stop: threading.Event
    bulk: int
    pacer: Pacer | None = None


def agent(port: int, load: Load) -> None:
    while not load.stop.is_set():
        try:
            cycles(Http(port), load)
        except (OSError, http.client.HTTPException) as exc:
            if not load.stop.is_set():
                with load.stats.lock:
                    load.stats.errors[f"exception {type(exc).__name__}"] += 1
                time.sleep(0.1)


def cycles(client: Http, load: Load) -> None:
    pipeline_id, stats, stop, bulk, pacer = (
        load.pipeline_id, load.stats, load.stop, load.bulk, load.pacer
    )  # fmt: skip
    while not stop.is_set():
        status, got = client.call(
            "POST",
            "/tasks/bulk",
            {"tasks": [{"pipeline_id": pipeline_id, "title": "soak", "description": ""}] * bulk},
        )
        if status != 201:
            stats.failed("bulk", status, got)
            continue
        for _ in range(bulk):
            if pacer is not None:
                pacer.wait()
            started = time.monotonic()
            status, got = client.call(
                "POST", "/leases/claim", {"agent_id": "soak", "agent_role": "soak"}
            )
            took = time.monotonic() - started
            if status != 200:
                if status != 204:
                    stats.failed("claim", status, got)
                continue
            run, token = got["run"]["id"], got["lease_token"]
            status, got = client.call(
                "POST", f"/runs/{run}/events", {"kind": "step", "data": {"n": 1}}, token
            )
            if status != 201:
                stats.failed("event", status, got)
            status, got = client.call(
                "POST",
                f"/runs/{run}/transition",
                {"trigger": "finish", "usage": {"tokens": 100}},
                token,
            )
            if status != 200:
                stats.failed("transition", status, got)
            with stats.lock:
                stats.claims.append((started, took))
                stats.cycles += status == 200


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def latency(values: list[float]) -> dict[str, float]:
    """Claims' count and p50/p99/max in ms."""
    return {
        "claims": len(values),
        "p50_ms": round(pct(values, 0.5) * 1000, 2),
        "p99_ms": round(pct(values, 0.99) * 1000, 2),
        "max_ms": round(max(values, default=0.0) * 1000, 2),
    }


def counters(client: Http) -> tuple[int, int]:
    """(rows pruned, prune passes) so far, from the server's /metrics."""
    status, text = client.call("GET", "/metrics")
    if status != 200:
        return 0, 0
    rows = sum(
        int(float(v))
        for v in re.findall(rb"^nulltickets_pruned_rows_total\{[^}]*\} (\S+)$", text, re.M)
    )
    passes = re.search(rb"^nulltickets_prune_passes_total (\S+)$", text, re.M)
    return rows, int(float(passes.group(1))) if passes else 0


def batch_times(port: int) -> dict[str, float] | None:
    """The server's prune batches so far (batch_summary of its /metrics)."""
    status, text = Http(port).call("GET", "/metrics")
    return batch_summary(text.decode()) if status == 200 else None


def batch_summary(metrics: str) -> dict[str, float] | None:
    """How many prune batches `metrics` counts, their mean time, and the bound of the
    histogram's bucket that holds their p99 (nulltickets_prune_batch_duration_seconds); None
    when there is none."""
    name = "nulltickets_prune_batch_duration_seconds"
    mean = mean_of(metrics, name)
    buckets = [
        (float(le), float(n))
        for le, n in re.findall(rf'^{name}_bucket\{{le="([^"]+)"\}} (\S+)$', metrics, re.M)
    ]
    if mean is None or not buckets:
        return None
    count = buckets[-1][1]  # le="+Inf"
    p99 = next(le for le, n in buckets if n >= 0.99 * count)
    return {
        "batches": int(count),
        "mean_ms": round(mean * 1000, 2),
        "p99_ms_at_most": round(p99 * 1000, 2),
    }


def pruned(port: int) -> int:
    return counters(Http(port))[0]


def size(db: str) -> dict[str, int]:
    if db.startswith(("postgresql://", "postgres://")):
        import psycopg

        with psycopg.connect(db) as pg:
            row = pg.execute("SELECT pg_database_size(current_database())").fetchone()
        return {"bytes": int(row[0]) if row else 0}
    import apsw

    conn = apsw.Connection(db, flags=apsw.SQLITE_OPEN_READONLY)
    try:
        pages = int(conn.pragma("page_count"))
        free = int(conn.pragma("freelist_count"))
        (count,) = conn.execute("SELECT count(*) FROM tasks").fetchall()[0]
        tasks = int(str(count))
    finally:
        conn.close()
    wal = Path(db + "-wal")
    return {
        "bytes": os.path.getsize(db),
        "wal_bytes": wal.stat().st_size if wal.exists() else 0,
        "pages": pages,
        "free_pages": free,
        "tasks": tasks,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__)
    p.add_argument("--db", help="SQLite file or postgresql:// URL (default: a temporary file)")
    p.add_argument(
        "--postgres", action="store_true", help="on a throwaway PostgreSQL cluster of its own"
    )
    p.add_argument("--cycles", type=int, default=500_000)
    p.add_argument("--minutes", type=float, default=60.0)
    p.add_argument("--agents", type=int, default=8)
    p.add_argument("--bulk", type=int, default=20, help="tasks each agent creates at once")
    p.add_argument(
        "--rate", type=float, help="cycles a second in all (default: as fast as the server goes)"
    )
    p.add_argument("--retention", default="30s")
    p.add_argument("--prune-interval", default="2s")
    p.add_argument("--durability", default="normal")
    p.add_argument("--every", type=float, default=30.0, help="seconds between lines")
    p.add_argument("--watch", type=float, default=0.2, help="seconds between reads of /metrics")
    args = p.parse_args(argv)

    workdir = Path(tempfile.mkdtemp(prefix="nulltickets-soak-"))
    cluster = None
    if args.postgres:
        from benchmarks.pgcluster import start_postgres

        cluster = start_postgres()
        args.db = cluster.dsn(cluster.create_database())
    db = args.db or str(workdir / "soak.db")
    port = free_port()
    cmd = [
        sys.executable, "-m", "nulltickets", "serve", "--port", str(port), "--db", db,
        "--retention", args.retention, "--prune-interval", args.prune_interval,
        "--durability", args.durability,
    ]  # fmt: skip
    env = {**os.environ, "NULLTICKETS_HOME": str(workdir / "home")}
    log = open(workdir / "server.log", "wb")  # noqa: SIM115 (open for the server's lifetime)
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if Http(port).call("GET", "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"the server did not start: see {workdir / 'server.log'}")
            time.sleep(0.1)
        status, made = Http(port).call(
            "POST", "/pipelines", {"name": f"soak-{port}", "definition": PIPELINE}
        )
        assert status == 201, made
        stats = Stats()
        pacer = Pacer(args.rate) if args.rate is not None else None
        load = Load(made["id"], stats, stop, args.bulk, pacer)
        for _ in range(args.agents):
            t = threading.Thread(target=agent, args=(port, load), daemon=True)
            t.start()
            threads.append(t)
        watch = PruneWatch(port, args.watch)
        watch.thread.start()
        started = time.monotonic()
        last_cycles, last_at, last_pruned = 0, started, 0
        figures: list[dict[str, Any]] = []
        pending: list[Claim] = []
        during: list[float] = []  # every claim of the run, split
        besides: list[float] = []
        pace = f"{args.rate:g} cycles/s" if args.rate is not None else "as fast as it goes"
        print(
            f"soak: {args.agents} agents ({pace}), retention {args.retention}, database {db}",
            flush=True,
        )
        while True:
            time.sleep(args.every)
            now = time.monotonic()
            cycles, claims = stats.take()
            pruning, idle, pending = watch.split(pending + claims)
            during += pruning
            besides += idle
            total_pruned = pruned(port)
            took = [t for _, t in claims]
            row = {
                "minutes": round((now - started) / 60, 2),
                "cycles": cycles,
                "cycles_per_s": round((cycles - last_cycles) / (now - last_at), 1),
                "claim_p50_ms": round(pct(took, 0.5) * 1000, 2),
                "claim_p99_ms": round(pct(took, 0.99) * 1000, 2),
                "claims_pruning": latency(pruning),
                "claims_idle": latency(idle),
                "pruned_rows": total_pruned - last_pruned,
                **stats.failures(),
                **size(db),
            }
            figures.append(row)
            print(json.dumps(row), flush=True)
            last_cycles, last_at, last_pruned = cycles, now, total_pruned
            if cycles >= args.cycles or now - started >= args.minutes * 60:
                break
        watch.stop.set()
        summary = {
            **figures[-1],
            "retention": args.retention,
            "rate": args.rate,
            "prune_passes": len(watch.windows),
            "seconds_pruning": round(sum(b - a for a, b in watch.windows), 1),
            "claims_pruning": latency(during),
            "claims_idle": latency(besides),
            "prune_batches": batch_times(port),
        }
        print(json.dumps({"summary": summary, "lines": len(figures)}), flush=True)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
        if cluster is not None:
            cluster.stop()
    if args.db is None or cluster is not None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
