"""`python -m benchmarks`: every figure of the claim-throughput benchmark, as a table and JSON.

Sections (--sections picks some, comma-separated; all by default):
  cycle       HTTP agent cycle (claim -> event -> transition) on SQLite at 1, 4, 16, 64 agents
  mcp         the cycle claim -> checkpoint -> transition through /mcp (the MCP SDK's client,
              one long-lived session per agent) beside the same cycle over the HTTP API, at 1
              and 4 Python agents, their runs interleaved: what a cycle costs the server on each
  durability  the same cycle at 16 and 64 agents with --durability full, normal, and full with
              its WAL synced by the Python thread instead of the C ones, their runs
              interleaved; full's cycles/s over normal's and over the Python thread's; and
              first the disk's own fdatasync, one and two at a time (benchmarks/disk.py)
  postgres    the PostgreSQL comparison at 16 and 64 agents, side by side: SQLite full and
              normal; PostgreSQL with synchronous_commit on and off behind one, two and three
              servers on one database (the agents split across them); the peer queue
              procrastinate doing fetch and complete in-process on the same cluster (the
              `bench` extra); cycles/s, claim p99, the servers' and PostgreSQL's CPU per
              cycle; then the capacity model drawn from those costs (a throwaway cluster of
              its own; --postgres-figures writes this part for the docs)
  backlog     claim latency with 1,000 vs 100,000 tasks (mostly done) and 100,000 waiting
  ops_queue   GET /ops/queue with 100 vs 100,000 finished tasks (each with its run, 20
              waiting after a failed attempt), on SQLite and on PostgreSQL
  idle        idle long-poll agents, idle event streams and a /metrics scrape: server CPU
  fleet       16 working agents alone, then beside 5,000 waiting long-poll claims and 500 event
              streams: their latency, the crowd's task answered and taken, memory per waiter
              (SQLite; and two servers on one PostgreSQL database)
  core        claim+transition cycles/s in-process, without HTTP, per core implementation

--baseline REV runs the cycle section's rows for the revision REV too (a temporary git
worktree served by this Python), interleaved with this tree's runs (REV, tree, REV, tree, ...),
and prints both with their ratio and the server's CPU per cycle (benchmarks/baseline.py); with
the postgres section also chosen, the same rows on PostgreSQL (one server, `full`) as well.

No figure is asserted: machines are shared and noisy. Each HTTP cycle figure is the median of
three runs (`--rounds`), each on a fresh server and database. The agents are the native load client
(benchmarks/loadgen.c, built with the system's C compiler) where one can be built, else the
Python one; the client measures its own CPU, and the table says when it, not the server, was
the bottleneck.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.cycle import cycle, cycle_rounds, cycle_tasks, median_run, pct
from benchmarks.load import native_client
from benchmarks.seed import measure_claims, measure_ops_queue, seed_database

__all__ = ["SECTIONS", "main", "median_run", "pct", "render"]

SECTIONS = (
    "cycle",
    "mcp",
    "durability",
    "postgres",
    "backlog",
    "ops_queue",
    "idle",
    "fleet",
    "core",
)


def machine() -> dict[str, Any]:
    import apsw
    import granian
    import msgspec

    from nulltickets import __version__, core

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "nulltickets": __version__,
        "core": core.IMPLEMENTATION,
        "sqlite": apsw.sqlite_lib_version(),
        "apsw": apsw.apsw_version(),
        "granian": granian.__version__,
        "msgspec": msgspec.__version__,
        "load_client": "native (C)" if native_client() is not None else "python",
    }


def parse_sections(text: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"unknown section {', '.join(unknown) or '(none)'}; choose from {', '.join(SECTIONS)}"
        )
    return chosen


def cycle_with_baseline(
    work: Path,
    rev: str,
    agents_list: tuple[int, ...],
    tasks_for: Any,
    rounds: int,
    *,
    postgres: bool = False,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The cycle rows, each round of each row run first on `rev` and then on this tree. With
    `postgres`, the same on PostgreSQL too (one server, `full`, a fresh database of one
    throwaway cluster for each run), with the servers' CPU per cycle beside the rates."""
    from benchmarks.baseline import BaselineTree, common_core, compare, core_env
    from nulltickets import core

    this_python = [sys.executable, "-m", "nulltickets"]  # both sides: no NULLTICKETS_BINARY
    print(f"  checking out {rev} and building its core", flush=True)
    with (
        BaselineTree(rev, build_core=core.IMPLEMENTATION == "compiled") as tree,
        ExitStack() as stack,
    ):
        shared = common_core(core.IMPLEMENTATION, tree.core)
        tree.probe(shared)  # the checkout imports from itself
        before_env, after_env = tree.env(shared), core_env(shared)
        info: dict[str, Any] = {"rev": rev, "commit": tree.commit, "core": shared, "rows": []}
        if shared != core.IMPLEMENTATION:
            info["note"] = (
                f"{rev} has no compiled core ({tree.build_note}): both sides ran the "
                "interpreted core."
            )
        elif tree.build_note:
            info["note"] = f"{rev}'s compiled core: {tree.build_note}."

        def sqlite_run(env: dict[str, str], agents: int, tasks: int) -> dict[str, Any]:
            return cycle(work, agents, tasks, "normal", env=env, cmd=this_python)

        sides: list[tuple[str, Any]] = [("sqlite", sqlite_run)]
        if postgres:
            from benchmarks.cycle import measure
            from benchmarks.harness import BenchServer
            from benchmarks.pgcluster import PostgresUnavailable, start_postgres

            try:
                cluster = stack.enter_context(closing_cluster(start_postgres()))
            except PostgresUnavailable as exc:
                info["postgres_error"] = str(exc)
            else:

                def postgres_run(env: dict[str, str], agents: int, tasks: int) -> dict[str, Any]:
                    with cluster.database() as name:
                        dsn = cluster.dsn(name)
                        log = work / f"baseline-pg-{dsn[-8:]}.log"
                        with BenchServer(
                            dsn, durability="full", log=log, env=env, cmd=this_python
                        ) as s:
                            m = measure([s], agents, tasks, postgres_cpu=cluster.cpu_s)
                    return {"engine": "postgresql", "durability": "full", **m}

                sides.append(("postgresql", postgres_run))
        rows = []
        for engine, run in sides:
            for agents in agents_list:
                before, after = [], []
                for _ in range(rounds):
                    tasks = tasks_for(agents)
                    before.append(run(before_env, agents, tasks))
                    after.append(run(after_env, agents, tasks))
                row = median_run(after)
                if engine == "sqlite":
                    rows.append(row)
                info["rows"].append({"engine": engine, **compare(median_run(before), row)})
                c = info["rows"][-1]
                print(
                    f"  {engine} {agents:>3} agents: {c['before_cycles_per_s']:>8.0f} cycles/s "
                    f"at {rev}, {c['after_cycles_per_s']:>8.0f} here (ratio {c['ratio']}); "
                    f"server CPU {c['before_server_cpu_ms']} -> {c['after_server_cpu_ms']} "
                    "ms/cycle",
                    flush=True,
                )
    return rows, info


