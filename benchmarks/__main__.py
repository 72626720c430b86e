"""`python -m benchmarks`: every figure of the claim-throughput benchmark, as a table and JSON.

Sections:
  cycle       HTTP agent cycle (claim -> event -> transition) at 1, 4, 16 and 64 agents
  durability  the same cycle at 16 agents with synchronous=FULL and NORMAL
  backlog     claim latency with 1,000 vs 100,000 tasks (mostly done) and 100,000 waiting
  ops_queue   GET /ops/queue with 100 vs 100,000 finished tasks
  core        claim+transition cycles/s in-process, without HTTP, per core implementation

No figure is asserted: machines are shared and noisy. Each HTTP cycle figure is the median of
three runs (`--rounds`), each on a fresh server and database. The agents are the native load client
(benchmarks/loadgen.c, built with the system's C compiler) where one can be built, else the
Python one; the client measures its own CPU, and the table says when it, not the server, was
the bottleneck.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import BenchServer, bulk_load, create_pipeline
from benchmarks.load import ENDPOINTS, native_client, run_agents
from benchmarks.seed import measure_claims, measure_ops_queue, seed_database


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


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


def cycle(workdir: Path, agents: int, tasks: int, durability: str) -> dict[str, Any]:
    db = workdir / f"cycle-{agents}-{durability}.db"
    with BenchServer(db, durability=durability) as server:
        pipeline = create_pipeline(server)
        ids = bulk_load(server, pipeline, tasks)
        cpu0 = server.cpu_s()
        report, wall = run_agents(server.port, agents, "worker", "complete", processes=4)
        server_cpu = server.cpu_s() - cpu0
        peak = server.peak_rss_mb()
    completed = report.completed
    requests = sum(len(report.latencies[e]) for e in ENDPOINTS)
    cpus = os.cpu_count() or 1
    client_cores = report.cpu_s / wall
    result = {
        "agents": agents,
        "durability": durability,
        "tasks": tasks,
        "seconds": round(wall, 3),
        "cycles_per_s": round(len(completed) / wall, 1),
        "requests_per_s": round(requests / wall, 1),
        "latency_ms": {
            e: {
                q: round(pct(report.latencies[e], v), 3)
                for q, v in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
            }
            for e in ENDPOINTS
        },
        "completed_exactly_once": sorted(completed) == sorted(ids),
        "errors": report.errors,
        "server_cpu_cores": round(server_cpu / wall, 2),
        "client_cpu_cores": round(client_cores, 2),
        "client_bound": client_cores > 0.5 * cpus,
        "server_peak_rss_mb": round(peak, 1),
    }
    return result


def cycle_rounds(
    workdir: Path, agents: int, tasks: int, durability: str, rounds: int
) -> dict[str, Any]:
    """`rounds` runs of the cycle, each on a fresh server and database. The figures are those
    of the median run (by cycles/s): a shared machine's speed drifts by several percent from
    one run to the next. Every run's cycles/s is kept, and every run must complete each task
    exactly once."""
    return median_run([cycle(workdir, agents, tasks, durability) for _ in range(rounds)])


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median cycles/s, carrying every run's cycles/s, whether all of them
    completed each task exactly once, and the highest peak memory of any."""
    ordered = sorted(runs, key=lambda r: r["cycles_per_s"])
    result = dict(ordered[(len(ordered) - 1) // 2])  # the lower median when even
    result["rounds_cycles_per_s"] = [r["cycles_per_s"] for r in runs]
    result["completed_exactly_once"] = all(r["completed_exactly_once"] for r in runs)
    result["server_peak_rss_mb"] = max(r["server_peak_rss_mb"] for r in runs)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run in seconds")
    p.add_argument("--out", default="bench-results.json", help="JSON results file")
    p.add_argument("--markdown", default=None, help="also write the table as Markdown here")
    p.add_argument(
        "--rounds", type=int, default=None, help="runs per HTTP cycle figure (3; quick: 1)"
    )
    args = p.parse_args(argv)

    quick = args.quick
    rounds = max(1, args.rounds or (1 if quick else 3))
    agents_list = (1, 4) if quick else (1, 4, 16, 64)

    def tasks_for(agents: int) -> int:
        """Enough tasks for several seconds of load at each concurrency."""
        return max(agents * 20, 200) if quick else min(20_000, max(3_000, agents * 1_500))

    big = 2_000 if quick else 100_000
    small = 100 if quick else 1_000
    results: dict[str, Any] = {
        "machine": machine(),
        "quick": quick,
        "rounds": rounds,
        "started": time.time(),
    }

    with tempfile.TemporaryDirectory(prefix="nulltickets-bench-") as tmp:
        work = Path(tmp)
        print("HTTP agent cycle (claim -> event -> transition), durability normal", flush=True)
        results["cycle"] = []
        for agents in agents_list:
            r = cycle_rounds(work, agents, tasks_for(agents), "normal", rounds)
            results["cycle"].append(r)
            print(f"  {agents:>3} agents: {r['cycles_per_s']:>8.0f} cycles/s", flush=True)

        print("Durability", flush=True)
        dur_agents = 4 if quick else 16
        results["durability"] = {
            d: cycle_rounds(work, dur_agents, tasks_for(dur_agents), d, rounds)
            for d in ("full", "normal")
        }

        print("Backlog scaling", flush=True)
        claims = 40 if quick else 300
        ready = claims + 50  # enough ready tasks for every measured claim
        scenarios = {
            f"{small}_total": dict(done=small - ready, waiting=ready),
            f"{big}_mostly_done": dict(done=big - ready, waiting=ready),
            f"{big}_waiting": dict(done=0, waiting=big),
        }
        backlog: dict[str, Any] = {}
        for name, shape in scenarios.items():
            db = work / f"backlog-{name}.db"
            seed_database(db, **shape)
            backlog[name] = measure_claims(db, claims=claims)
        base = backlog[f"{small}_total"]["claim_p50_ms"]
        backlog["ratio_mostly_done"] = round(
            backlog[f"{big}_mostly_done"]["claim_p50_ms"] / base, 2
        )
        backlog["ratio_waiting"] = round(backlog[f"{big}_waiting"]["claim_p50_ms"] / base, 2)
        results["backlog"] = backlog

        print("/ops/queue", flush=True)
        ops: dict[str, Any] = {}
        for n in (100, big):
            db = work / f"ops-{n}.db"
            seed_database(db, done=n, waiting=20)
            ops[str(n)] = measure_ops_queue(db, calls=20 if quick else 200)
        ops["ratio"] = round(ops[str(big)]["p50_ms"] / ops["100"]["p50_ms"], 2)
        results["ops_queue"] = ops

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
    print(f"\nresults written to {args.out}")
    return 0


def render(r: dict[str, Any]) -> str:
    m = r["machine"]
    lines = [
        f"nulltickets {m['nulltickets']} (core: {m['core']}), Python {m['python']}, "
        f"SQLite {m['sqlite']}, granian {m['granian']}, {m['cpus']} CPUs, {m['machine']}, "
        f"load client {m.get('load_client', 'python')}",
        "",
        "| agents | durability | cycles/s | req/s | claim p50/p99 ms | event p99 ms | "
        "transition p99 ms | server CPU | client CPU | peak RSS MB | exactly once |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    rounds = r.get("rounds", 1)
    note = (
        f"Each row is the median of {rounds} runs (a fresh server and database each); "
        "every run's cycles/s is in the JSON."
        if rounds > 1
        else "Each row is one run (a fresh server and database)."
    )
    rows = [*r["cycle"], *r["durability"].values()]
    for c in rows:
        lat = c["latency_ms"]
        bound = " (client-bound)" if c["client_bound"] else ""
        lines.append(
            f"| {c['agents']} | {c['durability']} | {c['cycles_per_s']:.0f}{bound} | "
            f"{c['requests_per_s']:.0f} | {lat['claim']['p50']:.2f} / {lat['claim']['p99']:.2f} | "
            f"{lat['event']['p99']:.2f} | {lat['transition']['p99']:.2f} | "
            f"{c['server_cpu_cores']:.2f} | {c['client_cpu_cores']:.2f} | "
            f"{c['server_peak_rss_mb']:.0f} | {'yes' if c['completed_exactly_once'] else 'NO'} |"
        )
    lines.append(f"\n{note}")
    b = r["backlog"]
    claims = {k: v for k, v in b.items() if isinstance(v, dict)}
    lines += ["", "| backlog | claim p50 ms | claim p95 ms |", "|---|---:|---:|"]
    lines += [
        f"| {k} | {v['claim_p50_ms']:.2f} | {v['claim_p95_ms']:.2f} |" for k, v in claims.items()
    ]
    lines.append(
        f"\nBacklog ratio (mostly done / small): {b['ratio_mostly_done']}; "
        f"(all waiting / small): {b['ratio_waiting']}"
    )
    o = r["ops_queue"]
    sizes = [k for k in o if k != "ratio"]
    lines.append(
        "/ops/queue p50: "
        + ", ".join(f"{k} finished tasks {o[k]['p50_ms']:.2f} ms" for k in sizes)
        + f" (ratio {o['ratio']})"
    )
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
        m = r["metrics"]
        lines.append(
            f"GET /metrics p50: {m['p50_ms']:.2f} ms with {m['finished_tasks']} finished tasks "
            f"({m['bytes']} bytes)"
        )
    core = r["core"]
    lines.append(
        "Core in-process claim+event+transition: "
        + ", ".join(f"{k} {v:.0f} cycles/s" for k, v in core["cycles_per_s"].items())
        + (f" (compiled/python {core['ratio']})" if core.get("ratio") else "")
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
