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
from psycopg.pq import TransactionStatus

from nulltickets import core
from nulltickets.domain.model import Assignment, Dependency, Failure, LeaseRow, StageCount, Task
from nulltickets.errors import StorageBusy, Unauthorized
from nulltickets.storage.backend import (
    PRUNE_COUNTED,
    Backend,
    Claimed,
    Ended,
    Failed,
    Move,
    Moved,
    NewPipeline,
    NewTask,
    QueueRow,
    StageBoardRow,
    StagePolicyRow,
    TaskView,
    _run,
    _task,
    ids_param,
)
from nulltickets.storage.postgres.combine import Result
from nulltickets.storage.postgres.green import GreenConnection, GreenCursor
from nulltickets.storage.queries import load_backend_queries

Q = load_backend_queries("nulltickets.storage.postgres", "pyformat")

_encode = msgspec.json.encode


class LostRace(StorageBusy):
    """Another server's claim of the same task committed first: nothing of this unit of work
    is kept, and the database runs it again (a fresh snapshot no longer offers that task)."""


class SecondStatement(BaseException):
    """A read run as one statement on its own went on to a second one: the database runs it
    again in a transaction (one snapshot for all its statements). A BaseException, so that
    no handler of the unit of work's own takes it for a failure."""


_decode_any = msgspec.json.Decoder()
_failures = msgspec.json.Decoder(list[tuple[int, str, str, str | None, int | None]])
_dependencies = msgspec.json.Decoder(list[tuple[str, bool]])
_assignments = msgspec.json.Decoder(list[tuple[str, str, str | None, bool, int, int]])
_queue_rows = msgspec.json.Decoder(list[tuple[str, int, int | None, int, int, int]])
_stage_counts = msgspec.json.Decoder(list[tuple[str, int]])

# Statements that are, when a unit of work that writes starts with them, that whole unit of
# work: each then runs as its own transaction (autocommit), so PostgreSQL sees one message and
# answers once, with no BEGIN and no COMMIT of their own; or, from the event loop, in one
# transaction with the other such units its requests sent in the same turn (postgres.combine).
# Each writes everything it writes in itself, and what comes back says whether it wrote; when
# it did, the unit of work runs no other statement (nothing after it could be in its
# transaction: the backend refuses to). When one of them comes after another statement, it
# runs in that transaction, as any other.
ALONE = frozenset(
    {
        "create_task",
        "store_put",
        "store_delete",
        "claim_task",
        "extend_held_lease",
        "insert_event_under_lease",
        "transition_run",
        "checkpoint_run",
        "fail_run",
        "release_run",
        "release_agent",
    }
)