def ops_queue_at(
    sizes: tuple[int, int],
    calls: int,
    seeded: Callable[[int], Path | str],
    log: Callable[[int], Path | None] = lambda n: None,
) -> dict[str, Any]:
    """GET /ops/queue's p50 on `seeded(n)` (a database with n finished tasks, each with its run,
    and 20 waiting after a failed attempt) for each size, and the second's over the first's."""
    ops: dict[str, Any] = {}
    for n in sizes:
        ops[str(n)] = measure_ops_queue(seeded(n), calls, log=log(n))
    ops["ratio"] = round(ops[str(sizes[1])]["p50_ms"] / ops[str(sizes[0])]["p50_ms"], 2)
    return ops


def ops_queue_postgres(work: Path, sizes: tuple[int, int], calls: int) -> dict[str, Any]:
    """ops_queue_at on PostgreSQL, the same databases as SQLite's (each in a throwaway cluster's
    database), or why it was not measured."""
    from benchmarks.pgcluster import PostgresUnavailable, start_postgres

    try:
        import psycopg

        cluster = start_postgres()
    except (ImportError, PostgresUnavailable) as exc:
        return {"error": str(exc)}

    def seeded(n: int) -> str:
        dsn = cluster.dsn(cluster.create_database())
        seed_database(dsn, done=n, waiting=20, history=True)
        # What autovacuum leaves within its first minute: the runs' dead versions (each was
        # written running, then ended) gone from the indexes, and the planner's statistics.
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("VACUUM ANALYZE")
        return dsn

    with closing_cluster(cluster):
        return ops_queue_at(sizes, calls, seeded, log=lambda n: work / f"ops-pg-{n}.log")


