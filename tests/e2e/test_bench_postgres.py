"""The benchmark's postgres section at a tiny size, against real servers, a real PostgreSQL
cluster and the real peer queue: every variant has its row (SQLite `full` and `normal`;
PostgreSQL with synchronous_commit on and off behind one, two and three servers; the peer with
both), every task is done exactly once, the CPU per cycle of the servers and of PostgreSQL is
measured, and the capacity model is drawn from them. No figure is asserted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from benchmarks import peer
from benchmarks.__main__ import main, render
from benchmarks.pgfloor import BATCH
from benchmarks.postgres import VARIANTS, Variant, run_once, warmup_tasks

from tests.pgserver import PostgresServer

pytestmark = [
    pytest.mark.process,
    # Most of its servers serve from PostgreSQL, which the Python package does (make test).
    pytest.mark.skipif(
        bool(os.environ.get("NULLTICKETS_BINARY")),
        reason="the release binaries carry no PostgreSQL driver",
    ),
]


def test_the_section_has_a_row_for_every_variant_and_the_model(tmp_path: Path) -> None:
    out, table, figures = tmp_path / "b.json", tmp_path / "b.md", tmp_path / "figures.md"
    argv = ["--quick", "--sections", "postgres", "--out", str(out), "--markdown", str(table)]
    assert main([*argv, "--postgres-figures", str(figures)]) == 0
    results = json.loads(out.read_text())
    section = results["postgres"]
    rows = section["rows"]
    assert [(r["engine"], r["durability"], r["servers"], r["agents"]) for r in rows] == [
        (v.engine, v.durability, v.servers, 4) for v in VARIANTS
    ]
    assert [r for r in rows if "not_measured" in r] == []
    assert section["postgresql"] and section["peer"]["version"]
    for r in rows:
        # Measured after a warm-up of its own (a token one in a quick run).
        assert r["warmup"] == warmup_tasks(4, quick=True) > 0, r
        assert r["completed_exactly_once"], r
        assert r["cycles_per_s"] > 0 and r["server_cpu_ms_per_cycle"] > 0, r
        assert r["latency_ms"]["claim"]["p99"] > 0, r
        if r["engine"] == "sqlite":
            assert "postgres_cpu_ms_per_cycle" not in r
        else:
            assert r["postgres_cpu_ms_per_cycle"] > 0, r
    floor = section["floor"]
    for kind in ("select", "insert_commit"):
        assert floor[kind]["statements"] == 200
        assert floor[kind]["client_cpu_us"] > 0 and floor[kind]["wall_us"] > 0, floor
    batch = floor["insert_batch"]
    assert batch["rows"] == 200 and batch["statements"] == 200 // BATCH, batch
    assert batch["client_cpu_us"] > 0 and batch["wall_us"] > 0, batch
    # The backend's CPU is read from /proc where there is one.
    assert floor["insert_commit"]["postgres_cpu_us"] > 0 or not Path("/proc/self").exists()
    model = section["model"]
    assert sorted(model["costs"]) == ["1", "2", "3"]
    assert model["grid"]["8"]["16"] >= model["grid"]["8"]["1"] > 0

    text = table.read_text()
    assert text == render(results) + "\n"
    for v in VARIANTS:
        servers = "in-process" if v.servers == 0 else str(v.servers)
        durability = v.durability
        if v.engine != "sqlite":
            durability += f" (synchronous_commit {'on' if v.durability == 'full' else 'off'})"
        assert f"| {v.engine} | {servers} | 4 | {durability} | " in text, v
    assert "cycles/s = min(N * 1 * 1000 / s, K * 1000 / p)" in text
    assert f"worked through tasks (jobs) unmeasured: {warmup_tasks(4, quick=True)} at 4 " in text
    assert "| 32 | " in text and " servers |" in text
    assert "procrastinate on the same cluster: full " in text
    floor_line = "The machine's floor (benchmarks/pgfloor.py: one connection, no concurrency, 200 "
    assert floor_line in text
    assert f"The same 200 rows committed {BATCH} to a statement ({200 // BATCH} statements)" in text
    written = figures.read_text()
    assert written.startswith("Measured ") and "python -m benchmarks --sections postgres" in written
    assert written.split("\n", 1)[1] in text


def databases(cluster: PostgresServer) -> set[str]:
    with cluster.admin() as conn:
        return {name for (name,) in conn.execute("SELECT datname FROM pg_database").fetchall()}


def test_a_measured_run_leaves_no_database_behind_for_autovacuum_to_visit(
    postgres: PostgresServer, tmp_path: Path
) -> None:
    """Each run has a database of its own, dropped once it is measured: none of a run's
    tables is left for autovacuum to work on while a later run is measured."""
    before = databases(postgres)
    for variant in (Variant("postgresql", "full", 2), Variant(peer.NAME, "normal", 0)):
        row = run_once(variant, postgres, tmp_path, agents=2, tasks=10, warmup=2)
        assert row["completed_exactly_once"] and row["cycles_per_s"] > 0, row
        assert databases(postgres) == before
