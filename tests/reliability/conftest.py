"""Fixtures of the reliability suites; the report hooks live in report.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.report import (  # noqa: F401  (pytest finds hooks by name here)
    Recorder,
    pytest_runtest_logreport,
    pytest_runtest_logstart,
    pytest_sessionfinish,
)
from tests.server import Server


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Recorder:
    """Add a row to the reliability report: what was tried, how many times, with what result."""
    return Recorder(request.node.nodeid)


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[Server]]:
    """Servers a test starts itself; whatever is still running at the end is killed."""
    started: list[Server] = []
    yield started
    for server in started:
        if server.proc is not None and server.proc.poll() is None:
            server.stop(timeout=10)
        server.kill()
