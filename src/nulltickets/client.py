"""A typed Python client for the whole nulltickets API, using the server's own msgspec types.

    from nulltickets.client import Client
    with Client("http://127.0.0.1:7700") as api:
        claimed = api.claim("agent-1", "coder", wait_ms=30_000)
        if claimed is not None:
            api.checkpoint(claimed.run.id, claimed.lease_token, {"step": 1})
            api.transition(claimed.run.id, claimed.lease_token, "complete")

`Client` keeps one connection (one client per thread); `nulltickets.aclient.AsyncClient` has the
same operations for asyncio. Both survive anything the server does short of refusing: a
connection error reconnects, and a failed call is tried again, with capped exponential backoff
and jitter, when that is safe:

- a connection that could not be made (refused, reset, unreachable): nothing was sent;
- 503 and 507 (the server refused before writing: storage busy, full, read-only) and 429,
  after the answer's `Retry-After`;
- after the request was sent (a lost answer, a reset, a read timeout, a 502/504 from a proxy),
  only a call that is safe to repeat: a read, a store PUT or DELETE, a heartbeat, or a write
  with an `Idempotency-Key`. Every other write gets a fresh key per call (unless
  `idempotency_keys=False`), reused by its retries, so the server replays the answer of a write
  it already applied instead of applying it twice.

Every error answer raises `ApiError` (status, code, message); a server still unreachable when
the retry budget is spent raises `Unreachable`, an `OSError`.

A long-polling claim the server answered at once with 204 and `Retry-After` (it holds as many
waiting claims as it is set to) returns None only after that pause, within its own wait, so an
agent that claims again in a loop does not ask again at once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import email.utils
import http.client
import json
import random
import select
import socket
import ssl
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, TypeVar

import msgspec

from nulltickets.domain import commands as cmd
from nulltickets.domain.model import (
    AgentReleased,
    ArtifactPage,
    Assignment,
    BulkOutcome,
    CheckpointResult,
    ClaimResult,
    CreatedKey,
    Dependency,
    EventPage,
    FailingReport,
    FailureGroups,
    FailurePage,
    Health,
    KeyInfo,
    NamespacePage,
    Pipeline,
    QueueReport,
    Released,
    RetryReport,
    SearchHit,
    SpanPage,
    StageReport,
    StoreEntry,
    TaskCheckpoint,
    TaskDetails,
    TaskEventPage,
    TaskPage,
    TaskRunPage,
    TraceIngest,
    TransitionResult,
)

T = TypeVar("T")

DEFAULT_BASE_URL = "http://127.0.0.1:7700"

# Codes with which the server says that a lease is gone for good: its holder must stop.
LEASE_LOST_CODES = frozenset(
    {"lease_superseded", "task_cancelled", "expired", "not_found", "conflict", "unauthorized"}
)


class ApiError(Exception):
    """The server answered with an error envelope (or something that is not JSON)."""

    def __init__(
        self, status: int, code: str, message: str, retry_after: float | None = None
    ) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message
        self.retry_after = retry_after

    @property
    def lease_lost(self) -> bool:
        """On a lease route: the lease is gone for good (expired, superseded, cancelled, or
        the run is over), so its holder should stop working on the task."""
        return self.status in (401, 404, 409, 410) and self.code in LEASE_LOST_CODES


class Unreachable(ConnectionError):
    """The server could not be reached (or answered nothing) within the retry budget."""


class ClientAborted(ConnectionAbortedError):
    """`Client.abort()` was called: the call in flight and every later one fail."""


@dataclass(frozen=True)
class Retry:
    """When and how long a call is tried again.

    The n-th retry waits `min(max_delay, base_delay * 2**n)` scaled by a random factor in
    [0.5, 1] (or the answer's `Retry-After`); a call gives up after `max_attempts` tries or once
    `timeout` seconds have passed since it started (None: never).
    """

    timeout: float | None = 30.0
    max_attempts: int | None = None
    base_delay: float = 0.05
    max_delay: float = 2.0

    def backoff(self, retry: int) -> float:
        delay = min(self.max_delay, self.base_delay * 2.0 ** min(retry, 30))
        return delay * random.uniform(0.5, 1.0)


DEFAULT_RETRY = Retry()
NO_RETRY = Retry(max_attempts=1)
FOREVER = Retry(timeout=None)


@dataclass(frozen=True)
class RetryEvent:
    """Passed to `on_retry` before each wait: what failed and how long the client waits."""

    method: str
    path: str
    attempt: int  # the attempt that failed, from 1
    delay: float
    reason: str  # "503 storage_busy: ..." or "ConnectionRefusedError: ..."
    status: int | None  # the error answer's status, None for a connection error


@dataclass(frozen=True)
class Call(Generic[T]):
    """One API call, built once and sent by either client, as often as its retries need."""

    method: str
    path: str  # with the query string, below the base URL's path
    decode: Callable[[int, bytes], T]
    body: bytes | None = None
    bearer: str | None = None  # a lease token instead of the client's token
    content_type: str = "application/json"
    repeatable: bool = False  # safe to send again without an Idempotency-Key
    keyed: bool = False  # a write that gets an Idempotency-Key
    wait_s: float = 0.0  # how long the server may hold the answer (long poll)


class _Answer(msgspec.Struct):
    error: _Detail


class _Detail(msgspec.Struct):
    code: str
    message: str


class _Id(msgspec.Struct):
    id: int | str


class _Ids(msgspec.Struct):
    ids: list[str]


class _Expires(msgspec.Struct):
    expires_at_ms: int


class _RunState(msgspec.Struct):
    run_id: str


_decoders: dict[Any, msgspec.json.Decoder[Any]] = {}


def _decoder(kind: Any) -> msgspec.json.Decoder[Any]:
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind)
    return decoder


def _as(kind: type[T]) -> Callable[[int, bytes], T]:
    def decode(status: int, payload: bytes) -> T:
        value: T = _decoder(kind).decode(payload)
        return value

    return decode


def _as_list(kind: type[T]) -> Callable[[int, bytes], list[T]]:
    def decode(status: int, payload: bytes) -> list[T]:
        value: list[T] = _decoder(list[kind]).decode(payload)  # type: ignore[valid-type]
        return value

    return decode


def _nothing(status: int, payload: bytes) -> None:
    return None


def _id(status: int, payload: bytes) -> str:
    return str(_decoder(_Id).decode(payload).id)


def _event_id(status: int, payload: bytes) -> int:
    return int(_decoder(_Id).decode(payload).id)


def _json(status: int, payload: bytes) -> Any:
    return json.loads(payload)


def _text(status: int, payload: bytes) -> str:
    return payload.decode()


def _seg(value: str) -> str:
    """One path segment that arrives whole, whatever it holds: the server's HTTP layer decodes
    the path once before splitting it, so `/` and `%` are escaped (`%2F`, `%25`) before the
    segment is percent-encoded; the server undoes that escape after the split."""
    return urllib.parse.quote(value.replace("%", "%25").replace("/", "%2F"), safe="")


def _query(path: str, **params: Any) -> str:
    kept = [
        (k, str(v).lower() if isinstance(v, bool) else str(v))
        for k, v in params.items()
        if v is not None
    ]
    return f"{path}?{urllib.parse.urlencode(kept)}" if kept else path


def _body(fields: Mapping[str, Any]) -> bytes:
    """A JSON body without the fields that are None (absent and null mean the same)."""
    return msgspec.json.encode({k: v for k, v in fields.items() if v is not None})


def _struct_body(value: msgspec.Struct | Mapping[str, Any]) -> Any:
    if isinstance(value, msgspec.Struct):
        return msgspec.to_builtins(value)
    return dict(value)


class Calls:
    """Every operation of the API as a `Call`: the one place that knows paths and bodies."""

    # --- discovery -----------------------------------------------------------------------------

    @staticmethod
    def health() -> Call[Health]:
        return Call("GET", "/health", _as(Health), repeatable=True)

    @staticmethod
    def openapi() -> Call[Any]:
        return Call("GET", "/openapi.json", _json, repeatable=True)

    # --- pipelines -----------------------------------------------------------------------------

    @staticmethod
    def create_pipeline(name: str, definition: Mapping[str, Any]) -> Call[str]:
        body = _body({"name": name, "definition": dict(definition)})
        return Call("POST", "/pipelines", _id, body, keyed=True)

    @staticmethod
    def list_pipelines() -> Call[list[Pipeline]]:
        return Call("GET", "/pipelines", _as_list(Pipeline), repeatable=True)

    @staticmethod
    def get_pipeline(pipeline_id: str) -> Call[Pipeline]:
        return Call("GET", f"/pipelines/{_seg(pipeline_id)}", _as(Pipeline), repeatable=True)

    # --- tasks ---------------------------------------------------------------------------------

    @staticmethod
    def create_task(
        pipeline_id: str,
        title: str,
        description: str = "",
        *,
        idempotency_key: str | None = None,
        priority: int | None = None,
        metadata: Any = None,
        retry_policy: cmd.RetryPolicy | Mapping[str, Any] | None = None,
        dependencies: list[str] | None = None,
        assigned_agent_id: str | None = None,
        assigned_by: str | None = None,
    ) -> Call[str]:
        body = _body(
            {
                "pipeline_id": pipeline_id,
                "title": title,
                "description": description,
                "idempotency_key": idempotency_key,
                "priority": priority,
                "metadata": metadata,
                "retry_policy": None if retry_policy is None else _struct_body(retry_policy),
                "dependencies": dependencies,
                "assigned_agent_id": assigned_agent_id,
                "assigned_by": assigned_by,
            }
        )
        return Call("POST", "/tasks", _id, body, keyed=True)

    @staticmethod
    def create_tasks(tasks: list[cmd.CreateTask | Mapping[str, Any]]) -> Call[list[str]]:
        body = msgspec.json.encode({"tasks": [_struct_body(t) for t in tasks]})

        def ids(status: int, payload: bytes) -> list[str]:
            return _decoder(_Ids).decode(payload).ids  # type: ignore[no-any-return]

        return Call("POST", "/tasks/bulk", ids, body, keyed=True)

    @staticmethod
    def list_tasks(
        *,
        stage: str | None = None,
        pipeline_id: str | None = None,
        role: str | None = None,
        text: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Call[TaskPage]:
        path = _query(
            "/tasks",
            stage=stage,
            pipeline_id=pipeline_id,
            role=role,
            q=text,
            limit=limit,
            cursor=cursor,
        )
        return Call("GET", path, _as(TaskPage), repeatable=True)

    @staticmethod
    def list_task_runs(
        task_id: str,
        *,
        limit: int | None = None,
        cursor: str | None = None,
        newest_first: bool = False,
    ) -> Call[TaskRunPage]:
        order = "desc" if newest_first else None
        path = _query(f"/tasks/{_seg(task_id)}/runs", order=order, limit=limit, cursor=cursor)
        return Call("GET", path, _as(TaskRunPage), repeatable=True)

    @staticmethod
    def get_task(task_id: str) -> Call[TaskDetails]:
        return Call("GET", f"/tasks/{_seg(task_id)}", _as(TaskDetails), repeatable=True)

    @staticmethod
    def run_state(task_id: str) -> Call[str]:
        def run_id(status: int, payload: bytes) -> str:
            return _decoder(_RunState).decode(payload).run_id  # type: ignore[no-any-return]

        return Call("GET", f"/tasks/{_seg(task_id)}/run-state", run_id, repeatable=True)

    @staticmethod
    def get_checkpoint(task_id: str) -> Call[TaskCheckpoint]:
        path = f"/tasks/{_seg(task_id)}/checkpoint"
        return Call("GET", path, _as(TaskCheckpoint), repeatable=True)

    @staticmethod
    def requeue(
        task_id: str,
        stage: str | None = None,
        reset_attempts: bool = False,
        reason: str | None = None,
        *,
        actor: str | None = None,
    ) -> Call[TaskDetails]:
        body = _body(
            {"stage": stage, "reset_attempts": reset_attempts, "reason": reason, "actor": actor}
        )
        path = f"/tasks/{_seg(task_id)}/requeue"
        return Call("POST", path, _as(TaskDetails), body, keyed=True)

    @staticmethod
    def cancel(
        task_id: str, reason: str | None = None, *, actor: str | None = None
    ) -> Call[TaskDetails]:
        body = _body({"reason": reason, "actor": actor})
        path = f"/tasks/{_seg(task_id)}/cancel"
        return Call("POST", path, _as(TaskDetails), body, keyed=True)

    @staticmethod
    def requeue_tasks(
        ids: list[str],
        stage: str | None = None,
        reset_attempts: bool = False,
        reason: str | None = None,
        *,
        actor: str | None = None,
    ) -> Call[BulkOutcome]:
        body = _body(
            {
                "ids": list(ids),
                "stage": stage,
                "reset_attempts": reset_attempts,
                "reason": reason,
                "actor": actor,
            }
        )
        return Call("POST", "/tasks/requeue", _as(BulkOutcome), body, keyed=True)

    @staticmethod
    def cancel_tasks(
        ids: list[str], reason: str | None = None, *, actor: str | None = None
    ) -> Call[BulkOutcome]:
        body = _body({"ids": list(ids), "reason": reason, "actor": actor})
        return Call("POST", "/tasks/cancel", _as(BulkOutcome), body, keyed=True)

    @staticmethod
    def list_task_events(
        task_id: str, *, limit: int | None = None, cursor: str | None = None
    ) -> Call[TaskEventPage]:
        path = _query(f"/tasks/{_seg(task_id)}/events", limit=limit, cursor=cursor)
        return Call("GET", path, _as(TaskEventPage), repeatable=True)

    @staticmethod
    def add_dependency(task_id: str, depends_on_task_id: str) -> Call[None]:
        body = _body({"depends_on_task_id": depends_on_task_id})
        path = f"/tasks/{_seg(task_id)}/dependencies"
        return Call("POST", path, _nothing, body, keyed=True)

    @staticmethod
    def list_dependencies(task_id: str) -> Call[list[Dependency]]:
        path = f"/tasks/{_seg(task_id)}/dependencies"
        return Call("GET", path, _as_list(Dependency), repeatable=True)

    @staticmethod
    def assign(task_id: str, agent_id: str, assigned_by: str | None = None) -> Call[None]:
        body = _body({"agent_id": agent_id, "assigned_by": assigned_by})
        path = f"/tasks/{_seg(task_id)}/assignments"
        return Call("POST", path, _nothing, body, keyed=True)

    @staticmethod
    def list_assignments(task_id: str) -> Call[list[Assignment]]:
        path = f"/tasks/{_seg(task_id)}/assignments"
        return Call("GET", path, _as_list(Assignment), repeatable=True)

    @staticmethod
    def unassign(task_id: str, agent_id: str) -> Call[None]:
        path = f"/tasks/{_seg(task_id)}/assignments/{_seg(agent_id)}"
        return Call("DELETE", path, _nothing, keyed=True)

    # --- leases and runs -----------------------------------------------------------------------

    @staticmethod
    def claim(
        agent_id: str,
        role: str,
        *,
        lease_ttl_ms: int | None = None,
        wait_ms: int | None = None,
        concurrency: Mapping[str, int] | None = None,
    ) -> Call[ClaimResult | None]:
        body = _body(
            {
                "agent_id": agent_id,
                "agent_role": role,
                "lease_ttl_ms": lease_ttl_ms,
                "wait_ms": wait_ms,
                "concurrency": None if concurrency is None else {"per_state": dict(concurrency)},
            }
        )

        def claimed(status: int, payload: bytes) -> ClaimResult | None:
            if status == 204:
                return None
            return _decoder(ClaimResult).decode(payload)  # type: ignore[no-any-return]

        # A replayed claim returns the same lease under a fresh token: safe to repeat by key.
        wait_s = min(wait_ms or 0, cmd.MAX_WAIT_MS) / 1000
        return Call("POST", "/leases/claim", claimed, body, keyed=True, wait_s=wait_s)

    @staticmethod
    def heartbeat(
        lease_id: str,
        lease_token: str,
        *,
        lease_ttl_ms: int | None = None,
        expected_fence: int | None = None,
    ) -> Call[int]:
        body = _body({"lease_ttl_ms": lease_ttl_ms, "expected_fence": expected_fence})

        def expires(status: int, payload: bytes) -> int:
            return _decoder(_Expires).decode(payload).expires_at_ms  # type: ignore[no-any-return]

        # Extending a lease twice is the same as extending it once, a little later.
        path = f"/leases/{_seg(lease_id)}/heartbeat"
        return Call("POST", path, expires, body, bearer=lease_token, repeatable=True)

    @staticmethod
    def event(
        run_id: str,
        lease_token: str,
        kind: str,
        data: Any = None,
        *,
        expected_fence: int | None = None,
    ) -> Call[int]:
        body = _body({"kind": kind, "data": data, "expected_fence": expected_fence})
        path = f"/runs/{_seg(run_id)}/events"
        return Call("POST", path, _event_id, body, bearer=lease_token, keyed=True)

    @staticmethod
    def list_events(
        run_id: str,
        *,
        lease_token: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Call[EventPage]:
        path = _query(f"/runs/{_seg(run_id)}/events", limit=limit, cursor=cursor)
        return Call("GET", path, _as(EventPage), bearer=lease_token, repeatable=True)

    @staticmethod
    def checkpoint(
        run_id: str,
        lease_token: str,
        patch: Mapping[str, Any],
        *,
        expected_fence: int | None = None,
    ) -> Call[CheckpointResult]:
        body = msgspec.json.encode(
            {"checkpoint": dict(patch)}
            if expected_fence is None
            else {"checkpoint": dict(patch), "expected_fence": expected_fence}
        )
        path = f"/runs/{_seg(run_id)}/checkpoint"
        return Call("PUT", path, _as(CheckpointResult), body, bearer=lease_token, keyed=True)

    @staticmethod
    def transition(
        run_id: str,
        lease_token: str,
        trigger: str,
        *,
        instructions: str | None = None,
        usage: Any = None,
        expected_stage: str | None = None,
        expected_task_version: int | None = None,
        expected_fence: int | None = None,
    ) -> Call[TransitionResult]:
        body = _body(
            {
                "trigger": trigger,
                "instructions": instructions,
                "usage": usage,
                "expected_stage": expected_stage,
                "expected_task_version": expected_task_version,
                "expected_fence": expected_fence,
            }
        )
        path = f"/runs/{_seg(run_id)}/transition"
        return Call("POST", path, _as(TransitionResult), body, bearer=lease_token, keyed=True)

    @staticmethod
    def fail(
        run_id: str,
        lease_token: str,
        error: str,
        *,
        usage: Any = None,
        expected_fence: int | None = None,
    ) -> Call[None]:
        body = _body({"error": error, "usage": usage, "expected_fence": expected_fence})
        path = f"/runs/{_seg(run_id)}/fail"
        return Call("POST", path, _nothing, body, bearer=lease_token, keyed=True)

    @staticmethod
    def release(
        run_id: str,
        lease_token: str,
        reason: str | None = None,
        *,
        expected_fence: int | None = None,
    ) -> Call[Released]:
        body = _body({"reason": reason, "expected_fence": expected_fence})
        path = f"/runs/{_seg(run_id)}/release"
        return Call("POST", path, _as(Released), body, bearer=lease_token, keyed=True)

    @staticmethod
    def release_agent(agent_id: str, reason: str | None = None) -> Call[AgentReleased]:
        body = _body({"agent_id": agent_id, "reason": reason})
        return Call("POST", "/agents/release", _as(AgentReleased), body, keyed=True)

    # --- artifacts -----------------------------------------------------------------------------

    @staticmethod
    def create_artifact(
        kind: str,
        uri: str,
        *,
        task_id: str | None = None,
        run_id: str | None = None,
        sha256: str | None = None,
        size_bytes: int | None = None,
        meta: Any = None,
    ) -> Call[str]:
        body = _body(
            {
                "kind": kind,
                "uri": uri,
                "task_id": task_id,
                "run_id": run_id,
                "sha256": sha256,
                "size_bytes": size_bytes,
                "meta": meta,
            }
        )
        return Call("POST", "/artifacts", _id, body, keyed=True)

    @staticmethod
    def list_artifacts(
        *,
        task_id: str | None = None,
        run_id: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Call[ArtifactPage]:
        path = _query("/artifacts", task_id=task_id, run_id=run_id, limit=limit, cursor=cursor)
        return Call("GET", path, _as(ArtifactPage), repeatable=True)

    # --- store ---------------------------------------------------------------------------------

    @staticmethod
    def store_put(namespace: str, key: str, value: Any) -> Call[None]:
        path = f"/store/{_seg(namespace)}/{_seg(key)}"
        body = msgspec.json.encode({"value": value})
        return Call("PUT", path, _nothing, body, repeatable=True)

    @staticmethod
    def store_get(namespace: str, key: str) -> Call[StoreEntry]:
        path = f"/store/{_seg(namespace)}/{_seg(key)}"
        return Call("GET", path, _as(StoreEntry), repeatable=True)

    @staticmethod
    def store_delete(namespace: str, key: str) -> Call[None]:
        path = f"/store/{_seg(namespace)}/{_seg(key)}"
        return Call("DELETE", path, _nothing, repeatable=True)

    @staticmethod
    def store_list(namespace: str) -> Call[list[StoreEntry]]:
        return Call("GET", f"/store/{_seg(namespace)}", _as_list(StoreEntry), repeatable=True)

    @staticmethod
    def store_delete_namespace(namespace: str) -> Call[None]:
        return Call("DELETE", f"/store/{_seg(namespace)}", _nothing, repeatable=True)

    @staticmethod
    def store_search(
        q: str,
        *,
        namespace: str | None = None,
        limit: int | None = None,
        filter_path: str | None = None,
        filter_value: str | None = None,
    ) -> Call[list[SearchHit]]:
        path = _query(
            "/store/search",
            q=q,
            namespace=namespace,
            limit=limit,
            filter_path=filter_path,
            filter_value=filter_value,
        )
        return Call("GET", path, _as_list(SearchHit), repeatable=True)

    # --- operations and traces -----------------------------------------------------------------

    @staticmethod
    def queue_report(
        *, near_expiry_ms: int | None = None, stuck_ms: int | None = None
    ) -> Call[QueueReport]:
        path = _query("/ops/queue", near_expiry_ms=near_expiry_ms, stuck_ms=stuck_ms)
        return Call("GET", path, _as(QueueReport), repeatable=True)

    @staticmethod
    def stage_report() -> Call[StageReport]:
        return Call("GET", "/ops/stages", _as(StageReport), repeatable=True)

    @staticmethod
    def retry_report(*, limit: int | None = None) -> Call[RetryReport]:
        return Call("GET", _query("/ops/retrying", limit=limit), _as(RetryReport), repeatable=True)

    @staticmethod
    def list_failures(
        *,
        kind: str | None = None,
        pipeline_id: str | None = None,
        error: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> Call[FailurePage]:
        path = _query(
            "/ops/failures",
            kind=kind,
            pipeline_id=pipeline_id,
            error=error,
            limit=limit,
            cursor=cursor,
        )
        return Call("GET", path, _as(FailurePage), repeatable=True)

    @staticmethod
    def failure_groups(
        *, kind: str | None = None, pipeline_id: str | None = None, limit: int | None = None
    ) -> Call[FailureGroups]:
        path = _query("/ops/failures/groups", kind=kind, pipeline_id=pipeline_id, limit=limit)
        return Call("GET", path, _as(FailureGroups), repeatable=True)

    @staticmethod
    def failing_report(
        *,
        min_failures: int | None = None,
        window_ms: int | None = None,
        limit: int | None = None,
    ) -> Call[FailingReport]:
        path = _query("/ops/failing", min_failures=min_failures, window_ms=window_ms, limit=limit)
        return Call("GET", path, _as(FailingReport), repeatable=True)

    @staticmethod
    def list_namespaces(
        *, limit: int | None = None, cursor: str | None = None
    ) -> Call[NamespacePage]:
        path = _query("/namespaces", limit=limit, cursor=cursor)
        return Call("GET", path, _as(NamespacePage), repeatable=True)

    @staticmethod
    def metrics() -> Call[str]:
        """The Prometheus text format, as the server wrote it."""
        return Call("GET", "/metrics", _text, repeatable=True)

    @staticmethod
    def ingest_traces(payload: bytes, content_type: str = "application/json") -> Call[TraceIngest]:
        return Call(
            "POST", "/v1/traces", _as(TraceIngest), payload, content_type=content_type, keyed=True
        )

    @staticmethod
    def list_spans(
        run_id: str, *, limit: int | None = None, cursor: str | None = None
    ) -> Call[SpanPage]:
        path = _query(f"/runs/{_seg(run_id)}/spans", limit=limit, cursor=cursor)
        return Call("GET", path, _as(SpanPage), repeatable=True)

    # --- keys ----------------------------------------------------------------------------------

    @staticmethod
    def create_key(name: str, access: str, roles: list[str] | None = None) -> Call[CreatedKey]:
        # Neither keyed nor repeatable: the server records no answer that holds a key, so a
        # call that may have reached it is not sent again (an unused key would be the cost).
        body = _body({"name": name, "access": access, "roles": roles})
        return Call("POST", "/keys", _as(CreatedKey), body)

    @staticmethod
    def list_keys() -> Call[list[KeyInfo]]:
        return Call("GET", "/keys", _as_list(KeyInfo), repeatable=True)

    @staticmethod
    def revoke_key(key_id: str) -> Call[KeyInfo]:
        return Call("DELETE", f"/keys/{_seg(key_id)}", _as(KeyInfo), keyed=True)


# --- what both clients share: the URL, the headers, the decoding and the retry policy ----------


@dataclass(frozen=True)
class Endpoint:
    """Where the server is: `http://host[:port][/prefix]` or `https://...`."""

    scheme: str
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, base_url: str) -> Endpoint:
        url = urllib.parse.urlsplit(base_url.strip())
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base URL must be http(s)://host[:port], got {base_url!r}")
        try:
            port = url.port or (443 if url.scheme == "https" else 80)
        except ValueError:
            raise ValueError(f"base URL has a bad port: {base_url!r}") from None
        return cls(url.scheme, url.hostname, port, url.path.rstrip("/"))

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.tls else 80
        return host if self.port == default else f"{host}:{self.port}"


@dataclass
class Attempts:
    """The retry decisions of one call, shared by both clients: `after_*` return how long to
    wait before the next attempt, or raise what the caller gets."""

    call: Call[Any]
    policy: Retry
    on_retry: Callable[[RetryEvent], None] | None
    started: float = field(default_factory=time.monotonic)
    attempt: int = 1

    def after_error(self, exc: BaseException, sent: bool) -> float:
        """A connection error; `sent`: the request may have reached the server."""
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if sent and not self._repeatable():
            raise Unreachable(
                f"{self.call.method} {self.call.path}: connection lost after the request was "
                f"sent ({reason}); not repeated, as it might have been applied"
            ) from exc
        delay = self._next(self.policy.backoff(self.attempt - 1))
        if delay is None:
            raise Unreachable(
                f"{self.call.method} {self.call.path}: server unreachable after "
                f"{self.attempt} attempt(s) in {time.monotonic() - self.started:.1f} s "
                f"({reason})"
            ) from exc
        return self._announce(delay, reason, None)

    def after_answer(self, status: int, headers: Mapping[str, str], payload: bytes) -> float:
        """An error answer: raise it, or say how long to wait before trying again."""
        error = error_of(status, headers, payload)
        if status in (429, 503, 507):
            wait = error.retry_after
            if wait is None:
                wait = self.policy.backoff(self.attempt - 1)
            else:
                wait += random.uniform(0, wait / 10)  # not every client at the same instant
        elif status in (502, 504) and self._repeatable():
            wait = self.policy.backoff(self.attempt - 1)
        else:
            raise error
        delay = self._next(wait)
        if delay is None:
            raise error
        return self._announce(delay, str(error), status)

    def pause_after(self, status: int, headers: Mapping[str, str]) -> float:
        """A long-poll claim answered 204 before its wait was up, with `Retry-After` (the
        server holds as many waiting claims as it is set to): how long to wait, within the
        call's own wait, before reporting that nothing was claimed. 0 for any other answer."""
        if status != 204 or not self.call.wait_s:
            return 0.0
        retry = _retry_after(headers.get("retry-after"))
        if retry is None:
            return 0.0
        left = self.started + self.call.wait_s - time.monotonic()
        return max(0.0, min(retry, left))

    def _repeatable(self) -> bool:
        return self.call.repeatable or self.call.keyed

    def _next(self, wait: float) -> float | None:
        policy = self.policy
        if policy.max_attempts is not None and self.attempt >= policy.max_attempts:
            return None
        if policy.timeout is not None:
            left = self.started + policy.timeout - time.monotonic()
            if wait > left:
                return None
        return wait

    def _announce(self, delay: float, reason: str, status: int | None) -> float:
        if self.on_retry is not None:
            self.on_retry(
                RetryEvent(self.call.method, self.call.path, self.attempt, delay, reason, status)
            )
        self.attempt += 1
        return delay


def error_of(status: int, headers: Mapping[str, str], payload: bytes) -> ApiError:
    retry_after = _retry_after(headers.get("retry-after"))
    try:
        detail = _decoder(_Answer).decode(payload).error
        return ApiError(status, detail.code, detail.message, retry_after)
    except msgspec.DecodeError:
        text = payload[:200].decode("utf-8", "replace")
        return ApiError(status, "unexpected_response", text, retry_after)


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    with contextlib.suppress(TypeError, ValueError):
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    return None


class Transport:
    """What both clients hold: the endpoint, the token, and how a call becomes headers."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        timeout: float,
        retry: Retry,
        idempotency_keys: bool,
        on_retry: Callable[[RetryEvent], None] | None,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self.endpoint = Endpoint.parse(base_url)
        self.base_url = base_url
        self.token = token
        self.timeout = timeout
        self.retry = retry
        self.idempotency_keys = idempotency_keys
        self.on_retry = on_retry
        self.ssl_context = ssl_context
        if self.endpoint.tls and ssl_context is None:
            self.ssl_context = ssl.create_default_context()

    def prepare(self, call: Call[Any], retry: Retry | None) -> tuple[Call[Any], Attempts]:
        if call.keyed and not self.idempotency_keys:
            call = dataclasses.replace(call, keyed=False)
        return call, Attempts(call, retry or self.retry, self.on_retry)

    def headers(self, call: Call[Any], key: str | None) -> dict[str, str]:
        headers = {"Host": self.endpoint.host_header, "Accept": "application/json"}
        if call.body is not None:
            headers["Content-Type"] = call.content_type
        token = call.bearer if call.bearer is not None else self.token
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        if key is not None:
            headers["Idempotency-Key"] = key
        return headers

    def target(self, call: Call[Any]) -> str:
        return self.endpoint.prefix + call.path

    def read_timeout(self, call: Call[Any]) -> float:
        return self.timeout + call.wait_s

    @staticmethod
    def new_key(call: Call[Any]) -> str | None:
        return uuid.uuid4().hex if call.keyed else None


# --- the synchronous client --------------------------------------------------------------------


class _NotSent(Exception):
    def __init__(self, cause: BaseException) -> None:
        self.cause = cause


class _Lost(Exception):
    def __init__(self, cause: BaseException) -> None:
        self.cause = cause


class Client:
    """The API over one kept-alive connection (not thread-safe: one client per thread).

    `retry` is the default policy of every call (a call may give its own to `run`),
    `timeout` bounds each attempt (a long-polling claim gets its wait on top), `on_retry` is
    told of every retry (for a log line), `ssl_context` verifies an `https://` server.
    """

    def __init__(
        self,
        base_url: str = DEFAULT_BASE_URL,
        token: str | None = None,
        timeout: float = 60.0,
        *,
        retry: Retry = DEFAULT_RETRY,
        idempotency_keys: bool = True,
        on_retry: Callable[[RetryEvent], None] | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.transport = Transport(
            base_url,
            token,
            timeout=timeout,
            retry=retry,
            idempotency_keys=idempotency_keys,
            on_retry=on_retry,
            ssl_context=ssl_context,
        )
        self._conn: http.client.HTTPConnection | None = None
        self._aborted = threading.Event()

    @property
    def base_url(self) -> str:
        return self.transport.base_url

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def abort(self) -> None:
        """Cut the call in flight (from a signal handler or another thread), and make it and
        every later call raise `ClientAborted`. A long-polling claim cut this way claims
        nothing."""
        self._aborted.set()
        conn = self._conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    # --- transport -----------------------------------------------------------------------------

    def run(self, call: Call[T], retry: Retry | None = None) -> T:
        """Send `call` (and again, as its retry policy allows); its decoded answer."""
        call, attempts = self.transport.prepare(call, retry)
        key = self.transport.new_key(call)
        while True:
            if self._aborted.is_set():
                raise ClientAborted("client aborted")
            try:
                status, headers, payload = self._send(call, key)
            except (_NotSent, _Lost) as failure:
                if self._aborted.is_set():
                    raise ClientAborted("client aborted") from failure.cause
                delay = attempts.after_error(failure.cause, sent=isinstance(failure, _Lost))
            else:
                if status < 400:
                    if self._aborted.wait(attempts.pause_after(status, headers)):
                        raise ClientAborted("client aborted")
                    return call.decode(status, payload)
                delay = attempts.after_answer(status, headers, payload)
            if self._aborted.wait(delay):
                raise ClientAborted("client aborted")

    def _connection(self) -> http.client.HTTPConnection:
        conn = self._conn
        if conn is not None and conn.sock is not None and _dropped(conn.sock):
            self.close()  # the server closed it while it was idle
            conn = None
        if conn is None:
            t = self.transport
            ep = t.endpoint
            if ep.tls:
                conn = http.client.HTTPSConnection(
                    ep.host, ep.port, timeout=t.timeout, context=t.ssl_context
                )
            else:
                conn = http.client.HTTPConnection(ep.host, ep.port, timeout=t.timeout)
            self._conn = conn
        return conn

    def _send(self, call: Call[Any], key: str | None) -> tuple[int, dict[str, str], bytes]:
        conn = self._connection()
        try:
            if conn.sock is None:
                conn.connect()
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise _NotSent(exc) from exc
        assert conn.sock is not None
        t = self.transport
        try:
            conn.sock.settimeout(t.read_timeout(call))
            conn.request(call.method, t.target(call), call.body, t.headers(call, key))
            response = conn.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as exc:
            self.close()  # never reuse a connection in an unknown state
            raise _Lost(exc) from exc
        headers = {k.lower(): v for k, v in response.getheaders()}
        if response.will_close:
            self.close()
        return response.status, headers, payload

    # --- discovery -----------------------------------------------------------------------------

    def health(self) -> Health:
        return self.run(Calls.health())

    def openapi(self) -> Any:
        return self.run(Calls.openapi())

    # --- pipelines -----------------------------------------------------------------------------

    def create_pipeline(self, name: str, definition: Mapping[str, Any]) -> str:
        return self.run(Calls.create_pipeline(name, definition))

    def list_pipelines(self) -> list[Pipeline]:
        return self.run(Calls.list_pipelines())

    def get_pipeline(self, pipeline_id: str) -> Pipeline:
        return self.run(Calls.get_pipeline(pipeline_id))

    # --- tasks ---------------------------------------------------------------------------------

    def create_task(
        self,
        pipeline_id: str,
        title: str,
        description: str = "",
        *,
        idempotency_key: str | None = None,
        priority: int | None = None,
        metadata: Any = None,
        retry_policy: cmd.RetryPolicy | Mapping[str, Any] | None = None,
        dependencies: list[str] | None = None,
        assigned_agent_id: str | None = None,
        assigned_by: str | None = None,
    ) -> str:
        return self.run(
            Calls.create_task(
                pipeline_id,
                title,
                description,
                idempotency_key=idempotency_key,
                priority=priority,
                metadata=metadata,
                retry_policy=retry_policy,
                dependencies=dependencies,
                assigned_agent_id=assigned_agent_id,
                assigned_by=assigned_by,
            )
        )

    def create_tasks(self, tasks: list[cmd.CreateTask | Mapping[str, Any]]) -> list[str]:
        return self.run(Calls.create_tasks(tasks))

    def list_tasks(
        self,
        *,
        stage: str | None = None,
        pipeline_id: str | None = None,
        role: str | None = None,
        text: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> TaskPage:
        """`text`: only tasks whose title or id contains it (any case)."""
        return self.run(
            Calls.list_tasks(
                stage=stage,
                pipeline_id=pipeline_id,
                role=role,
                text=text,
                limit=limit,
                cursor=cursor,
            )
        )

    def list_task_runs(
        self,
        task_id: str,
        *,
        limit: int | None = None,
        cursor: str | None = None,
        newest_first: bool = False,
    ) -> TaskRunPage:
        """Every run of the task, oldest attempt first (or newest first), with its agent and
        error."""
        call = Calls.list_task_runs(task_id, limit=limit, cursor=cursor, newest_first=newest_first)
        return self.run(call)

    def get_task(self, task_id: str) -> TaskDetails:
        return self.run(Calls.get_task(task_id))

    def run_state(self, task_id: str) -> str:
        return self.run(Calls.run_state(task_id))

    def get_checkpoint(self, task_id: str) -> TaskCheckpoint:
        return self.run(Calls.get_checkpoint(task_id))

    def requeue(
        self,
        task_id: str,
        stage: str | None = None,
        reset_attempts: bool = False,
        reason: str | None = None,
        *,
        actor: str | None = None,
    ) -> TaskDetails:
        """Make a dead-lettered, cancelled, failed or waiting task claimable now."""
        return self.run(Calls.requeue(task_id, stage, reset_attempts, reason, actor=actor))

    def cancel(
        self, task_id: str, reason: str | None = None, *, actor: str | None = None
    ) -> TaskDetails:
        """Never claim the task again; its holder's next lease call gets 409 task_cancelled."""
        return self.run(Calls.cancel(task_id, reason, actor=actor))

    def requeue_tasks(
        self,
        ids: list[str],
        stage: str | None = None,
        reset_attempts: bool = False,
        reason: str | None = None,
        *,
        actor: str | None = None,
    ) -> BulkOutcome:
        """Requeue many tasks in one transaction; what happened to each, in the order given."""
        return self.run(Calls.requeue_tasks(ids, stage, reset_attempts, reason, actor=actor))

    def cancel_tasks(
        self, ids: list[str], reason: str | None = None, *, actor: str | None = None
    ) -> BulkOutcome:
        """Cancel many tasks in one transaction; what happened to each, in the order given."""
        return self.run(Calls.cancel_tasks(ids, reason, actor=actor))

    def list_task_events(
        self, task_id: str, *, limit: int | None = None, cursor: str | None = None
    ) -> TaskEventPage:
        """What operators did to the task (requeued, cancelled), oldest first."""
        return self.run(Calls.list_task_events(task_id, limit=limit, cursor=cursor))

    def add_dependency(self, task_id: str, depends_on_task_id: str) -> None:
        return self.run(Calls.add_dependency(task_id, depends_on_task_id))

    def list_dependencies(self, task_id: str) -> list[Dependency]:
        return self.run(Calls.list_dependencies(task_id))

    def assign(self, task_id: str, agent_id: str, assigned_by: str | None = None) -> None:
        return self.run(Calls.assign(task_id, agent_id, assigned_by))

    def list_assignments(self, task_id: str) -> list[Assignment]:
        return self.run(Calls.list_assignments(task_id))

    def unassign(self, task_id: str, agent_id: str) -> None:
        return self.run(Calls.unassign(task_id, agent_id))

    # --- leases and runs -----------------------------------------------------------------------

    def claim(
        self,
        agent_id: str,
        role: str,
        *,
        lease_ttl_ms: int | None = None,
        wait_ms: int | None = None,
        concurrency: Mapping[str, int] | None = None,
    ) -> ClaimResult | None:
        """Claim a task for `role`; with `wait_ms`, wait up to that long for one. None: none."""
        return self.run(
            Calls.claim(
                agent_id, role, lease_ttl_ms=lease_ttl_ms, wait_ms=wait_ms, concurrency=concurrency
            )
        )

    def heartbeat(
        self,
        lease_id: str,
        lease_token: str,
        *,
        lease_ttl_ms: int | None = None,
        expected_fence: int | None = None,
    ) -> int:
        """Extend the lease; its new expiry (ms since the epoch)."""
        return self.run(
            Calls.heartbeat(
                lease_id, lease_token, lease_ttl_ms=lease_ttl_ms, expected_fence=expected_fence
            )
        )

    def event(
        self,
        run_id: str,
        lease_token: str,
        kind: str,
        data: Any = None,
        *,
        expected_fence: int | None = None,
    ) -> int:
        return self.run(Calls.event(run_id, lease_token, kind, data, expected_fence=expected_fence))

    def list_events(
        self,
        run_id: str,
        *,
        lease_token: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> EventPage:
        return self.run(
            Calls.list_events(run_id, lease_token=lease_token, limit=limit, cursor=cursor)
        )

    def checkpoint(
        self,
        run_id: str,
        lease_token: str,
        patch: Mapping[str, Any],
        *,
        expected_fence: int | None = None,
    ) -> CheckpointResult:
        return self.run(Calls.checkpoint(run_id, lease_token, patch, expected_fence=expected_fence))

    def transition(
        self,
        run_id: str,
        lease_token: str,
        trigger: str,
        *,
        instructions: str | None = None,
        usage: Any = None,
        expected_stage: str | None = None,
        expected_task_version: int | None = None,
        expected_fence: int | None = None,
    ) -> TransitionResult:
        return self.run(
            Calls.transition(
                run_id,
                lease_token,
                trigger,
                instructions=instructions,
                usage=usage,
                expected_stage=expected_stage,
                expected_task_version=expected_task_version,
                expected_fence=expected_fence,
            )
        )

    def fail(
        self,
        run_id: str,
        lease_token: str,
        error: str,
        *,
        usage: Any = None,
        expected_fence: int | None = None,
    ) -> None:
        return self.run(
            Calls.fail(run_id, lease_token, error, usage=usage, expected_fence=expected_fence)
        )

    def release(
        self,
        run_id: str,
        lease_token: str,
        reason: str | None = None,
        *,
        expected_fence: int | None = None,
    ) -> Released:
        return self.run(Calls.release(run_id, lease_token, reason, expected_fence=expected_fence))

    def release_agent(self, agent_id: str, reason: str | None = None) -> AgentReleased:
        return self.run(Calls.release_agent(agent_id, reason))

    # --- artifacts -----------------------------------------------------------------------------

    def create_artifact(
        self,
        kind: str,
        uri: str,
        *,
        task_id: str | None = None,
        run_id: str | None = None,
        sha256: str | None = None,
        size_bytes: int | None = None,
        meta: Any = None,
    ) -> str:
        return self.run(
            Calls.create_artifact(
                kind,
                uri,
                task_id=task_id,
                run_id=run_id,
                sha256=sha256,
                size_bytes=size_bytes,
                meta=meta,
            )
        )

    def list_artifacts(
        self,
        *,
        task_id: str | None = None,
        run_id: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> ArtifactPage:
        return self.run(
            Calls.list_artifacts(task_id=task_id, run_id=run_id, limit=limit, cursor=cursor)
        )

    # --- store ---------------------------------------------------------------------------------

    def store_put(self, namespace: str, key: str, value: Any) -> None:
        return self.run(Calls.store_put(namespace, key, value))

    def store_get(self, namespace: str, key: str) -> StoreEntry:
        return self.run(Calls.store_get(namespace, key))

    def store_delete(self, namespace: str, key: str) -> None:
        return self.run(Calls.store_delete(namespace, key))

    def store_list(self, namespace: str) -> list[StoreEntry]:
        return self.run(Calls.store_list(namespace))

    def store_delete_namespace(self, namespace: str) -> None:
        return self.run(Calls.store_delete_namespace(namespace))

    def store_search(
        self,
        q: str,
        *,
        namespace: str | None = None,
        limit: int | None = None,
        filter_path: str | None = None,
        filter_value: str | None = None,
    ) -> list[SearchHit]:
        return self.run(
            Calls.store_search(
                q,
                namespace=namespace,
                limit=limit,
                filter_path=filter_path,
                filter_value=filter_value,
            )
        )

    # --- operations and traces -----------------------------------------------------------------

    def queue_report(
        self, *, near_expiry_ms: int | None = None, stuck_ms: int | None = None
    ) -> QueueReport:
        return self.run(Calls.queue_report(near_expiry_ms=near_expiry_ms, stuck_ms=stuck_ms))

    def stage_report(self) -> StageReport:
        return self.run(Calls.stage_report())

    def retry_report(self, *, limit: int | None = None) -> RetryReport:
        """Tasks waiting on a retry delay, soonest claimable first."""
        return self.run(Calls.retry_report(limit=limit))

    def list_failures(
        self,
        *,
        kind: str | None = None,
        pipeline_id: str | None = None,
        error: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> FailurePage:
        """Dead-lettered, cancelled and failing tasks, newest first (kind: one of them)."""
        return self.run(
            Calls.list_failures(
                kind=kind, pipeline_id=pipeline_id, error=error, limit=limit, cursor=cursor
            )
        )

    def failure_groups(
        self, *, kind: str | None = None, pipeline_id: str | None = None, limit: int | None = None
    ) -> FailureGroups:
        """The failed tasks grouped by state and last error, the largest groups first."""
        return self.run(Calls.failure_groups(kind=kind, pipeline_id=pipeline_id, limit=limit))

    def failing_report(
        self,
        *,
        min_failures: int | None = None,
        window_ms: int | None = None,
        limit: int | None = None,
    ) -> FailingReport:
        """Tasks failing in a loop (min_failures in a row within window_ms), most first."""
        call = Calls.failing_report(min_failures=min_failures, window_ms=window_ms, limit=limit)
        return self.run(call)

    def list_namespaces(
        self, *, limit: int | None = None, cursor: str | None = None
    ) -> NamespacePage:
        return self.run(Calls.list_namespaces(limit=limit, cursor=cursor))

    def metrics(self) -> str:
        return self.run(Calls.metrics())

    def ingest_traces(self, payload: bytes, content_type: str = "application/json") -> TraceIngest:
        return self.run(Calls.ingest_traces(payload, content_type))

    def list_spans(
        self, run_id: str, *, limit: int | None = None, cursor: str | None = None
    ) -> SpanPage:
        return self.run(Calls.list_spans(run_id, limit=limit, cursor=cursor))

    # --- keys (admin) --------------------------------------------------------------------------

    def create_key(self, name: str, access: str, roles: list[str] | None = None) -> CreatedKey:
        """Make a key (`access`: read, agent or admin; an agent key needs `roles`). Its
        `key` is in this answer only."""
        return self.run(Calls.create_key(name, access, roles))

    def list_keys(self) -> list[KeyInfo]:
        """Every key, without the key itself."""
        return self.run(Calls.list_keys())

    def revoke_key(self, key_id: str) -> KeyInfo:
        """Revoke a key: every server refuses it from now on."""
        return self.run(Calls.revoke_key(key_id))


def _dropped(sock: socket.socket) -> bool:
    """An idle kept-alive connection the server has closed (or sent something unasked on)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)
