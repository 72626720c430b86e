"""The database as the rest of the server sees it: one writer, a pool of readers.

Every write runs on the writer's single connection. The writer takes whatever jobs are waiting,
runs them in one `BEGIN IMMEDIATE` transaction, commits once, and only then hands each job its
own result or error. A failing job never fails its neighbours and never leaves a partial write
(see `_execute`), and no caller hears "done" before its write is committed.

In the server the writer runs on the event loop's own thread: a job submitted while the loop is
busy waits for the next flush, which the loop runs as soon as the requests in hand have been
read. That is group commit without any thread hand-off on the hot path (measured: thread
hand-offs cost more than the SQL). Callers without a loop (tools, tests) use `run_sync`, which
runs a batch of one under the same lock. Reads run on their own connections in a small thread
pool (apsw releases the GIL inside SQLite), each job inside one read transaction.

WAL checkpoints run on a thread of their own (`Checkpointer`), not inside the commit that
crosses the threshold as SQLite would do by default: a checkpoint's two fsyncs would otherwise
stop every request for several milliseconds.

With durability `full` the commit's own fsync is off the loop's thread too: the connection
commits with synchronous=NORMAL and a thread of its own syncs the WAL (`walsync.py`); a batch's
callers hear back only once a sync that began after its COMMIT has completed, and so do the
long-polls and event streams its notifications wake (`on_commit`). Meanwhile the loop reads,
decides and commits the next batches, which the next sync covers all at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import apsw

from nulltickets.domain.stats import BATCH_SIZES, CHECKPOINT_SECONDS, COMMIT_SECONDS, Histogram
from nulltickets.errors import StorageBusy, StorageFull, StorageReadOnly, StorageUnavailable
from nulltickets.storage.ports import Capabilities, StorageStats
from nulltickets.storage.sqlite import connection, walsync
from nulltickets.storage.sqlite.backend import SqliteBackend
from nulltickets.storage.sqlite.notifier import LocalNotifier

log = logging.getLogger("nulltickets.storage")

T = TypeVar("T")
RETRY_MIN_S = 0.01  # first wait for another process's write lock; doubles up to:
RETRY_MAX_S = 0.2
Job = Callable[[SqliteBackend], Any]
Outcome = tuple[Any, BaseException | None]
Entry = tuple[Job, "asyncio.Future[Any]", float]  # a pending job, its caller's future, when
# What a commit has to tell (its notifications), told once the commit is durable.
Tell = Callable[[], None]


def storage_error(exc: BaseException, system_errno: int | None = None) -> BaseException:
    """Translate driver errors into ours at the storage edge (`system_errno`: the OS error of
    the connection's last failure, when known)."""
    if isinstance(exc, apsw.BusyError | apsw.LockedError):
        return StorageBusy()
    if isinstance(exc, apsw.FullError):
        return StorageFull()
    if isinstance(exc, apsw.IOError):
        # A write past a file-size limit (EFBIG) or onto a full disk (ENOSPC) often surfaces as
        # SQLITE_IOERR_WRITE rather than SQLITE_FULL; any other I/O error is retryable at best.
        if system_errno in (errno.EFBIG, errno.ENOSPC) or (
            "disk" in str(exc).lower() and "full" in str(exc).lower()
        ):
            return StorageFull()
        return StorageUnavailable(f"database I/O error: {exc}")
    if isinstance(exc, apsw.ReadOnlyError):
        return StorageReadOnly()
    return exc


def _errno(conn: apsw.Connection) -> int | None:
    try:
        value = conn.system_errno
    except apsw.Error:
        return None
    return int(value) if value else None


class _Locked(Exception):
    """Another process holds the database's write lock: nothing of the batch ran."""


CHECKPOINT_FRAMES = 1000  # SQLite's own autocheckpoint threshold
WAL_LIMIT_FRAMES = 16000  # about 64 MB of WAL: past it, the writer finishes a checkpoint itself


class Checkpointer:
    """Copies the WAL back into the database file on a thread of its own.

    The writer's connection never checkpoints inside a commit; its WAL hook wakes this thread
    every CHECKPOINT_FRAMES frames instead, and the thread runs a PASSIVE checkpoint on its own
    connection while the writer goes on committing. Through `execute`, apsw releases the GIL for
    the whole checkpoint (its `wal_checkpoint()` method holds it, which would stall the event
    loop just the same).

    SQLite starts the WAL over only at a write that finds every frame already copied back. Under
    constant load a background pass never quite catches up, so once the WAL passes `limit`
    frames the writer copies the small remainder itself, between two transactions (`finish`),
    and the next transaction starts the file over: the WAL stays bounded.
    """

    def __init__(self, path: str, durability: str, limit: int = WAL_LIMIT_FRAMES) -> None:
        self.path = path
        self.durability = durability
        self.limit = limit
        self.frames = 0  # frames in the WAL after the last commit
        self.passes = 0
        self.finishes = 0
        # Observed by this thread and by the writer's (`finish`): shared.
        self.durations = Histogram(CHECKPOINT_SECONDS, shared=True)
        self._asked_at = 0
        self._failing = False
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def attach(self, writer_conn: apsw.Connection) -> None:
        """Take over checkpointing from `writer_conn` and start the thread."""
        writer_conn.pragma("wal_autocheckpoint", 0)
        writer_conn.set_wal_hook(self._on_commit)
        self._thread = threading.Thread(
            target=self._run, name="nulltickets-checkpointer", daemon=True
        )
        self._thread.start()

    def _on_commit(self, conn: apsw.Connection, name: str, frames: int) -> int:
        """SQLite's WAL hook, on the writer's thread after each commit: wake the thread every
        CHECKPOINT_FRAMES new frames."""
        self.frames = frames
        if frames < self._asked_at:  # the WAL started over
            self._asked_at = 0
        if frames - self._asked_at >= CHECKPOINT_FRAMES:
            self._asked_at = frames
            self._wake.set()
        return apsw.SQLITE_OK

    def _run(self) -> None:
        conn: apsw.Connection | None = None
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stopping:
                break
            try:
                if conn is None:
                    conn = connection.connect_writer(self.path, self.durability)
                    conn.set_busy_timeout(0)
                    conn.pragma("wal_autocheckpoint", 0)
                started = time.perf_counter()
                conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                self.durations.observe(time.perf_counter() - started)
                self.passes += 1
            except Exception as exc:  # disk full, I/O error: next time
                self._failed(exc)
            else:
                self._recovered()
        if conn is not None:
            conn.close()

    def _failed(self, exc: BaseException) -> None:
        """Say so once, not at every attempt, while checkpoints keep failing."""
        if not self._failing:
            self._failing = True
            log.warning("WAL checkpoint failed (the WAL grows until one succeeds): %s", exc)

    def _recovered(self) -> None:
        if self._failing:
            self._failing = False
            log.warning("WAL checkpoints succeed again")

    def finish(self, writer_conn: apsw.Connection) -> None:
        """Between two of the writer's transactions: if the WAL is past its limit, copy what
        the thread has not yet copied, so that the next transaction starts the file over."""
        if self.frames < self.limit:
            return
        try:
            # A pass of the thread in progress makes this return at once (busy); next time.
            started = time.perf_counter()
            row = writer_conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        except apsw.Error as exc:
            self._failed(exc)
            return
        self._recovered()
        if row is not None and not row[0]:  # row: (busy, frames in the WAL, frames copied)
            self.durations.observe(time.perf_counter() - started)
            self.finishes += 1

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None


class Writer:
    """Owns the only read-write connection; commits the jobs waiting together.

    When another process holds the write lock, the batch waits for it without blocking the
    event loop: SQLite's own busy wait is off on this connection, and the flush is retried on a
    timer. A job still waiting after the busy timeout gets StorageBusy (503 Retry-After).
    """

    def __init__(self, path: str, durability: str, max_batch: int = 128) -> None:
        self.path = path
        self.durability = durability
        self.max_batch = max_batch
        self._conn: apsw.Connection | None = None
        self._lock = threading.Lock()
        self._pending: list[Entry] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flush_scheduled = False
        self._retry_delay = RETRY_MIN_S
        self.busy_timeout_s = connection.BUSY_TIMEOUT_MS / 1000
        self._after_commit: list[Callable[[], Tell | None]] = []
        self.checkpointer = Checkpointer(path, durability)
        self.batches = 0
        self.jobs = 0
        # Observed under self._lock, but read by /metrics on the loop's thread: shared.
        self.commit_durations = Histogram(COMMIT_SECONDS, shared=True)
        self.batch_sizes = Histogram(BATCH_SIZES, shared=True)
        # Durability `full` off the loop's thread (see the module's text): commits are numbered;
        # a batch waits in `_unsynced` with the number of the last commit it may depend on
        # until a WAL sync that began after that commit has completed (`_durable`), and so
        # does the time of its commit: `durable_waits` counts how long each batch waited.
        self.syncer: walsync.Syncer | None = None
        self._committed = 0
        self._durable = 0
        self._unsynced: deque[tuple[int, float, list[Entry], list[Outcome], list[Tell]]] = deque()
        self.durable_waits = Histogram(COMMIT_SECONDS, shared=True)  # run_sync's threads too
        self._sync_failed: BaseException | None = None
        self._readers_waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    def start(self) -> None:
        self._conn = connection.connect_writer(self.path, self.durability)
        connection.migrate(self._conn)  # synchronous=FULL still: each migration is on disk
        self._conn.set_busy_timeout(0)  # never wait inside SQLite: see the class docstring
        self._backend = SqliteBackend(self._conn)
        if self.path != ":memory:":
            self.checkpointer.attach(self._conn)
            if self.durability == "full":
                wal = walsync.WalFile.of(self._conn)
                if wal is not None:
                    self._conn.pragma("synchronous", "NORMAL")
                    self.syncer = walsync.start(wal)
                    log.debug("durability full: the WAL is synced by %s", self.syncer.name)
                else:  # every commit keeps syncing itself, on the loop's thread
                    log.info("durability full: the WAL cannot be synced apart from commits here")

    def stop(self) -> None:
        """Run every job still pending, then close the connection (checkpointing the WAL)."""
        while self._pending:  # a lock held elsewhere fails them after the busy timeout
            self._flush_scheduled = False
            self._flush()
            if self._pending:
                time.sleep(self._retry_delay)
        syncs, name = 0, ""
        if self.syncer is not None:
            # The loop no longer runs the thread's reports: settle the last batches here.
            seq = self._committed
            try:
                self._sync_here(seq)
            except StorageUnavailable as exc:
                self._fail_sync(exc)
            else:
                self._synced(seq, None)
            self.syncer.stop()
            syncs, name = self.syncer.syncs, self.syncer.name
            self.syncer = None
        self.checkpointer.stop()
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(apsw.Error):
                    self._conn.execute("PRAGMA optimize")  # keep the planner's statistics fresh
                self._conn.close()
                self._conn = None
        if self.batches:
            log.info(
                "writer committed %d jobs in %d transactions (%.1f per commit); "
                "%d background checkpoints, %d finished by the writer",
                self.jobs,
                self.batches,
                self.jobs / self.batches,
                self.checkpointer.passes,
                self.checkpointer.finishes,
            )
        if syncs:
            log.info(
                "%d WAL syncs off the loop's thread by %s (%.1f jobs per sync)",
                syncs,
                name,
                self.jobs / syncs,
            )

    def on_commit(self, collect: Callable[[], Tell | None]) -> None:
        """Call `collect()` after every commit, on the committing thread with the writer's lock
        held: it takes what that commit has to tell and returns what tells it (or None). The
        writer calls that once the commit is durable, just before the batch's callers hear
        back: at once, or with the WAL-sync barrier once the covering sync has completed (on
        the loop; for `run_sync`, on its thread after its sync). After a failed sync, never:
        no one hears of a commit that a power cut could still take back."""
        self._after_commit.append(collect)

    async def run(self, job: Callable[[SqliteBackend], T]) -> T:
        """Run `job` in the next batch; return its result once that batch is committed (and,
        with durability `full`, synced)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._pending.append((job, future, time.monotonic()))
        if loop is not self._loop:
            self._use_loop(loop)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self._flush)
        return await future

    async def settled(self) -> None:
        """Return once every commit made so far is on disk: a read that may have seen one is
        answered only then, so that no answer shows what a power cut could still take back.
        (After a failed sync, when writes are refused, reads go on without waiting.)"""
        if self.syncer is None or self._committed <= self._durable or self._sync_failed:
            return
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._use_loop(loop)  # the sync thread's reports come here from now on...
        seq = self._committed
        if self.syncer.synced >= seq:  # ...and one that came before (run_sync) is seen here
            return
        future: asyncio.Future[None] = loop.create_future()
        self._readers_waiting.append((seq, future))
        await future

    def run_sync(self, job: Callable[[SqliteBackend], T]) -> T:
        """Run `job` in a transaction of its own, from any thread."""
        deadline = time.monotonic() + self.busy_timeout_s
        delay = RETRY_MIN_S
        while True:
            try:
                [outcome], tell = self._execute([job])
            except _Locked:
                if time.monotonic() >= deadline:
                    raise StorageBusy() from None
                time.sleep(delay)
                delay = min(delay * 2, RETRY_MAX_S)
                continue
            result, exc = outcome
            if self.syncer is not None:
                committed_at = time.perf_counter()
                self._sync_here(self._committed)  # covers this job's commit, and any before
                self.durable_waits.observe(time.perf_counter() - committed_at)
            _tell(tell)
            if exc is not None:
                raise exc
            return result  # type: ignore[no-any-return]

    def _flush(self) -> None:
        self._flush_scheduled = False
        batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
        try:
            outcomes, tell = self._execute([job for job, _, _ in batch])
        except _Locked:
            self._wait_for_lock(batch)
            return
        self._retry_delay = RETRY_MIN_S
        if self._pending:
            self._schedule_flush(0.0)
        if self.syncer is None:
            _tell(tell)
            self._answer(batch, outcomes)
            return
        if self._sync_failed is not None:  # nothing ran (see _execute); fail the waiting too
            self._fail_sync(self._sync_failed)
            self._answer(batch, outcomes)
            return
        # Every outcome waits, failures too: a refusal may rest on a commit not yet synced. So
        # do the notifications: no long-poll or event stream hears of a commit before that.
        self._unsynced.append((self._committed, time.perf_counter(), batch, outcomes, tell))
        self.syncer.committed(self._committed)
        self._settle()

    def _use_loop(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the flushes on `loop`, and hear the sync thread's reports there (a closed loop
        hears none: stop() settles what is left)."""
        self._loop = loop
        if self.syncer is not None:
            self.syncer.attach(loop, self._synced)

    def _synced(self, seq: int, exc: BaseException | None) -> None:
        """On the loop: commits up to `seq` are on disk, or the sync failed."""
        if exc is None and self._sync_failed is not None:
            exc = self._sync_failed  # a sync on another thread failed meanwhile
        if exc is not None:
            self._fail_sync(exc)
        else:
            self._durable = max(self._durable, seq)
        self._settle()

    def _fail_sync(self, exc: BaseException) -> None:
        """A failed sync leaves unknown which committed frames reached the disk, and SQLite
        recovers a WAL only up to its first bad frame, so no later commit could be promised
        either: every waiting batch fails, and so does every write until the server restarts
        (SQLite then recovers what the disk really holds)."""
        if self._sync_failed is None:
            log.error("the WAL could not be synced: writes are refused until the server restarts")
            err = exc if isinstance(exc, StorageUnavailable) else StorageUnavailable(str(exc))
            self._sync_failed = err
        self._durable = -1  # nothing settles as a success from now on
        while self._unsynced:  # their notifications are dropped: see on_commit
            _, _, batch, _, _ = self._unsynced.popleft()
            self._answer(batch, [(None, self._sync_failed)] * len(batch))
        self._release_readers()

    def _settle(self) -> None:
        """Answer the batches whose commits are on disk, in commit order."""
        if self.syncer is not None and self._sync_failed is None:
            # What a sync for run_sync made durable, whose report went to no loop (or another).
            self._durable = max(self._durable, self.syncer.synced)
        now = time.perf_counter()
        while self._unsynced and self._unsynced[0][0] <= self._durable:
            _, committed_at, batch, outcomes, tell = self._unsynced.popleft()
            self.durable_waits.observe(now - committed_at)
            _tell(tell)
            self._answer(batch, outcomes)
        if self._readers_waiting:
            self._release_readers()

    def _release_readers(self) -> None:
        waiting = self._readers_waiting
        while waiting and (waiting[0][0] <= self._durable or self._sync_failed is not None):
            _, future = waiting.popleft()
            if not future.done():
                future.set_result(None)

    def _sync_here(self, seq: int) -> None:
        """Off the loop (run_sync: any thread; stop): block until commits up to `seq` are on
        disk. Raises StorageUnavailable."""
        assert self.syncer is not None
        if self._sync_failed is not None:
            raise self._sync_failed
        try:
            self.syncer.sync_through(seq)
        except StorageUnavailable as exc:
            self._sync_failed = exc  # the loop fails its waiting batches at the next report
            raise

    def _answer(self, batch: list[Entry], outcomes: list[Outcome]) -> None:
        for (_, future, _), (result, exc) in zip(batch, outcomes, strict=True):
            if future.done():  # the request was cancelled (client went away); the write stands
                continue
            if exc is not None:
                future.set_exception(exc)
            else:
                future.set_result(result)

    def _schedule_flush(self, delay: float) -> None:
        if self._flush_scheduled or self._loop is None:
            return
        self._flush_scheduled = True
        if delay:
            self._loop.call_later(delay, self._flush)
        else:
            self._loop.call_soon(self._flush)

    def _wait_for_lock(self, batch: list[Entry]) -> None:
        """The database is locked: give up on jobs older than the busy timeout, put the others
        back in front, and try again a little later."""
        now = time.monotonic()
        keep = []
        for entry in batch:
            _, future, submitted = entry
            if now - submitted >= self.busy_timeout_s:
                if not future.done():
                    future.set_exception(StorageBusy())
            else:
                keep.append(entry)
        self._pending[:0] = keep
        if self._pending:
            self._schedule_flush(self._retry_delay)
            self._retry_delay = min(self._retry_delay * 2, RETRY_MAX_S)

    def _execute(self, jobs: list[Job]) -> tuple[list[Outcome], list[Tell]]:
        """Run `jobs` in one transaction; return each one's outcome after COMMIT, and what the
        commit has to tell (see `on_commit`).

        Savepoints would cost two statements a job, so the batch runs without them: a job that
        fails before writing anything (most failures: a lease check, a missing row) simply
        drops out. One that fails after writing (rare) makes the whole transaction roll back,
        and the others run again in a fresh one, so no failed job leaves a partial write.
        """
        outcomes: list[Outcome | None] = [None] * len(jobs)
        todo = list(range(len(jobs)))
        if self._sync_failed is not None:  # see _fail_sync
            return [(None, self._sync_failed)] * len(jobs), []
        tell: list[Tell] = []
        with self._lock:
            while todo:
                todo = self._attempt(jobs, todo, outcomes)
            done = [o if o is not None else (None, StorageBusy()) for o in outcomes]
            if any(e is None for _r, e in done):
                tell = [t for collect in self._after_commit if (t := collect()) is not None]
            if self._conn is not None:
                self.checkpointer.finish(self._conn)
        return done, tell

    def _attempt(
        self, jobs: list[Job], todo: list[int], outcomes: list[Outcome | None]
    ) -> list[int]:
        """One transaction over the jobs in `todo`; returns the jobs to run again."""
        conn = self._conn
        if conn is None:
            for i in todo:
                outcomes[i] = (None, StorageUnavailable("the database is closed"))
            return []
        try:
            conn.execute("BEGIN IMMEDIATE")
        except apsw.BusyError:
            if len(todo) == len(outcomes):  # nothing of the batch has run yet
                raise _Locked() from None
            for i in todo:
                outcomes[i] = (None, StorageBusy())
            return []
        except Exception as exc:
            for i in todo:
                outcomes[i] = (None, storage_error(exc))
            return []
        ran: list[tuple[int, Any]] = []
        for n, i in enumerate(todo):
            before = conn.total_changes()
            try:
                result = jobs[i](self._backend)
            except BaseException as exc:
                err = storage_error(exc, _errno(conn))
                outcomes[i] = (None, err)
                if conn.total_changes() == before and conn.in_transaction:
                    continue  # failed before writing: nothing to undo
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                if isinstance(err, StorageFull | StorageReadOnly | StorageBusy):
                    # The database refuses writes: everyone in this batch gets that answer.
                    for j in todo[n + 1 :]:
                        outcomes[j] = (None, err)
                    for j, _ in ran:
                        outcomes[j] = (None, err)
                    return []
                return [j for j, _ in ran] + todo[n + 1 :]
            ran.append((i, result))
        started = time.perf_counter()
        try:
            conn.execute("COMMIT")
        except Exception as exc:
            err = storage_error(exc, _errno(conn))
            log.warning("commit of a batch of %d failed: %s", len(ran), exc)
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            for i, _ in ran:
                outcomes[i] = (None, err)
            return []
        for i, result in ran:
            outcomes[i] = (result, None)
        self.commit_durations.observe(time.perf_counter() - started)
        self.batch_sizes.observe(len(todo))
        self._committed += 1
        self.batches += 1
        self.jobs += len(todo)
        return []


def _tell(tell: list[Tell]) -> None:
    for t in tell:
        t()


class Readers:
    """A few threads, each with its own read-only connection."""

    def __init__(self, path: str, size: int = 4) -> None:
        self.path = path
        self._local = threading.local()
        self._backends: list[SqliteBackend] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="nulltickets-reader")
        self._closed = False

    def _backend(self) -> SqliteBackend:
        backend: SqliteBackend | None = getattr(self._local, "backend", None)
        if backend is None:
            backend = SqliteBackend(connection.connect_reader(self.path))
            self._local.backend = backend
            with self._lock:
                self._backends.append(backend)
        return backend

    def run(self, job: Callable[[SqliteBackend], T]) -> T:
        if self._closed:  # as on PostgreSQL: no read of a closed database (nor a new connection)
            raise StorageUnavailable("the database is closed")
        backend = self._backend()
        conn = backend.conn
        conn.execute("BEGIN")
        try:
            return job(backend)
        except apsw.Error as exc:
            raise storage_error(exc) from exc
        finally:
            if conn.in_transaction:
                conn.execute("COMMIT")

    async def read(self, job: Callable[[SqliteBackend], T], *, kind: Hashable | None = None) -> T:
        if self._closed:
            raise StorageUnavailable("the database is closed")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.run, job)

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)
        with self._lock:
            for backend in self._backends:
                backend.conn.close()
            self._backends.clear()


