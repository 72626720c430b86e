"""The benchmark's `mcp` section against real servers: the same claim -> checkpoint ->
transition cycle through /mcp (the MCP SDK's client, modern protocol) and over the HTTP API,
every task completed exactly once and every step timed; and its table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchmarks.__main__ import render
from benchmarks.mcp import STEPS, cycle

pytestmark = pytest.mark.process


@pytest.mark.parametrize("surface", ["http", "mcp"])
def test_agents_complete_every_task_once_with_checkpoints(tmp_path: Path, surface: str) -> None:
    row = cycle(tmp_path, surface, agents=2, tasks=30)
    assert row["completed_exactly_once"], row
    assert row["errors"] == {}
    assert row["surface"] == surface and row["agents"] == 2 and row["tasks"] == 30
    for step in STEPS:
        assert row["latency_ms"][step]["p50"] > 0, (step, row)
    assert row["server_cpu_ms_per_cycle"] > 0 and row["client_cpu_ms_per_cycle"] > 0
    if surface == "mcp":
        assert row["protocol"] == "2026-07-28"
    else:
        assert "protocol" not in row


def test_the_section_runs_from_the_command_line(tmp_path: Path) -> None:
    from benchmarks.__main__ import main

    out, table = tmp_path / "bench.json", tmp_path / "bench.md"
    assert main(["--quick", "--sections", "mcp", "--out", str(out), "--markdown", str(table)]) == 0
    results = json.loads(out.read_text())
    assert [r["surface"] for r in results["mcp"]] == ["http", "mcp"]
    assert all(r["completed_exactly_once"] for r in results["mcp"])
    assert [x["agents"] for x in results["mcp_ratio"]] == [1]
    text = table.read_text()
    assert text == render(results) + "\n"
    assert "| HTTP API | 1 |" in text and "| /mcp (2026-07-28) | 1 |" in text
    assert "Server CPU per cycle, /mcp over the HTTP API: " in text