@contextlib.contextmanager
def closing_cluster(cluster: Any) -> Iterator[Any]:
    try:
        yield cluster
    finally:
        cluster.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run in seconds")
    p.add_argument("--out", default="bench-results.json", help="JSON results file")
    p.add_argument("--markdown", default=None, help="also write the table as Markdown here")
    p.add_argument(
        "--rounds", type=int, default=None, help="runs per HTTP cycle figure (3; quick: 1)"
    )
    p.add_argument(
        "--sections",
        type=parse_sections,
        default=list(SECTIONS),
        help=f"comma-separated sections to run (default all: {','.join(SECTIONS)})",
    )
    p.add_argument(
        "--postgres-figures",
        metavar="FILE",
        default=None,
        help="write the postgres section's table and capacity model to FILE as Markdown "
        "(the docs include benchmarks/results/postgresql.md)",
    )
    p.add_argument(
        "--baseline",
        metavar="REV",
        default=None,
        help="also run the SQLite cycle rows of git revision REV, interleaved with this tree's",
    )
    args = p.parse_args(argv)

    quick = args.quick
    sections: list[str] = args.sections
    if args.baseline and "cycle" not in sections:
        sections = ["cycle", *sections]
    rounds = max(1, args.rounds or (1 if quick else 3))
    agents_list = (1, 4) if quick else (1, 4, 16, 64)

    def tasks_for(agents: int) -> int:
        return cycle_tasks(agents, quick)

    big = 2_000 if quick else 100_000
    small = 100 if quick else 1_000
    results: dict[str, Any] = {
        "machine": machine(),
        "quick": quick,
        "rounds": rounds,
        "sections": sections,
        "started": time.time(),
    }

    with tempfile.TemporaryDirectory(prefix="nulltickets-bench-") as tmp:
        work = Path(tmp)
        if "cycle" in sections:
            print("HTTP agent cycle (claim -> event -> transition), durability normal", flush=True)
            if args.baseline:
                from benchmarks.baseline import BaselineError

                try:
                    results["cycle"], results["baseline"] = cycle_with_baseline(
                        work,
                        args.baseline,
                        agents_list,
                        tasks_for,
                        rounds,
                        postgres="postgres" in sections,
                    )
                except BaselineError as exc:  # no git, no such revision: the rest still runs
                    print(f"  no comparison with {args.baseline}: {exc}", flush=True)
                    results["baseline"] = {"rev": args.baseline, "error": str(exc)}
            if "cycle" not in results:
                results["cycle"] = []
                for agents in agents_list:
                    r = cycle_rounds(work, agents, tasks_for(agents), "normal", rounds)
                    results["cycle"].append(r)
                    print(f"  {agents:>3} agents: {r['cycles_per_s']:>8.0f} cycles/s", flush=True)

        if "mcp" in sections:
            print("Claim -> checkpoint -> transition through /mcp and the HTTP API", flush=True)
            from benchmarks.mcp import mcp_rows, mcp_tasks

            results["mcp"], results["mcp_ratio"] = mcp_rows(
                work, (1,) if quick else (1, 4), lambda agents: mcp_tasks(agents, quick), rounds
            )

        if "durability" in sections:
            print(
                "Durability full, normal and full on the Python sync thread, interleaved runs",
                flush=True,
            )
            from benchmarks.disk import describe, sync_floor

            results["disk_sync"] = sync_floor(work, 200 if quick else 1_000)
            print(f"  {describe(results['disk_sync'])}", flush=True)
            results["durability"], results["durability_ratio"] = durability_rows(
                work, (4,) if quick else (16, 64), tasks_for, rounds
            )

        if "postgres" in sections:
            print(
                "PostgreSQL beside SQLite: synchronous_commit on and off, 1 to 3 servers, "
                "and a peer",
                flush=True,
            )
            from benchmarks.postgres import postgres_section

            results["postgres"] = postgres_section(
                work,
                (4,) if quick else (16, 64),
                100 if quick else 500,
                rounds,
                adapt=not quick,
                floor_statements=200 if quick else 2_000,
                quick=quick,
            )
            results["machine"]["postgresql"] = results["postgres"]["postgresql"]

        if "backlog" in sections:
            print("Backlog scaling", flush=True)
            claims = 40 if quick else 300
            ready = claims + 50  # enough ready tasks for every measured claim
            scenarios = {  # (finished, waiting)
                f"{small}_total": (small - ready, ready),
                f"{big}_mostly_done": (big - ready, ready),
                f"{big}_waiting": (0, big),
            }
            backlog: dict[str, Any] = {}
            for name, (done, waiting) in scenarios.items():
                db = work / f"backlog-{name}.db"
                seed_database(db, done=done, waiting=waiting)
                backlog[name] = measure_claims(db, claims=claims)
            base = backlog[f"{small}_total"]["claim_p50_ms"]
            backlog["ratio_mostly_done"] = round(
                backlog[f"{big}_mostly_done"]["claim_p50_ms"] / base, 2
            )
            backlog["ratio_waiting"] = round(backlog[f"{big}_waiting"]["claim_p50_ms"] / base, 2)
            results["backlog"] = backlog

        if "ops_queue" in sections:
            print("/ops/queue", flush=True)
            calls = 20 if quick else 200

            def seeded(n: int) -> Path:
                db = work / f"ops-{n}.db"
                seed_database(db, done=n, waiting=20, history=True)
                return db

            results["ops_queue"] = ops_queue_at((100, big), calls, seeded)
            results["ops_queue_postgres"] = ops_queue_postgres(work, (100, big), calls)

        if "idle" in sections:
            print("Idle long-poll agents", flush=True)
            from benchmarks.idle import idle_long_poll

            results["idle_long_poll"] = idle_long_poll(
                work, agents=50 if quick else 200, seconds=3.0 if quick else 10.0
            )

            print("Idle event streams, and a /metrics scrape", flush=True)
            from benchmarks.live import idle_sse, metrics_cost

            results["idle_sse"] = idle_sse(
                work, clients=50 if quick else 200, seconds=3.0 if quick else 10.0
            )
            results["metrics"] = metrics_cost(
                work, calls=20 if quick else 200, done=1000 if quick else big
            )

        if "fleet" in sections:
            print("A fleet: working agents beside thousands of waiting ones", flush=True)
            from benchmarks.fleet import fleet_rows

            results["fleet"] = fleet_rows(work, quick)

        if "core" in sections:
            print("Core, in-process", flush=True)
            from benchmarks.core import core_cycles

            results["core"] = core_cycles(work, cycles=500 if quick else 5000)

    results["finished"] = time.time()
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    table = render(results)
    print()
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    if args.postgres_figures and "postgres" in results:
        from benchmarks.postgres import figures

        command = "python -m benchmarks --sections postgres"
        Path(args.postgres_figures).write_text(
            figures(results["postgres"], results["machine"], rounds, command)
        )
        print(f"the postgres section's figures written to {args.postgres_figures}")
    print(f"\nresults written to {args.out}")
    return 0


