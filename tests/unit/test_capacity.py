"""capacity.py: the limits on waiting claims and streams follow the open files and the memory
a server has, leave connections for work that does not wait, and cap what is set by hand."""

from __future__ import annotations

import sys

import pytest

from nulltickets.server.capacity import (
    FILE_RESERVE,
    MIN_WORKING,
    STREAM_BYTES,
    WAITER_BYTES,
    plan,
    raise_file_limit,
)

PLENTY = 64 * 2**30  # bytes: memory that bounds nothing here


def test_the_open_files_bound_the_waiting_and_leave_an_eighth_for_work() -> None:
    room = plan(20_000, PLENTY)
    assert room.connections == 20_000 - FILE_RESERVE
    assert room.working == room.connections // 8
    assert room.max_waiters + room.max_streams == room.connections - room.working
    assert room.max_streams == (room.connections - room.working) // 10


def test_few_open_files_still_leave_connections_for_work() -> None:
    room = plan(1024, PLENTY)
    assert room.working == MIN_WORKING
    assert room.max_waiters + room.max_streams + room.working == room.connections


def test_memory_bounds_the_waiting_when_it_is_short() -> None:
    room = plan(1_000_000, 1_000 * 2**20)  # a million files, 1000 MiB
    budget = 1_000 * 2**20 // 2
    assert room.max_waiters == budget * 9 // 10 // WAITER_BYTES
    assert room.max_streams == budget // 10 // STREAM_BYTES
    assert room.connections == 1_000_000 - FILE_RESERVE


def test_limits_set_by_hand_are_kept_up_to_the_room_there_is() -> None:
    room = plan(20_000, PLENTY, max_waiters=50, max_streams=0)
    assert (room.max_waiters, room.max_streams, room.capped) == (50, 0, ())
    huge = plan(2_000, PLENTY, max_waiters=1_000_000)
    assert huge.capped == ("max_waiters",)
    assert huge.max_waiters == huge.connections - huge.working


def test_the_start_up_line_says_the_limits() -> None:
    line = plan(20_000, 8 * 2**30, max_waiters=5_000, max_streams=500).describe()
    assert "20,000 open files" in line and "8,192 MiB" in line
    assert "up to 5,000 waiting claims and 500 event streams" in line


@pytest.mark.skipif(sys.platform == "win32", reason="Windows has no open-files limit")
def test_the_open_files_limit_is_raised_to_the_hard_limit() -> None:
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        lowered = min(soft, 512)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
        now = raise_file_limit()
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == now
        assert now == hard or (hard == resource.RLIM_INFINITY and now >= lowered)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
