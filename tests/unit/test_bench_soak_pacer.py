"""The soak's pacer (benchmarks/soak.py): agents paced to a rate start their cycles that far
apart in all, and a stall is not made up in a burst. A clock of the test's own: no figure
here depends on the machine."""

from __future__ import annotations

import threading

import pytest
from benchmarks.soak import Pacer


class Clock:
    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


def test_callers_at_one_moment_get_starts_one_gap_apart() -> None:
    clock = Clock()
    pacer = Pacer(4.0, clock, clock.sleep)
    starts = [pacer.wait() for _ in range(5)]
    assert starts == [100.0, 100.25, 100.5, 100.75, 101.0]
    assert clock.slept == [0.25, 0.5, 0.75, 1.0]  # the first goes at once


def test_a_start_missed_is_not_made_up_in_a_burst() -> None:
    clock = Clock()
    pacer = Pacer(10.0, clock, clock.sleep)
    assert pacer.wait() == 100.0
    clock.now = 105.0  # the server stalled for 5 s: 50 starts missed
    assert [pacer.wait() for _ in range(3)] == pytest.approx([105.0, 105.1, 105.2])
    assert clock.slept == pytest.approx([0.1, 0.2])


def test_threads_share_the_rate_and_never_share_a_start() -> None:
    clock = Clock()
    pacer = Pacer(1000.0, clock, clock.sleep)
    starts: list[float] = []
    lock = threading.Lock()

    def agent() -> None:
        for _ in range(250):
            start = pacer.wait()
            with lock:
                starts.append(start)

    threads = [threading.Thread(target=agent) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(starts) == pytest.approx([100.0 + i / 1000 for i in range(2000)])


def test_a_rate_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="more than 0"):
        Pacer(0.0)