CAPABILITIES = Capabilities(
    name="sqlite",
    cross_process_notifications=False,
    group_commit=True,
    # Another process may open the file (tools do), but its writes wait for the lock and its
    # commits wake no long-poll here: one server per file.
    shared_by_servers=False,
)


class SqliteDatabase:
    """storage.ports.Database on one SQLite file: the writer's group commit for `write`, the
    reader pool for `read`, and an in-process notifier fed by the writer's commits."""

    capabilities = CAPABILITIES

    def __init__(self, path: str, *, durability: str = "full", readers: int = 4) -> None:
        self.path = path
        self.writer = Writer(path, durability)
        self.readers = Readers(path, max(1, readers))
        self._notifier = LocalNotifier()
        self.writer.on_commit(self._notifier.collect)

    @property
    def notifier(self) -> LocalNotifier:
        return self._notifier

    def open(self) -> None:
        connection.check_sqlite()
        connection.ensure_parent(self.path)
        connection.check_writable(self.path)
        self.writer.start()

    def close(self) -> None:
        self.readers.close()
        self.writer.stop()

    def stats(self) -> StorageStats:
        writer = self.writer
        figures: dict[str, float] = {
            "writer_batches": writer.batches,
            "writer_jobs": writer.jobs,
            "wal_checkpoints": writer.checkpointer.passes,
            "wal_checkpoints_forced": writer.checkpointer.finishes,
        }
        if self.path != ":memory:":
            try:
                figures["wal_bytes"] = os.path.getsize(self.path + "-wal")
            except OSError:
                figures["wal_bytes"] = 0
        histograms = {
            "commit_duration_seconds": writer.commit_durations,
            "checkpoint_duration_seconds": writer.checkpointer.durations,
            "writer_batch_size": writer.batch_sizes,
        }
        if writer.syncer is not None:
            histograms["wal_sync_duration_seconds"] = writer.syncer.durations
            histograms["durable_wait_seconds"] = writer.durable_waits
        return StorageStats(figures, histograms)

    def schema_version(self) -> tuple[int, int]:
        conn = connection.connect_reader(self.path)
        try:
            current = int(conn.pragma("user_version"))
        finally:
            conn.close()
        return current, len(connection.migrations())

    async def write(self, job: Callable[[SqliteBackend], T]) -> T:
        return await self.writer.run(job)

    def write_sync(self, job: Callable[[SqliteBackend], T]) -> T:
        """Run a write from a plain thread (tools, tests, benchmarks)."""
        return self.writer.run_sync(job)

    async def read(self, job: Callable[[SqliteBackend], T], *, kind: Hashable | None = None) -> T:
        result = await self.readers.read(job)
        await self.writer.settled()  # what it read is on disk before anyone hears of it
        return result

    def read_sync(self, job: Callable[[SqliteBackend], T]) -> T:
        return self.readers.run(job)


Database = SqliteDatabase  # the name tools and tests know it by
