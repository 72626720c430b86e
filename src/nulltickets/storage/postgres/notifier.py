"""Notifications across processes: NOTIFY inside the unit of work, one LISTEN per process.

`notify` adds (role, at_ms) to the unit of work's backend, which sends them in one pg_notify
just before COMMIT: PostgreSQL delivers them when (and only if) the transaction commits, to
every server listening on the database, this one included. Each process keeps one connection
that LISTENs, on a thread of its own, and hands every notification to the subscribers on
their event loops.

Revoked keys travel on a channel of their own (nulltickets_keys, the key's id as payload) and
reach the `on_revoke` callbacks on the listening thread itself, with no hop to a loop.

When that connection is lost (PostgreSQL restarted, a network cut), notifications sent
meanwhile are gone; so once it is back, every subscriber hears EVERY_ROLE once, and every
long-poll looks at the committed state again: a wake-up may be late by the reconnection,
never lost. Revocations missed meanwhile cannot be replayed: `revocations_heard` is False
while the connection is down, and once it listens again every `on_revoke` callback hears
None (forget every key) before it says True. (Without a running loop at `subscribe`,
callbacks run on the listening thread.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psycopg

from nulltickets.storage.backend import Backend
from nulltickets.storage.dsn import redact
from nulltickets.storage.ports import EVERY_ROLE, Wake
from nulltickets.storage.postgres.backend import PostgresBackend, Q

log = logging.getLogger("nulltickets.storage")

MAX_COUNT = 100_000  # wake-ups one line may stand for (more than any unit of work makes)
KEYS_CHANNEL = "nulltickets_keys"  # see queries.sql: notify_key_revoked, listen
POLL_S = 0.25  # how often the listening thread looks up from its wait (to stop promptly)
RECONNECT_MIN_S = 0.05
RECONNECT_MAX_S = 1.0


def parse_payload(payload: str) -> list[tuple[str, int, str | None]]:
    """The wake-ups of one notification, (role, at_ms, agent) once for each it stands for
    (PostgresBackend.send_notifications writes them); anything malformed is left out."""
    found: list[tuple[str, int, str | None]] = []
    for line in payload.split("\n"):
        role, sep, rest = line.rpartition("\t")
        if not sep or not role:
            continue
        at, _, more = rest.partition(";")
        count_text, _, agent_text = more.partition(";")
        try:
            at_ms = int(at)
            count = int(count_text) if count_text else 1
            agent = json.loads(agent_text) if agent_text else None
        except ValueError:
            continue
        if count < 1 or not (agent is None or isinstance(agent, str)):
            continue
        found.extend([(role, at_ms, agent)] * min(count, MAX_COUNT))
    return found


class PostgresNotifier:
    def __init__(self, url: str) -> None:
        self.url = url
        self._subscribers: list[tuple[Wake, asyncio.AbstractEventLoop | None]] = []
        # (callback, its loop or None for the committing thread, what says if it is wanted)
        self._on_commit: list[
            tuple[Callable[[], None], asyncio.AbstractEventLoop | None, Callable[[], bool] | None]
        ] = []
        self._on_revoke: list[Callable[[str | None], None]] = []
        self._waiting = 0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self.connected = threading.Event()  # the LISTEN is in place
        # Whether someone stopped waiting for the first LISTEN (`listening_within`): the
        # connection, when it comes, then wakes every long-poll once, as after a reconnection.
        self._late = False
        self._late_lock = threading.Lock()
        self.reconnects = 0

    # --- the Notifier port ---------------------------------------------------------------------

    @property
    def listening(self) -> bool:
        # Other servers' long-polls may be waiting: this process cannot know that nobody is.
        return True

    def notify(self, b: Backend, role: str, at_ms: int, agent: str | None = None) -> None:
        if not isinstance(b, PostgresBackend):
            raise TypeError("a PostgreSQL notification needs a PostgreSQL unit of work")
        b.notify(role, at_ms, agent)

    def subscribe(self, callback: Wake, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if loop is None:
            with contextlib.suppress(RuntimeError):
                loop = asyncio.get_running_loop()
        self._subscribers.append((callback, loop))

    def on_commit(
        self,
        callback: Callable[[], None],
        loop: asyncio.AbstractEventLoop | None = None,
        *,
        wanted: Callable[[], bool] | None = None,
    ) -> None:
        """Called after each write this process commits (PostgresDatabase calls `committed`)
        and after every notification from any server, so streams also see other servers'
        work that woke a role; work of other servers that notified nobody (a run event) is
        seen at this process's next commit or notification."""
        if loop is None:
            with contextlib.suppress(RuntimeError):
                loop = asyncio.get_running_loop()
        self._on_commit.append((callback, loop, wanted))

    def committed(self) -> None:
        """After a unit of work of this process committed (on the committing thread)."""
        for hook, loop, wanted in list(self._on_commit):
            if wanted is not None and not wanted():
                continue
            if loop is None:
                hook()
            elif not loop.is_closed():
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(hook)

    def revoke(self, b: Backend, key_id: str) -> None:
        if not isinstance(b, PostgresBackend):
            raise TypeError("a PostgreSQL notification needs a PostgreSQL unit of work")
        b.revoke(key_id)

    def on_revoke(self, callback: Callable[[str | None], None]) -> None:
        self._on_revoke.append(callback)

    @property
    def revocations_heard(self) -> bool:
        return self.connected.is_set()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        self._waiting += 1
        try:
            yield
        finally:
            self._waiting -= 1

    def listening_within(self, timeout: float) -> bool:
        """Wait up to `timeout` for the LISTEN. False: it is not in place yet, and notifications
        committed meanwhile are lost; the LISTEN, once in place, then wakes every long-poll."""
        if self.connected.wait(timeout):
            return True
        with self._late_lock:
            if self.connected.is_set():
                return True
            self._late = True
        return False

    # --- the listening thread ------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="nulltickets-pg-listen", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout=5)

    def _run(self) -> None:
        delay = RECONNECT_MIN_S
        first = True
        while not self._stopping.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True, connect_timeout=3) as conn:
                    conn.execute(Q["listen"])
                    self._revoked(None)  # whatever was revoked before this LISTEN is unknown
                    with self._late_lock:
                        self.connected.set()
                        late, self._late = self._late, False
                    delay = RECONNECT_MIN_S
                    if not first:
                        self.reconnects += 1
                        log.info("listening for notifications again: waking every long-poll")
                    if late or not first:
                        self._deliver([(EVERY_ROLE, 0, None)])
                    first = False
                    while not self._stopping.is_set():
                        for note in conn.notifies(timeout=POLL_S):
                            if note.channel == KEYS_CHANNEL:
                                self._revoked(note.payload)
                            else:
                                self._deliver(parse_payload(note.payload))
            except psycopg.Error as exc:
                if self.connected.is_set():
                    reason = redact(str(exc), self.url)
                    log.warning("lost the notification connection to PostgreSQL: %s", reason)
                self.connected.clear()
                first = False
                self._stopping.wait(delay)
                delay = min(delay * 2, RECONNECT_MAX_S)
        self.connected.clear()

    def _revoked(self, key_id: str | None) -> None:
        for callback in list(self._on_revoke):
            try:
                callback(key_id)
            except Exception:  # a callback's bug must not end the listening thread
                log.exception("a key revocation callback failed")

    def _deliver(self, wakes: list[tuple[str, int, str | None]]) -> None:
        if not wakes:
            return
        self.committed()  # another server's commit: event streams read what it added
        for callback, loop in list(self._subscribers):
            if loop is None:
                for role, at_ms, agent in wakes:
                    callback(role, at_ms, agent)
            elif not loop.is_closed():
                for role, at_ms, agent in wakes:
                    with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                        loop.call_soon_threadsafe(callback, role, at_ms, agent)
