"""The agent cycle through `/mcp` beside the same cycle over the plain HTTP API: claim ->
checkpoint -> transition, on one server each (SQLite, durability normal, a token and one agent
key per agent, as agents on MCP run).

Both sides are Python agents in this process, on one asyncio loop, over the same HTTP client
library (httpx2, which the MCP SDK's Streamable HTTP transport uses), one keep-alive client per
agent:
  http  POST /leases/claim, PUT /runs/{id}/checkpoint, POST /runs/{id}/transition, the lease
        token as the bearer of the last two;
  mcp   one long-lived `mcp.Client` per agent (connected and its tools listed before the
        measured stretch), calling claim_task, save_checkpoint and transition_task; the
        session holds the lease, so no token passes through the agent.
The runs of the two alternate (http, mcp, http, mcp, ...) so that the machine's drift falls on
both alike. The figure that compares them is the server's CPU per cycle; cycles/s and latency
depend on the client too, which on MCP is a protocol stack of its own (its CPU per cycle is
beside it).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import urllib.error
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.cycle import median_run, pct
from benchmarks.harness import BenchServer, bulk_load, create_pipeline

STEPS = ("claim", "checkpoint", "transition")
SURFACES = ("http", "mcp")
ROLE = "worker"
CHECKPOINT = {"step": 1, "notes": "parsed the input"}


@dataclass
class Tally:
    """What the agents of one run saw: each step's latencies (s), the tasks they completed,
    their unexpected answers by kind, and the MCP protocol versions their sessions spoke."""

    latencies: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STEPS})
    completed: list[str] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    protocols: set[str] = field(default_factory=set)

    def error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


async def http_agent(
    base: str, key: str, name: str, ready: asyncio.Event, start: asyncio.Event, tally: Tally
) -> None:
    """Cycles over the HTTP API until a claim finds nothing."""
    import httpx2

    claim_body = {"agent_id": name, "agent_role": ROLE}
    bearer = {"Authorization": f"Bearer {key}"}
    lat, clock = tally.latencies, time.perf_counter
    async with httpx2.AsyncClient(base_url=base, timeout=60) as http:
        await http.get("/health")  # the connection is open before the measured stretch
        ready.set()
        await start.wait()
        while True:
            t0 = clock()
            r = await http.post("/leases/claim", json=claim_body, headers=bearer)
            t1 = clock()
            lat["claim"].append(t1 - t0)
            if r.status_code == 204:
                return
            if r.status_code != 200:
                tally.error(f"claim {r.status_code}")
                continue
            claimed = r.json()
            run = claimed["run"]["id"]
            lease = {"Authorization": f"Bearer {claimed['lease_token']}"}
            body = {"checkpoint": CHECKPOINT}
            r = await http.put(f"/runs/{run}/checkpoint", json=body, headers=lease)
            t2 = clock()
            lat["checkpoint"].append(t2 - t1)
            if r.status_code != 200:
                tally.error(f"checkpoint {r.status_code}")
            r = await http.post(
                f"/runs/{run}/transition", json={"trigger": "complete"}, headers=lease
            )
            lat["transition"].append(clock() - t2)
            if r.status_code == 200:
                tally.completed.append(claimed["task"]["id"])
            else:
                tally.error(f"transition {r.status_code}")


async def mcp_agent(
    base: str, key: str, name: str, ready: asyncio.Event, start: asyncio.Event, tally: Tally
) -> None:
    """Cycles through /mcp on one long-lived session until claim_task answers nothing came."""
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    lat, clock = tally.latencies, time.perf_counter
    bearer = {"Authorization": f"Bearer {key}"}
    async with (
        httpx2.AsyncClient(headers=bearer, timeout=60) as http,
        Client(streamable_http_client(f"{base}/mcp", http_client=http)) as client,
    ):
        tally.protocols.add(client.protocol_version)
        await client.list_tools()  # as an agent does before it calls any
        ready.set()
        await start.wait()
        while True:
            t0 = clock()
            r = await client.call_tool("claim_task", {"role": ROLE})
            t1 = clock()
            lat["claim"].append(t1 - t0)
            claimed = r.structured_content or {}
            if r.is_error:
                tally.error(f"claim {claimed.get('error', {}).get('code')}")
                continue
            if not claimed.get("claimed"):
                return
            r = await client.call_tool("save_checkpoint", {"checkpoint": CHECKPOINT})
            t2 = clock()
            lat["checkpoint"].append(t2 - t1)
            if r.is_error:
                tally.error("checkpoint error")
            r = await client.call_tool("transition_task", {"trigger": "complete"})
            lat["transition"].append(clock() - t2)
            if r.is_error:
                tally.error("transition error")
            else:
                tally.completed.append(claimed["task"]["id"])


AGENTS = {"http": http_agent, "mcp": mcp_agent}


async def _run(
    server: BenchServer, surface: str, keys: list[str]
) -> tuple[Tally, dict[str, float]]:
    """The agents connect (and on MCP list the tools), then work through the queue together;
    the tally and the measured stretch's wall time and CPU (server's, this process's)."""
    base = f"http://127.0.0.1:{server.port}"
    tally, start = Tally(), asyncio.Event()
    readies = [asyncio.Event() for _ in keys]
    running = [
        asyncio.create_task(AGENTS[surface](base, key, f"{surface}-{i}", ready, start, tally))
        for i, (key, ready) in enumerate(zip(keys, readies, strict=True))
    ]
    connected = asyncio.ensure_future(asyncio.gather(*(r.wait() for r in readies)))
    watched: list[asyncio.Future[Any]] = [connected, *running]
    await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
    if not connected.done():  # an agent ended (failed) before all were connected
        connected.cancel()
        start.set()
        await asyncio.gather(*running)
        raise RuntimeError(f"{surface} agents ended before the run began")
    cpu0, client0, t0 = server.cpu_s(), time.process_time(), time.perf_counter()
    start.set()
    await asyncio.gather(*running)
    spent = {
        "seconds": time.perf_counter() - t0,
        "server_cpu_s": server.cpu_s() - cpu0,
        "client_cpu_s": time.process_time() - client0,
    }
    return tally, spent


