"""The tests' own PostgreSQL: when it cannot start, the tests that need it fail, saying why."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from benchmarks.pgguard import alive

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


STARTER = """
import sys
from benchmarks.pgcluster import start_postgres

server = start_postgres()
pid = (server.data / "postmaster.pid").read_text().split()[0]
print(server.root, pid, flush=True)
sys.stdin.read()  # until the test kills this process; stop() is never called
"""


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_cluster_whose_starter_is_killed_is_ended_and_removed(signum: int) -> None:
    """PostgreSQL's postmaster is a daemon, not a child that dies with its parent: without its
    guard, a benchmark or test session killed before it stopped its cluster left it running."""
    with subprocess.Popen(
        [sys.executable, "-c", STARTER],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as starter:
        try:
            assert starter.stdout is not None
            root_text, pid_text = starter.stdout.readline().split()
            root, postmaster = Path(root_text), int(pid_text)
            assert root.is_dir() and alive(postmaster)
            starter.send_signal(signum)
            starter.wait(timeout=10)
        finally:
            starter.kill()
    deadline = time.monotonic() + 30
    while (alive(postmaster) or root.exists()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(postmaster), "the postmaster outlived the process that started it"
    assert not root.exists(), "the cluster's directory was left behind"
