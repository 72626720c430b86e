"""The PostgreSQL comparison: the agent cycle on SQLite (`full` and `normal`), on PostgreSQL with
`synchronous_commit` on and off behind one, two and three servers on one database (the agents
split across them), and a peer queue doing the same work in-process on the same cluster
(benchmarks/peer.py), at each number of agents; for each, cycles/s, the claim p99, and the CPU
per cycle of the servers and of PostgreSQL. From those per-cycle costs, a capacity model:
cycles/s for N servers in front of a PostgreSQL of K cores, and where adding servers stops
helping.

The cluster is a throwaway one of its own (benchmarks/pgcluster.py) with fsync on and
`synchronous_commit = on`; a server with `--durability normal` turns it off on its connections,
and `full` leaves it on. Every run gets a new database (or SQLite file) and fresh servers; the
runs of one round go through every variant in turn (SQLite full, normal, PostgreSQL full at 1, 2,
3 servers, normal at 1, 2, 3, the peer full and normal), so the machine's drift falls on all
alike. The number of tasks of a variant's later rounds is set from its first round, so that each
run lasts about TARGET_S seconds. Before it is measured, every run works through `warmup`
tasks (jobs, for the peer) with the same agents: a server's first requests open its connections
and plan its statements on each of them, once, and in a run of a few seconds that once would
weigh as if it went on for as long as servers run (with three servers, it was most of
PostgreSQL's CPU per cycle). PostgreSQL's CPU is read from /proc: the postmaster, its
processes and the backends it has reaped (PostgresServer.cpu_s).
"""

from __future__ import annotations

import os
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import peer
from benchmarks.cycle import cycle, measure
from benchmarks.harness import BenchServer
from benchmarks.pgcluster import PostgresServer, PostgresUnavailable, start_postgres
from benchmarks.pgfloor import describe as describe_floor
from benchmarks.pgfloor import measure_floor

SERVERS = (1, 2, 3)
# Each run of a variant after its first lasts about this long.
TARGET_S = 4.0
MIN_TASKS, MAX_TASKS = 300, 20_000
# A run's warm-up (warmup_tasks): tasks per agent, and at least this many.
WARMUP_PER_AGENT, WARMUP_MIN = 10, 300
# The cores one server process can use: its event loop and granian's threads share one GIL.
CORES_PER_SERVER = 1.0
# The capacity model's grid: PostgreSQL cores and servers in front of it.
MODEL_CORES = (2, 4, 8, 16, 32)
MODEL_SERVERS = (1, 2, 3, 4, 8, 16)
DASH = "-"


@dataclass(frozen=True)
class Variant:
    engine: str  # sqlite, postgresql or the peer's name
    durability: str  # full or normal
    servers: int  # 0: the peer, in-process

    @property
    def key(self) -> str:
        return f"{self.engine}/{self.durability}/{self.servers}"


VARIANTS = (
    Variant("sqlite", "full", 1),
    Variant("sqlite", "normal", 1),
    *(Variant("postgresql", "full", n) for n in SERVERS),
    *(Variant("postgresql", "normal", n) for n in SERVERS),
    Variant(peer.NAME, "full", 0),
    Variant(peer.NAME, "normal", 0),
)


def not_measured(v: Variant, agents: int, reason: str) -> dict[str, Any]:
    return {
        "engine": v.engine,
        "durability": v.durability,
        "servers": v.servers,
        "agents": agents,
        "not_measured": reason,
    }


def warmup_tasks(agents: int, quick: bool) -> int:
    """The tasks of a run's warm-up: enough for each of the agents' requests to have run several
    times on every connection of three servers (8 that write each) before the measured stretch;
    a few in a quick run, which only checks that the section works."""
    return 2 * agents if quick else max(WARMUP_MIN, WARMUP_PER_AGENT * agents)


def run_once(
    v: Variant,
    cluster: PostgresServer | None,
    work: Path,
    agents: int,
    tasks: int,
    warmup: int = 0,
) -> dict[str, Any]:
    if v.engine == "sqlite":
        return cycle(work, agents, tasks, v.durability, warmup=warmup)
    assert cluster is not None
    with cluster.database() as name:
        return _run_postgres(v, cluster, cluster.dsn(name), work, agents, tasks, warmup)


