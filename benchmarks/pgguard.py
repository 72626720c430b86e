"""The guard of a throwaway PostgreSQL cluster (benchmarks/pgcluster.py): it ends the cluster
when the process that started it ends without stopping it (SIGTERM, SIGKILL, a crash).

PostgreSQL's postmaster runs as a daemon of its own, not as a child that dies with its
parent, so a benchmark or a test session killed before its `finally` left the cluster
running, with its temporary directory. This process waits for that parent to end and then
ends the cluster as `pg_ctl stop -m immediate` would (SIGQUIT to the postmaster, which ends
its backends), and removes the directory. A parent that stops the cluster itself ends this
process first.

    python pgguard.py PARENT_PID DATA_DIR ROOT_DIR

Standard library only: it runs by path, in a session of its own, so that a signal sent to
the parent's process group does not end it before it has done its work.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
import time
from pathlib import Path

# How long the postmaster has to go after SIGQUIT before it and its backends are killed.
QUIT_S = 10.0


def wait_for_exit(pid: int) -> None:
    """Return once process `pid` has ended (at once if it already has)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (older kernels): poll
        while alive(pid):
            time.sleep(0.5)
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def alive(pid: int) -> bool:
    """The process is still there (PostgreSQL's own check of its lock file asks the same); a
    zombie counts until it is reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def postmaster_pid(data: Path) -> int | None:
    """The postmaster's pid from the first line of the cluster's lock file, if it is there."""
    try:
        return int((data / "postmaster.pid").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def end_cluster(data: Path, root: Path) -> None:
    postmaster = postmaster_pid(data)
    if postmaster is not None and alive(postmaster):
        os.kill(postmaster, signal.SIGQUIT)
        deadline = time.monotonic() + QUIT_S
        while alive(postmaster) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(postmaster):
            os.kill(postmaster, signal.SIGKILL)
    shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str]) -> int:
    parent, data, root = int(argv[0]), Path(argv[1]), Path(argv[2])
    wait_for_exit(parent)
    end_cluster(data, root)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
