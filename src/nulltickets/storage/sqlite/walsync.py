"""Syncing the writer's WAL file off the event loop's thread, through SQLite's own file handle.

With `--durability full` the writer's connection runs with synchronous=NORMAL, so COMMIT writes
the WAL frames without waiting for the disk, and the writer makes its commits durable itself:
it asks `WalSyncer` (a thread of its own) to sync the WAL, and answers a batch only once a sync
that began after the batch's COMMIT returned has completed. One sync covers every commit made
before it began, so while one runs, the loop goes on reading, deciding and committing.

The sync goes through SQLite's VFS, not around it: `SQLITE_FCNTL_JOURNAL_POINTER` hands out the
`sqlite3_file` the writer's connection writes its WAL through, and `WalFile.sync` calls that
file's own xSync method, exactly the call SQLite makes at the end of a synchronous=FULL commit
(the same flags: F_FULLFSYNC on macOS when the connection has `PRAGMA fullfsync`, FlushFileBuffers
on Windows, fdatasync or fsync elsewhere). A VFS layered under SQLite (the tests' power-cut VFS)
therefore sees an ordinary xSync. ctypes releases the GIL for the length of the call.

What synchronous=NORMAL leaves out in WAL mode is only that per-commit sync: SQLite still syncs
the WAL before every checkpoint copies it back, the database file when a checkpoint has copied
all of it, and the new WAL header when the log starts over. The log starts over only after a
checkpoint has copied every frame into the database file and synced that file, so a restart
never drops a commit, answered or waiting.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable

import apsw

from nulltickets.errors import StorageUnavailable

log = logging.getLogger("nulltickets.storage")

THREAD_NAME = "nulltickets-wal-sync"

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
        self._pointer = pointer
        self._xsync = methods.xSync
        self.flags = flags
        self.syncs = 0

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
        rc = self._xsync(self._pointer, self.flags)
        if rc != apsw.SQLITE_OK:
            raise StorageUnavailable(f"the WAL file could not be synced (SQLite error {rc})")
        self.syncs += 1


class WalSyncer:
    """A thread that syncs the WAL whenever the writer has committed something not yet synced.

    `committed(seq)` (any thread) says commits up to `seq` are in the WAL; the thread then reads
    the latest `seq` *before* it starts a sync and, once the sync returns, reports
    `done(seq, None)` (or `done(seq, error)`) through the callback, from its own thread. Syncs
    follow one another without a round trip through the loop while commits keep coming. A
    thread without the loop waits with `sync_through(seq)` instead. Every sync of the writer's
    barrier runs on this one thread (THREAD_NAME).

    A failed sync ends the thread: every later `sync_through` raises that error."""

    def __init__(self, wal: WalFile, done: Callable[[int, BaseException | None], None]) -> None:
        self.wal = wal
        self._done = done
        self._cond = threading.Condition(threading.Lock())
        self._committed = 0
        self._synced = 0
        self._stopping = False
        self.failed: StorageUnavailable | None = None
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    @property
    def synced(self) -> int:
        """The last commit known to be on disk."""
        return self._synced

    def committed(self, seq: int) -> None:
        with self._cond:
            if seq > self._committed:
                self._committed = seq
                self._cond.notify_all()

    def sync_through(self, seq: int) -> None:
        """Block until commits up to `seq` are on disk (from a thread other than the loop's);
        raises StorageUnavailable when a sync failed."""
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

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._committed <= self._synced and not self._stopping:
                    self._cond.wait()
                if self._committed <= self._synced:  # stopping, nothing left
                    return
                target = self._committed  # every commit up to here returned before the sync
            try:
                self.wal.sync()
            except BaseException as exc:
                log.error("syncing the WAL failed: %s", exc)
                err = exc if isinstance(exc, StorageUnavailable) else StorageUnavailable(str(exc))
                with self._cond:
                    self.failed = err
                    self._cond.notify_all()
                self._done(target, err)
                return  # the writer stops writing (see Writer._fail_sync): nothing more to sync
            with self._cond:
                self._synced = target
                self._cond.notify_all()
            self._done(target, None)

    def stop(self) -> None:
        """Finish the sync in progress (and one for commits not yet synced), then end."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
