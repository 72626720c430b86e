"""How many rows the pruner's next batch takes: as many as fit in its time at the pace of the
batches before, growing at most twofold, between one row and the limit."""

from __future__ import annotations

from nulltickets.service.retention import FIRST_BATCH, Sizer


def test_a_batch_grows_twofold_to_the_limit_while_batches_are_quick() -> None:
    sizer = Sizer(100, 0.002)
    sizes = [sizer.size]
    for _ in range(8):
        sizer.took(sizer.size, 0.00001)  # far below the time aimed at
        sizes.append(sizer.size)
    assert sizes[0] == FIRST_BATCH
    assert sizes[:5] == [FIRST_BATCH * 2**i for i in range(5)]  # 4, 8, 16, 32, 64
    assert sizes[-1] == 100


def test_a_slow_batch_makes_the_next_one_fit_the_time() -> None:
    sizer = Sizer(100, 0.002)
    for _ in range(10):
        sizer.took(sizer.size, 0.00001)
    sizer.took(100, 0.010)  # 100 rows in 10 ms: 20 rows fit in 2 ms
    assert sizer.size == 20
    sizer.took(20, 1.0)  # the machine stalled: one row at a time, never none
    assert sizer.size == 1
    sizer.took(0, 5.0)  # a batch that found nothing says nothing of the pace
    assert sizer.size == 1


def test_the_limit_is_never_passed_even_when_a_batch_takes_no_measurable_time() -> None:
    sizer = Sizer(3, 0.002)
    for _ in range(5):
        sizer.took(sizer.size, 0.0)
    assert sizer.size == 3


def test_with_no_time_aimed_at_a_batch_grows_to_the_limit_however_slow() -> None:
    sizer = Sizer(100, None)
    for _ in range(10):
        sizer.took(sizer.size, 10.0)
    assert sizer.size == 100