# The same `full` with the WAL synced by the Python thread instead of the C ones: what
# cext/walsync.c buys (the same Python thread where it is not built, then a ratio near 1).
PYTHON_SYNC = {"NULLTICKETS_WAL_SYNC": "python"}


def durability_rows(
    work: Path, agents_list: tuple[int, ...], tasks_for: Any, rounds: int
) -> tuple[dict[str, dict[str, Any]], list[dict[str, Any]]]:
    """The cycle with `full`, with `normal`, and with `full` on the Python sync thread at each
    number of agents, their runs alternating (full, normal, full-python, full, ...) so that the
    machine's drift falls on all alike; the rows (by "AGENTS/DURABILITY") and, per number of
    agents, full's cycles/s over normal's and over the Python sync thread's."""
    rows: dict[str, dict[str, Any]] = {}
    ratios = []
    for agents in agents_list:
        runs: dict[str, list[dict[str, Any]]] = {"full": [], "normal": [], "full-python": []}
        for _ in range(rounds):
            for variant in runs:
                durability, _, sync = variant.partition("-")
                env = PYTHON_SYNC if sync else None
                run = cycle(work, agents, tasks_for(agents), durability, env=env)
                if sync:
                    run["wal_sync"] = sync
                runs[variant].append(run)
        for variant, done in runs.items():
            rows[f"{agents}/{variant}"] = median_run(done)
        full, normal = rows[f"{agents}/full"], rows[f"{agents}/normal"]
        python = rows[f"{agents}/full-python"]
        ratio = round(full["cycles_per_s"] / normal["cycles_per_s"], 3)
        over_python = round(full["cycles_per_s"] / python["cycles_per_s"], 3)
        steal = [r["host"]["steal"] for done in runs.values() for r in done if r.get("host")]
        ratios.append(
            {
                "agents": agents,
                "full_cycles_per_s": full["cycles_per_s"],
                "normal_cycles_per_s": normal["cycles_per_s"],
                "full_python_sync_cycles_per_s": python["cycles_per_s"],
                "full_over_normal": ratio,
                "full_over_python_sync": over_python,
                "full_claim_p99_ms": full["latency_ms"]["claim"]["p99"],
                # Where full's time goes: a request's mean latency with each, the server's
                # mean WAL sync and each batch's mean wait for one (from its COMMIT).
                "normal_request_mean_ms": normal["request_mean_ms"],
                "full_request_mean_ms": full["request_mean_ms"],
                "full_wal_sync_ms_mean": full.get("wal_sync_ms_mean"),
                "full_durable_wait_ms_mean": full.get("durable_wait_ms_mean"),
                "host_steal_max": max(steal) if steal else None,
            }
        )
        print(
            f"  {agents:>3} agents: full {full['cycles_per_s']:>8.0f}, normal "
            f"{normal['cycles_per_s']:>8.0f}, full on the Python sync thread "
            f"{python['cycles_per_s']:>8.0f} cycles/s (full/normal {ratio}, full/Python sync "
            f"{over_python}), full claim p99 {full['latency_ms']['claim']['p99']:.2f} ms",
            flush=True,
        )
        print(f"      {where_time_goes(ratios[-1])}", flush=True)
    return rows, ratios


