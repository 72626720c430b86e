"""Ids: the 36-character UUID shape clients know, version 7, ordered by creation time."""

from __future__ import annotations

import time
import uuid

from nulltickets.domain.ids import new_id
from tests.conftest import ID_SHAPE


def test_an_id_is_a_version_7_rfc_uuid_in_canonical_form() -> None:
    for _ in range(2000):
        value = new_id()
        assert ID_SHAPE.match(value), value
        parsed = uuid.UUID(value)
        assert parsed.version == 7
        assert parsed.variant == uuid.RFC_4122
        assert str(parsed) == value


def test_the_prefix_is_the_creation_time_in_milliseconds() -> None:
    before = time.time_ns() // 1_000_000
    value = new_id()
    after = time.time_ns() // 1_000_000
    stamp = int(value.replace("-", "")[:12], 16)
    assert before <= stamp <= after


def test_ids_of_later_milliseconds_sort_after_earlier_ones_and_never_repeat() -> None:
    first = new_id()
    time.sleep(0.002)
    second = new_id()
    assert first < second
    many = {new_id() for _ in range(20_000)}
    assert len(many) == 20_000


def test_ids_made_one_after_another_sort_in_that_order_within_a_millisecond() -> None:
    made = [new_id() for _ in range(20_000)]
    assert made == sorted(made)
    assert len(set(made)) == len(made)
    stamps = [v.replace("-", "")[:12] for v in made]
    assert len(set(stamps)) < len(made)  # many shared a millisecond, and still sorted


def test_ids_made_by_many_threads_at_once_never_repeat() -> None:
    import threading

    found: list[list[str]] = [[] for _ in range(8)]

    def make(out: list[str]) -> None:
        out.extend(new_id() for _ in range(5_000))

    threads = [threading.Thread(target=make, args=(out,)) for out in found]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [v for out in found for v in out]
    assert len(set(every)) == len(every)
    for out in found:
        assert out == sorted(out)
