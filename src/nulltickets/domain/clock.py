"""Time and chance, as values the service is given: the wall clock and a random source in the
server, a clock a test moves by hand."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

Clock = Callable[[], int]  # milliseconds since the Unix epoch
Random = Callable[[], float]  # uniform in [0, 1)


def wall_ms() -> int:
    return time.time_ns() // 1_000_000


system_random: Random = random.Random().random


class FixedClock:
    """A clock that stands still until moved: `clock.advance(ms)`, `clock.now = ms`."""

    def __init__(self, now: int = 1_700_000_000_000) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now

    def advance(self, ms: int) -> int:
        self.now += ms
        return self.now