def where_time_goes(x: dict[str, Any]) -> str:
    """One line on what `full` adds to a request, from the runs of one number of agents."""
    line = (
        f"a request takes {x['normal_request_mean_ms']:.2f} ms on average with normal, "
        f"{x['full_request_mean_ms']:.2f} ms with full"
    )
    if x.get("full_durable_wait_ms_mean") is not None:
        line += (
            f", of which {x['full_durable_wait_ms_mean']:.2f} ms waiting from its COMMIT for a "
            f"WAL sync ({x['full_wal_sync_ms_mean']:.2f} ms the sync itself)"
        )
    if x.get("host_steal_max") is not None:
        line += f"; CPU steal up to {x['host_steal_max']:.0%} during the runs"
    # full/normal = normal's time / full's, so 0.90 allows full a ninth of normal's time more.
    line += (
        f"; for full/normal 0.90, full may add at most {x['normal_request_mean_ms'] / 9:.2f} ms "
        "to a request"
    )
    return line


def cycle_row(c: dict[str, Any]) -> str:
    """One row of the cycle table: a measured run, or what kept it from being measured."""
    engine = c.get("engine", "sqlite")
    durability = c.get("durability", "normal")
    if c.get("wal_sync") == "python":
        durability += " (Python sync thread)"
    head = f"| {engine} | {c.get('servers', 1)} | {c['agents']} | {durability} |"
    if "not_measured" in c:
        return f"{head} not measured: {c['not_measured']} |" + " |" * 8
    lat = c["latency_ms"]
    bound = " (client-bound)" if c["client_bound"] else ""
    return (
        f"{head} {c['cycles_per_s']:.0f}{bound} | "
        f"{c['requests_per_s']:.0f} | {lat['claim']['p50']:.2f} / {lat['claim']['p99']:.2f} | "
        f"{lat['event']['p99']:.2f} | {lat['transition']['p99']:.2f} | "
        f"{c['server_cpu_cores']:.2f} | {c['client_cpu_cores']:.2f} | "
        f"{c['server_peak_rss_mb']:.0f} | {'yes' if c['completed_exactly_once'] else 'NO'} |"
    )


