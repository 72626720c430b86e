"""The server says which SQLite it runs on: /health and the start line carry the version and
the chosen compile options. Against a release binary (NULLTICKETS_BINARY) that is
vendor/sqlite with build/sqlite-options.txt; under `python -m nulltickets` it is whatever apsw
this interpreter has, which the test asks directly."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server import Server

ROOT = Path(__file__).resolve().parents[2]

# What SQLite reports is a property of the SQLite backend: these servers run on their file even
# when the rest of the suite runs on PostgreSQL.
pytestmark = [pytest.mark.process, pytest.mark.e2e, pytest.mark.sqlite_file]


def expected() -> tuple[str, set[str]]:
    """(version, the options that must be reported) for the server under test."""
    if os.environ.get("NULLTICKETS_BINARY"):
        header = (ROOT / "vendor" / "sqlite" / "sqlite3.h").read_text()
        m = re.search(r'^#define SQLITE_VERSION\s+"([^"]+)"', header, re.M)
        assert m
        wanted = set()
        for line in (ROOT / "build" / "sqlite-options.txt").read_text().splitlines():
            fields = line.split("#", 1)[0].split()
            if fields:
                wanted.add(fields[0].removeprefix("SQLITE_"))
        return m.group(1), wanted
    probe = (
        "import apsw, json; print(json.dumps([apsw.sqlite_lib_version(), apsw.compile_options]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    version, options = json.loads(out.stdout)
    return version, {"ENABLE_FTS5", *(o for o in options if o.startswith("THREADSAFE="))}


def test_health_and_the_start_line_name_the_sqlite_and_its_options(fresh_server: Server) -> None:
    version, wanted = expected()
    client = fresh_server.client()
    try:
        doc = client.get("/health").json
    finally:
        client.close()
    assert doc["sqlite_version"] == version
    options = doc["sqlite_options"]
    assert options == sorted(options)
    reported_kinds = ("ENABLE_", "OMIT_", "DQS=", "THREADSAFE=", "DEFAULT_MEMSTATUS=", "LIKE_")
    assert {o for o in wanted if o.startswith(reported_kinds)} <= set(options)
    assert all(o.startswith(reported_kinds) for o in options), options  # no limits or defaults
    line = next(li for li in fresh_server.output().splitlines() if "listening on" in li)
    assert line.endswith(f"SQLite {version} ({' '.join(options)})"), line
