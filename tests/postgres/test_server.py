"""The tests' own PostgreSQL: when it cannot start, the tests that need it fail, saying why."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tests_needing_postgres_fail_with_the_reason_when_it_cannot_start() -> None:
    bindir = Path(tempfile.mkdtemp(prefix="nulltickets-fake-pg-"))
    try:
        for tool in ("initdb", "pg_ctl"):
            script = bindir / tool
            script.write_text(
                "#!/bin/sh\necho 'initdb: cannot create directory: no space' >&2\nexit 1\n"
            )
            script.chmod(stat.S_IRWXU | stat.S_IRGRP | stat.S_IXGRP | stat.S_IROTH | stat.S_IXOTH)
        bindir.chmod(0o755)
        done = subprocess.run(
            [
                sys.executable, "-m", "pytest", "-q",
                # without the plugins this run has no use for, which take seconds to load
                "-p", "no:cacheprovider", "-p", "no:schemathesis", "-p", "no:hypothesispytest",
                "tests/postgres/test_migrations.py::test_the_server_runs_with_fsync_on",
            ],
            cwd=ROOT,
            env={**os.environ, "NULLTICKETS_PG_BINDIR": str(bindir)},
            capture_output=True,
            text=True,
            timeout=120,
        )  # fmt: skip
    finally:
        shutil.rmtree(bindir, ignore_errors=True)
    out = done.stdout
    assert done.returncode == 1, out
    assert (
        "PostgreSQL is needed and unavailable: initdb failed: "
        "initdb: cannot create directory: no space"
    ) in out
    assert "1 error" in out and "skipped" not in out
