"""The database as the rest of the server sees it: one writer thread, a pool of readers.

Every write runs on the writer's single connection. The writer takes whatever jobs are waiting,
runs each inside its own SAVEPOINT of one `BEGIN IMMEDIATE` transaction, commits once, and only
then hands each job its own result or error. So a failing job never fails its neighbours, and no
caller hears "done" before its write is committed. Reads run on their own connections in a small
thread pool (apsw releases the GIL inside SQLite), each job inside one read transaction.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import apsw

from nulltickets.errors import StorageBusy, StorageFull, StorageReadOnly
from nulltickets.storage.sqlite import connection
from nulltickets.storage.sqlite.backend import SqliteBackend

log = logging.getLogger("nulltickets.storage")

T = TypeVar("T")
Job = Callable[[SqliteBackend], Any]
Done = Callable[[Any, BaseException | None], None]

_STOP = object()


def storage_error(exc: BaseException) -> BaseException:
    """Translate driver errors into ours at the storage edge."""
    if isinstance(exc, apsw.BusyError | apsw.LockedError):
        return StorageBusy()
    if isinstance(exc, apsw.FullError):
        return StorageFull()
    if isinstance(exc, apsw.ReadOnlyError):
        return StorageReadOnly()
    return exc


class Writer:
    """Owns the only read-write connection and the thread that uses it."""

    def __init__(self, path: str, durability: str, max_batch: int = 64) -> None:
        self.path = path
        self.durability = durability
        self.max_batch = max_batch
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._conn: apsw.Connection | None = None
        self.batches = 0
        self.jobs = 0

    def start(self) -> None:
        self._conn = connection.connect_writer(self.path, self.durability)
        connection.migrate(self._conn)
        self._backend = SqliteBackend(self._conn)
        self._thread = threading.Thread(target=self._run, name="nulltickets-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Job, done: Done) -> None:
        self._queue.put((job, done))

    def stop(self) -> None:
        """Finish every job already queued, then close the connection (checkpointing the WAL)."""
        if self._thread is None:
            return
        self._queue.put(_STOP)
        self._thread.join()
        self._thread = None

    def _run(self) -> None:
        assert self._conn is not None
        stopping = False
        while not stopping:
            item = self._queue.get()
            if item is _STOP:
                break
            batch = [item]
            while len(batch) < self.max_batch:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is _STOP:
                    stopping = True
                    break
                batch.append(item)
            self._execute(batch)
        self._conn.close()
        self._conn = None

    def _execute(self, batch: list[tuple[Job, Done]]) -> None:
        conn = self._conn
        assert conn is not None
        try:
            conn.execute("BEGIN IMMEDIATE")
        except Exception as exc:
            err = storage_error(exc)
            for _job, done in batch:
                done(None, err)
            return
        outcomes: list[tuple[Done, Any, BaseException | None]] = []
        aborted: BaseException | None = None  # set when SQLite rolled the whole batch back
        for job, done in batch:
            if aborted is not None:
                outcomes.append((done, None, aborted))
                continue
            conn.execute("SAVEPOINT job")
            try:
                result = job(self._backend)
            except BaseException as exc:
                err = storage_error(exc)
                if conn.in_transaction:
                    conn.execute("ROLLBACK TO job")
                    conn.execute("RELEASE job")
                else:  # e.g. SQLITE_FULL: the statement took the transaction with it
                    aborted = err
                outcomes.append((done, None, err))
            else:
                conn.execute("RELEASE job")
                outcomes.append((done, result, None))
        if aborted is None:
            try:
                conn.execute("COMMIT")
            except Exception as exc:
                aborted = storage_error(exc)
                log.warning("commit of a batch of %d failed: %s", len(batch), exc)
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
        if aborted is not None:
            # Nothing of this batch is stored: successes become the storage error; requests that
            # failed on their own keep their own error.
            outcomes = [
                (done, None, aborted if exc_ is None else exc_) for done, _r, exc_ in outcomes
            ]
        self.batches += 1
        self.jobs += len(batch)
        for done, result, exc_ in outcomes:
            try:
                done(result, exc_)
            except Exception:  # a callback must never kill the writer
                log.exception("writer callback failed")


class Readers:
    """A few threads, each with its own read-only connection."""

    def __init__(self, path: str, size: int = 4) -> None:
        self.path = path
        self._local = threading.local()
        self._backends: list[SqliteBackend] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=size, thread_name_prefix="nulltickets-reader")

    def _backend(self) -> SqliteBackend:
        backend: SqliteBackend | None = getattr(self._local, "backend", None)
        if backend is None:
            backend = SqliteBackend(connection.connect_reader(self.path))
            self._local.backend = backend
            with self._lock:
                self._backends.append(backend)
        return backend

    def run(self, job: Callable[[SqliteBackend], T]) -> T:
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

    async def read(self, job: Callable[[SqliteBackend], T]) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.run, job)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            for backend in self._backends:
                backend.conn.close()
            self._backends.clear()


class Database:
    """What the service layer uses: `await write(job)`, `await read(job)`."""

    def __init__(self, path: str, *, durability: str = "normal", readers: int = 4) -> None:
        self.path = path
        self.writer = Writer(path, durability)
        self.readers = Readers(path, readers)

    def open(self) -> None:
        connection.check_sqlite()
        connection.ensure_parent(self.path)
        connection.check_writable(self.path)
        self.writer.start()

    def close(self) -> None:
        self.readers.close()
        self.writer.stop()

    async def write(self, job: Callable[[SqliteBackend], T]) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def done(result: Any, exc: BaseException | None) -> None:
            loop.call_soon_threadsafe(_settle, future, result, exc)

        self.writer.submit(job, done)
        return await future

    def write_sync(self, job: Callable[[SqliteBackend], T]) -> T:
        """Run a write from a plain thread (tools, tests, benchmarks)."""
        box: list[Any] = []
        event = threading.Event()

        def done(result: Any, exc: BaseException | None) -> None:
            box.extend((result, exc))
            event.set()

        self.writer.submit(job, done)
        event.wait()
        if box[1] is not None:
            raise box[1]
        return box[0]  # type: ignore[no-any-return]

    async def read(self, job: Callable[[SqliteBackend], T]) -> T:
        return await self.readers.read(job)

    def read_sync(self, job: Callable[[SqliteBackend], T]) -> T:
        return self.readers.run(job)


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():  # the request was cancelled (client went away); the write stands
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
