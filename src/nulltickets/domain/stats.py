"""Fixed-bucket histograms for GET /metrics: an observation is one bisect and two additions."""

from __future__ import annotations

import threading
from bisect import bisect_left


class Histogram:
    """Counts of observations at or below each bound (the last count: above every bound) and
    their sum. `shared=True` guards them with a lock of their own, for observations from several
    threads (a storage backend's); the lock is held for the two additions only."""

    __slots__ = ("_lock", "bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...], *, shared: bool = False) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self._lock = threading.Lock() if shared else None

    def observe(self, value: float) -> None:
        slot = bisect_left(self.bounds, value)
        lock = self._lock
        if lock is None:
            self.counts[slot] += 1
            self.total += value
            return
        with lock:
            self.counts[slot] += 1
            self.total += value

    def snapshot(self) -> tuple[list[int], float]:
        """(the counts per bucket, not cumulative; the sum), consistent with each other."""
        lock = self._lock
        if lock is None:
            return list(self.counts), self.total
        with lock:
            return list(self.counts), self.total


# Bounds, in seconds, of a commit (the WAL write and its fsync) and of a WAL checkpoint.
COMMIT_SECONDS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
)
CHECKPOINT_SECONDS = (*COMMIT_SECONDS, 5.0, 10.0)
# Bounds of the number of writes committed together (the SQLite writer's max_batch is 128).
BATCH_SIZES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
