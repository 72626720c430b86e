"""What one server can hold: its open files and memory, turned into the limits on long-poll
claims and event streams, and the connections granian may keep open.

A waiting claim or an open stream costs a connection (one file descriptor) and some memory
(WAITER_BYTES, STREAM_BYTES: measured by `make bench`'s fleet section), never a request slot:
granian may hold every connection the process has files for. At start the process raises its
open-files limit to the hard limit; of those files, FILE_RESERVE stay for the database, logs
and PostgreSQL connections, and of the connections left, an eighth (at least MIN_WORKING) stays
for work that does not wait (heartbeats, events, transitions, creates, reads). The rest is the
room for waiting: nine tenths of it for long-poll claims, a tenth for event streams, each
bounded by MEMORY_SHARE of the memory available at start. A limit set by hand is kept, but
never above the room there is.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path

# Files kept for what is not a client's connection: the database and its WAL, logs, the
# PostgreSQL pool and listener, the event loop's own.
FILE_RESERVE = 256
# Connections always left for work that does not wait: an eighth, at least this many.
MIN_WORKING = 512
# Of the memory available at start, the share waiting claims and streams may take together.
MEMORY_SHARE = 0.5
# What one waiting claim and one open stream add to the server's resident memory (measured:
# `make bench`, section fleet), rounded up.
WAITER_BYTES = 20 * 1024
STREAM_BYTES = 24 * 1024
# Where the operating system has no open-files limit to read (Windows): what we assume.
FILES_WITHOUT_LIMIT = 8192


@dataclass(frozen=True, slots=True)
class Capacity:
    files: int  # the open-files limit the server runs with
    memory: int | None  # bytes available at start (None: unknown)
    connections: int  # connections granian may hold open (its backpressure)
    working: int  # of those, always left for work that does not wait
    max_waiters: int
    max_streams: int
    capped: tuple[str, ...] = ()  # settings given by hand above the room there is

    def describe(self) -> str:
        memory = "" if self.memory is None else f", {self.memory // 2**20:,} MiB memory available"
        return (
            f"capacity: {self.files:,} open files{memory}: up to {self.max_waiters:,} waiting "
            f"claims and {self.max_streams:,} event streams (about {WAITER_BYTES // 1024} and "
            f"{STREAM_BYTES // 1024} KiB each), {self.working:,} connections kept for work"
        )


def raise_file_limit() -> int:
    """Raise this process's open-files limit to its hard limit (children inherit it); the
    limit it now has."""
    try:
        import resource
    except ImportError:  # Windows: no such limit on sockets
        return FILES_WITHOUT_LIMIT
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        target = 1 << 20
    if sys.platform == "darwin":  # macOS refuses more than kern.maxfilesperproc
        target = min(target, _darwin_max_files())
    if soft == resource.RLIM_INFINITY or soft >= target:
        return int(target if soft == resource.RLIM_INFINITY else soft)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return int(target if soft == resource.RLIM_INFINITY else soft)


def _darwin_max_files() -> int:
    import subprocess

    try:
        out = subprocess.run(
            ["sysctl", "-n", "kern.maxfilesperproc"], capture_output=True, text=True, timeout=5
        ).stdout
        return int(out.strip())
    except (OSError, ValueError, subprocess.SubprocessError):
        return 10240  # OPEN_MAX


def available_memory() -> int | None:
    """Bytes this process may still use: the system's available memory, or what is left under
    its cgroup's limit if that is less; None where neither can be read."""
    found: list[int] = []
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
                break
    with contextlib.suppress(OSError, ValueError):
        cgroup = Path("/sys/fs/cgroup")
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text().strip())
            found.append(max(0, int(limit) - used))
    return min(found) if found else None


def plan(
    files: int,
    memory: int | None,
    max_waiters: int | None = None,
    max_streams: int | None = None,
) -> Capacity:
    """The limits for a process with `files` open files and `memory` bytes available; a limit
    given (not None) is kept up to the room there is."""
    connections = max(64, files - FILE_RESERVE)
    working = min(connections, max(MIN_WORKING, connections // 8))
    room = connections - working
    waiters_room, streams_room = room - room // 10, room // 10
    if memory is not None:
        budget = int(memory * MEMORY_SHARE)
        waiters_room = min(waiters_room, budget * 9 // 10 // WAITER_BYTES)
        streams_room = min(streams_room, budget // 10 // STREAM_BYTES)
    capped = []
    waiters, streams = waiters_room, streams_room
    if max_waiters is not None:
        waiters = min(max_waiters, room)
        if max_waiters > room:
            capped.append("max_waiters")
    if max_streams is not None:
        streams = min(max_streams, room)
        if max_streams > room:
            capped.append("max_streams")
    return Capacity(files, memory, connections, working, waiters, streams, tuple(capped))
