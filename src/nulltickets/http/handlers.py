"""Handlers: decode the request, call the service on the right connection, encode the result.

Writes go through `Context.write`, which runs them on the writer and, when the request carries
an `Idempotency-Key`, records or replays the response in the same transaction.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from nulltickets import otlp
from nulltickets.domain import commands as cmd
from nulltickets.domain.model import ClaimResult, LeaseRow
from nulltickets.domain.tokens import lease_token_hash, same_token
from nulltickets.errors import (
    InvalidJson,
    InvalidRequest,
    LeaseExpired,
    NotFound,
    ReservedNamespace,
    TaskCancelled,
    Unauthorized,
)
from nulltickets.http.request import Request
from nulltickets.http.wakeups import Wakeups
from nulltickets.service import RESERVED_NAMESPACE, Reply, Tracker, now_ms
from nulltickets.storage.backend import Backend
from nulltickets.storage.sqlite.database import Database

if TYPE_CHECKING:
    from nulltickets.http.metrics import Metrics
    from nulltickets.http.sse import StreamHub

T = TypeVar("T")

_encoder = msgspec.json.Encoder()
encode = _encoder.encode


class IdBody(msgspec.Struct):
    id: str


class IdsBody(msgspec.Struct):
    ids: list[str]


class StatusBody(msgspec.Struct):
    status: str


class ExpiresBody(msgspec.Struct):
    expires_at_ms: int


class EventIdBody(msgspec.Struct):
    id: int


class RunStateBody(msgspec.Struct):
    run_id: str


_decoders: dict[type, msgspec.json.Decoder[Any]] = {}


def decode(kind: type[T], body: bytes) -> T:
    """Decode a JSON body into `kind`; anything unparsable is 400 invalid_json."""
    decoder = _decoders.get(kind)
    if decoder is None:
        decoder = _decoders[kind] = msgspec.json.Decoder(kind, strict=False)
    try:
        body.decode("utf-8")  # msgspec passes invalid UTF-8 inside strings through
        value: T = decoder.decode(body)
    except UnicodeDecodeError as exc:
        raise InvalidJson(f"invalid JSON body: not UTF-8 at byte {exc.start}") from None
    except msgspec.DecodeError as exc:
        raise InvalidJson(f"invalid JSON body: {exc}") from None
    except RecursionError:
        raise InvalidJson("invalid JSON body: nested too deeply") from None
    return value


def decode_later(kind: type[T], body: bytes) -> Callable[[], T]:
    """Decode now, but report a bad body only when called (after the lease checks)."""
    try:
        value = decode(kind, body)
    except InvalidJson as exc:
        error = exc

        def fail() -> T:
            raise error

        return fail
    return lambda: value


@dataclass
class Context:
    db: Database
    tracker: Tracker
    admin_token: str | None
    wakeups: Wakeups = field(default_factory=Wakeups)
    hub: StreamHub | None = None  # GET /events/stream
    metrics: Metrics | None = None  # GET /metrics

    async def read(self, job: Callable[[Backend], T]) -> T:
        return await self.db.read(job)

    async def write(
        self,
        req: Request,
        execute: Callable[[Backend, int], Reply],
        *,
        auth_hash: bytes | None = None,
        redact: Callable[[bytes], bytes] | None = None,
        revive: Callable[[Backend, bytes], bytes] | None = None,
    ) -> Reply:
        key = req.header("idempotency-key")
        tracker = self.tracker

        def job(b: Backend) -> Reply:
            now = now_ms()
            if key is None:
                return execute(b, now)
            return tracker.idempotent(
                b,
                key=key,
                method=req.method,
                path=req.path,
                request_hash=req.body_hash(),
                auth_hash=auth_hash,
                execute=lambda: execute(b, now),
                now=now,
                redact=redact,
                revive=(lambda body: revive(b, body)) if revive is not None else None,
            )

        return await self.db.write(job)


def ok(status: int, value: Any) -> Reply:
    return Reply(status, encode(value))


NO_CONTENT = Reply(204, b"")


# --- health ------------------------------------------------------------------------------------


async def health(ctx: Context, req: Request) -> Reply:
    now = now_ms()
    return ok(200, await ctx.read(lambda b: ctx.tracker.health(b, now)))


# --- pipelines ---------------------------------------------------------------------------------


async def create_pipeline(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.CreatePipeline, req.body)
    return await ctx.write(
        req, lambda b, now: ok(201, IdBody(ctx.tracker.create_pipeline(b, command, now)))
    )


async def list_pipelines(ctx: Context, req: Request) -> Reply:
    return ok(200, await ctx.read(ctx.tracker.list_pipelines))


async def get_pipeline(ctx: Context, req: Request) -> Reply:
    pipeline_id = req.params["id"]
    return ok(200, await ctx.read(lambda b: ctx.tracker.get_pipeline(b, pipeline_id)))


# --- tasks -------------------------------------------------------------------------------------


async def create_task(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.CreateTask, req.body)
    return await ctx.write(
        req, lambda b, now: ok(201, IdBody(ctx.tracker.create_task(b, command, now)))
    )


async def create_tasks(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.CreateTasks, req.body)
    if not command.tasks:
        raise InvalidRequest("tasks must not be empty")
    return await ctx.write(
        req, lambda b, now: ok(201, IdsBody(ctx.tracker.create_tasks(b, command.tasks, now)))
    )


async def list_tasks(ctx: Context, req: Request) -> Reply:
    limit = req.limit(50)
    after = req.composite_cursor()
    stage, pipeline_id = req.query.get("stage"), req.query.get("pipeline_id")
    role = req.query.get("role")
    items, cursor = await ctx.read(
        lambda b: ctx.tracker.list_tasks(
            b, stage=stage, pipeline_id=pipeline_id, after=after, limit=limit, agent_role=role
        )
    )
    return ok(200, {"items": items, "next_cursor": cursor})


async def get_task(ctx: Context, req: Request) -> Reply:
    task_id = req.params["id"]
    return ok(200, await ctx.read(lambda b: ctx.tracker.get_task(b, task_id)))


async def requeue_task(ctx: Context, req: Request) -> Reply:
    task_id = req.params["id"]
    # The body is optional: without one the task is requeued where it failed.
    command = decode(cmd.RequeueTask, req.body) if req.body.strip() else cmd.RequeueTask()
    return await ctx.write(
        req, lambda b, now: ok(200, ctx.tracker.requeue(b, task_id, command, now))
    )


async def cancel_task(ctx: Context, req: Request) -> Reply:
    task_id = req.params["id"]
    command = decode(cmd.CancelTask, req.body) if req.body.strip() else cmd.CancelTask()
    return await ctx.write(
        req, lambda b, now: ok(200, ctx.tracker.cancel(b, task_id, command, now))
    )


async def list_task_events(ctx: Context, req: Request) -> Reply:
    task_id = req.params["id"]
    limit = req.limit(100)
    after = req.event_cursor()
    items, cursor = await ctx.read(lambda b: ctx.tracker.list_task_events(b, task_id, after, limit))
    return ok(200, {"items": items, "next_cursor": cursor})


async def run_state(ctx: Context, req: Request) -> Reply:
    task_id = req.params["id"]
    return ok(200, RunStateBody(await ctx.read(lambda b: ctx.tracker.run_state(b, task_id))))


async def add_dependency(ctx: Context, req: Request) -> Reply:
    task_id = req.params["id"]
    command = decode(cmd.AddDependency, req.body)

    def execute(b: Backend, now: int) -> Reply:
        ctx.tracker.add_dependency(b, task_id, command.depends_on_task_id, now)
        return ok(201, StatusBody("created"))

    return await ctx.write(req, execute)


async def list_dependencies(ctx: Context, req: Request) -> Reply:
    task_id = req.params["id"]
    return ok(200, await ctx.read(lambda b: ctx.tracker.list_dependencies(b, task_id)))


async def assign(ctx: Context, req: Request) -> Reply:
    task_id = req.params["id"]
    command = decode(cmd.Assign, req.body)

    def execute(b: Backend, now: int) -> Reply:
        ctx.tracker.assign(b, task_id, command, now)
        return ok(201, StatusBody("assigned"))

    return await ctx.write(req, execute)


async def list_assignments(ctx: Context, req: Request) -> Reply:
    task_id = req.params["id"]
    return ok(200, await ctx.read(lambda b: ctx.tracker.list_assignments(b, task_id)))


async def unassign(ctx: Context, req: Request) -> Reply:
    task_id, agent_id = req.params["id"], req.params["agent_id"]

    def execute(b: Backend, now: int) -> Reply:
        ctx.tracker.unassign(b, task_id, agent_id, now)
        return ok(200, StatusBody("unassigned"))

    return await ctx.write(req, execute)


# --- leases and runs ---------------------------------------------------------------------------

_REDACTED_TOKEN = ""


async def claim(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.Claim, req.body)
    wait_ms = max(0, min(command.wait_ms or 0, cmd.MAX_WAIT_MS))

    def execute(b: Backend, now: int) -> Reply:
        result = ctx.tracker.claim(b, command, now)
        return NO_CONTENT if result is None else ok(200, result)

    def redact(body: bytes) -> bytes:
        # Lease tokens are never stored in clear, not even in the idempotency record.
        result = msgspec.json.decode(body, type=ClaimResult)
        result.lease_token = _REDACTED_TOKEN
        return encode(result)

    def revive(b: Backend, body: bytes) -> bytes:
        result = msgspec.json.decode(body, type=ClaimResult)
        result.lease_token = ctx.tracker.rotate_claim_token(b, result.lease_id)
        return encode(result)

    if not wait_ms:
        return await ctx.write(req, execute, redact=redact, revive=revive)
    # Long poll: try, and while nothing is claimable wait for a wake-up of this role.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_ms / 1000
    role = command.agent_role
    ctx.tracker.long_polls += 1  # from before the first attempt: see Tracker.long_polls
    try:
        while True:
            generation = ctx.wakeups.generation(role)
            reply = await ctx.write(req, execute, redact=redact, revive=revive)
            remaining = deadline - loop.time()
            if reply.status != 204 or remaining <= 0 or ctx.wakeups.closing:
                return reply
            connected = await ctx.wakeups.wait(role, generation, remaining, req.disconnected())
            if not connected:  # nobody would receive a lease claimed now
                return reply
    finally:
        ctx.tracker.long_polls -= 1


def _lease_hash(req: Request) -> bytes:
    return lease_token_hash(req.require_bearer())


def _fence(command: Callable[[], Any]) -> int | None:
    """The expected_fence of a body decoded later (None if absent or the body is bad)."""
    try:
        fence: int | None = command().expected_fence
    except InvalidJson:
        return None
    return fence


async def heartbeat(ctx: Context, req: Request) -> Reply:
    lease_id = req.params["id"]
    token_hash = _lease_hash(req)
    # The body is optional; when present it may ask for a new TTL.
    command = decode_later(cmd.Heartbeat, req.body) if req.body.strip() else cmd.Heartbeat

    def execute(b: Backend, now: int) -> Reply:
        expires = ctx.tracker.heartbeat(b, lease_id, token_hash, command(), now)
        return ok(200, ExpiresBody(expires))

    return await ctx.write(req, execute, auth_hash=token_hash)


async def append_event(ctx: Context, req: Request) -> Reply:
    run_id = req.params["id"]
    token_hash = _lease_hash(req)
    command = decode_later(cmd.AppendEvent, req.body)

    def execute(b: Backend, now: int) -> Reply:
        try:
            event = command()
        except InvalidJson:  # the lease's errors come before the body's
            ctx.tracker.check_run_lease(b, run_id, token_hash, now)
            raise
        return ok(201, EventIdBody(ctx.tracker.append_event(b, run_id, token_hash, event, now)))

    return await ctx.write(req, execute, auth_hash=token_hash)


async def list_events(ctx: Context, req: Request) -> Reply:
    run_id = req.params["id"]
    if ctx.admin_token is not None:
        # The original lets any bearer read events; require the admin token or this run's live
        # lease. Anything else is 401, whatever the reason the lease does not match.
        token = req.require_bearer()
        if not same_token(token, ctx.admin_token):
            token_hash = lease_token_hash(token)
            now = now_ms()
            try:
                await ctx.read(lambda b: ctx.tracker.check_run_lease(b, run_id, token_hash, now))
            except (NotFound, LeaseExpired, TaskCancelled) as exc:
                raise Unauthorized("needs the admin token or this run's lease token") from exc
    limit = req.limit(100)
    after = req.event_cursor()
    items, cursor = await ctx.read(lambda b: ctx.tracker.list_events(b, run_id, after, limit))
    return ok(200, {"items": items, "next_cursor": cursor})


async def _under_run_lease(
    ctx: Context,
    req: Request,
    command: Callable[[], T],
    act: Callable[[Backend, LeaseRow, T, int], Reply],
) -> Reply:
    """A write on /runs/{id}/...: the run's lease (and any expected_fence) is checked first,
    then `act` runs with the lease and the body, which is only then required to be valid."""
    run_id = req.params["id"]
    token_hash = _lease_hash(req)

    def execute(b: Backend, now: int) -> Reply:
        lease = ctx.tracker.check_run_lease(b, run_id, token_hash, now, _fence(command))
        return act(b, lease, command(), now)

    return await ctx.write(req, execute, auth_hash=token_hash)


async def transition(ctx: Context, req: Request) -> Reply:
    def act(b: Backend, lease: LeaseRow, move: cmd.MoveTask, now: int) -> Reply:
        return ok(200, ctx.tracker.transition(b, lease, move, now))

    return await _under_run_lease(ctx, req, decode_later(cmd.MoveTask, req.body), act)


async def fail(ctx: Context, req: Request) -> Reply:
    def act(b: Backend, lease: LeaseRow, failure: cmd.FailRun, now: int) -> Reply:
        ctx.tracker.fail(b, lease, failure, now)
        return ok(200, StatusBody("failed"))

    return await _under_run_lease(ctx, req, decode_later(cmd.FailRun, req.body), act)


async def write_checkpoint(ctx: Context, req: Request) -> Reply:
    def act(b: Backend, lease: LeaseRow, patch: cmd.WriteCheckpoint, now: int) -> Reply:
        return ok(200, ctx.tracker.checkpoint(b, lease, patch, now))

    return await _under_run_lease(ctx, req, decode_later(cmd.WriteCheckpoint, req.body), act)


async def release(ctx: Context, req: Request) -> Reply:
    def act(b: Backend, lease: LeaseRow, reason: cmd.ReleaseRun, now: int) -> Reply:
        return ok(200, ctx.tracker.release(b, lease, reason, now))

    # The body is optional: a reason and an expected_fence.
    command = decode_later(cmd.ReleaseRun, req.body) if req.body.strip() else cmd.ReleaseRun
    return await _under_run_lease(ctx, req, command, act)


async def release_agent(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.ReleaseAgent, req.body)
    return await ctx.write(
        req,
        lambda b, now: ok(200, ctx.tracker.release_agent(b, command.agent_id, command.reason, now)),
    )


async def get_checkpoint(ctx: Context, req: Request) -> Reply:
    task_id = req.params["id"]
    return ok(200, await ctx.read(lambda b: ctx.tracker.get_checkpoint(b, task_id)))


# --- artifacts ---------------------------------------------------------------------------------


async def create_artifact(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.CreateArtifact, req.body)
    return await ctx.write(
        req, lambda b, now: ok(201, IdBody(ctx.tracker.create_artifact(b, command, now)))
    )


async def list_artifacts(ctx: Context, req: Request) -> Reply:
    limit = req.limit(100)
    after = req.composite_cursor()
    task_id, run_id = req.query.get("task_id"), req.query.get("run_id")
    items, cursor = await ctx.read(
        lambda b: ctx.tracker.list_artifacts(
            b, task_id=task_id, run_id=run_id, after=after, limit=limit
        )
    )
    return ok(200, {"items": items, "next_cursor": cursor})


def check_admin(ctx: Context, req: Request) -> None:
    token = req.bearer()
    if ctx.admin_token is not None and (token is None or not same_token(token, ctx.admin_token)):
        raise Unauthorized("missing or invalid admin token")


async def openapi(ctx: Context, req: Request) -> Reply:
    from nulltickets.http.openapi import document  # the document is built from the route table

    return Reply(200, document())


# --- store -------------------------------------------------------------------------------------


async def put_value(ctx: Context, req: Request) -> Reply:
    namespace, key = req.params["namespace"], req.params["key"]
    if namespace == RESERVED_NAMESPACE:
        raise ReservedNamespace('the namespace "search" is reserved')
    command = decode(cmd.PutValue, req.body)

    def execute(b: Backend, now: int) -> Reply:
        ctx.tracker.put_value(b, namespace, key, command, now)
        return NO_CONTENT

    return await ctx.write(req, execute)


async def get_value(ctx: Context, req: Request) -> Reply:
    namespace, key = req.params["namespace"], req.params["key"]
    return ok(200, await ctx.read(lambda b: ctx.tracker.get_value(b, namespace, key)))


async def delete_value(ctx: Context, req: Request) -> Reply:
    namespace, key = req.params["namespace"], req.params["key"]

    def execute(b: Backend, now: int) -> Reply:
        ctx.tracker.delete_value(b, namespace, key)
        return NO_CONTENT

    return await ctx.write(req, execute)


async def list_namespace(ctx: Context, req: Request) -> Reply:
    namespace = req.params["namespace"]
    return ok(200, await ctx.read(lambda b: ctx.tracker.list_namespace(b, namespace)))


async def delete_namespace(ctx: Context, req: Request) -> Reply:
    namespace = req.params["namespace"]

    def execute(b: Backend, now: int) -> Reply:
        ctx.tracker.delete_namespace(b, namespace)
        return NO_CONTENT

    return await ctx.write(req, execute)


async def search_store(ctx: Context, req: Request) -> Reply:
    q = req.query
    text = q.get("q")
    limit = req.search_limit() if text is not None and text.strip() else 10
    hits = await ctx.read(
        lambda b: ctx.tracker.search(
            b,
            text=text,
            namespace=q.get("namespace"),
            filter_path=q.get("filter_path"),
            filter_value=q.get("filter_value"),
            limit=limit,
        )
    )
    return ok(200, hits)


# --- operations --------------------------------------------------------------------------------


async def queue_report(ctx: Context, req: Request) -> Reply:
    near_expiry_ms = req.int_param("near_expiry_ms", 60_000)
    stuck_ms = req.int_param("stuck_ms", 300_000)
    now = now_ms()
    return ok(
        200, await ctx.read(lambda b: ctx.tracker.queue_report(b, now, near_expiry_ms, stuck_ms))
    )


async def stage_report(ctx: Context, req: Request) -> Reply:
    now = now_ms()
    return ok(200, await ctx.read(lambda b: ctx.tracker.stage_report(b, now)))


# --- traces ------------------------------------------------------------------------------------


async def ingest_traces(ctx: Context, req: Request) -> Reply:
    content_type = otlp.normalize_content_type(req.header("content-type"))
    spans: list[otlp.SpanRow] | None
    if otlp.is_json(content_type):
        spans = otlp.spans_from_json(req.body)  # 400 invalid_json: nothing is stored
    elif otlp.is_protobuf(content_type):
        try:
            spans = otlp.spans_from_protobuf(req.body)
        except otlp.OtlpDecodeError:
            spans = None  # kept raw, as the original keeps every protobuf payload
    else:
        spans = None
    body = req.body
    return await ctx.write(
        req, lambda b, now: ok(200, ctx.tracker.ingest_traces(b, content_type, spans, body, now))
    )


async def list_spans(ctx: Context, req: Request) -> Reply:
    run_id = req.params["id"]
    limit = req.limit(100)
    after = req.event_cursor()
    items, cursor = await ctx.read(lambda b: ctx.tracker.list_spans(b, run_id, after, limit))
    return ok(200, {"items": items, "next_cursor": cursor})
