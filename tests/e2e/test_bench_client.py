"""The benchmark's load clients against a real server: every task completed exactly once, every
request timed, the client's own CPU reported; the native client builds where a compiler is."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from benchmarks.harness import BenchServer, bulk_load, create_pipeline
from benchmarks.load import ENDPOINTS, native_client, run_agents


@pytest.mark.parametrize("client", ["native", "python"])
def test_agents_complete_every_task_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, client: str
) -> None:
    if client == "python":
        monkeypatch.setenv("NULLTICKETS_BENCH_CLIENT", "python")
        assert native_client() is None
    else:
        monkeypatch.delenv("NULLTICKETS_BENCH_CLIENT", raising=False)
        if shutil.which("cc") is None and shutil.which("gcc") is None:
            pytest.fail("no C compiler: the native load client cannot be built here")
        assert native_client() is not None
    with BenchServer(tmp_path / "bench.db") as server:
        pipeline = create_pipeline(server)
        ids = bulk_load(server, pipeline, 60)
        report, wall = run_agents(server.port, 4, "worker", "complete", processes=2)
        queue = server.get("/ops/queue")
    assert sorted(report.completed) == sorted(ids)
    assert report.errors == {}
    assert len(report.latencies["event"]) == len(report.latencies["transition"]) == 60
    assert len(report.latencies["claim"]) == 60 + 4  # each agent's last claim finds nothing
    assert all(latency > 0 for e in ENDPOINTS for latency in report.latencies[e])
    assert report.cpu_s > 0 and wall > 0
    assert [r["claimable_count"] for r in queue["roles"]] == [0]
