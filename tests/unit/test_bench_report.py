"""The benchmark's own logic without measuring anything: the baseline comparison, the rows of
the cycle table (PostgreSQL beside SQLite, and rows that could not be measured), the
temporary checkout of a baseline revision, and the sections `--help` lists."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from benchmarks.__main__ import SECTIONS, parse_sections, render
from benchmarks.baseline import BaselineError, BaselineTree, common_core, compare
from benchmarks.baseline import render as render_baseline
from benchmarks.postgres import (
    VARIANTS,
    Variant,
    capacity_model,
    not_measured,
    render_model,
    table_row,
)

ROOT = Path(__file__).resolve().parents[2]

MACHINE = {
    "nulltickets": "x",
    "core": "compiled",
    "python": "3.11",
    "sqlite": "3.51.3",
    "granian": "2",
    "cpus": 2,
    "machine": "x86_64",
}


def row(
    rate: float, *, engine: str = "sqlite", servers: int = 1, agents: int = 16
) -> dict[str, Any]:
    lat = {"p50": 1.0, "p95": 2.0, "p99": 3.0}
    return {
        "engine": engine,
        "servers": servers,
        "agents": agents,
        "durability": "normal",
        "cycles_per_s": rate,
        "requests_per_s": rate * 3,
        "latency_ms": {"claim": lat, "event": lat, "transition": lat},
        "completed_exactly_once": True,
        "client_bound": False,
        "server_cpu_cores": 1.0,
        "client_cpu_cores": 0.1,
        "server_peak_rss_mb": 50.0,
        "rounds_cycles_per_s": [rate],
    }


def sqlite_rows(lines: list[str]) -> list[list[str]]:
    """The agents, durability and cycles/s of each SQLite row of a rendered table."""
    return [li.split(" | ")[2:5] for li in lines if li.startswith("| sqlite")]


def test_the_ratio_is_after_over_before_with_every_run_kept() -> None:
    before = {**row(3000.0), "rounds_cycles_per_s": [2900.0, 3000.0, 3100.0]}
    after = {**row(2850.0), "rounds_cycles_per_s": [2850.0, 2800.0, 2900.0]}
    c = compare(before, after)
    assert c["ratio"] == 0.95
    assert c["before_rounds_cycles_per_s"] == [2900.0, 3000.0, 3100.0]
    assert c["after_rounds_cycles_per_s"] == [2850.0, 2800.0, 2900.0]
    assert c["exactly_once"] is True


def test_a_side_that_lost_a_task_marks_the_comparison() -> None:
    before = {**row(3000.0), "completed_exactly_once": False}
    assert compare(before, row(3000.0))["exactly_once"] is False


def test_a_before_side_that_completed_nothing_has_no_ratio() -> None:
    assert compare(row(0.0), row(3000.0))["ratio"] is None


def test_the_comparison_table_names_the_revision_core_and_ratio() -> None:
    info = {
        "rev": "ea98929",
        "commit": "ea98929f3c7a17e3806cacf3eec6c6572a6bdda4",
        "core": "compiled",
        "rows": [
            compare(row(2000.0, agents=4), row(2100.0, agents=4)),
            {
                "engine": "postgresql",
                **compare(
                    {**row(300.0, agents=16), "server_cpu_ms_per_cycle": 1.84},
                    {**row(330.0, agents=16), "server_cpu_ms_per_cycle": 1.756},
                ),
            },
        ],
    }
    text = "\n".join(render_baseline(info))
    assert "ea98929 (ea98929f3)" in text
    assert "compiled core on both sides" in text
    assert "| sqlite | 4 | normal | 2000 | 2100 | 1.05 | - / - | 2000 | 2100 |" in text
    assert "| postgresql | 16 | normal | 300 | 330 | 1.10 | 1.84 / 1.76 | 300 | 330 |" in text


def test_both_sides_run_the_compiled_core_only_when_both_have_it() -> None:
    assert common_core("compiled", "compiled") == "compiled"
    assert common_core("compiled", "python") == "python"
    assert common_core("python", "compiled") == "python"


def pg_row(v: Variant, agents: int, rate: float, server_ms: float, db_ms: float) -> dict[str, Any]:
    r = {**row(rate, engine=v.engine, servers=v.servers, agents=agents), "durability": v.durability}
    r["server_cpu_ms_per_cycle"] = server_ms
    if v.engine != "sqlite":
        r["postgres_cpu_ms_per_cycle"] = db_ms
    return r


def test_the_postgres_comparison_is_its_own_table_with_every_variant_in_order() -> None:
    rows = [pg_row(v, a, 100.0 + i, 2.0, 1.0) for a in (16, 64) for i, v in enumerate(VARIANTS)]
    section = {"postgresql": "15.18", "peer": {"name": "procrastinate", "version": "3.10.0"}}
    section |= {"rows": rows, "model": capacity_model(rows)}
    results = {"machine": {**MACHINE, "postgresql": "15.18"}, "rounds": 3, "postgres": section}
    lines = render(results).splitlines()
    assert "PostgreSQL 15.18" in lines[0]
    assert "PostgreSQL 15.18; peer: procrastinate 3.10.0" in lines
    body = [li.split(" | ")[:5] for li in lines if li.startswith("| ") and " | 16 | " in li]
    assert body == [
        ["| sqlite", "1", "16", "full", "100"],
        ["| sqlite", "1", "16", "normal", "101"],
        ["| postgresql", "1", "16", "full (synchronous_commit on)", "102"],
        ["| postgresql", "2", "16", "full (synchronous_commit on)", "103"],
        ["| postgresql", "3", "16", "full (synchronous_commit on)", "104"],
        ["| postgresql", "1", "16", "normal (synchronous_commit off)", "105"],
        ["| postgresql", "2", "16", "normal (synchronous_commit off)", "106"],
        ["| postgresql", "3", "16", "normal (synchronous_commit off)", "107"],
        ["| procrastinate", "in-process", "16", "full (synchronous_commit on)", "108"],
        ["| procrastinate", "in-process", "16", "normal (synchronous_commit off)", "109"],
    ]
    assert (
        "`full`, 16 agents: PostgreSQL over SQLite, one server each, 1.02; 2 servers over 1 1.01; "
        "3 servers over 1 1.02; claim p99 at 1, 2, 3 servers 3.0 / 3.0 / 3.0 ms."
    ) in lines
    sqlite = next(li for li in lines if li.startswith("| sqlite | 1 | 64 | full |"))
    assert sqlite.endswith("| 2.00 | - | yes |")


def test_the_capacity_model_is_the_lesser_of_the_servers_and_postgresql_cpu() -> None:
    # s = 2 ms of server CPU per cycle: 500 cycles/s per server core; p = 0.5 ms of PostgreSQL
    # CPU: 2,000 per PostgreSQL core; so 4 servers per PostgreSQL core.
    pg = [v for v in VARIANTS if v.engine == "postgresql" and v.durability == "full"]
    rows = [pg_row(v, 64, 300.0, 2.0, 0.5) for v in pg]
    rows += [pg_row(v, 16, 300.0, 9.0, 9.0) for v in pg]  # the largest agent count counts
    model = capacity_model(rows)
    assert model is not None and model["agents"] == 64
    assert model["grid"]["2"]["1"] == 500  # one server: its own core is the limit
    assert model["grid"]["2"]["8"] == 4000  # eight servers: two PostgreSQL cores are
    assert model["grid"]["2"]["16"] == 4000
    assert model["grid"]["32"]["16"] == 8000
    assert model["servers_per_postgres_core"] == 4.0
    text = "\n".join(render_model(model, rows))
    assert "| 2 | 500 | 1,000 | 1,500 | 2,000 | 4,000 | 4,000 | 8.0 servers |" in text
    assert "servers stop adding throughput at N = K * s / p = 4.00 * K" in text


def test_no_model_without_a_measured_postgresql_row() -> None:
    v = Variant("postgresql", "full", 1)
    assert capacity_model([not_measured(v, 16, "no PostgreSQL server found")]) is None


def test_durability_rows_sit_in_the_table_with_full_over_normal_per_agent_count() -> None:
    def dur(rate: float, durability: str, agents: int) -> dict[str, Any]:
        return {**row(rate, agents=agents), "durability": durability}

    results = {
        "machine": MACHINE,
        "rounds": 3,
        "durability": {
            "16/full": dur(900.0, "full", 16),
            "16/normal": dur(1000.0, "normal", 16),
            "64/full": dur(1200.0, "full", 64),
            "64/normal": dur(1250.0, "normal", 64),
        },
        "durability_ratio": [
            {"agents": 16, "full_over_normal": 0.9},
            {"agents": 64, "full_over_normal": 0.96},
        ],
    }
    lines = render(results).splitlines()
    body = sqlite_rows(lines)
    assert body == [
        ["16", "full", "900"],
        ["16", "normal", "1000"],
        ["64", "full", "1200"],
        ["64", "normal", "1250"],
    ]
    assert "full over normal (interleaved runs): 16 agents 0.9, 64 agents 0.96" in lines


def test_a_postgresql_that_could_not_start_is_a_row_saying_why() -> None:
    line = table_row(not_measured(Variant("postgresql", "normal", 2), 16, "no PostgreSQL"))
    assert line.startswith(
        "| postgresql | 2 | 16 | normal (synchronous_commit off) | not measured: no PostgreSQL"
    )
    header = "| system | servers | agents | durability | cycles/s | each run | claim p99 ms | "
    header += "server CPU ms/cycle | PostgreSQL CPU ms/cycle | exactly once |"
    assert line.count("|") == header.count("|")
    results = {"machine": MACHINE, "rounds": 1, "postgres": {"rows": [], "postgresql": None}}
    assert header in render(results)


def test_sections_are_checked_by_name() -> None:
    assert parse_sections("postgres, cycle") == ["postgres", "cycle"]
    with pytest.raises(Exception, match="unknown section nope"):
        parse_sections("cycle,nope")


def test_help_lists_every_section_and_the_baseline_option() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    assert "postgres" in SECTIONS
    for section in SECTIONS:
        assert f"\n  {section} " in done.stdout
    assert "--baseline REV" in done.stdout


def git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A small repository shaped like ours: src/nulltickets and cext/ at one commit."""
    repo = tmp_path / "repo"
    (repo / "src" / "nulltickets").mkdir(parents=True)
    (repo / "cext").mkdir()
    (repo / "src" / "nulltickets" / "__init__.py").write_text("")
    (repo / "cext" / "__init__.py").write_text("")
    git(tmp_path, "init", "-q", str(repo))
    git(repo, "add", ".")
    git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    return repo