# How a unit of work that writes opens its transaction (its connection is in autocommit mode:
# database.PostgresDatabase), before its first statement not of ALONE: what psycopg sends
# itself on a connection that is not, the server's default isolation level.
BEGIN: LiteralString = "BEGIN"

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

    def __init__(
        self,
        conn: psycopg.Connection[Any] | GreenConnection,
        *,
        writing: bool = False,
        one_read: bool = False,
    ) -> None:
        if writing and not conn.autocommit:
            # A statement of ALONE must be its own transaction, and the unit opens any other.
            raise ValueError("a unit of work that writes needs a connection in autocommit mode")
        self.conn = conn
        # In a unit of work that writes, lease lookups lock the lease (lock_lease_by_*), and
        # the unit opens its transaction itself (begin): its connection is in autocommit mode.
        self.writing = writing
        # A read run with no transaction around it: its one statement is its snapshot, and a
        # second one raises SecondStatement (the key's check, beforehand, is not counted).
        self.one_read = one_read
        self.statements = 0
        # Wake-ups of this unit of work, sent in one pg_notify just before its COMMIT.
        self.notifications: list[tuple[str, int, str | None]] = []
        # Keys this unit of work revoked, told to every server at its COMMIT.
        self.revoked: list[str] = []
        # The statement of ALONE that was this whole unit of work and is committed, if any.
        self.committed_alone: str | None = None
        # The key this unit of work acts for, until a statement confirmed it (confirm_key).
        self.unconfirmed_key: str | None = None
        # Statements nothing reads the result of (the answer recorded under the request's
        # Idempotency-Key, the wake-ups), sent with the unit's COMMIT (commit_script).
        self.with_commit: list[tuple[str, dict[str, Any]]] = []

    def _cur(self, name: str, params: dict[str, Any]) -> psycopg.Cursor[Any] | GreenCursor | Result:
        sql: LiteralString = Q[name]
        conn = self.conn
        if self.committed_alone is not None:
            raise RuntimeError(
                f"{name} after {self.committed_alone}, which was its unit of work and committed"
            )
        alone = (
            name in ALONE
            and self.writing
            and conn.info.transaction_status == TransactionStatus.IDLE
        )
        if not alone and self.unconfirmed_key is not None:
            self._confirm_unconfirmed_key()
        if self.one_read:
            if self.statements:
                raise SecondStatement(name)
            self.statements = 1
        if name in ALONE:  # each refuses to change anything without the key, when one is named
            params = {**params, "key_id": self.unconfirmed_key if alone else None}
        if alone:  # its own transaction: the connection is in autocommit mode
            cur: psycopg.Cursor[Any] | GreenCursor | Result
            if isinstance(conn, GreenConnection):  # with the loop's others: postgres.combine
                cur = conn.execute_alone(sql, params)
            else:  # prepared on its first use: see combine._alone
                cur = conn.execute(sql, params, prepare=True)
            self.committed_alone = name  # until its caller sees that it wrote nothing
            return cur
        self.begin()
        return conn.execute(sql, params)

    def begin(self) -> None:
        """Open this unit of work's transaction, unless it is open or the unit only reads: what
        its first statement not of ALONE does first (a statement sent on `conn` directly does
        not)."""
        if self._opens_transaction():
            self.conn.execute(BEGIN)

    def _opens_transaction(self) -> bool:
        """The next statement of this unit of work must open its transaction: the unit writes
        (its connection is in autocommit mode) and no transaction is open yet."""
        return self.writing and self.conn.info.transaction_status == TransactionStatus.IDLE

    def _wrote_nothing(self) -> None:
        """The statement of ALONE just run changed nothing (the key it was given, if any, may
        be gone): the unit of work goes on, and its next statement confirms the key."""
        self.committed_alone = None

    def confirm_key(self, key_id: str) -> None:
        # Checked by the unit's first statement: inside it when it is one of ALONE (one round
        # trip), else by api_key_by_id just before it.
        self.unconfirmed_key = key_id

    def _confirm_unconfirmed_key(self) -> None:
        key_id, self.unconfirmed_key = self.unconfirmed_key, None
        if key_id is None:
            return
        one_read, self.one_read = self.one_read, False  # a check, not the read's statement
        try:
            found = self.api_key_by_id(key_id)
        finally:
            self.one_read = one_read
        if found is None:
            raise Unauthorized("the key was revoked")

    def _all(self, name: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        return self._cur(name, params or {}).fetchall()

    def _one(self, name: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self._cur(name, params).fetchone()
        return row

    def _exec(self, name: str, params: dict[str, Any]) -> int:
        return self._cur(name, params).rowcount

    def _later(self, name: str, params: dict[str, Any]) -> None:
        if not self.writing:
            self._exec(name, params)
            return
        if self.committed_alone is not None:
            raise RuntimeError(
                f"{name} after {self.committed_alone}, which was its unit of work and committed"
            )
        self.with_commit.append((name, params))

    def _script(self, statements: Sequence[tuple[str, dict[str, Any]]]) -> Any:
        """Statements of queries.sql sent as one message, in order, each with its own snapshot
        (the simple query protocol: one round trip), their parameters bound by the driver; the
        cursor is on the first one's result, `nextset` moves to the next."""
        if not self._opens_transaction():
            return self.conn.execute(self._text(statements), prepare=False)
        # The transaction opens in the same message: its BEGIN's (empty) result is skipped.
        cur = self.conn.execute(f"{BEGIN};\n{self._text(statements)}", prepare=False)
        cur.nextset()
        return cur

    def _text(self, statements: Sequence[tuple[str, dict[str, Any]]]) -> str:
        """The statements with their parameters bound by the driver, as one text."""
        conn = self.conn
        if isinstance(conn, GreenConnection):
            mogrify = conn.mogrify
        else:
            mogrify = psycopg.ClientCursor(conn).mogrify
        return ";\n".join(mogrify(Q[name], params) for name, params in statements)

    def commit_script(self) -> str | None:
        """The statements to send with the COMMIT, then COMMIT, as one message (the
        transaction ends with it, or with the first of them that fails); None when there are
        none."""
        if not self.with_commit:
            return None
        text = self._text(self.with_commit)
        self.with_commit.clear()
        if self._opens_transaction():  # all in one transaction, as when one is open
            text = f"{BEGIN};\n{text}"
        return text + ";\nCOMMIT"

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

    def prune_tasks(self, ids: Sequence[str]) -> dict[str, int]:
        # One message: the foreign-key checks off where the role may, the batch's runs locked,
        # then one statement deleting all (prune_checks_off says why it is safe).
        params = ids_param(ids)
        cur = self._script(
            [("prune_checks_off", {}), ("prune_lock_runs", params), ("prune_delete", params)]
        )
        cur.nextset()
        cur.nextset()
        row = cur.fetchone()
        columns = [c.name for c in cur.description or ()]
        counts = dict(zip(columns, (int(n) for n in row), strict=True))
        return {table: counts[table] for table in PRUNE_COUNTED}

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
            self._later("notify_key_revoked", {"key_id": key_id})
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
            self._later("notify", {"payload": chunk})

    # --- the agent's cycle, each verb one statement (ALONE) ------------------------------------

    def put_value(self, namespace: str, key: str, value_json: str, now: int) -> None:
        # store_put: PUT /store/... as one statement that commits itself.
        params = {"namespace": namespace, "key": key, "value_json": value_json, "now": now}
        if not self._exec("store_put", params):
            self._wrote_nothing()
            self._confirm_unconfirmed_key()  # the key is gone: Unauthorized

    def delete_value(self, namespace: str, key: str) -> None:
        # store_delete: DELETE /store/... as one statement that commits itself.
        if not self._exec("store_delete", {"namespace": namespace, "key": key}):
            self._wrote_nothing()  # no such value, or the key is gone: say which
            self._confirm_unconfirmed_key()

    def create_task(self, task: NewTask, wake_role: str | None) -> tuple[bool, bool]:
        row = self._one("create_task", {**task.params(), "wake_role": wake_role})
        assert row is not None  # counts: always one row
        inserted, sent = int(row[0]) > 0, int(row[1]) > 0
        if not inserted:
            # The idempotency key is taken, or the request's key is gone: say which now, as
            # the caller takes a task not inserted for the first.
            self._wrote_nothing()
            self._confirm_unconfirmed_key()
        return inserted, sent

    def claim(
        self,
        *,
        agent_role: str,
        agent_id: str,
        run_id: str,
        lease_id: str,
        token_hash: bytes,
        ttl_ms: int | None,
        stage_ttls: Sequence[tuple[str, str, int]],
        default_ttl_ms: int,
        full_stages: Sequence[str],
        capped: Sequence[tuple[str, str, int]],
        known_pipelines: frozenset[str] | None,
        now: int,
    ) -> Claimed | NewPipeline | None:
        # claim_task: the statements of Backend.claim as one.
        params = {
            "agent_role": agent_role,
            "agent_id": agent_id,
            "run_id": run_id,
            "lease_id": lease_id,
            "token_hash": token_hash,
            "ttl_ms": ttl_ms,
            "stage_ttls": _encode(stage_ttls).decode() if stage_ttls else None,
            "default_ttl_ms": default_ttl_ms,
            "full_stages": _encode(full_stages).decode() if full_stages else None,
            "capped": _encode(capped).decode() if capped else None,
            "known": None if known_pipelines is None else _encode(sorted(known_pipelines)).decode(),
            "now": now,
        }
        row = self._one("claim_task", params)
        if row is None or row[15] is None:
            self._wrote_nothing()
        if row is None:
            self._confirm_unconfirmed_key()  # nothing claimable, or the key is gone
            return None
        task = _task(row[:15])
        if row[15] is None:
            if known_pipelines is not None and task.pipeline_id not in known_pipelines:
                return NewPipeline(task.pipeline_id)
            raise LostRace("the task was claimed at the same moment; claim again")
        failures = [Failure(*f) for f in _failures.decode(row[20])] if row[20] else []
        return Claimed(
            task, int(row[15]), int(row[16]), compact(row[17]), int(row[18]), int(row[19]), failures
        )

    def transition_run(
        self,
        *,
        run_id: str,
        token_hash: bytes,
        fence: int | None,
        expected_stage: str | None,
        expected_task_version: int | None,
        moves: Sequence[Move],
        usage_json: str,
        now: int,
    ) -> Moved | None:
        # transition_run: the statements of Backend.transition_run as one, with the wake-ups.
        params = {
            "run_id": run_id,
            "token_hash": token_hash,
            "fence": fence,
            "expected_stage": expected_stage,
            "expected_task_version": expected_task_version,
            "moves": _encode(moves).decode(),
            "usage_json": usage_json,
            "now": now,
        }
        row = self._one("transition_run", params)
        if row is None:
            self._wrote_nothing()
            return None
        return Moved(row[0], row[1], row[2], row[3], notified=True)

    def checkpoint_run(
        self,
        run_id: str,
        token_hash: bytes,
        fence: int | None,
        patch_json: str,
        default_ttl_ms: int,
        now: int,
    ) -> tuple[str, int, int] | None:
        # checkpoint_run: the statements of Backend.checkpoint_run as one.
        params = {
            "run_id": run_id,
            "token_hash": token_hash,
            "fence": fence,
            "patch": patch_json,
            "default_ttl_ms": default_ttl_ms,
            "now": now,
        }
        row = self._one("checkpoint_run", params)
        if row is None:
            self._wrote_nothing()
            return None
        return str(compact(row[0])), int(row[1]), int(row[2])

    def fail_run(
        self,
        *,
        run_id: str,
        token_hash: bytes,
        fence: int | None,
        usage_json: str,
        error: str | None,
        retryable: bool | None,
        known_pipelines: int,
        unreadable: Sequence[str],
        policies: Sequence[StagePolicyRow],
        rand: float,
        now: int,
    ) -> Failed | None:
        # fail_run: the statements of Backend.fail_run as one, with the wake-ups.
        params = _attempt_params(
            "failed", usage_json, error, retryable, known_pipelines, unreadable, policies, rand, now
        )
        params.update(run_id=run_id, token_hash=token_hash, fence=fence)
        row = self._one("fail_run", params)
        if row is None:
            self._wrote_nothing()
            return None
        return _failed(row)

    def expire_lease(
        self,
        *,
        lease_id: str,
        known_pipelines: int,
        unreadable: Sequence[str],
        policies: Sequence[StagePolicyRow],
        rand: float,
        now: int,
    ) -> Failed | None:
        # expire_lease: the statements of Backend.expire_lease as one, with the wake-ups.
        params = _attempt_params(
            "stale", "{}", "lease_expired", None, known_pipelines, unreadable, policies, rand, now
        )
        params["lease_id"] = lease_id
        row = self._one("expire_lease", params)
        return None if row is None else _failed(row)

    def release_run(
        self, *, run_id: str, token_hash: bytes, fence: int | None, reason: str | None, now: int
    ) -> Ended | None:
        # release_run: the statements of Backend.release_run as one, with the wake-up.
        params = {
            "run_id": run_id,
            "token_hash": token_hash,
            "fence": fence,
            "reason": reason,
            "reason_json": _encode(reason or "released").decode(),
            "now": now,
        }
        row = self._one("release_run", params)
        if row is None:
            self._wrote_nothing()
            return None
        return Ended(row[1], row[2], row[3], True)

    def release_agent(self, *, agent_id: str, reason: str, now: int) -> list[tuple[str, Ended]]:
        # release_agent: the statements of Backend.release_agent as one, with the wake-ups.
        params = {
            "agent_id": agent_id,
            "reason": reason,
            "reason_json": _encode(reason).decode(),
            "now": now,
        }
        rows = self._all("release_agent", params)
        if not rows:
            self._wrote_nothing()
            self._confirm_unconfirmed_key()  # no live lease, or the key is gone
        return [(row[0], Ended(row[1], row[2], row[3], True)) for row in rows]

    def extend_held_lease(
        self,
        id: str,
        token_hash: bytes,
        fence: int | None,
        ttl_ms: int | None,
        default_ttl_ms: int,
        now: int,
    ) -> int | None:
        expires = super().extend_held_lease(id, token_hash, fence, ttl_ms, default_ttl_ms, now)
        if expires is None:
            self._wrote_nothing()
        return expires

    def insert_event_under_lease(
        self,
        run_id: str,
        token_hash: bytes,
        fence: int | None,
        kind: str,
        data_json: str,
        now: int,
    ) -> int | None:
        event_id = super().insert_event_under_lease(run_id, token_hash, fence, kind, data_json, now)
        if event_id is None:
            self._wrote_nothing()
        return event_id

    # --- checkpoints: JSONB's text, compacted as SQLite writes it ------------------------------

    def task_details(self, id: str) -> tuple[Task, str | None, int, int | None, str | None] | None:
        details = super().task_details(id)
        if details is None:
            return None
        task, checkpoint, fence, cancelled_at_ms, cancel_reason = details
        return task, compact(checkpoint), fence, cancelled_at_ms, cancel_reason

    def task_view(self, id: str) -> TaskView | None:
        row = self._one("task_view", {"id": id})
        if row is None:
            return None
        dependencies = _dependencies.decode(row[27]) if row[27] else []
        assignments = _assignments.decode(row[28]) if row[28] else []
        failures = _failures.decode(row[29]) if row[29] else []
        return TaskView(
            _task(row[:15]),
            compact(row[15]),
            row[16],
            row[17],
            row[18],
            None if row[19] is None else _run(row[19:27]),
            [Dependency(d, bool(done)) for d, done in dependencies],
            [Assignment(*a) for a in assignments],
            [Failure(*f) for f in failures],
        )

    def task_checkpoint(self, id: str) -> tuple[str | None, int, list[Failure]] | None:
        row = self._one("task_checkpoint", {"id": id})
        if row is None:
            return None
        failures = _failures.decode(row[2]) if row[2] else []
        return compact(row[0]), row[1], [Failure(*f) for f in failures]

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
        # transaction committed) instead of doing the work again. The lock, then the read (its
        # snapshot taken once the lock is held), and first the check of the request's API key
        # when it has one, go as one message.
        params = {"key": key, "method": method, "path": path}
        statements = [("lock_idempotency_key", params), ("get_idempotency", params)]
        key_id, self.unconfirmed_key = self.unconfirmed_key, None
        if key_id is not None:
            statements.insert(0, ("api_key_by_id", {"id": key_id}))
        cur = self._script(statements)
        if key_id is not None:
            if cur.fetchone() is None:
                raise Unauthorized("the key was revoked")
            cur.nextset()
        cur.nextset()
        found = cur.fetchone()
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

    def queue_counts(
        self, now: int, stuck_before: int, near_expiry_before: int
    ) -> tuple[list[QueueRow], int, int]:
        params = {
            "now": now,
            "stuck_before": stuck_before,
            "near_expiry_before": near_expiry_before,
        }
        row = self._one("queue_counts", params)
        assert row is not None  # an aggregate: always one row
        return _queue_rows.decode(row[2]), int(row[0]), int(row[1])

    def health_counts(self, now: int) -> tuple[list[StageCount], int]:
        row = self._one("health_counts", {"now": now})
        assert row is not None
        return [StageCount(stage, n) for stage, n in _stage_counts.decode(row[0])], int(row[1])


def _attempt_params(
    run_status: str,
    usage_json: str,
    error: str | None,
    retryable: bool | None,
    known_pipelines: int,
    unreadable: Sequence[str],
    policies: Sequence[StagePolicyRow],
    rand: float,
    now: int,
) -> dict[str, Any]:
    """The parameters of the fragment failed_attempt, which fail_run and expire_lease end
    with: how the run ends, and what the failure is decided from."""
    return {
        "run_status": run_status,
        "usage_json": usage_json,
        "error": error,
        "retryable": retryable,
        "known_pipelines": known_pipelines,
        "unreadable": _encode(unreadable).decode(),
        "policies": _encode(policies).decode(),
        "rand": rand,
        "parked_at": core.DEAD_LETTER_ELIGIBLE_AT,
        "now": now,
    }


def _failed(row: Sequence[Any]) -> Failed:
    """What fail_run and expire_lease return: the wake-ups went with the statement."""
    pipeline_id, task_id, stage, failed, dead, target, at = row[:7]
    return Failed(pipeline_id, task_id, stage, int(failed), dead, target, int(at), True)


def _lease(row: Sequence[Any]) -> LeaseRow:
    values = list(row)
    values[3] = bytes(values[3])
    return LeaseRow(*values)
