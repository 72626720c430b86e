"""The ports every storage backend implements: a `Database` (units of work over a `Backend`),
a `Notifier` (wake-ups of long-polling claims) and the `Capabilities` that say what a backend
can do. The service sees storage only through these and `storage.backend.Backend`; which
backend stands behind them is chosen once, by `storage.factory.open_database`.

A unit of work is a job: a function given a `Backend` that runs every statement of one API
call inside one transaction. `write(job)` returns the job's result only after its transaction
committed; if the job raises, nothing it wrote stays. A backend may run a job more than once
(SQLite runs a group commit's jobs again after a neighbour's partial write rolled back;
PostgreSQL may retry a serialization failure), so a job's effects outside the database go
through the `Notifier` only, whose deliveries are wake-ups that cause a recheck, never a
decision.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, TypeVar

from nulltickets.domain.stats import Histogram
from nulltickets.storage.backend import Backend

T = TypeVar("T")

# A wake-up: (agent role, at_ms, agent id). at_ms 0 means "now"; later means "when the clock
# reaches it" (a retry delay running out). The agent id is None, or the one agent the work is
# assigned to. Each wake-up stands for one piece of work: two tasks made claimable are two.
Wake = Callable[[str, int, str | None], None]
# The role of a wake-up for every role at once: a notifier that may have missed notifications
# (PostgreSQL's listening connection, after it reconnected) sends it, and every long-poll looks
# at the committed state again.
EVERY_ROLE = "*"


@dataclass(frozen=True, slots=True)
class StorageStats:
    """What a backend measured in this process, for /metrics.

    figures: numbers by name (SQLite: writer_batches, writer_jobs, wal_checkpoints,
    wal_checkpoints_forced, wal_bytes; PostgreSQL: retries).
    histograms: by name, what each observation measured: commit_duration_seconds (each
    COMMIT: SQLite's group-commit batch, without the WAL sync that durability `full` makes on
    a thread of its own; PostgreSQL's unit of work), and on SQLite
    checkpoint_duration_seconds (each WAL checkpoint) and writer_batch_size (writes per
    committed batch); with durability `full` on SQLite, where the WAL is synced apart from the
    commits, wal_sync_duration_seconds (each sync of the WAL) and durable_wait_seconds (each
    batch's wait, from its COMMIT, for a sync to cover it). A backend leaves out what it does
    not have.
    """

    figures: dict[str, float]
    histograms: dict[str, Histogram]


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a backend can do, for the layers above to adapt to (never to branch on its name)."""

    name: str  # "sqlite" or "postgresql": for logs and the start-up line
    # Notifications reach subscribers in other processes (PostgreSQL LISTEN/NOTIFY); without
    # it, a notification reaches this process's subscribers only.
    cross_process_notifications: bool
    # Writes submitted together share one transaction and one commit (SQLite's writer).
    group_commit: bool
    # Several `nulltickets serve` processes may share the database and act as one tracker.
    shared_by_servers: bool


class Notifier(Protocol):
    """Tells long-polling claims that their role may have work.

    The service calls `notify` inside a unit of work; subscribers hear of it after that unit
    commits, on their event loop, and no sooner than the commit is as durable as the unit's
    own answer promises (SQLite with durability `full`: after the WAL sync that covers it). A
    notification of a unit that rolled back may still be delivered: a wake-up only makes a
    claim look again, so an extra one costs a query and a missing one would cost a wait.
    PostgreSQL: `notify` is a `pg_notify` on the unit's own
    connection (so it is sent at commit), and one LISTEN connection per process calls the
    subscribers.
    """

    @property
    def listening(self) -> bool:
        """Whether a "work now" notification may have anyone to wake. False only when the
        backend knows that nobody waits (SQLite: no long-poll in this process), which lets
        the service skip them and the lookups they need. Notifications for later are always
        sent."""
        ...

    def notify(self, b: Backend, role: str, at_ms: int, agent: str | None = None) -> None:
        """Inside the unit of work `b`: `role` may have one more piece of claimable work at
        `at_ms` (0: now); for `agent` only, when given (assigned to it)."""
        ...

    def subscribe(self, callback: Wake, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Call `callback(role, at_ms, agent)` for every committed notification, once per
        `notify` (several of a unit of work are not merged), on `loop` (default: the running
        loop; with none, on the thread that committed)."""
        ...

    def revoke(self, b: Backend, key_id: str) -> None:
        """Inside the unit of work `b`: key `key_id` was revoked. Once the unit commits, every
        process's `on_revoke` callbacks hear it (PostgreSQL: every server's, by NOTIFY)."""
        ...

    def on_revoke(self, callback: Callable[[str | None], None]) -> None:
        """Call `callback(key_id)` for every committed revocation of any process, on the
        notifier's own thread (SQLite: the committing one, before the unit's caller hears of
        the commit; PostgreSQL: the listening one), so it must be quick and thread-safe.
        `callback(None)`: revocations may have been missed (PostgreSQL's listening connection
        was lost and is back), so nothing known about keys can be trusted any more."""
        ...

    @property
    def revocations_heard(self) -> bool:
        """Whether every revocation committed from now on reaches this process's `on_revoke`
        callbacks: always on SQLite, on PostgreSQL while the listening connection is up. A
        cache of keys is trusted only then."""
        ...

    def waiting(self) -> AbstractContextManager[None]:
        """Held by a long-poll claim from before its first attempt until it returns."""
        ...

    def on_commit(
        self,
        callback: Callable[[], None],
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        wanted: Callable[[], bool] | None = None,
    ) -> None:
        """Call `callback()` after every committed unit of work of this process, whether or not
        it notified anyone (event streams read what it added), on `loop` as `subscribe` does.
        Not filtered by `listening`; `wanted()`, when given, is asked first on the committing
        thread (it must be cheap and safe there) and False skips the call and its hop to
        `loop`: with no event stream open a commit costs no wake-up of the loop."""
        ...


class Database(Protocol):
    """One database: units of work, notifications, capabilities."""

    @property
    def capabilities(self) -> Capabilities: ...

    @property
    def notifier(self) -> Notifier: ...

    def open(self) -> None:
        """Check, migrate and connect. Raises StartupError (or a Storage* error) with a
        message fit for the start-up line."""
        ...

    def close(self) -> None:
        """Finish the writes in hand, then release every connection."""
        ...

    def schema_version(self) -> tuple[int, int]:
        """(the database's schema version, the latest migration this build has)."""
        ...

    def stats(self) -> StorageStats:
        """Read-only figures and timings of this process's storage for /metrics (see
        StorageStats); observing them costs the storage O(1) per commit or checkpoint."""
        ...

    async def read(self, job: Callable[[Backend], T], *, kind: Hashable | None = None) -> T:
        """Run `job` in one read-only transaction (one consistent snapshot). `kind` names
        what the job does (a verb, say): jobs of one kind run alike, which a backend may
        learn from (PostgreSQL runs a read of one statement on its own, with no transaction
        around it)."""
        ...

    async def write(self, job: Callable[[Backend], T]) -> T:
        """Run `job` in one read-write transaction; its result once committed."""
        ...

    def read_sync(self, job: Callable[[Backend], T]) -> T:
        """`read` from a plain thread (tools, tests)."""
        ...

    def write_sync(self, job: Callable[[Backend], T]) -> T:
        """`write` from a plain thread (tools, tests), in a transaction of its own."""
        ...
