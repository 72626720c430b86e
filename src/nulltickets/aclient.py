"""The asyncio client: the same operations and retry rules as `nulltickets.client.Client`, on
asyncio streams, with a small pool of kept-alive connections so that coroutines can call at once.

    from nulltickets.aclient import AsyncClient
    async with AsyncClient("http://127.0.0.1:7700") as api:
        claimed = await api.claim("orchestrator-1", "coder", wait_ms=30_000)

Calls are built, decoded and retried by what `nulltickets.client` shares (`Calls`, `Transport`,
`Attempts`); this module only moves the bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar

from nulltickets.client import (
    DEFAULT_BASE_URL,
    DEFAULT_RETRY,
    Call,
    Calls,
    Retry,
    RetryEvent,
    Transport,
)
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

MAX_LINE = 65536
MAX_HEADERS = 100


class _NotSent(Exception):
    def __init__(self, cause: BaseException) -> None:
        self.cause = cause


class _Lost(Exception):
    def __init__(self, cause: BaseException) -> None:
        self.cause = cause


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    def usable(self) -> bool:
        """Still open: not closed by the server while it was idle."""
        return not (self.writer.is_closing() or self.reader.at_eof())

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            await asyncio.wait_for(self.writer.wait_closed(), 1.0)


class AsyncClient:
    """The API for asyncio. Up to `max_connections` calls run at once, each on its own
    kept-alive connection; the other arguments are those of `Client`."""

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
        max_connections: int = 10,
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
        self._idle: list[_Connection] = []
        self._slots = asyncio.Semaphore(max_connections)

    @property
    def base_url(self) -> str:
        return self.transport.base_url

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()

    # --- transport -----------------------------------------------------------------------------

    async def run(self, call: Call[T], retry: Retry | None = None) -> T:
        """Send `call` (and again, as its retry policy allows); its decoded answer."""
        call, attempts = self.transport.prepare(call, retry)
        key = self.transport.new_key(call)
        while True:
            try:
                async with self._slots:
                    status, headers, payload = await self._send(call, key)
            except (_NotSent, _Lost) as failure:
                delay = attempts.after_error(failure.cause, sent=isinstance(failure, _Lost))
            else:
                if status < 400:
                    await asyncio.sleep(attempts.pause_after(status, headers))
                    return call.decode(status, payload)
                delay = attempts.after_answer(status, headers, payload)
            await asyncio.sleep(delay)

    async def _connect(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable():
                return conn
            await conn.close()
        t = self.transport
        ep = t.endpoint
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(
                    ep.host,
                    ep.port,
                    ssl=t.ssl_context if ep.tls else None,
                    server_hostname=ep.host if ep.tls else None,
                    limit=MAX_LINE,
                ),
                t.timeout,
            )
        except (TimeoutError, OSError, ssl.SSLError) as exc:
            raise _NotSent(exc) from exc
        return _Connection(reader, writer)

    async def _send(self, call: Call[Any], key: str | None) -> tuple[int, dict[str, str], bytes]:
        conn = await self._connect()
        t = self.transport
        headers = t.headers(call, key)
        headers["Content-Length"] = str(len(call.body or b""))
        head = f"{call.method} {t.target(call)} HTTP/1.1\r\n" + "".join(
            f"{name}: {value}\r\n" for name, value in headers.items()
        )
        try:
            conn.writer.write(head.encode("latin-1") + b"\r\n" + (call.body or b""))
            async with asyncio.timeout(t.read_timeout(call)):
                await conn.writer.drain()
                status, answer, payload, keep = await _read_response(conn.reader, call.method)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            await conn.close()
            raise _Lost(exc) from exc
        except BaseException:  # cancelled: the connection is in an unknown state
            conn.writer.close()
            raise
        if keep:
            self._idle.append(conn)
        else:
            await conn.close()
        return status, answer, payload

    # --- discovery -----------------------------------------------------------------------------

    async def health(self) -> Health:
        return await self.run(Calls.health())

    async def openapi(self) -> Any:
        return await self.run(Calls.openapi())

    # --- pipelines -----------------------------------------------------------------------------

    async def create_pipeline(self, name: str, definition: Mapping[str, Any]) -> str:
        return await self.run(Calls.create_pipeline(name, definition))

    async def list_pipelines(self) -> list[Pipeline]:
        return await self.run(Calls.list_pipelines())

    async def get_pipeline(self, pipeline_id: str) -> Pipeline:
        return await self.run(Calls.get_pipeline(pipeline_id))

    # --- tasks ---------------------------------------------------------------------------------

    async def create_task(
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
        return await self.run(
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

    async def create_tasks(self, tasks: list[cmd.CreateTask | Mapping[str, Any]]) -> list[str]:
        return await self.run(Calls.create_tasks(tasks))

    async def list_tasks(
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
        return await self.run(
            Calls.list_tasks(
                stage=stage,
                pipeline_id=pipeline_id,
                role=role,
                text=text,
                limit=limit,
                cursor=cursor,
            )
        )

    async def list_task_runs(
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
        return await self.run(call)

    async def get_task(self, task_id: str) -> TaskDetails:
        return await self.run(Calls.get_task(task_id))

    async def run_state(self, task_id: str) -> str:
        return await self.run(Calls.run_state(task_id))

    async def get_checkpoint(self, task_id: str) -> TaskCheckpoint:
        return await self.run(Calls.get_checkpoint(task_id))

    async def requeue(
        self,
        task_id: str,
        stage: str | None = None,
        reset_attempts: bool = False,
        reason: str | None = None,
        *,
        actor: str | None = None,
    ) -> TaskDetails:
        """Make a dead-lettered, cancelled, failed or waiting task claimable now."""
        return await self.run(Calls.requeue(task_id, stage, reset_attempts, reason, actor=actor))

    async def cancel(
        self, task_id: str, reason: str | None = None, *, actor: str | None = None
    ) -> TaskDetails:
        """Never claim the task again; its holder's next lease call gets 409 task_cancelled."""
        return await self.run(Calls.cancel(task_id, reason, actor=actor))

    async def requeue_tasks(
        self,
        ids: list[str],
        stage: str | None = None,
        reset_attempts: bool = False,
        reason: str | None = None,
        *,
        actor: str | None = None,
    ) -> BulkOutcome:
        """Requeue many tasks in one transaction; what happened to each, in the order given."""
        return await self.run(Calls.requeue_tasks(ids, stage, reset_attempts, reason, actor=actor))

    async def cancel_tasks(
        self, ids: list[str], reason: str | None = None, *, actor: str | None = None
    ) -> BulkOutcome:
        """Cancel many tasks in one transaction; what happened to each, in the order given."""
        return await self.run(Calls.cancel_tasks(ids, reason, actor=actor))

    async def list_task_events(
        self, task_id: str, *, limit: int | None = None, cursor: str | None = None
    ) -> TaskEventPage:
        """What operators did to the task (requeued, cancelled), oldest first."""
        return await self.run(Calls.list_task_events(task_id, limit=limit, cursor=cursor))

    async def add_dependency(self, task_id: str, depends_on_task_id: str) -> None:
        return await self.run(Calls.add_dependency(task_id, depends_on_task_id))

    async def list_dependencies(self, task_id: str) -> list[Dependency]:
        return await self.run(Calls.list_dependencies(task_id))

    async def assign(self, task_id: str, agent_id: str, assigned_by: str | None = None) -> None:
        return await self.run(Calls.assign(task_id, agent_id, assigned_by))

    async def list_assignments(self, task_id: str) -> list[Assignment]:
        return await self.run(Calls.list_assignments(task_id))

    async def unassign(self, task_id: str, agent_id: str) -> None:
        return await self.run(Calls.unassign(task_id, agent_id))

    # --- leases and runs -----------------------------------------------------------------------

    async def claim(
        self,
        agent_id: str,
        role: str,
        *,
        lease_ttl_ms: int | None = None,
        wait_ms: int | None = None,
        concurrency: Mapping[str, int] | None = None,
    ) -> ClaimResult | None:
        """Claim a task for `role`; with `wait_ms`, wait up to that long for one. None: none."""
        return await self.run(
            Calls.claim(
                agent_id, role, lease_ttl_ms=lease_ttl_ms, wait_ms=wait_ms, concurrency=concurrency
            )
        )

    async def heartbeat(
        self,
        lease_id: str,
        lease_token: str,
        *,
        lease_ttl_ms: int | None = None,
        expected_fence: int | None = None,
    ) -> int:
        """Extend the lease; its new expiry (ms since the epoch)."""
        return await self.run(
            Calls.heartbeat(
                lease_id, lease_token, lease_ttl_ms=lease_ttl_ms, expected_fence=expected_fence
            )
        )

    async def event(
        self,
        run_id: str,
        lease_token: str,
        kind: str,
        data: Any = None,
        *,
        expected_fence: int | None = None,
    ) -> int:
        return await self.run(
            Calls.event(run_id, lease_token, kind, data, expected_fence=expected_fence)
        )

    async def list_events(
        self,
        run_id: str,
        *,
        lease_token: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> EventPage:
        return await self.run(
            Calls.list_events(run_id, lease_token=lease_token, limit=limit, cursor=cursor)
        )

    async def checkpoint(
        self,
        run_id: str,
        lease_token: str,
        patch: Mapping[str, Any],
        *,
        expected_fence: int | None = None,
    ) -> CheckpointResult:
        return await self.run(
            Calls.checkpoint(run_id, lease_token, patch, expected_fence=expected_fence)
        )

    async def transition(
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
        return await self.run(
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

    async def fail(
        self,
        run_id: str,
        lease_token: str,
        error: str,
        *,
        usage: Any = None,
        expected_fence: int | None = None,
    ) -> None:
        return await self.run(
            Calls.fail(run_id, lease_token, error, usage=usage, expected_fence=expected_fence)
        )

    async def release(
        self,
        run_id: str,
        lease_token: str,
        reason: str | None = None,
        *,
        expected_fence: int | None = None,
    ) -> Released:
        return await self.run(
            Calls.release(run_id, lease_token, reason, expected_fence=expected_fence)
        )

    async def release_agent(self, agent_id: str, reason: str | None = None) -> AgentReleased:
        return await self.run(Calls.release_agent(agent_id, reason))

    # --- artifacts -----------------------------------------------------------------------------

    async def create_artifact(
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
        return await self.run(
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

    async def list_artifacts(
        self,
        *,
        task_id: str | None = None,
        run_id: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> ArtifactPage:
        return await self.run(
            Calls.list_artifacts(task_id=task_id, run_id=run_id, limit=limit, cursor=cursor)
        )

    # --- store ---------------------------------------------------------------------------------

    async def store_put(self, namespace: str, key: str, value: Any) -> None:
        return await self.run(Calls.store_put(namespace, key, value))

    async def store_get(self, namespace: str, key: str) -> StoreEntry:
        return await self.run(Calls.store_get(namespace, key))

    async def store_delete(self, namespace: str, key: str) -> None:
        return await self.run(Calls.store_delete(namespace, key))

    async def store_list(self, namespace: str) -> list[StoreEntry]:
        return await self.run(Calls.store_list(namespace))

    async def store_delete_namespace(self, namespace: str) -> None:
        return await self.run(Calls.store_delete_namespace(namespace))

    async def store_search(
        self,
        q: str,
        *,
        namespace: str | None = None,
        limit: int | None = None,
        filter_path: str | None = None,
        filter_value: str | None = None,
    ) -> list[SearchHit]:
        return await self.run(
            Calls.store_search(
                q,
                namespace=namespace,
                limit=limit,
                filter_path=filter_path,
                filter_value=filter_value,
            )
        )

    # --- operations and traces -----------------------------------------------------------------

    async def queue_report(
        self, *, near_expiry_ms: int | None = None, stuck_ms: int | None = None
    ) -> QueueReport:
        return await self.run(Calls.queue_report(near_expiry_ms=near_expiry_ms, stuck_ms=stuck_ms))

    async def stage_report(self) -> StageReport:
        return await self.run(Calls.stage_report())

    async def retry_report(self, *, limit: int | None = None) -> RetryReport:
        """Tasks waiting on a retry delay, soonest claimable first."""
        return await self.run(Calls.retry_report(limit=limit))

    async def list_failures(
        self,
        *,
        kind: str | None = None,
        pipeline_id: str | None = None,
        error: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> FailurePage:
        """Dead-lettered, cancelled and failing tasks, newest first (kind: one of them)."""
        return await self.run(
            Calls.list_failures(
                kind=kind, pipeline_id=pipeline_id, error=error, limit=limit, cursor=cursor
            )
        )

    async def failure_groups(
        self, *, kind: str | None = None, pipeline_id: str | None = None, limit: int | None = None
    ) -> FailureGroups:
        """The failed tasks grouped by state and last error, the largest groups first."""
        return await self.run(Calls.failure_groups(kind=kind, pipeline_id=pipeline_id, limit=limit))

    async def failing_report(
        self,
        *,
        min_failures: int | None = None,
        window_ms: int | None = None,
        limit: int | None = None,
    ) -> FailingReport:
        """Tasks failing in a loop (min_failures in a row within window_ms), most first."""
        call = Calls.failing_report(min_failures=min_failures, window_ms=window_ms, limit=limit)
        return await self.run(call)

    async def list_namespaces(
        self, *, limit: int | None = None, cursor: str | None = None
    ) -> NamespacePage:
        return await self.run(Calls.list_namespaces(limit=limit, cursor=cursor))

    async def metrics(self) -> str:
        return await self.run(Calls.metrics())

    async def ingest_traces(
        self, payload: bytes, content_type: str = "application/json"
    ) -> TraceIngest:
        return await self.run(Calls.ingest_traces(payload, content_type))

    async def list_spans(
        self, run_id: str, *, limit: int | None = None, cursor: str | None = None
    ) -> SpanPage:
        return await self.run(Calls.list_spans(run_id, limit=limit, cursor=cursor))

    # --- keys (admin) --------------------------------------------------------------------------

    async def create_key(
        self, name: str, access: str, roles: list[str] | None = None
    ) -> CreatedKey:
        """Make a key (`access`: read, agent or admin; an agent key needs `roles`). Its
        `key` is in this answer only."""
        return await self.run(Calls.create_key(name, access, roles))

    async def list_keys(self) -> list[KeyInfo]:
        """Every key, without the key itself."""
        return await self.run(Calls.list_keys())

    async def revoke_key(self, key_id: str) -> KeyInfo:
        """Revoke a key: every server refuses it from now on."""
        return await self.run(Calls.revoke_key(key_id))


async def _read_response(
    reader: asyncio.StreamReader, method: str
) -> tuple[int, dict[str, str], bytes, bool]:
    """One HTTP/1.1 response: status, headers (lower-case names), body, and whether the
    connection may carry another request. Raises ValueError on anything malformed."""
    while True:
        line = await reader.readuntil(b"\r\n")
        version, _, rest = line.decode("latin-1").partition(" ")
        if not version.startswith("HTTP/1."):
            raise ValueError(f"not an HTTP/1.x response: {line[:80]!r}")
        status = int(rest.split(" ", 1)[0])
        headers: dict[str, str] = {}
        for _ in range(MAX_HEADERS):
            field = await reader.readuntil(b"\r\n")
            if field == b"\r\n":
                break
            name, sep, value = field.decode("latin-1").partition(":")
            if not sep:
                raise ValueError(f"malformed header line: {field[:80]!r}")
            name = name.strip().lower()
            value = value.strip()
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        else:
            raise ValueError("too many header lines")
        if status >= 200:
            break  # a 1xx (100 Continue) is followed by the real answer
    connection = headers.get("connection", "").lower()
    keep = "close" not in connection and (version != "HTTP/1.0" or "keep-alive" in connection)
    if method == "HEAD" or status in (204, 304):
        return status, headers, b"", keep
    if "chunked" in headers.get("transfer-encoding", "").lower():
        parts: list[bytes] = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                while await reader.readuntil(b"\r\n") != b"\r\n":
                    pass  # trailers
                return status, headers, b"".join(parts), keep
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
    length = headers.get("content-length")
    if length is not None:
        return status, headers, await reader.readexactly(int(length)), keep
    return status, headers, await reader.read(), False  # the body ends with the connection