def warm_up(server: BenchServer) -> None:
    """One request to /mcp before the agents connect: the server loads the MCP SDK on first use
    (seconds on a busy machine), which is no part of a cycle, and a client whose discovery
    outlasts its own timeout (10 s) falls back to the older protocol era."""
    # Any answer, even a refusal of this bare request, means the SDK is loaded.
    with contextlib.suppress(urllib.error.HTTPError):
        server.post("/mcp", {"jsonrpc": "2.0", "id": 0, "method": "ping"})


def cycle(work: Path, surface: str, agents: int, tasks: int) -> dict[str, Any]:
    """One run of `agents` agents through `tasks` tasks on `surface`, on a fresh server."""
    db = work / f"mcp-{surface}-{agents}-{uuid.uuid4().hex[:8]}.db"
    with BenchServer(db, token=secrets.token_urlsafe(24)) as server:
        pipeline = create_pipeline(server, ROLE)
        keys = [
            server.post("/keys", {"name": f"agent-{i}", "access": "agent", "roles": [ROLE]})["key"]
            for i in range(agents)
        ]
        ids = bulk_load(server, pipeline, tasks)
        if surface == "mcp":
            warm_up(server)
        tally, spent = asyncio.run(_run(server, surface, keys))
        peak = server.peak_rss_mb()
    wall, cycles = spent["seconds"], len(tally.completed)
    row: dict[str, Any] = {
        "surface": surface,
        "agents": agents,
        "tasks": tasks,
        "seconds": round(wall, 3),
        "cycles_per_s": round(cycles / wall, 1),
        "latency_ms": {
            s: {
                q: round(pct(tally.latencies[s], v), 3)
                for q, v in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
            }
            for s in STEPS
        },
        "server_cpu_ms_per_cycle": round(spent["server_cpu_s"] / max(cycles, 1) * 1000, 3),
        "client_cpu_ms_per_cycle": round(spent["client_cpu_s"] / max(cycles, 1) * 1000, 3),
        "server_cpu_cores": round(spent["server_cpu_s"] / wall, 2),
        "client_cpu_cores": round(spent["client_cpu_s"] / wall, 2),
        # One Python process drives the agents: past most of one core, it is the bottleneck.
        "client_bound": spent["client_cpu_s"] / wall > 0.8,
        "server_peak_rss_mb": round(peak, 1),
        "completed_exactly_once": sorted(tally.completed) == sorted(ids),
        "errors": tally.errors,
    }
    if tally.protocols:
        row["protocol"] = ", ".join(sorted(tally.protocols))
    return row


