"""Syncing the writer's WAL file off the event loop's thread, through SQLite's own file handle.

With `--durability full` the writer's connection runs with synchronous=NORMAL, so COMMIT writes
the WAL frames without waiting for the disk, and the writer makes its commits durable itself:
it asks a `Syncer` (a thread of its own) to sync the WAL, and answers a batch only once a sync
that began after the batch's COMMIT returned has completed. One sync covers every commit made
before it began, so while one runs, the loop goes on reading, deciding and committing.

The thread is native where `nulltickets._cext.walsync` was built (POSIX systems with a C
compiler): it never takes the GIL, and tells the loop of each sync with a byte on a pipe the
loop watches. A Python thread doing the same took the GIL twice per sync, so each sync made the
loop's thread give the GIL up and wait to get it back. Measured on 2 cores (docs,
Performance), the native threads gave `full` 2 to 7% more cycles per second in `make bench`'s
interleaved runs, and up to 28% in a period when the disk's syncs were slow. Elsewhere a Python
thread runs instead, reporting through `call_soon_threadsafe`.

The sync goes through SQLite's VFS, not around it: `SQLITE_FCNTL_JOURNAL_POINTER` hands out the
`sqlite3_file` the writer's connection writes its WAL through, and `WalFile.sync` calls that
file's own xSync method, exactly the call SQLite makes at the end of a synchronous=FULL commit
(the same flags: F_FULLFSYNC on macOS when the connection has `PRAGMA fullfsync`, FlushFileBuffers
on Windows, fdatasync or fsync elsewhere). A VFS layered under SQLite (the tests' power-cut VFS)
therefore sees an ordinary xSync, whichever thread makes it (apsw takes the GIL inside a
Python VFS's methods itself). ctypes releases the GIL for the length of a call from Python.

What synchronous=NORMAL leaves out in WAL mode is only that per-commit sync: SQLite still syncs
the WAL before every checkpoint copies it back, the database file when a checkpoint has copied
all of it, and the new WAL header when the log starts over. The log starts over only after a
checkpoint has copied every frame into the database file and synced that file, so a restart
never drops a commit, answered or waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Protocol

import apsw

from nulltickets.domain.stats import COMMIT_SECONDS, Histogram
from nulltickets.errors import StorageUnavailable

try:
    from nulltickets._cext import walsync as _native
except ImportError:  # not built (no compiler, or not a POSIX system): the Python thread
    _native = None

log = logging.getLogger("nulltickets.storage")

THREAD_NAME = "nulltickets-wal-sync"
# The native syncer's threads. With two, a commit made while one sync runs starts its own sync at
# once on the other thread instead of waiting for the first to end: each fdatasync makes
# durable everything written before it began, so the later one's completion covers both. On
# this machine's disk two syncs overlap almost fully (about 6,000 syncs/s with two threads,
# 3,600 with one, at 180 against 150 µs each), and `full` at 16 agents gained about 10%; a
# third thread only made each sync slower.
NATIVE_THREADS = 2

_XSync = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
_XDeviceCharacteristics = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class _IoMethods(ctypes.Structure):
    """The head of SQLite's `sqlite3_io_methods` (version 1 layout, which every version keeps)."""

    _fields_ = [
        ("iVersion", ctypes.c_int),
        ("xClose", ctypes.c_void_p),
        ("xRead", ctypes.c_void_p),
        ("xWrite", ctypes.c_void_p),
        ("xTruncate", ctypes.c_void_p),
        ("xSync", _XSync),
        ("xFileSize", ctypes.c_void_p),
        ("xLock", ctypes.c_void_p),
        ("xUnlock", ctypes.c_void_p),
        ("xCheckReservedLock", ctypes.c_void_p),
        ("xFileControl", ctypes.c_void_p),
        ("xSectorSize", ctypes.c_void_p),
        ("xDeviceCharacteristics", _XDeviceCharacteristics),
    ]


class _File(ctypes.Structure):
    """SQLite's `sqlite3_file`: every VFS's file object starts with its methods."""

    _fields_ = [("pMethods", ctypes.POINTER(_IoMethods))]