def render(r: dict[str, Any]) -> str:
    m = r["machine"]
    postgres = f", PostgreSQL {m['postgresql']}" if m.get("postgresql") else ""
    lines = [
        f"nulltickets {m['nulltickets']} (core: {m['core']}), Python {m['python']}, "
        f"SQLite {m['sqlite']}{postgres}, granian {m['granian']}, {m['cpus']} CPUs, "
        f"{m['machine']}, load client {m.get('load_client', 'python')}",
    ]
    rows = [*r.get("cycle", []), *r.get("durability", {}).values()]
    if rows:
        lines += [
            "",
            "| engine | servers | agents | durability | cycles/s | req/s | claim p50/p99 ms | "
            "event p99 ms | transition p99 ms | server CPU | client CPU | peak RSS MB | "
            "exactly once |",
            "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            *(cycle_row(c) for c in rows),
        ]
        rounds = r.get("rounds", 1)
        lines.append(
            f"\nEach row is the median of {rounds} runs (a fresh server and database each); "
            "every run's cycles/s is in the JSON."
            if rounds > 1
            else "\nEach row is one run (a fresh server and database)."
        )
    if r.get("durability_ratio"):
        lines.append(
            "\nfull over normal (interleaved runs): "
            + ", ".join(
                f"{x['agents']} agents {x['full_over_normal']}" for x in r["durability_ratio"]
            )
        )
        lines += [
            f"{x['agents']} agents: {where_time_goes(x)}"
            for x in r["durability_ratio"]
            if "full_request_mean_ms" in x
        ]
        if "disk_sync" in r:
            from benchmarks.disk import describe

            lines.append(describe(r["disk_sync"]))
        if all("full_over_python_sync" in x for x in r["durability_ratio"]):
            lines.append(
                "full with the C sync threads over full with the Python one: "
                + ", ".join(
                    f"{x['agents']} agents {x['full_over_python_sync']}"
                    for x in r["durability_ratio"]
                )
            )
    if "postgres" in r:
        from benchmarks.postgres import render as render_postgres

        lines += render_postgres(r["postgres"], r.get("rounds", 1))
    if "baseline" in r:
        from benchmarks.baseline import render as render_baseline

        lines += ["", *render_baseline(r["baseline"])]
    if "mcp" in r:
        from benchmarks.mcp import render as render_mcp

        lines += render_mcp(r["mcp"], r.get("mcp_ratio", []))
    if "backlog" in r:
        b = r["backlog"]
        claims = {k: v for k, v in b.items() if isinstance(v, dict)}
        lines += ["", "| backlog | claim p50 ms | claim p95 ms |", "|---|---:|---:|"]
        lines += [
            f"| {k} | {v['claim_p50_ms']:.2f} | {v['claim_p95_ms']:.2f} |"
            for k, v in claims.items()
        ]
        lines.append(
            f"\nBacklog ratio (mostly done / small): {b['ratio_mostly_done']}; "
            f"(all waiting / small): {b['ratio_waiting']}"
        )
    for key, engine in (("ops_queue", "SQLite"), ("ops_queue_postgres", "PostgreSQL")):
        if key not in r:
            continue
        o = r[key]
        if "error" in o:
            lines.append(f"/ops/queue on {engine}: not measured ({o['error']})")
            continue
        sizes = [k for k in o if k != "ratio"]
        lines.append(
            f"/ops/queue p50 on {engine}: "
            + ", ".join(f"{k} finished tasks {o[k]['p50_ms']:.2f} ms" for k in sizes)
            + f" (ratio {o['ratio']})"
        )
    if "idle_long_poll" in r:
        idle = r["idle_long_poll"]
        lines.append(
            f"{idle['agents']} agents long-polling an empty queue: server CPU "
            f"{idle['server_cpu_percent_of_one_core']:.2f}% of one core over {idle['seconds']} s"
        )
    if "idle_sse" in r:
        sse = r["idle_sse"]
        lines.append(
            f"{sse['clients']} idle event streams (GET /events/stream): server CPU "
            f"{sse['server_cpu_percent_of_one_core']:.2f}% of one core over {sse['seconds']} s"
        )
    if "metrics" in r:
        mc = r["metrics"]
        lines.append(
            f"GET /metrics p50: {mc['p50_ms']:.2f} ms with {mc['finished_tasks']} finished tasks "
            f"({mc['bytes']} bytes)"
        )
    if "fleet" in r:
        from benchmarks.fleet import render as render_fleet

        lines += render_fleet(r["fleet"])
    if "core" in r:
        core = r["core"]
        lines.append(
            "Core in-process claim+event+transition: "
            + ", ".join(f"{k} {v:.0f} cycles/s" for k, v in core["cycles_per_s"].items())
            + (f" (compiled/python {core['ratio']})" if core.get("ratio") else "")
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
