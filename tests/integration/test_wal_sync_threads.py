"""The native WAL sync threads (cext/walsync.c), driven directly: a C function pointer for xSync
(a ctypes callback, which takes the GIL itself when the C threads call it) that the test holds,
fails or lets through, and the pipe the threads write to after every sync. Real POSIX threads.

The writer's use of them (answers only after the covering sync, failures, restarts) is in
test_wal_sync.py, which runs with the native syncer and with the Python one."""

from __future__ import annotations

import ctypes
import os
import select
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from nulltickets.storage.sqlite import walsync

native = pytest.importorskip(
    "nulltickets._cext.walsync", reason="the native sync threads are built on POSIX systems"
)

XSync = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
SQLITE_IOERR_FSYNC = 1034


class Disk:
    """An xSync that records each call, blocks while `held`, and fails while `failing`."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.held = False
        self.failing = False
        self.calls: list[tuple[int, int]] = []  # (thread ident, flags) of each sync begun
        self.in_progress = 0
        self.most_at_once = 0
        self.xsync = XSync(self._xsync)  # kept alive as long as the threads may call it

    def _xsync(self, _file: int | None, flags: int) -> int:
        with self.lock:
            self.calls.append((threading.get_ident(), flags))
            self.in_progress += 1
            self.most_at_once = max(self.most_at_once, self.in_progress)
            self.lock.notify_all()
            while self.held:
                self.lock.wait()
            self.in_progress -= 1
            return SQLITE_IOERR_FSYNC if self.failing else 0

    def release(self) -> None:
        with self.lock:
            self.held = False
            self.lock.notify_all()

    def wait_calls(self, n: int) -> None:
        with self.lock:
            assert self.lock.wait_for(lambda: len(self.calls) >= n, 10), self.calls


@pytest.fixture
def disk() -> Iterator[Disk]:
    d = Disk()
    yield d
    d.release()


def start(disk: Disk, threads: int = 1) -> tuple[Any, int]:
    r, w = os.pipe()
    os.set_blocking(w, False)
    address = ctypes.cast(disk.xsync, ctypes.c_void_p).value
    assert address
    st = native.SyncThread(address, 0xF11E, 3, w, threads)
    return st, r


def wake(fd: int) -> bool:
    """Whether the threads wrote to the pipe within 10 s (and empty it)."""
    ready, _, _ = select.select([fd], [], [], 10)
    if ready:
        os.read(fd, 4096)
    return bool(ready)


def test_a_commit_is_synced_with_the_files_flags_and_the_pipe_says_so(disk: Disk) -> None:
    st, r = start(disk)
    assert st.state() == (0, 0, 0)
    st.committed(1)
    assert wake(r)
    assert st.state() == (1, 0, 1)
    assert disk.calls[0][1] == 3
    assert disk.calls[0][0] in st.idents()  # made on the thread, not the caller's
    assert disk.calls[0][0] != threading.get_ident()
    st.stop()


def test_one_sync_covers_every_commit_made_before_it_began(disk: Disk) -> None:
    st, r = start(disk)
    disk.held = True
    st.committed(1)
    disk.wait_calls(1)
    for seq in (2, 3, 4):  # made while the first sync runs
        st.committed(seq)
    disk.release()
    st.sync_through(4)
    assert st.state()[0] == 4
    assert len(disk.calls) == 2  # the first for 1, one more for 2 to 4
    st.stop()
    os.close(r)


def test_with_two_threads_a_later_commit_does_not_wait_for_the_sync_in_progress(
    disk: Disk,
) -> None:
    st, r = start(disk, threads=2)
    assert len(set(st.idents())) == 2
    disk.held = True
    st.committed(1)
    disk.wait_calls(1)
    st.committed(2)
    disk.wait_calls(2)  # begun on the other thread while the first is still held
    assert disk.most_at_once == 2
    assert {c[0] for c in disk.calls} == set(st.idents())
    assert st.state()[0] == 0
    disk.release()
    assert st.sync_through(2) == 0
    assert st.state()[0] == 2
    st.stop()
    os.close(r)


def test_sync_through_blocks_without_the_gil_until_its_commit_is_synced(disk: Disk) -> None:
    st, r = start(disk)
    disk.held = True
    done = threading.Event()
    results: list[int] = []

    def waiter() -> None:
        results.append(st.sync_through(7))
        done.set()

    t = threading.Thread(target=waiter)
    t.start()
    disk.wait_calls(1)  # the callback ran under the GIL while the waiter blocked: no deadlock
    assert not done.wait(0.2)
    disk.release()
    assert done.wait(10)
    t.join()
    assert results == [0]
    assert st.state()[0] == 7
    st.stop()
    os.close(r)


def test_a_failed_sync_ends_every_thread_and_is_reported_to_all(disk: Disk) -> None:
    st, r = start(disk, threads=2)
    disk.failing = True
    st.committed(1)
    assert wake(r)
    synced, failed, syncs = st.state()
    assert (synced, failed, syncs) == (0, SQLITE_IOERR_FSYNC, 0)
    assert st.sync_through(2) == SQLITE_IOERR_FSYNC  # no thread left to sync: answered at once
    calls = len(disk.calls)
    st.committed(3)
    st.stop()  # joins both threads: they ended after the failure
    assert len(disk.calls) == calls
    os.close(r)


def test_stop_finishes_the_commits_not_yet_synced(disk: Disk) -> None:
    st, r = start(disk)
    disk.held = True
    st.committed(1)
    disk.wait_calls(1)
    st.committed(2)
    releaser = threading.Timer(0.2, disk.release)
    releaser.start()
    st.stop()
    releaser.join()
    assert st.state()[0] == 2
    assert st.idents() == ()
    assert st.sync_through(3) == -1  # stopped: nothing will sync it
    os.close(r)


def test_each_syncs_duration_is_counted_against_the_bounds(disk: Disk) -> None:
    """GET /metrics's nulltickets_wal_sync_duration_seconds: the threads time every completed
    sync themselves; a failed one is not counted (it ends the threads)."""
    r, w = os.pipe()
    os.set_blocking(w, False)
    address = ctypes.cast(disk.xsync, ctypes.c_void_p).value
    st = native.SyncThread(address, 0xF11E, 3, w, 1, (0.05, 10.0))
    assert st.durations() == ([0, 0, 0], 0.0)
    st.committed(1)
    st.sync_through(1)  # a sync the test does not hold: well under 10 s
    disk.held = True
    st.committed(2)
    disk.wait_calls(2)
    releaser = threading.Timer(0.2, disk.release)  # this one lasts at least 0.2 s
    releaser.start()
    assert st.sync_through(2) == 0
    releaser.join()
    counts, total = st.durations()
    assert sum(counts) == st.state()[2] == 2
    assert counts[1] >= 1 and counts[2] == 0  # the held one is above 0.05 s, none above 10 s
    assert 0.2 <= total < 20
    disk.failing = True
    st.committed(3)
    assert st.sync_through(3) == SQLITE_IOERR_FSYNC
    assert st.durations()[0] == counts
    st.stop()
    with pytest.raises(ValueError):
        native.SyncThread(address, 0xF11E, 3, w, 1, tuple(range(1, 34)))
    with pytest.raises(TypeError):
        native.SyncThread(address, 0xF11E, 3, w, 1, ("soon",))
    os.close(r)
    os.close(w)


def test_bad_arguments_are_refused_before_any_thread_starts(disk: Disk) -> None:
    address = ctypes.cast(disk.xsync, ctypes.c_void_p).value
    with pytest.raises(ValueError):
        native.SyncThread(address, 0xF11E, 3, -1)
    with pytest.raises(ValueError):
        native.SyncThread(0, 0xF11E, 3, 1)
    with pytest.raises(ValueError):
        native.SyncThread(address, 0xF11E, 3, 1, 9)


def test_the_native_threads_are_known_by_the_barriers_name(disk: Disk) -> None:
    """A layered VFS (the power-cut one, the tests' gate) tells the barrier's syncs apart by
    walsync.current_thread_name(), which names the C threads of a NativeSyncer too."""
    names: list[str] = []

    def xsync(file: int | None, flags: int) -> int:
        names.append(walsync.current_thread_name())
        return disk.xsync(file, flags)

    seen = XSync(xsync)
    methods = SimpleNamespace(xSync=seen)  # what WalFile keeps of the file's io methods
    wal = walsync.WalFile(0xF11E, methods, 3)  # type: ignore[arg-type]
    syncer = walsync.NativeSyncer(wal)
    try:
        syncer.committed(1)
        syncer.sync_through(1)
        assert syncer.synced == 1 and syncer.syncs == 1
    finally:
        syncer.stop()
    assert names == [walsync.THREAD_NAME]
    assert walsync.current_thread_name() == threading.current_thread().name
    assert len(syncer._idents) == walsync.NATIVE_THREADS
    assert not set(syncer._idents) & walsync._sync_threads  # stop() forgot them
