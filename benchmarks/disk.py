"""The disk's own sync, measured where the benchmark's databases live.

With `--durability full` every answered write waits for at least one sync of the WAL, so how
long this disk takes to sync a small write, with nothing else running, is the floor under what
`full` adds to a request. Each syncer overwrites 16 KB blocks of a file it wrote (and synced)
beforehand, as the WAL is overwritten once it has started over, and times the fdatasync after
each write; once one syncer at a time, once two at a time on two files (the server has two sync
threads).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.cycle import pct

BLOCK = 16 * 1024  # about what a commit of a few agents' jobs writes to the WAL
SPAN = 256  # blocks each file cycles over (4 MB, written and synced before the timing)


def _timed_syncs(path: Path, count: int, start: threading.Barrier) -> list[float]:
    sync = getattr(os, "fdatasync", os.fsync)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.pwrite(fd, bytes(BLOCK * SPAN), 0)
        os.fsync(fd)
        block = b"\x01" * BLOCK
        start.wait()
        times = []
        for i in range(count):
            os.pwrite(fd, block, (i % SPAN) * BLOCK)
            began = time.perf_counter()
            sync(fd)
            times.append(time.perf_counter() - began)
        return times
    finally:
        os.close(fd)
        path.unlink()


def sync_floor(directory: Path, count: int = 1_000) -> dict[str, dict[str, Any]]:
    """`count` timed syncs per syncer, one syncer and then two at once (threads: the GIL is
    released during each write and sync): each case's median and 90th percentile in ms."""
    result = {}
    for name, syncers in (("one", 1), ("two", 2)):
        start = threading.Barrier(syncers)
        with ThreadPoolExecutor(syncers) as pool:
            futures = [
                pool.submit(_timed_syncs, directory / f"disk-sync-{i}.bin", count, start)
                for i in range(syncers)
            ]
            times = [t for f in futures for t in f.result()]
        result[name] = {
            "syncers": syncers,
            "syncs": len(times),
            "median_ms": round(pct(times, 0.5), 3),
            "p90_ms": round(pct(times, 0.9), 3),
        }
    return result


def describe(floor: dict[str, dict[str, Any]]) -> str:
    """One line on the disk's own sync, for the durability section."""
    one, two = floor["one"], floor["two"]
    return (
        f"This disk, with nothing else running: an fdatasync after a {BLOCK // 1024} KB "
        f"overwrite takes {one['median_ms']:.2f} ms (median; p90 {one['p90_ms']:.2f}) one at a "
        f"time, {two['median_ms']:.2f} ms (p90 {two['p90_ms']:.2f}) two at a time"
    )
