"""Retention: finished tasks and the history of their work are deleted once they are older
than the retention, in small batches, optionally written to a JSON-lines file first.

What goes: a finished task (in a terminal stage, or dead-lettered or cancelled with no task
depending on it) that last changed before the cutoff, with its runs (and their usage), run
events, task events, leases, artifacts, dependencies, assignments and spans; the OTLP spans
of no kept task or run, with their batches, received before the cutoff; the recorded
answers of idempotent requests made before the cutoff. What stays: every task that is not
finished (queued, running, waiting on a retry, blocked), and all of its history, whatever
its age; the store; pipelines; keys.

Each batch is one short transaction of its own, so a claim waits for one batch at most,
never for a whole pass. Where every write waits for one writer (SQLite) a batch is bounded
by time as well as by count: it starts at a few tasks, and the next one takes as many as fit
in BATCH_S (about 2 ms of work, at the pace of the batches before it, never more than
`batch` tasks), so a claim behind it waits no longer than for a few claims of its own,
whatever a task holds; and after each batch the pruner pauses four times as long as the
batch took, so that few claims meet a batch at all. On PostgreSQL a batch holds no lock a
claim waits for; it takes `batch` tasks, and the pause is as long as the batch. There its
deletes are one statement, run without per-row foreign-key checks where the role may turn
them off (postgres/queries.sql, prune_checks_off).

On SQLite the server's writer is shared: a batch run from the pruner's thread would take the
writer's lock while the event loop waits for it (every request with it), and would hand the
GIL back and forth with the loop at each statement, holding the lock the while. In a server
each batch is therefore one more job in the writer's queue, run on the loop's thread like a
claim, in turn with the claims that came before it; only with an export file (its fsync
never runs on the loop's thread) does it run from the pruner's thread.

With an export file, a batch's rows are appended and fsynced before its transaction commits:
a row is deleted only once it is on disk in the file. A batch that fails after its rows were
written leaves them in the file and in the database, so a line may appear twice (the next
pass writes it again); each names its table and holds the whole row, its primary key
included.

On PostgreSQL several servers may prune at once: one batch at a time holds an advisory lock
(the others skip their pass), and the rows a batch takes are locked with SKIP LOCKED, so two
batches never take the same task even without it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from nulltickets.domain.stats import COMMIT_SECONDS, Histogram
from nulltickets.storage.backend import Backend
from nulltickets.storage.ports import Database

log = logging.getLogger("nulltickets.retention")

DAY_S = 86_400.0
# A month: a team that leaves agents running overnight and over a holiday still finds last
# week's runs, events and usage, and a month of history stays a few hundred MB at most for
# thousands of tasks a day. `--retention off` keeps everything.
DEFAULT_RETENTION_S = 30 * DAY_S
# How often a server looks for work: one indexed query when there is none.
DEFAULT_INTERVAL_S = 60.0
BATCH_TASKS = 100  # tasks per transaction at most (each with a few runs, events, spans)
BATCH_ROWS = 500  # idempotency records or OTLP batches per transaction at most
# The work of one transaction, aimed at: a claim waits for a batch no longer than for a few
# claims (measured: a 100-task batch of the soak, one run and event a task, is 2 ms of work on
# an idle machine, up to 9 ms in a busy server, and its writer was out of reach up to 21 ms).
BATCH_S = 0.002
# Where no writer is shared (PostgreSQL: a batch holds no lock a claim waits for, only the rows
# it deletes) a batch is bounded by count only: it is a few round trips even for one task, and
# on a busy machine a time bound shrank batches to one task each (measured: 2 ms, then 50 ms,
# and the pruning fell behind a soak of 150 tasks a second; 100 tasks take 10 to 35 ms).
# After each batch the pruner waits this many times as long as the batch took. Where the writer
# is shared (SQLite), four: a pass then takes at most a fifth of the writer's time, and a claim
# seldom meets a batch at all (measured, 1-minute soaks, a pass every 2 s: claim p99 while
# pruning 12 ms against 11 ms otherwise, where a pause as long as the batch gave 15 against
# 11). PostgreSQL shares no writer, and a batch's time there includes its wait for a pooled
# connection: a pause as long as the batch (its passes took half of a soak's run already).
PAUSE_SHARED = 4.0
PAUSE = 1.0
FIRST_BATCH = 4  # rows of the first batch of a loop, before anything is measured
VACUUM_PAGES = 256  # pages given back per transaction (1 MiB of 4 KiB pages)
_MIN_TIME = -(2**63)

Row = tuple[str, dict[str, Any]]
T = TypeVar("T")
K = TypeVar("K")  # the key that orders rows of one time: a task id, a batch id


def _bytes(value: object) -> object:
    if isinstance(value, memoryview):
        return bytes(value)
    raise NotImplementedError(type(value))


_encode = msgspec.json.Encoder(enc_hook=_bytes).encode


class Export:
    """A JSON-lines file, appended to: `{"table": ..., "row": {...}}` a line (bytes as
    base64). Made readable by its owner only: it holds whatever the tasks held."""

    def __init__(self, path: str) -> None:
        self.path = path
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._file = os.fdopen(fd, "ab")
        self.lines = 0

    def write(self, rows: Sequence[Row]) -> None:
        """Append the rows and return once they are on disk."""
        if not rows:
            return
        self._file.write(
            b"".join(_encode({"table": table, "row": row}) + b"\n" for table, row in rows)
        )
        self._file.flush()
        os.fsync(self._file.fileno())
        self.lines += len(rows)

    def close(self) -> None:
        self._file.close()


class Sizer:
    """How many rows the next batch takes: as many as fit in `target_s` at the pace the batches
    before it went (at most twice the last size, so one fast batch is no licence for a slow
    one), between 1 and `limit`; with no `target_s`, `limit` once grown to it."""

    def __init__(self, limit: int, target_s: float | None) -> None:
        self.limit, self.target_s = limit, target_s
        self.size = max(1, min(limit, FIRST_BATCH))

    def took(self, rows: int, seconds: float) -> None:
        if rows <= 0:
            return
        if self.target_s is None or seconds <= 0:
            fit = self.limit
        else:
            fit = int(self.target_s * rows / seconds)
        self.size = max(1, min(self.limit, 2 * self.size, fit))


class Stopped(Exception):
    """The server stopped while a batch waited for its turn."""


class PruneReport(msgspec.Struct):
    """What one pass deleted, by table (cascaded task events, dependencies and assignments not
    counted), and what it did to the file."""

    before_ms: int
    deleted: dict[str, int]
    batches: int
    exported: int  # lines written to the export file
    skipped: bool  # another server was pruning: this pass did nothing
    pages_before: int | None  # SQLite: pages in the file before and after the pass
    pages_after: int | None
    free_pages: int | None  # SQLite: pages still on the free list after the pass

    @property
    def total(self) -> int:
        return sum(self.deleted.values())


@dataclass
class Pruner:
    """Prunes `db`; `stopping()` is asked between batches (a server shutting down stops)."""

    db: Database
    export: Export | None = None
    batch: int = BATCH_TASKS
    # A batch's work aimed at (see BATCH_S): its size follows the pace of the ones before.
    # None: BATCH_S where the writer is shared (SQLite), else none (by count only).
    batch_s: float | None = None
    stopping: Callable[[], bool] = lambda: False
    # After each batch, wait as long as it took times this (None: PAUSE_SHARED where the
    # writer is shared, else PAUSE): claims get most of the time, however large the backlog.
    pause_ratio: float | None = None
    # Rows deleted by table since the process started (/metrics), across passes.
    totals: dict[str, int] = field(default_factory=dict)
    # How long each batch that deleted rows took, its commit aside (/metrics): on SQLite what a
    # claim waits behind one, on PostgreSQL how long one shares the database with claims.
    batch_seconds: Histogram = field(default_factory=lambda: Histogram(COMMIT_SECONDS, shared=True))
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # The server's event loop, where the writer is shared (SQLite): batches go through its
    # queue (see the module's text). None: each batch from this thread (a tool, PostgreSQL).
    loop: asyncio.AbstractEventLoop | None = None

    def __post_init__(self) -> None:
        shared = self.db.capabilities.group_commit
        self._target_s = self.batch_s
        if self._target_s is None and shared:
            self._target_s = BATCH_S
        default_pause = PAUSE_SHARED if shared else PAUSE
        self._pause = default_pause if self.pause_ratio is None else self.pause_ratio

    def prune(self, before_ms: int, *, vacuum: bool = True) -> PruneReport:
        """One pass over everything older than `before_ms`, batch by batch; with `vacuum`,
        then give the freed pages back to the file system (SQLite with auto_vacuum)."""
        report = PruneReport(before_ms, {}, 0, 0, False, None, None, None)
        pages = self.db.read_sync(lambda b: b.free_pages())
        if pages is not None:
            report.pages_before = pages[1]
        with self._lock:  # one pass at a time in this process
            if not self._tasks(report) or not self._spans(report):
                return report
            self._idempotency(report)
            if vacuum:
                self.give_back(report)
        return report

    def _batch(self, job: Callable[[Backend], T], sizer: Sizer | None = None) -> T:
        """Run `job` in a transaction of its own, then pause; with `sizer`, tell it how long
        the job's work took for the rows it returned (`_rows`)."""
        started = time.monotonic()
        worked = 0.0

        def timed(b: Backend) -> T:
            nonlocal worked
            begun = time.perf_counter()
            try:
                return job(b)
            finally:
                worked = time.perf_counter() - begun

        if self.loop is not None and self.export is None:
            result = self._on_loop(timed)
        else:
            result = self.db.write_sync(timed)
        rows = _rows(result)
        if rows:  # one that found nothing to delete is a pass's last look, not a batch
            self.batch_seconds.observe(worked)
        if sizer is not None:
            sizer.took(rows, worked)
        if self._pause > 0:
            time.sleep(min(1.0, (time.monotonic() - started) * self._pause))
        return result

    def _on_loop(self, job: Callable[[Backend], T]) -> T:
        """Run `job` as a write of the loop's queue; wait for it here. A server stopping gives
        up waiting: a batch its loop took in hand is still committed before the writer closes,
        one it never took is never started."""
        assert self.loop is not None
        done: concurrent.futures.Future[T] = concurrent.futures.Future()

        def tell(task: asyncio.Future[T]) -> None:
            if task.cancelled():
                done.set_exception(Stopped())
            elif (exc := task.exception()) is not None:
                done.set_exception(exc)
            else:
                done.set_result(task.result())

        def start() -> None:  # on the loop
            if done.set_running_or_notify_cancel():
                asyncio.ensure_future(self.db.write(job)).add_done_callback(tell)

        self.loop.call_soon_threadsafe(start)
        while True:
            try:
                return done.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                if self.stopping():
                    done.cancel()
                    raise Stopped() from None

    def _count(self, report: PruneReport, deleted: dict[str, int]) -> None:
        report.batches += 1
        for table, n in deleted.items():
            report.deleted[table] = report.deleted.get(table, 0) + n
            self.totals[table] = self.totals.get(table, 0) + n

    def _tasks(self, report: PruneReport) -> bool:
        """Finished tasks and their history; False when the pass was skipped."""

        def delete(b: Backend, found: list[tuple[str, int]]) -> dict[str, int]:
            ids = [task_id for task_id, _ in found]
            if self.export is not None:
                # On disk before the transaction that deletes them commits.
                self._export(report, b.prune_export(ids))
            return b.prune_tasks(ids)

        return self._keyset(
            report,
            Sizer(self.batch, self._target_s),
            (_MIN_TIME, ""),
            lambda b, after, size: b.prune_candidates(report.before_ms, after, size),
            delete,
        )

    def _spans(self, report: PruneReport) -> bool:
        """OTLP batches of no kept task or run, with their spans; False when skipped."""

        def delete(b: Backend, found: list[tuple[int, int]]) -> dict[str, int]:
            ids = [batch_id for batch_id, _ in found]
            rows, deleted = b.prune_spans(ids, export=self.export is not None)
            self._export(report, rows)
            return deleted

        return self._keyset(
            report,
            Sizer(BATCH_ROWS, self._target_s),
            (_MIN_TIME, 0),
            lambda b, after, size: b.prune_span_batches(report.before_ms, after, size),
            delete,
        )

    def _export(self, report: PruneReport, rows: Sequence[Any]) -> None:
        if self.export is not None and rows:
            self.export.write(rows)
            report.exported += len(rows)

    def _keyset(
        self,
        report: PruneReport,
        sizer: Sizer,
        start: tuple[int, K],
        find: Callable[[Backend, tuple[int, K], int], list[tuple[K, int]]],
        delete: Callable[[Backend, list[tuple[K, int]]], dict[str, int]],
    ) -> bool:
        """Batches of the sizer's size, found after the last one's (time, key), each deleted
        in its own transaction under the prune lock; False when another server holds it."""
        after: tuple[int, K] = start
        while not self.stopping():
            size = sizer.size

            def job(
                b: Backend, after: tuple[int, K] = after, size: int = size
            ) -> tuple[list[tuple[K, int]], dict[str, int]] | None:
                if not b.try_prune_lock():
                    return None
                found = find(b, after, size)
                return found, (delete(b, found) if found else {})

            done = self._batch(job, sizer)
            if done is None:
                report.skipped = True
                return False
            found, deleted = done
            if found:
                self._count(report, deleted)
            if len(found) < size:
                break
            key, at = found[-1]
            after = (at, key)
        return True

    def _idempotency(self, report: PruneReport) -> None:
        """Recorded answers are a cache of replies (some hold lease tokens), not history: they
        are deleted, never exported."""
        sizer = Sizer(BATCH_ROWS, self._target_s)
        while not self.stopping():
            size = sizer.size

            def job(b: Backend, size: int = size) -> int:
                return b.prune_idempotency(report.before_ms, size) if b.try_prune_lock() else 0

            n = self._batch(job, sizer)
            if n:
                self._count(report, {"idempotency_keys": n})
            if n < size:
                break

    def give_back(self, report: PruneReport | None = None) -> tuple[int, int] | None:
        """Give the free pages of a SQLite file back, VACUUM_PAGES per transaction; (pages,
        free pages) after, or None on a backend without a file or a file that cannot."""
        steps: int | None = None  # what was free at first, at most: writes that free more
        while True:  # meanwhile wait for the next pass
            pages = self.db.read_sync(lambda b: b.free_pages())
            if pages is None:
                return None
            free, count, incremental = pages
            if report is not None:
                report.pages_after, report.free_pages = count, free
            if steps is None:
                steps = -(-free // VACUUM_PAGES)
            if not incremental or free == 0 or steps <= 0 or self.stopping():
                return count, free
            self._batch(lambda b: b.give_back_pages(VACUUM_PAGES))
            steps -= 1


def _rows(result: object) -> int:
    """Rows a batch's job took: a count, or (found, deleted) of a keyset batch."""
    if isinstance(result, int):
        return result
    if isinstance(result, tuple):
        return len(result[0])
    return 0


class RetentionJob:
    """The server's background pruning: a thread that runs a pass every `interval_s`, pruning
    what is older than `retention_s` (stopped with `stop()`, between two batches). With
    `loop` (the server's), batches run in its writer's queue where the writer is shared."""

    def __init__(
        self,
        db: Database,
        retention_s: float,
        interval_s: float,
        clock: Callable[[], int],
        *,
        export: str | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.retention_ms = int(retention_s * 1000)
        self.interval_s = interval_s
        self.clock = clock
        self._stop = threading.Event()
        # Opened (and created) now, so that a file that cannot be written fails the start.
        self.export = None if export is None else Export(export)
        # Batches through the loop's writer where it is shared by every write (SQLite).
        shared = loop if db.capabilities.group_commit else None
        self.pruner = Pruner(db, self.export, stopping=self._stop.is_set, loop=shared)
        self.passes = 0
        self._thread = threading.Thread(target=self._run, name="nulltickets-retention", daemon=True)

    @property
    def totals(self) -> dict[str, int]:
        return self.pruner.totals

    @property
    def batch_seconds(self) -> Histogram:
        return self.pruner.batch_seconds

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        if self.export is not None:
            self.export.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                report = self.pruner.prune(self.clock() - self.retention_ms)
            except Exception as exc:  # busy, full, unreachable: next time
                if not self._stop.is_set():
                    log.warning("pruning failed (retried at the next pass): %s", exc)
                continue
            self.passes += 1
            if report.total:
                log.info(
                    "pruned %d rows older than the retention in %d batches",
                    report.total,
                    report.batches,
                )
