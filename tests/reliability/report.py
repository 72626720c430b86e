"""What the reliability suites tried, how many times, and how it went: each test adds rows with
`record(...)`; the outcome of the test is attached at the end, and the whole list is written as
JSON when `NULLTICKETS_RELIABILITY_JSON` names a file (`make soak` does;
scripts/reliability_report.py turns that file into RELIABILITY.md).

This module is a pytest plugin in all but name: tests/reliability/conftest.py re-exports its hooks.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pytest

ENV_JSON = "NULLTICKETS_RELIABILITY_JSON"
ENV_SOAK = "NULLTICKETS_SOAK"
REPO = Path(__file__).resolve().parents[2]


def soak() -> bool:
    return os.environ.get(ENV_SOAK, "") not in ("", "0")


def scale(short: int, long: int) -> int:
    """`short` in `make test`, `long` under `make soak`."""
    return long if soak() else short


@dataclass
class Row:
    suite: str
    check: str
    tried: int
    unit: str
    detail: str = ""
    test: str = ""
    outcome: str = "not run"
    reason: str = ""
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


ROWS: list[Row] = []
_started: dict[str, float] = {}


class Recorder:
    """Bound to one test: `record(suite, check, tried, unit, detail, **extra)`."""

    def __init__(self, nodeid: str) -> None:
        self.nodeid = nodeid

    def __call__(
        self, suite: str, check: str, tried: int, unit: str, detail: str = "", **extra: Any
    ) -> Row:
        row = Row(suite, check, tried, unit, detail, test=self.nodeid, extra=extra)
        ROWS.append(row)
        return row


def _outcome(report: pytest.TestReport) -> tuple[str, str]:
    if hasattr(report, "wasxfail"):
        if report.skipped:
            return "xfail", str(report.wasxfail).removeprefix("reason: ")
        return "xpass", str(report.wasxfail)
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
        return "skipped", str(reason).removeprefix("Skipped: ")
    return ("passed", "") if report.passed else ("failed", _short(report))


def _short(report: pytest.TestReport) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    message = getattr(crash, "message", "") or str(report.longrepr)
    return message.splitlines()[0][:300] if message else "failed"


def pytest_runtest_logstart(nodeid: str, location: tuple[str, int | None, str]) -> None:
    _started[nodeid] = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """The worst phase decides: a failing teardown fails a test whose call passed."""
    if report.when == "call" or report.outcome != "passed":
        outcome, reason = _outcome(report)
        for row in ROWS:
            if row.test == report.nodeid and (row.outcome in ("not run", "passed")):
                row.outcome, row.reason = outcome, reason
    if report.when == "teardown":
        spent = time.monotonic() - _started.get(report.nodeid, time.monotonic())
        for row in ROWS:
            if row.test == report.nodeid:
                row.seconds = round(spent, 1)


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip()


def environment() -> dict[str, Any]:
    import apsw

    from nulltickets import __version__

    return {
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "soak": soak(),
        "nulltickets": __version__,
        "commit": _git("rev-parse", "--short", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", "src")),
        "python": platform.python_version(),
        "sqlite": apsw.sqlite_lib_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "cpus": os.cpu_count(),
    }


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    target = os.environ.get(ENV_JSON)
    if not target or not ROWS:
        return
    doc = {"environment": environment(), "rows": [asdict(row) for row in ROWS]}
    path = Path(target)
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    print(f"\nreliability results: {len(ROWS)} rows written to {path}", file=sys.stderr)
