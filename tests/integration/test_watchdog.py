"""The watchdog of a command's process group (worker/process_group.py), with real processes:
it removes the run's directory only when the process that started the group is gone, never
while that process, alive, is still ending its run."""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import struct
import sys
import tempfile
import termios
from pathlib import Path

import pytest

from nulltickets.worker.process_group import ProcessGroup
from tests.conftest import wait_for

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="process groups are POSIX's")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def started(leftover: Path) -> ProcessGroup:
    group = ProcessGroup(["sleep", "300"], dict(os.environ), leftover=leftover)
    assert group.watchdog is not None
    return group


def waiting(group: ProcessGroup) -> bool:
    """The watchdog has read the group's id and its traps for it are set: nothing is left in
    its pipe and it sleeps (in its second read, the only place it blocks before it ends).
    Before that, a TERM only makes it exit, since it has no group to end yet."""
    assert group.watchdog is not None and group._hold is not None
    unread: int = struct.unpack("i", fcntl.ioctl(group._hold, termios.FIONREAD, b"\0" * 4))[0]
    stat = Path(f"/proc/{group.watchdog.pid}/stat")
    if not stat.exists():  # no /proc: the pipe read is all that can be seen
        return unread == 0
    return unread == 0 and stat.read_text().rpartition(")")[2].split()[0] == "S"


def finish(group: ProcessGroup) -> None:
    group.end()
    group.close()
    for stream in (group.proc.stdin, group.proc.stdout, group.proc.stderr):
        if stream is not None:
            stream.close()


def test_the_watchdog_removes_the_directory_when_the_starter_is_gone() -> None:
    leftover = Path(tempfile.mkdtemp(prefix="nulltickets-run-"))
    (leftover / "lease.json").write_text("{}")
    group = started(leftover)
    assert group.watchdog is not None and group._hold is not None
    watchdog = group.watchdog
    try:
        os.close(group._hold)  # what the kernel does when the worker dies
        group._hold = None
        # Reaped here, as init reaps it when the worker is dead; then the watchdog removes.
        wait_for("the command to end", lambda: group.proc.poll() is not None)
        assert watchdog.wait(timeout=30) == 0
        assert not leftover.exists()
    finally:
        finish(group)
        shutil.rmtree(leftover, ignore_errors=True)  # when the test failed


def test_a_term_to_the_watchdog_ends_the_group_and_leaves_the_directory_to_the_worker() -> None:
    leftover = Path(tempfile.mkdtemp(prefix="nulltickets-run-"))
    group = started(leftover)
    try:
        assert group.watchdog is not None
        wait_for("the watchdog to know the group", lambda: waiting(group))
        group.watchdog.send_signal(signal.SIGTERM)  # a service manager's TERM to every process
        group.watchdog.wait(timeout=30)
        assert group.proc.wait(timeout=30) == -signal.SIGTERM
        assert leftover.is_dir()  # the worker, alive, removes it itself
    finally:
        finish(group)  # also when the test failed: no command is left running
        shutil.rmtree(leftover, ignore_errors=True)
