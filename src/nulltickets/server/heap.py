"""The server's garbage collector: what start-up made is frozen, young collections are rare, and
every collection is timed for GET /metrics.

Nearly everything a request makes is freed by reference counting; the cyclic collector only
finds the rest. With CPython's defaults it ran about every 4 ms under load, and every few
hundred milliseconds a full collection walked every object start-up had made (modules, routes,
prepared statements): 15 to 20 ms in which no request moved, which was most of the 99th
percentile at 64 agents. `settle()` collects once, freezes what survives (the collector never
walks it again), and lets the young generation grow to YOUNG_THRESHOLD objects before it is
collected, so a collection runs when garbage has really piled up: memory held by cycles stays
bounded by that many objects.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from nulltickets.domain.stats import Histogram

# Allocations of tracked objects (net of those freed) between young collections; CPython's
# default is 700. The older generations keep CPython's ratios (10 young collections per middle
# one, 10 of those per full one).
YOUNG_THRESHOLD = 50_000
OLDER_THRESHOLDS = (10, 10)

# Bounds, in seconds, of one collection's pause.
PAUSE_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
GENERATIONS = (0, 1, 2)


class Collector:
    """Owns the process's collector settings from `settle()` to `close()`, and times each
    collection: `pauses[generation]` is a histogram of their durations."""

    def __init__(self) -> None:
        self.pauses = {g: Histogram(PAUSE_SECONDS) for g in GENERATIONS}
        self.frozen = 0
        self._started = 0.0
        self._previous: tuple[int, int, int] | None = None

    def settle(self) -> None:
        """Call once start-up is done: what it made is then frozen, never walked again."""
        if self._previous is not None:
            return
        gc.collect()
        gc.freeze()
        self.frozen = gc.get_freeze_count()
        self._previous = gc.get_threshold()
        gc.set_threshold(YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
        gc.callbacks.append(self._timed)

    def close(self) -> None:
        """CPython's settings back (the frozen objects stay frozen: unfreezing would hand them
        all to the next full collection at once)."""
        if self._previous is None:
            return
        if self._timed in gc.callbacks:
            gc.callbacks.remove(self._timed)
        gc.set_threshold(*self._previous)
        self._previous = None

    def _timed(self, phase: str, info: dict[str, Any]) -> None:
        # Collections do not nest and run with the GIL held: no lock needed.
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.pauses[info["generation"]].observe(time.perf_counter() - self._started)