def test_the_baseline_checkout_is_removed_with_its_worktree_entry(repo: Path) -> None:
    with BaselineTree("HEAD", repo=repo, build_core=False) as tree:
        assert tree.commit == git(repo, "rev-parse", "HEAD")
        assert (tree.path / "src" / "nulltickets" / "__init__.py").exists()
        # The cext/ package is where an install would map it, inside the checkout.
        assert (tree.path / "src" / "nulltickets" / "_cext").resolve() == (
            tree.path / "cext"
        ).resolve()
        assert len(git(repo, "worktree", "list").splitlines()) == 2
        folder = tree.folder
    assert not folder.exists()
    assert git(repo, "worktree", "list", "--porcelain").splitlines()[0] == f"worktree {repo}"
    assert len(git(repo, "worktree", "list").splitlines()) == 1


def test_the_checkout_is_removed_after_a_failure_inside(repo: Path) -> None:
    with pytest.raises(RuntimeError), BaselineTree("HEAD", repo=repo, build_core=False) as tree:
        folder = tree.folder
        raise RuntimeError("a run failed")
    assert not folder.exists()
    assert len(git(repo, "worktree", "list").splitlines()) == 1


def test_an_unknown_revision_is_a_baseline_error_and_leaves_nothing(repo: Path) -> None:
    tree = BaselineTree("no-such-rev", repo=repo, build_core=False)
    with pytest.raises(BaselineError, match="rev-parse"), tree:
        pass
    assert not tree.folder.exists()
    assert len(git(repo, "worktree", "list").splitlines()) == 1


