"""The server's garbage collector settings (heap.py), in this process: what start-up made is
frozen, a young collection waits for YOUNG_THRESHOLD new objects, and each one is timed."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from nulltickets.server import heap


@pytest.fixture
def collector() -> Iterator[heap.Collector]:
    before = gc.get_threshold()
    c = heap.Collector()
    c.settle()
    yield c
    c.close()
    gc.unfreeze()  # this process is pytest's, not a server's: its objects back to the collector
    assert gc.get_threshold() == before


def garbage_cycles(n: int) -> None:
    """n objects the reference counts never free: each list holds itself."""
    for _ in range(n):
        a: list[object] = []
        a.append(a)


def collections(c: heap.Collector, generation: int) -> int:
    counts, _ = c.pauses[generation].snapshot()
    return sum(counts)


def test_settle_freezes_what_exists_and_raises_the_young_threshold(
    collector: heap.Collector,
) -> None:
    assert gc.get_threshold() == (heap.YOUNG_THRESHOLD, *heap.OLDER_THRESHOLDS)
    assert collector.frozen > 1000  # (some are freed since, by their reference counts)
    collector.settle()  # a second call changes nothing
    assert gc.get_threshold()[0] == heap.YOUNG_THRESHOLD
    assert gc.callbacks.count(collector._timed) == 1


def test_a_young_collection_waits_for_the_threshold_then_frees_the_cycles(
    collector: heap.Collector,
) -> None:
    gc.collect(0)
    young = collections(collector, 0)
    garbage_cycles(2_000)  # CPython's default threshold (700) would have collected twice
    assert collections(collector, 0) == young
    garbage_cycles(heap.YOUNG_THRESHOLD + 1_000)
    assert collections(collector, 0) > young
    # Collected: the young generation holds fewer objects than one threshold's worth.
    assert gc.get_count()[0] < heap.YOUNG_THRESHOLD


def test_each_collection_is_timed_in_its_generation(collector: heap.Collector) -> None:
    full = collections(collector, 2)
    garbage_cycles(10_000)
    gc.collect()
    assert collections(collector, 2) == full + 1
    counts, total = collector.pauses[2].snapshot()
    assert total > 0
    assert len(counts) == len(heap.PAUSE_SECONDS) + 1


def test_close_stops_timing_and_gives_back_the_thresholds() -> None:
    before = gc.get_threshold()
    c = heap.Collector()
    c.settle()
    c.close()
    gc.unfreeze()
    assert gc.get_threshold() == before
    assert c._timed not in gc.callbacks
    timed = collections(c, 2)
    gc.collect()
    assert collections(c, 2) == timed