def mcp_tasks(agents: int, quick: bool) -> int:
    """Tasks for a few seconds of the slower surface at each number of agents."""
    return 60 * agents if quick else max(1_000, 500 * agents)


def mcp_rows(
    work: Path, agents_list: tuple[int, ...], tasks_for: Callable[[int], int], rounds: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """For each number of agents, `rounds` runs of each surface, alternating; the median run of
    each (by cycles/s), and per number of agents what a cycle through /mcp costs the server
    over one through the HTTP API."""
    rows, ratios = [], []
    for agents in agents_list:
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SURFACES}
        for _ in range(rounds):
            for surface in SURFACES:
                runs[surface].append(cycle(work, surface, agents, tasks_for(agents)))
        http, mcp = (median_run(runs[s]) for s in SURFACES)
        rows += [http, mcp]
        ratios.append(
            {
                "agents": agents,
                "server_cpu_mcp_over_http": round(
                    mcp["server_cpu_ms_per_cycle"] / http["server_cpu_ms_per_cycle"], 2
                ),
                "cycles_per_s_mcp_over_http": round(mcp["cycles_per_s"] / http["cycles_per_s"], 2),
            }
        )
        for row in (http, mcp):
            print(f"  {agents:>3} agents, {describe(row)}", flush=True)
    return rows, ratios


def describe(row: dict[str, Any]) -> str:
    return (
        f"{row['surface']:>4}: {row['cycles_per_s']:>7.0f} cycles/s, server CPU "
        f"{row['server_cpu_ms_per_cycle']:.2f} ms and client CPU "
        f"{row['client_cpu_ms_per_cycle']:.2f} ms per cycle"
    )


def render(rows: list[dict[str, Any]], ratios: list[dict[str, Any]]) -> list[str]:
    """The section's table and its ratios, as Markdown lines."""
    lines = [
        "",
        "| cycle (claim -> checkpoint -> transition) | agents | cycles/s | claim p50/p99 ms | "
        "checkpoint p99 ms | transition p99 ms | server CPU ms/cycle | client CPU ms/cycle | "
        "exactly once |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lat = r["latency_ms"]
        what = "HTTP API" if r["surface"] == "http" else f"/mcp ({r.get('protocol', '?')})"
        bound = " (client-bound)" if r["client_bound"] else ""
        lines.append(
            f"| {what} | {r['agents']} | {r['cycles_per_s']:.0f}{bound} | "
            f"{lat['claim']['p50']:.2f} / {lat['claim']['p99']:.2f} | "
            f"{lat['checkpoint']['p99']:.2f} | {lat['transition']['p99']:.2f} | "
            f"{r['server_cpu_ms_per_cycle']:.2f} | {r['client_cpu_ms_per_cycle']:.2f} | "
            f"{'yes' if r['completed_exactly_once'] else 'NO'} |"
        )
    lines.append(
        "\nBoth with Python agents on one asyncio loop over httpx2, a key per agent; on /mcp one "
        "long-lived `mcp.Client` each. Server CPU per cycle, /mcp over the HTTP API: "
        + ", ".join(
            f"{x['server_cpu_mcp_over_http']} at {x['agents']} agent" + "s" * (x["agents"] > 1)
            for x in ratios
        )
        + "."
    )
    return lines