def test_full_on_the_python_sync_thread_is_a_row_of_its_own_with_its_ratio() -> None:
    def dur(rate: float, durability: str, **extra: Any) -> dict[str, Any]:
        return {**row(rate, agents=16), "durability": durability, **extra}

    results = {
        "machine": MACHINE,
        "rounds": 3,
        "durability": {
            "16/full": dur(900.0, "full"),
            "16/normal": dur(1000.0, "normal"),
            "16/full-python": dur(720.0, "full", wal_sync="python"),
        },
        "durability_ratio": [
            {
                "agents": 16,
                "full_over_normal": 0.9,
                "full_over_python_sync": 1.25,
                "normal_request_mean_ms": 2.0,
                "full_request_mean_ms": 2.5,
                "full_durable_wait_ms_mean": 0.55,
                "full_wal_sync_ms_mean": 0.34,
                "host_steal_max": 0.0,
            },
        ],
    }
    lines = render(results).splitlines()
    body = sqlite_rows(lines)
    assert body == [
        ["16", "full", "900"],
        ["16", "normal", "1000"],
        ["16", "full (Python sync thread)", "720"],
    ]
    assert "full with the C sync threads over full with the Python one: 16 agents 1.25" in lines
    [where] = [li for li in lines if li.startswith("16 agents: a request takes")]
    assert "0.55 ms waiting from its COMMIT for a WAL sync (0.34 ms the sync itself)" in where


