"""PostgresBackend: storage.backend.Backend over psycopg, running the queries of queries.sql.

The methods run on the connection of one unit of work (PostgresDatabase gives each job its own
transaction on a pooled connection). What is PostgreSQL's stays here: the runner over psycopg
(a new row's id comes back by RETURNING), search terms become the query text store_query
reads, JSONB's text is compacted, lease and idempotency rows are locked by the unit of work
that writes, wake-ups go out by NOTIFY, and a claim that lost a race to another server says
so with LostRace, on which the database runs the whole unit of work again.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from typing import Any, LiteralString

import msgspec
import psycopg
from psycopg import errors as pg_errors

from nulltickets.domain.model import LeaseRow, Task
from nulltickets.errors import StorageBusy
from nulltickets.storage.backend import Backend, QueueRow, StageBoardRow
from nulltickets.storage.queries import load_backend_queries

Q = load_backend_queries("nulltickets.storage.postgres", "pyformat")

_encode = msgspec.json.encode


class LostRace(StorageBusy):
    """Another server's claim of the same task committed first: nothing of this unit of work
    is kept, and the database runs it again (a fresh snapshot no longer offers that task)."""


_decode_any = msgspec.json.Decoder()

# The advisory lock key of retention: "NTKR" (the migrators' is "NTKT").
PRUNE_LOCK = 0x4E544B52


def compact(text: str | None) -> str | None:
    """JSONB's text (`{"a": 1, "b": [1, 2]}`) without the spaces, as SQLite's JSON functions
    write it (`{"a":1,"b":[1,2]}`): a checkpoint reads the same on both backends."""
    if text is None:
        return None
    return _encode(_decode_any.decode(text)).decode()


def fts_text(terms: Sequence[str]) -> str:
    """The terms as store_query (migration 0001) reads them: each a quoted phrase, so that no
    term is an operator (the form SQLite's FTS5 query takes too)."""
    return " ".join('"' + t.replace('"', '""') + '"' for t in terms)


class PostgresBackend(Backend):
    _unique_violation = pg_errors.UniqueViolation
    # insert_run returns no row when another server's claim committed first.
    _claim_race = LostRace
    # A JSON path PostgreSQL cannot read, from the request.
    _bad_query = (pg_errors.SyntaxError, pg_errors.DataException)

    def __init__(self, conn: psycopg.Connection[Any], *, writing: bool = False) -> None:
        self.conn = conn
        # In a unit of work that writes, lease lookups lock the lease (lock_lease_by_*).
        self.writing = writing
        # Wake-ups of this unit of work, sent in one pg_notify just before its COMMIT.
        self.notifications: list[tuple[str, int, str | None]] = []
        # Keys this unit of work revoked, told to every server at its COMMIT.
        self.revoked: list[str] = []

    def _cur(self, name: str, params: dict[str, Any]) -> psycopg.Cursor[Any]:
        sql: LiteralString = Q[name]
        return self.conn.execute(sql, params)

    def _all(self, name: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        return self._cur(name, params or {}).fetchall()

    def _one(self, name: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self._cur(name, params).fetchone()
        return row

    def _exec(self, name: str, params: dict[str, Any]) -> int:
        return self._cur(name, params).rowcount

    def _insert(self, name: str, params: dict[str, Any]) -> int:
        return int(self._value(name, params))

    def _search_text(self, terms: Sequence[str]) -> str:
        return fts_text(terms)

    def _rows(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        cursor = self._cur(name, params)
        columns = [c.name for c in cursor.description or ()]
        return [dict(zip(columns, row, strict=True)) for row in cursor.fetchall()]

    def try_prune_lock(self) -> bool:
        # One server prunes at a time (the lock ends with the unit of work).
        return bool(self._value("prune_lock", {"lock_key": PRUNE_LOCK}))

    def _query_error(self, exc: Exception) -> str:
        return str(exc).splitlines()[0]  # the rest is PostgreSQL's context lines

    def engine(self) -> tuple[str, str, list[str]]:
        return "postgresql", str(self.conn.info.server_version), []

    # --- notifications -------------------------------------------------------------------------

    def notify(self, role: str, at_ms: int, agent: str | None = None) -> None:
        self.notifications.append((role, at_ms, agent))

    def revoke(self, key_id: str) -> None:
        self.revoked.append(key_id)

    def send_notifications(self) -> None:
        """One pg_notify with every wake-up of the unit of work (PostgreSQL delivers it at
        COMMIT, and not at all after a rollback). A line per (role, at_ms, agent), saying how
        many wake-ups it stands for: `role<TAB>at_ms`, or `role<TAB>at_ms;count[;"agent"]`
        (the agent as a JSON string); notifier.parse_payload reads them. One more
        per revoked key."""
        for key_id in dict.fromkeys(self.revoked):
            self._exec("notify_key_revoked", {"key_id": key_id})
        self.revoked.clear()
        if not self.notifications:
            return
        counted = Counter(self.notifications)
        self.notifications.clear()
        lines = []
        for (role, at, agent), count in counted.items():
            if agent is not None:
                lines.append(f"{role}\t{at};{count};{json.dumps(agent)}")
            elif count > 1:
                lines.append(f"{role}\t{at};{count}")
            else:
                lines.append(f"{role}\t{at}")
        payload = "\n".join(lines)
        # A NOTIFY payload must stay under 8000 bytes: longer lists go as several.
        chunks: list[str] = []
        while len(payload.encode()) > 7000:
            cut = payload.rfind("\n", 0, 3500)
            if cut <= 0:
                break
            chunks.append(payload[:cut])
            payload = payload[cut + 1 :]
        chunks.append(payload)
        for chunk in chunks:
            self._exec("notify", {"payload": chunk})

    # --- checkpoints: JSONB's text, compacted as SQLite writes it ------------------------------

    def task_details(self, id: str) -> tuple[Task, str | None, int, int | None, str | None] | None:
        details = super().task_details(id)
        if details is None:
            return None
        task, checkpoint, fence, cancelled_at_ms, cancel_reason = details
        return task, compact(checkpoint), fence, cancelled_at_ms, cancel_reason

    def task_resume(self, id: str) -> tuple[str | None, int] | None:
        resume = super().task_resume(id)
        return None if resume is None else (compact(resume[0]), resume[1])

    def bump_fence(self, id: str) -> tuple[int, str | None]:
        fence, checkpoint = super().bump_fence(id)
        return fence, compact(checkpoint)

    def merge_checkpoint(self, id: str, patch_json: str) -> str:
        return str(compact(super().merge_checkpoint(id, patch_json)))

    # --- leases and idempotency keys: locked by the unit of work that writes ------------------

    def lease_by_run(self, run_id: str) -> LeaseRow | None:
        name = "lock_lease_by_run" if self.writing else "lease_by_run"
        row = self._one(name, {"run_id": run_id})
        return None if row is None else _lease(row)

    def lease_by_id(self, id: str) -> LeaseRow | None:
        name = "lock_lease_by_id" if self.writing else "lease_by_id"
        row = self._one(name, {"id": id})
        return None if row is None else _lease(row)

    def get_idempotency(
        self, key: str, method: str, path: str
    ) -> tuple[bytes, bytes | None, int, str] | None:
        # Concurrent requests under one key, on any server, run one after the other from here:
        # a later one finds the first one's stored answer (read committed sees it once that
        # transaction committed) instead of doing the work again.
        self._exec("lock_idempotency_key", {"key": key, "method": method, "path": path})
        found = super().get_idempotency(key, method, path)
        if found is None:
            return None
        request_hash, auth, status, body = found
        return (bytes(request_hash), None if auth is None else bytes(auth), status, body)

    # --- counts, as separate columns -----------------------------------------------------------

    def _board_row(self, r: tuple[Any, ...]) -> StageBoardRow:
        return (r[0], r[1], r[2], int(r[3]), r[4], int(r[5]), int(r[6]), int(r[7]), int(r[8]),
                int(r[9]))  # fmt: skip

    def _queue_row(self, r: tuple[Any, ...]) -> QueueRow:
        return (r[0], int(r[1]), r[2], int(r[3]), int(r[4]), int(r[5]))


def _lease(row: Sequence[Any]) -> LeaseRow:
    values = list(row)
    values[3] = bytes(values[3])
    return LeaseRow(*values)
