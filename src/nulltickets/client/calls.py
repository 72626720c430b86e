"""Every operation of the API as a `Call`, built once and sent by either client: its method,
path, body and how its answer decodes (the sans-IO core of both clients); and what both share:
the errors a call raises and the retry policy.

A new call of `Calls` gets its methods on `Client` and `AsyncClient` from `make generate`
(generate.py writes methods.py).
"""

from __future__ import annotations

import json
import random
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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
    Run,
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


def verb_call(
    method: str,
    path: str,
    params: list[str],
    query: Mapping[str, str],
    body: bytes | None,
    *,
    bearer: str | None = None,
    keyed: bool = False,
) -> Call[Any]:
    """A call of a verb of the table by its declaration (the MCP server's tools make
    theirs so): `path` its pattern, `params` the values of its parameters in order. Its
    answer is JSON, or None when empty."""
    values = iter(params)
    target = "/".join(
        _seg(next(values)) if part.startswith("{") else part for part in path.split("/")
    )
    if query:
        target = f"{target}?{urllib.parse.urlencode(list(query.items()))}"

    def answer(status: int, payload: bytes) -> Any:
        return json.loads(payload) if payload else None

    write = method != "GET"
    return Call(method, target, answer, body, bearer=bearer, repeatable=not write, keyed=keyed)


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
    def get_run(run_id: str) -> Call[Run]:
        """A run by its id: task, attempt, status, agent, times."""
        return Call("GET", f"/runs/{_seg(run_id)}", _as(Run), repeatable=True)

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