def test_a_histograms_mean_is_read_from_the_metrics_text() -> None:
    from benchmarks.cycle import mean_of

    text = "\n".join(
        [
            "# TYPE nulltickets_wal_sync_duration_seconds histogram",
            'nulltickets_wal_sync_duration_seconds_bucket{le="0.001"} 3',
            "nulltickets_wal_sync_duration_seconds_sum 0.0009",
            "nulltickets_wal_sync_duration_seconds_count 3",
            "nulltickets_durable_wait_seconds_count 0",
            "nulltickets_durable_wait_seconds_sum 0.0",
        ]
    )
    assert mean_of(text, "nulltickets_wal_sync_duration_seconds") == pytest.approx(0.0003)
    assert mean_of(text, "nulltickets_durable_wait_seconds") is None  # nothing observed
    assert mean_of(text, "nulltickets_commit_duration_seconds") is None  # not there


def test_the_hosts_idle_and_steal_shares_come_from_two_readings() -> None:
    from benchmarks.cycle import host_cpu, host_share

    # user nice system idle iowait irq softirq steal
    before = [100, 0, 50, 1000, 0, 0, 0, 10]
    after = [500, 0, 150, 1400, 0, 0, 0, 110]
    assert host_share(before, after) == {"idle": 0.4, "steal": 0.1}
    assert host_share(None, after) == {}
    reading = host_cpu()
    if sys.platform == "linux":
        assert reading is not None and len(reading) >= 8


def test_the_durability_line_says_what_full_adds_to_a_request() -> None:
    from benchmarks.__main__ import where_time_goes

    x = {
        "normal_request_mean_ms": 2.0,
        "full_request_mean_ms": 2.5,
        "full_durable_wait_ms_mean": 0.55,
        "full_wal_sync_ms_mean": 0.34,
        "host_steal_max": 0.12,
    }
    line = where_time_goes(x)
    assert "2.00 ms on average with normal, 2.50 ms with full" in line
    assert "0.55 ms waiting from its COMMIT for a WAL sync (0.34 ms the sync itself)" in line
    assert "CPU steal up to 12%" in line
    assert line.endswith("for full/normal 0.90, full may add at most 0.22 ms to a request")
    bare = where_time_goes({**x, "full_durable_wait_ms_mean": None, "host_steal_max": None})
    assert "WAL sync" not in bare and "steal" not in bare