class WalFile:
    """The WAL file of one open connection, as that connection's VFS sees it.

    Valid while the connection is open and in WAL mode: SQLite keeps one handle on the WAL for
    the connection's life (it deletes the file only when the last connection closes, which the
    writer's own open connection prevents). The owner must stop using it before closing the
    connection."""

    def __init__(self, pointer: int, methods: _IoMethods, flags: int) -> None:
        self.pointer = pointer
        self._xsync = methods.xSync
        self.flags = flags

    @property
    def xsync_address(self) -> int:
        """The address of the file's xSync method, for a sync thread written in C."""
        address = ctypes.cast(self._xsync, ctypes.c_void_p).value
        assert address is not None
        return address

    @classmethod
    def of(cls, conn: apsw.Connection) -> WalFile | None:
        """The WAL file of `conn`, or None when its WAL cannot be synced apart from its commits
        (no WAL, or a device on which a write may damage bytes next to it: there SQLite pads
        each synchronous=FULL commit to a sector boundary, which NORMAL does not)."""
        pointer = ctypes.c_void_p()
        if not conn.file_control(
            "main", apsw.SQLITE_FCNTL_JOURNAL_POINTER, ctypes.addressof(pointer)
        ):
            return None
        if not pointer.value:
            return None
        file = _File.from_address(pointer.value)
        if not file.pMethods:
            return None
        methods = file.pMethods.contents
        if not methods.xSync or not methods.xDeviceCharacteristics:
            return None
        if not methods.xDeviceCharacteristics(pointer.value) & (
            apsw.SQLITE_IOCAP_POWERSAFE_OVERWRITE | apsw.SQLITE_IOCAP_SEQUENTIAL
        ):
            return None
        # SQLite's own commit sync: SQLITE_SYNC_FULL (F_FULLFSYNC on macOS) with `fullfsync`.
        flags = apsw.SQLITE_SYNC_FULL if conn.pragma("fullfsync") else apsw.SQLITE_SYNC_NORMAL
        return cls(pointer.value, methods, flags)

    def sync(self) -> None:
        """The WAL's xSync, from any thread, without the GIL. Raises StorageUnavailable."""
        rc = self._xsync(self.pointer, self.flags)
        if rc != apsw.SQLITE_OK:
            raise StorageUnavailable(f"the WAL file could not be synced (SQLite error {rc})")


Report = Callable[[int, BaseException | None], None]

# The identifiers (threading.get_ident()) of the sync threads running, Python or native.
_sync_threads: set[int] = set()


def current_thread_name() -> str:
    """The calling thread's name, every WAL sync thread (a native one too, which Python knows
    by no name) being THREAD_NAME: how a layered VFS tells the barrier's syncs apart."""
    if threading.get_ident() in _sync_threads:
        return THREAD_NAME
    return threading.current_thread().name


class Syncer(Protocol):
    """Syncs the writer's WAL whenever the writer has committed something not yet synced.

    `committed(seq)` (any thread) says commits up to `seq` are in the WAL; the thread then reads
    the latest `seq` *before* it starts a sync, and once the sync returns, the `report` given to
    `attach` hears `report(seq, None)` (or `report(seq, error)`) on the event loop given with
    it. Syncs follow one another without a round trip through the loop while commits keep
    coming. A thread without the loop waits with `sync_through(seq)` instead.

    A failed sync ends the thread: every later `sync_through` raises that error."""

    wal: WalFile
    failed: StorageUnavailable | None
    name: str  # what syncs, for the log: "2 native threads", "a Python thread"
    durations: Histogram  # how long each completed sync took, for GET /metrics

    @property
    def synced(self) -> int:
        """The last commit known to be on disk."""

    @property
    def syncs(self) -> int:
        """Syncs completed so far."""

    def committed(self, seq: int) -> None: ...

    def sync_through(self, seq: int) -> None:
        """Block until commits up to `seq` are on disk (from a thread other than the loop's);
        raises StorageUnavailable when a sync failed."""

    def attach(self, loop: asyncio.AbstractEventLoop, report: Report) -> None:
        """Report every sync's outcome through `report`, on `loop` (the loop's own thread),
        from now on."""

    def stop(self) -> None:
        """Finish the sync in progress (and one for commits not yet synced), then end."""


def start(wal: WalFile) -> Syncer:
    """The sync threads for `wal`: the native ones (`nulltickets._cext.walsync`, which never
    take the GIL) where they were built, else a Python thread. NULLTICKETS_WAL_SYNC=python picks
    the Python thread, and so does NULLTICKETS_PURE_PYTHON=1, as it picks the interpreted
    core."""
    python = (
        os.environ.get("NULLTICKETS_WAL_SYNC") == "python"
        or os.environ.get("NULLTICKETS_PURE_PYTHON") == "1"
    )
    if _native is not None and not python:
        return NativeSyncer(wal)
    return ThreadSyncer(wal)