def _run_postgres(
    v: Variant,
    cluster: PostgresServer,
    dsn: str,
    work: Path,
    agents: int,
    tasks: int,
    warmup: int,
) -> dict[str, Any]:
    if v.engine == peer.NAME:
        return peer.run(dsn, agents, tasks, v.durability, cluster.cpu_s, warmup)
    with ExitStack() as stack:
        running = [
            stack.enter_context(
                BenchServer(
                    dsn,
                    durability=v.durability,
                    log=work / f"pg-{agents}-{v.durability}-{v.servers}-{k}-{dsn[-8:]}.log",
                )
            )
            for k in range(v.servers)
        ]
        result = measure(running, agents, tasks, postgres_cpu=cluster.cpu_s, warmup=warmup)
    return {"engine": "postgresql", "durability": v.durability, **result}


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median cycles/s, with every run's cycles/s; its CPU per cycle is the
    median over the runs (the steadier figure when throughput scatters)."""
    ordered = sorted(runs, key=lambda r: r["cycles_per_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["rounds_cycles_per_s"] = [r["cycles_per_s"] for r in runs]
    row["completed_exactly_once"] = all(r["completed_exactly_once"] for r in runs)
    for key in ("server_cpu_ms_per_cycle", "postgres_cpu_ms_per_cycle", "client_cpu_ms_per_cycle"):
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            row[f"rounds_{key}"] = values
            row[key] = round(statistics.median(values), 3)
    return row


def postgres_section(
    work: Path,
    agents_list: tuple[int, ...],
    tasks: int,
    rounds: int,
    *,
    adapt: bool = True,
    floor_statements: int = 2_000,
    quick: bool = False,
) -> dict[str, Any]:
    """Every variant at each number of agents, the median of `rounds` interleaved runs, each
    after its warm-up (warmup_tasks; `quick`: a token one); the first round of a variant runs
    `tasks` tasks, later ones (with `adapt`) about TARGET_S seconds' worth. First the
    machine's floor (benchmarks/pgfloor.py, `floor_statements` of each kind). Returns the
    rows, the capacity model, the floor, and the versions of PostgreSQL and of the peer.
    Without PostgreSQL (or its driver, or the peer's package) the rows that need it say why
    instead of giving a figure."""
    cluster: PostgresServer | None = None
    pg_missing = peer_missing = None
    try:
        import psycopg  # noqa: F401  (the driver the servers need)
    except ImportError:
        pg_missing = "no PostgreSQL driver: pip install 'nulltickets[postgres]'"
    if pg_missing is None:
        try:
            cluster = start_postgres()
        except PostgresUnavailable as exc:
            pg_missing = str(exc)
    peer_version = peer.version()
    if peer_version is None:
        peer_missing = f"{peer.NAME} is not installed: pip install -c constraints.txt -e '.[bench]'"
    section: dict[str, Any] = {
        "postgresql": None,
        "peer": {"name": peer.NAME, "version": peer_version},
        "cores_per_server": CORES_PER_SERVER,
        "load_average": [load_average()],
        "rows": [],
    }
    try:
        if cluster is not None:
            with cluster.admin() as conn:
                row = conn.execute("SHOW server_version").fetchone()
            section["postgresql"] = str(row[0]) if row else None
            section["floor"] = measure_floor(cluster, floor_statements)
            print(f"  {describe_floor(section['floor'])}", flush=True)
        for agents in agents_list:
            runs: dict[Variant, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
            failed: dict[Variant, str] = {}
            size = dict.fromkeys(VARIANTS, tasks)
            for v in VARIANTS:
                if v.engine != "sqlite" and pg_missing:
                    failed[v] = pg_missing
                elif v.engine == peer.NAME and peer_missing:
                    failed[v] = peer_missing
            for _ in range(rounds):
                for v in VARIANTS:
                    if v in failed:
                        continue
                    try:
                        run = run_once(
                            v, cluster, work, agents, size[v], warmup_tasks(agents, quick)
                        )
                    except RuntimeError as exc:  # a server that did not start: say so, go on
                        failed[v] = str(exc)
                        continue
                    runs[v].append(run)
                    if adapt and run["cycles_per_s"] > 0:
                        want = int(run["cycles_per_s"] * TARGET_S)
                        size[v] = max(MIN_TASKS, min(MAX_TASKS, want))
            for v in VARIANTS:
                if v in failed or not runs[v]:
                    section["rows"].append(not_measured(v, agents, failed.get(v, "no run")))
                    continue
                section["rows"].append(median_row(runs[v]))
                print(f"  {agents:>3} agents, {describe(section['rows'][-1])}", flush=True)
        section["model"] = capacity_model(section["rows"])
        section["load_average"].append(load_average())
        return section
    finally:
        if cluster is not None:
            cluster.stop()


def load_average() -> float | None:
    """The machine's one-minute load average (other work on a shared machine shows here)."""
    try:
        return round(os.getloadavg()[0], 1)
    except OSError:
        return None


def describe(row: dict[str, Any]) -> str:
    """One progress line for a measured row."""
    where = (
        "in-process"
        if row["servers"] == 0
        else f"{row['servers']} server{'s' * (row['servers'] > 1)}"
    )
    db = row.get("postgres_cpu_ms_per_cycle")
    return (
        f"{row['engine']} {row['durability']}, {where}: {row['cycles_per_s']:.0f} cycles/s, "
        f"claim p99 {row['latency_ms']['claim']['p99']:.1f} ms, server CPU "
        f"{fmt(row.get('server_cpu_ms_per_cycle'))} ms/cycle"
        + (f", PostgreSQL {fmt(db)} ms/cycle" if db is not None else "")
    )


def fmt(value: float | None, digits: int = 2) -> str:
    return DASH if value is None else f"{value:.{digits}f}"


# --- the capacity model ---------------------------------------------------------------------


def capacity_model(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """From the PostgreSQL `full` rows at the largest number of agents measured: each server
    count's CPU per cycle (servers' sum s, PostgreSQL's p, ms), and the cycles/s the model
    gives N servers of CORES_PER_SERVER cores each in front of a PostgreSQL of K cores:
    min(N * 1000 * CORES_PER_SERVER / s, K * 1000 / p), with s and p of the largest server
    count measured for N beyond it. The servers stop adding throughput at
    N* = K * s / (CORES_PER_SERVER * p). None when no such row was measured."""
    measured = [
        r
        for r in rows
        if r["engine"] == "postgresql"
        and r["durability"] == "full"
        and "not_measured" not in r
        and r.get("server_cpu_ms_per_cycle")
        and r.get("postgres_cpu_ms_per_cycle")
    ]
    if not measured:
        return None
    agents = max(r["agents"] for r in measured)
    at = {r["servers"]: r for r in measured if r["agents"] == agents}
    largest = at[max(at)]
    costs = {
        n: {
            "server_ms": r["server_cpu_ms_per_cycle"],
            "postgres_ms": r["postgres_cpu_ms_per_cycle"],
            "client_ms": r.get("client_cpu_ms_per_cycle"),
            "measured_cycles_per_s": r["cycles_per_s"],
            # Everything here shares this machine's cores: the most CPU alone would allow.
            "cpu_bound_here": round(
                1000
                * (os.cpu_count() or 1)
                / (
                    r["server_cpu_ms_per_cycle"]
                    + r["postgres_cpu_ms_per_cycle"]
                    + (r.get("client_cpu_ms_per_cycle") or 0.0)
                )
            ),
        }
        for n, r in sorted(at.items())
    }

    def cost(n: int) -> dict[str, Any]:
        return costs.get(n, costs[largest["servers"]])

    def predict(n: int, k: int) -> float:
        c = cost(n)
        server, db = float(c["server_ms"]), float(c["postgres_ms"])
        return min(n * 1000 * CORES_PER_SERVER / server, k * 1000 / db)

    top = cost(largest["servers"])
    return {
        "agents": agents,
        "durability": "full",
        "cores_per_server": CORES_PER_SERVER,
        "costs": {str(n): c for n, c in costs.items()},
        "grid": {
            str(k): {str(n): round(predict(n, k)) for n in MODEL_SERVERS} for k in MODEL_CORES
        },
        "postgres_cycles_per_core": round(1000 / top["postgres_ms"]),
        "server_cycles_per_core": round(1000 / top["server_ms"]),
        "servers_per_postgres_core": round(
            top["server_ms"] / (CORES_PER_SERVER * top["postgres_ms"]), 2
        ),
    }


def peer_per_core(rows: list[dict[str, Any]], agents: int) -> dict[str, float]:
    """The peer's jobs per second per PostgreSQL core, by durability, at `agents`."""
    return {
        r["durability"]: round(1000 / r["postgres_cpu_ms_per_cycle"])
        for r in rows
        if r["engine"] == peer.NAME
        and r["agents"] == agents
        and "not_measured" not in r
        and r.get("postgres_cpu_ms_per_cycle")
    }


# --- rendering ------------------------------------------------------------------------------


def warmups(rows: list[dict[str, Any]]) -> str:
    """What the runs' warm-ups were, in words, one figure per number of agents."""
    by_agents = sorted({(r["agents"], r.get("warmup", 0)) for r in rows if "cycles_per_s" in r})
    done = [f"{w:,} at {a} agents" for a, w in by_agents if w]
    if not done:
        return "no warm-up"
    return f"the same agents worked through tasks (jobs) unmeasured: {', '.join(done)}"


def durability_label(row: dict[str, Any]) -> str:
    if row["engine"] == "sqlite":
        return str(row["durability"])
    on = "on" if row["durability"] == "full" else "off"
    return f"{row['durability']} (synchronous_commit {on})"


def table_row(row: dict[str, Any]) -> str:
    servers = "in-process" if row["servers"] == 0 else str(row["servers"])
    head = f"| {row['engine']} | {servers} | {row['agents']} | {durability_label(row)} |"
    if "not_measured" in row:
        return f"{head} not measured: {row['not_measured']} |" + " |" * 5
    runs = ", ".join(f"{x:.0f}" for x in row.get("rounds_cycles_per_s", [row["cycles_per_s"]]))
    return (
        f"{head} {row['cycles_per_s']:.0f} | {runs} | "
        f"{row['latency_ms']['claim']['p99']:.1f} | {fmt(row.get('server_cpu_ms_per_cycle'))} | "
        f"{fmt(row.get('postgres_cpu_ms_per_cycle'))} | "
        f"{'yes' if row['completed_exactly_once'] else 'NO'} |"
    )


def render(section: dict[str, Any], rounds: int) -> list[str]:
    """The comparison table, then the capacity model, as Markdown lines."""
    version = section.get("postgresql") or "not available"
    p = section.get("peer", {})
    lines = [
        "",
        f"PostgreSQL {version}; peer: {p.get('name')} {p.get('version') or '(not installed)'}",
        "",
        "| system | servers | agents | durability | cycles/s | each run | claim p99 ms | "
        "server CPU ms/cycle | PostgreSQL CPU ms/cycle | exactly once |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|---|",
        *(table_row(r) for r in section["rows"]),
        "",
        f"Each row is the median of {rounds} run{'s' * (rounds > 1)}, the variants' runs "
        "interleaved; CPU per cycle is the median over the runs. Each run is measured after "
        f"{warmups(section['rows'])} (fresh servers' connections, their statements' plans, "
        "caches). Several servers share one "
        "database, the agents split across them; their CPU is the sum. The peer runs in one "
        "process with no HTTP: its CPU is the queue's and its agents' together, its claim is "
        "a fetch and its cycle a fetch and a complete.",
    ]
    lines += ratios(section["rows"])
    enqueued = [
        f"{r['durability']} at {r['agents']} agents {r['enqueue_per_s']:,.0f}"
        for r in section["rows"]
        if r["engine"] == peer.NAME and "enqueue_per_s" in r
    ]
    if enqueued:
        lines.append(
            f"{peer.NAME} enqueued its jobs in one batch (`batch_defer_async`) at, in jobs/s: "
            + ", ".join(enqueued)
            + "."
        )
    if section.get("floor"):
        lines += ["", describe_floor(section["floor"])]
    model = section.get("model")
    if model:
        lines += render_model(model, section["rows"])
    return lines


def ratios(rows: list[dict[str, Any]]) -> list[str]:
    """At each number of agents: PostgreSQL `full` behind one server over SQLite `full`, two
    and three servers over one, and the claim p99 at each server count (`full`)."""
    got = {
        (r["engine"], r["durability"], r["servers"], r["agents"]): r
        for r in rows
        if "not_measured" not in r
    }
    lines = []
    for agents in sorted({r["agents"] for r in rows}):

        def rate(engine: str, servers: int, agents: int = agents) -> float | None:
            r = got.get((engine, "full", servers, agents))
            return r["cycles_per_s"] if r and r["cycles_per_s"] > 0 else None

        parts = []
        one, sqlite = rate("postgresql", 1), rate("sqlite", 1)
        if one and sqlite:
            parts.append(f"PostgreSQL over SQLite, one server each, {one / sqlite:.2f}")
        for n in SERVERS[1:]:
            more = rate("postgresql", n)
            if one and more:
                parts.append(f"{n} servers over 1 {more / one:.2f}")
        p99 = [
            f"{got[k]['latency_ms']['claim']['p99']:.1f}"
            for k in (("postgresql", "full", n, agents) for n in SERVERS)
            if k in got
        ]
        if p99:
            parts.append(f"claim p99 at 1, 2, 3 servers {' / '.join(p99)} ms")
        if parts:
            lines.append(f"`full`, {agents} agents: " + "; ".join(parts) + ".")
    return ["", *lines] if lines else []


def render_model(model: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    costs = model["costs"]
    lines = [
        "",
        f"Capacity model, from the PostgreSQL `full` rows at {model['agents']} agents "
        f"(s: the servers' CPU ms per cycle, summed; p: PostgreSQL's; c: the load client's):",
        "",
        "| servers | s ms | p ms | c ms | measured cycles/s | CPU-bound here |",
        "|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {n} | {c['server_ms']:.2f} | {c['postgres_ms']:.2f} | {fmt(c['client_ms'])} | "
            f"{c['measured_cycles_per_s']:.0f} | {c['cpu_bound_here']:,} |"
            for n, c in costs.items()
        ),
        "",
        "CPU-bound here: the cycles/s this machine's cores would allow if CPU were all that "
        "limited them, cores * 1000 / (s + p + c); measured below it, the rest is waiting "
        "(round trips, locks, commits).",
        "",
        f"cycles/s = min(N * {model['cores_per_server']:g} * 1000 / s, K * 1000 / p), for N "
        f"servers of {model['cores_per_server']:g} core each and a PostgreSQL of K cores "
        "(s and p of the largest measured server count beyond it):",
        "",
        "| PostgreSQL cores | "
        + " | ".join(f"{n} server{'s' * (n > 1)}" for n in MODEL_SERVERS)
        + " | stops scaling at |",
        "|---:|" + "---:|" * (len(MODEL_SERVERS) + 1),
    ]
    per = model["servers_per_postgres_core"]
    for k, by_n in model["grid"].items():
        cells = " | ".join(f"{v:,}" for v in by_n.values())
        lines.append(f"| {k} | {cells} | {per * int(k):.1f} servers |")
    lines += [
        "",
        f"One PostgreSQL core carries about {model['postgres_cycles_per_core']:,} cycles/s and "
        f"one server core about {model['server_cycles_per_core']:,}: servers stop adding "
        f"throughput at N = K * s / p = {per:.2f} * K.",
    ]
    peer_rates = peer_per_core(rows, model["agents"])
    if peer_rates:
        lines.append(
            f"{peer.NAME} on the same cluster: "
            + ", ".join(f"{d} {v:,} jobs/s per PostgreSQL core" for d, v in peer_rates.items())
            + f" at {model['agents']} agents."
        )
    return lines


def figures(section: dict[str, Any], machine: dict[str, Any], rounds: int, command: str) -> str:
    """The Markdown the docs include (docs/performance.md): where and when the figures were
    measured, the table and the model."""
    when = time.strftime("%Y-%m-%d", time.gmtime())
    head = (
        f"Measured {when} with `{command}`: nulltickets {machine['nulltickets']} (core: "
        f"{machine['core']}), Python {machine['python']}, SQLite {machine['sqlite']}, "
        f"granian {machine['granian']}, {machine['cpus']} CPUs ({machine['machine']}), load "
        f"client {machine.get('load_client', 'python')}; the servers, PostgreSQL and the load "
        "client all on the same machine"
    )
    loads = [x for x in section.get("load_average", []) if x is not None]
    if len(loads) == 2:
        head += f" (load average {loads[0]} at the start, {loads[1]} at the end)"
    head += "."
    return "\n".join([head, *render(section, rounds)]) + "\n"