def test_the_disks_own_sync_is_timed_one_and_two_at_a_time_and_rendered(tmp_path: Path) -> None:
    from benchmarks.disk import describe, sync_floor

    floor = sync_floor(tmp_path, 20)
    assert [(c["syncers"], c["syncs"]) for c in floor.values()] == [(1, 20), (2, 40)]
    for case in floor.values():
        assert 0 < case["median_ms"] <= case["p90_ms"]
    assert list(tmp_path.iterdir()) == []  # its files are gone
    line = describe(floor)
    assert line.startswith("This disk, with nothing else running: an fdatasync after a 16 KB")
    assert f"{floor['two']['median_ms']:.2f} ms (p90 {floor['two']['p90_ms']:.2f}) two" in line
    results = {
        "machine": MACHINE,
        "rounds": 1,
        "durability": {"16/full": {**row(900.0, agents=16), "durability": "full"}},
        "durability_ratio": [{"agents": 16, "full_over_normal": 0.9}],
        "disk_sync": floor,
    }
    assert line in render(results).splitlines()


def fleet_side(p50: float, p99: float, cycles: int, **crowd: Any) -> dict[str, Any]:
    return {
        "agents": {"p50_ms": p50, "p99_ms": p99, "cycles": cycles},
        "created_answered_ms": crowd.get("answered"),
        "taken_ms": crowd.get("taken"),
        "wakeups": crowd.get("wakeups", 0),
        "kib_per_waiter": crowd.get("waiter"),
        "kib_per_stream": crowd.get("stream"),
    }


def test_the_fleet_rows_put_the_agents_alone_and_beside_the_crowd_side_by_side() -> None:
    fleet = {
        "waiters": 5000,
        "streams": 500,
        "agents": 16,
        "rows": [
            {
                "engine": "sqlite",
                "servers": 1,
                "alone": fleet_side(5.0, 40.0, 900),
                "crowd": fleet_side(
                    6.0, 60.0, 850, answered=12.5, taken=20.1, wakeups=1, waiter=18.2, stream=23.0
                ),
            }
        ],
        "postgres_not_measured": "pg_ctl not found",
    }
    lines = render({"machine": MACHINE, "fleet": fleet}).splitlines()
    assert any(
        "beside 5,000 waiting long-poll claims and 500 open event streams" in li for li in lines
    )
    [sqlite] = [li for li in lines if li.startswith("| sqlite")]
    assert sqlite.split(" | ")[1:10] == [
        "1",
        "5.00 / 40.00",
        "6.00 / 60.00",
        "1.50",
        "900 / 850",
        "12.5",
        "20.1",
        "1",
        "18.2",
    ]
    assert "PostgreSQL not measured: pg_ctl not found" in lines


def test_the_soak_reads_its_prune_batches_from_the_metrics_text() -> None:
    from benchmarks.soak import batch_summary

    name = "nulltickets_prune_batch_duration_seconds"
    text = "\n".join(
        [
            f"# TYPE {name} histogram",
            f'{name}_bucket{{le="0.001"}} 10',
            f'{name}_bucket{{le="0.005"}} 150',
            f'{name}_bucket{{le="0.025"}} 199',
            f'{name}_bucket{{le="0.1"}} 200',
            f'{name}_bucket{{le="+Inf"}} 200',
            f"{name}_sum 0.9",
            f"{name}_count 200",
        ]
    )
    # 199 of the 200 took 25 ms at most: at least 99% of them, so the p99 is in that bucket.
    assert batch_summary(text) == {"batches": 200, "mean_ms": 4.5, "p99_ms_at_most": 25.0}
    # With 197 there, fewer than 99% did: the p99 is in the next bucket, up to 100 ms.
    slower = text.replace(f'{name}_bucket{{le="0.025"}} 199', f'{name}_bucket{{le="0.025"}} 197')
    assert batch_summary(slower) == {"batches": 200, "mean_ms": 4.5, "p99_ms_at_most": 100.0}
    nothing = "\n".join([f'{name}_bucket{{le="+Inf"}} 0', f"{name}_sum 0.0", f"{name}_count 0"])
    assert batch_summary(nothing) is None  # a server that has pruned nothing yet
    assert batch_summary("nulltickets_up 1") is None  # --retention off: no such family