class ThreadSyncer:
    """The Syncer on a Python thread: the sync itself runs without the GIL (ctypes releases it),
    but the thread takes the GIL to start each sync and to return from it."""

    name = "a Python thread"

    def __init__(self, wal: WalFile) -> None:
        self.wal = wal
        self._cond = threading.Condition(threading.Lock())
        self._committed = 0
        self._synced = 0
        self._syncs = 0
        self._stopping = False
        self._to: tuple[asyncio.AbstractEventLoop, Report] | None = None
        self.failed: StorageUnavailable | None = None
        self.durations = Histogram(COMMIT_SECONDS, shared=True)
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()
        assert self._thread.ident is not None
        _sync_threads.add(self._thread.ident)

    @property
    def synced(self) -> int:
        return self._synced

    @property
    def syncs(self) -> int:
        return self._syncs

    def committed(self, seq: int) -> None:
        with self._cond:
            if seq > self._committed:
                self._committed = seq
                self._cond.notify_all()

    def sync_through(self, seq: int) -> None:
        with self._cond:
            if seq > self._committed:
                self._committed = seq
                self._cond.notify_all()
            while self._synced < seq and self.failed is None:
                if not self._thread.is_alive():
                    raise StorageUnavailable("the WAL sync thread has stopped")
                self._cond.wait(1.0)
            if self.failed is not None:
                raise self.failed

    def attach(self, loop: asyncio.AbstractEventLoop, report: Report) -> None:
        self._to = (loop, report)

    def _report(self, seq: int, exc: BaseException | None) -> None:
        to = self._to
        if to is None:
            return
        loop, report = to
        with contextlib.suppress(RuntimeError):  # the loop is closed: its owner settles the rest
            loop.call_soon_threadsafe(report, seq, exc)

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._committed <= self._synced and not self._stopping:
                    self._cond.wait()
                if self._committed <= self._synced:  # stopping, nothing left
                    return
                target = self._committed  # every commit up to here returned before the sync
            began = time.perf_counter()
            try:
                self.wal.sync()
            except BaseException as exc:
                log.error("syncing the WAL failed: %s", exc)
                err = exc if isinstance(exc, StorageUnavailable) else StorageUnavailable(str(exc))
                with self._cond:
                    self.failed = err
                    self._cond.notify_all()
                self._report(target, err)
                return  # the writer stops writing (see Writer._fail_sync): nothing more to sync
            self.durations.observe(time.perf_counter() - began)
            with self._cond:
                self._synced = target
                self._syncs += 1
                self._cond.notify_all()
            self._report(target, None)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        _sync_threads.discard(self._thread.ident or 0)


class _NativeDurations(Histogram):
    """The native threads' own count of their syncs' durations (kept in C, under the lock the
    threads share), read as a Histogram."""

    __slots__ = ("_thread",)

    def __init__(self, thread: object) -> None:
        super().__init__(COMMIT_SECONDS)
        self._thread = thread

    def observe(self, value: float) -> None:
        raise TypeError("the native sync threads count their syncs themselves")

    def snapshot(self) -> tuple[list[int], float]:
        counts, total = self._thread.durations()  # type: ignore[attr-defined]
        return list(counts), float(total)


class NativeSyncer:
    """The Syncer on a POSIX thread of `nulltickets._cext.walsync`, which never takes the GIL:
    the loop learns of each sync from a byte on a pipe it watches (`attach`), and reads the
    thread's progress then."""

    name = f"{NATIVE_THREADS} native threads"

    def __init__(self, wal: WalFile) -> None:
        assert _native is not None
        self.wal = wal
        self.failed: StorageUnavailable | None = None
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)  # a full pipe means a wake-up is on its way already
        try:
            self._thread = _native.SyncThread(
                wal.xsync_address, wal.pointer, wal.flags, self._wfd, NATIVE_THREADS, COMMIT_SECONDS
            )
        except BaseException:
            os.close(self._rfd)
            os.close(self._wfd)
            raise
        self.durations: Histogram = _NativeDurations(self._thread)
        self._idents: tuple[int, ...] = self._thread.idents()
        _sync_threads.update(self._idents)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._to: Report | None = None
        self._stopped = False

    @property
    def synced(self) -> int:
        synced: int = self._thread.state()[0]
        return synced

    @property
    def syncs(self) -> int:
        syncs: int = self._thread.state()[2]
        return syncs

    def committed(self, seq: int) -> None:
        self._thread.committed(seq)

    def _error(self, rc: int) -> StorageUnavailable:
        if self.failed is None:
            if rc < 0:
                self.failed = StorageUnavailable("the WAL sync thread has stopped")
            else:
                self.failed = StorageUnavailable(
                    f"the WAL file could not be synced (SQLite error {rc})"
                )
            log.error("syncing the WAL failed: %s", self.failed)
        return self.failed

    def sync_through(self, seq: int) -> None:
        rc: int = self._thread.sync_through(seq)
        if rc:
            raise self._error(rc)

    def attach(self, loop: asyncio.AbstractEventLoop, report: Report) -> None:
        self._to = report
        if loop is self._loop or self._stopped:
            return
        self._detach()
        loop.add_reader(self._rfd, self._readable)
        self._loop = loop

    def _detach(self) -> None:
        if self._loop is not None:
            with contextlib.suppress(Exception):  # a loop closed already has let go of it
                self._loop.remove_reader(self._rfd)
            self._loop = None

    def _readable(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self._rfd, 4096)  # any number of syncs: the state says how far they got
        synced, rc, _ = self._thread.state()
        if self._to is not None:
            self._to(synced, self._error(rc) if rc else None)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._thread.stop()
        self._detach()
        _sync_threads.difference_update(self._idents)
        os.close(self._rfd)
        os.close(self._wfd)
