"""The benchmark's load clients against a real server: every task completed exactly once, every
request timed, the client's own CPU reported; the native client builds where a compiler is."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from benchmarks.harness import BenchServer, bulk_load, create_pipeline
from benchmarks.load import ENDPOINTS, native_client, run_agents

from tests.server import alive

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]


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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_benchmark_killed_by_a_signal_leaves_no_server_running(tmp_path: Path) -> None:
    script = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from benchmarks.harness import BenchServer\n"
        f"server = BenchServer(Path({str(tmp_path / 'bench.db')!r})).__enter__()\n"
        "print(*server.pids, flush=True)\n"
        "time.sleep(120)\n"
    )
    with subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
    ) as bench:
        try:
            assert bench.stdout is not None
            pids = [int(p) for p in bench.stdout.readline().split()]
            assert pids and all(alive(pid) for pid in pids)
        finally:
            bench.kill()
    deadline = time.monotonic() + 60
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if alive(pid)]
