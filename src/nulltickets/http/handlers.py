"""Handlers: decode the request, call the service, encode the result.

The service runs each call as one unit of work, idempotency included: a handler gives it the
request's `Idem` (when the request has an Idempotency-Key), whose `record` is `answer` below,
so a recorded answer is exactly what the first response sent. `answer` is also the one place
that turns what a write did (`Kind`) into a status.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from nulltickets import otlp
from nulltickets.domain import commands as cmd
from nulltickets.domain.tokens import lease_token_hash
from nulltickets.errors import (
    InvalidJson,
    InvalidRequest,
    InvalidRetryPolicy,
    KeysNeedToken,
    LeaseExpired,
    NotFound,
    ReservedNamespace,
    TaskCancelled,
    TrackerError,
    Unauthorized,
)
from nulltickets.http import access
from nulltickets.http.request import Request
from nulltickets.http.response import WebReply
from nulltickets.http.slowdown import Slowdown
from nulltickets.http.wakeups import Wakeups
from nulltickets.service import RESERVED_NAMESPACE, Idem, Kind, Outcome, Recorded, Service

if TYPE_CHECKING:
    from nulltickets.heap import Collector
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
    except msgspec.ValidationError as exc:
        raise _invalid(exc) from None
    except msgspec.DecodeError as exc:
        raise InvalidJson(f"invalid JSON body: {exc}") from None
    except RecursionError:
        raise InvalidJson("invalid JSON body: nested too deeply") from None
    return value


_AT = re.compile(r"(?P<what>.*) - at `(?P<path>\$[^`]*)`", re.DOTALL)
_IN_RETRY_POLICY = re.compile(r"\.retry_policy(?:\.|$)")
_UNKNOWN_FIELD = re.compile(r"Object contains unknown field `(?P<key>.*)`", re.DOTALL)


def _invalid(exc: msgspec.ValidationError) -> TrackerError:
    """A body that is JSON but not the route's shape: 400 invalid_json (as the original
    answers a wrong type), except for an unknown key or a value out of range in a task's
    retry_policy, which the original accepted: 400 invalid_retry_policy, naming the key."""
    found = _AT.fullmatch(str(exc))
    if found is None or not _IN_RETRY_POLICY.search(found["path"]) or ", got `" in found["what"]:
        return InvalidJson(f"invalid JSON body: {exc}")
    unknown = _UNKNOWN_FIELD.fullmatch(found["what"])
    if unknown is None:
        return InvalidRetryPolicy(f"{found['path']}: {found['what']}")
    known = ", ".join(cmd.RetryPolicy.__struct_fields__)
    return InvalidRetryPolicy(
        f"{found['path']}: unknown key {unknown['key']!r} (a retry_policy takes {known})"
    )


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
    service: Service
    admin_token: str | None
    wakeups: Wakeups = field(default_factory=Wakeups)
    hub: StreamHub | None = None  # GET /events/stream
    metrics: Metrics | None = None  # GET /metrics
    collector: Collector | None = None  # the garbage collector's settings and timings
    slowdown: Slowdown = field(default_factory=Slowdown)  # wrong tokens and keys wait


Reply = Recorded  # a status and the encoded body, as sent (and as a replay sends it again)

NO_CONTENT = Reply(204, b"")
# A long-poll the server has no room for answers at once; its 204 asks the client to come back
# after this many seconds at most (its own wait, if shorter).
WAIT_REFUSED_RETRY_S = 5


def answer(outcome: Outcome[Any]) -> Reply:
    """The response to a write's outcome, and the answer its idempotency record keeps: 201
    for CREATED, 200 for OK, 204 for EMPTY. (By identity: an Enum member's hash is Python code,
    and this runs for every write.)"""
    kind = outcome.kind
    if kind is Kind.EMPTY:
        return NO_CONTENT
    return Reply(201 if kind is Kind.CREATED else 200, encode(outcome.value))


def respond(result: Outcome[Any] | Recorded) -> Reply:
    return result if isinstance(result, Recorded) else answer(result)


def respond_with(body: Callable[[Any], Any]) -> Callable[[Outcome[Any] | Recorded], Reply]:
    """`respond`, with the outcome's value wrapped in the route's body first."""

    def wrapped(result: Outcome[Any] | Recorded) -> Reply:
        if isinstance(result, Recorded):
            return result
        return answer(Outcome(result.kind, body(result.value)))

    return wrapped


def idem(req: Request, auth_hash: bytes | None = None, body: Any = None) -> Idem | None:
    """The request's identity for idempotent replay, if it carries an Idempotency-Key.
    `body` wraps the outcome's value as the route's response does."""
    key = req.header("idempotency-key")
    if key is None:
        return None
    record = answer if body is None else _wrapping(body)
    return Idem(key, req.method, req.path, req.body_hash(), auth_hash, record)


def _wrapping(body: Callable[[Any], Any]) -> Callable[[Outcome[Any]], Reply]:
    return lambda outcome: answer(Outcome(outcome.kind, body(outcome.value)))


def ok(status: int, value: Any) -> Reply:
    return Reply(status, encode(value))


def _page(items: list[Any], cursor: str | None) -> dict[str, Any]:
    return {"items": items, "next_cursor": cursor}


# --- health ------------------------------------------------------------------------------------


async def health(ctx: Context, req: Request) -> Reply:
    return ok(200, await ctx.service.health())


# --- pipelines ---------------------------------------------------------------------------------

_id = IdBody
_ids = IdsBody


async def create_pipeline(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.CreatePipeline, req.body)
    result = await ctx.service.create_pipeline(command, idem(req, body=_id))
    return respond_with(_id)(result)


async def list_pipelines(ctx: Context, req: Request) -> Reply:
    return ok(200, await ctx.service.list_pipelines())


async def get_pipeline(ctx: Context, req: Request) -> Reply:
    return ok(200, await ctx.service.get_pipeline(req.params["id"]))


# --- tasks -------------------------------------------------------------------------------------


async def create_task(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.CreateTask, req.body)
    return respond_with(_id)(await ctx.service.create_task(command, idem(req, body=_id)))


async def create_tasks(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.CreateTasks, req.body)
    if not command.tasks:
        raise InvalidRequest("tasks must not be empty")
    return respond_with(_ids)(await ctx.service.create_tasks(command.tasks, idem(req, body=_ids)))


async def list_tasks(ctx: Context, req: Request) -> Reply:
    limit = req.limit(50)
    after = req.composite_cursor()
    q = req.query
    items, cursor = await ctx.service.list_tasks(
        stage=q.get("stage"),
        pipeline_id=q.get("pipeline_id"),
        after=after,
        limit=limit,
        agent_role=q.get("role"),
        text=q.get("q"),
    )
    return ok(200, _page(items, cursor))


async def list_task_runs(ctx: Context, req: Request) -> Reply:
    limit = req.limit(100)
    order = req.query.get("order", "asc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("order must be asc (oldest attempt first) or desc (newest first)")
    cursor = req.event_cursor("an attempt number") if "cursor" in req.query else None
    items, next_cursor = await ctx.service.list_task_runs(
        req.params["id"], cursor, limit, newest_first=order == "desc"
    )
    return ok(200, _page(items, next_cursor))


async def get_task(ctx: Context, req: Request) -> Reply:
    return ok(200, await ctx.service.get_task(req.params["id"]))


async def requeue_task(ctx: Context, req: Request) -> Reply:
    # The body is optional: without one the task is requeued where it failed.
    command = decode(cmd.RequeueTask, req.body) if req.body.strip() else cmd.RequeueTask()
    return respond(await ctx.service.requeue(req.params["id"], command, idem(req)))


async def cancel_task(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.CancelTask, req.body) if req.body.strip() else cmd.CancelTask()
    return respond(await ctx.service.cancel(req.params["id"], command, idem(req)))


async def requeue_tasks(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.RequeueTasks, req.body)
    return respond(await ctx.service.requeue_many(command, idem(req)))


async def cancel_tasks(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.CancelTasks, req.body)
    return respond(await ctx.service.cancel_many(command, idem(req)))


async def list_task_events(ctx: Context, req: Request) -> Reply:
    limit = req.limit(100)
    after = req.event_cursor()
    items, cursor = await ctx.service.list_task_events(req.params["id"], after, limit)
    return ok(200, _page(items, cursor))


async def run_state(ctx: Context, req: Request) -> Reply:
    return ok(200, RunStateBody(await ctx.service.run_state(req.params["id"])))


def _created(_: None) -> StatusBody:
    return StatusBody("created")


def _assigned(_: None) -> StatusBody:
    return StatusBody("assigned")


def _unassigned(_: None) -> StatusBody:
    return StatusBody("unassigned")


def _failed(_: None) -> StatusBody:
    return StatusBody("failed")


async def add_dependency(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.AddDependency, req.body)
    result = await ctx.service.add_dependency(
        req.params["id"], command.depends_on_task_id, idem(req, body=_created)
    )
    return respond_with(_created)(result)


async def list_dependencies(ctx: Context, req: Request) -> Reply:
    return ok(200, await ctx.service.list_dependencies(req.params["id"]))


async def assign(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.Assign, req.body)
    result = await ctx.service.assign(req.params["id"], command, idem(req, body=_assigned))
    return respond_with(_assigned)(result)


async def list_assignments(ctx: Context, req: Request) -> Reply:
    return ok(200, await ctx.service.list_assignments(req.params["id"]))


async def unassign(ctx: Context, req: Request) -> Reply:
    task_id, agent_id = req.params["id"], req.params["agent_id"]
    result = await ctx.service.unassign(task_id, agent_id, idem(req, body=_unassigned))
    return respond_with(_unassigned)(result)


# --- leases and runs ---------------------------------------------------------------------------


async def claim(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.Claim, req.body)
    access.check_role(req.principal, command.agent_role)
    wait_ms = max(0, min(command.wait_ms or 0, cmd.MAX_WAIT_MS))
    metrics = ctx.metrics
    if not wait_ms:
        reply = respond(await ctx.service.claim(command, idem(req)))
        if metrics is not None:
            metrics.claimed(reply.status, None)
        return reply
    loop = asyncio.get_running_loop()
    started = loop.time()
    reply = await _long_poll(ctx, req, command, started + wait_ms / 1000)
    if metrics is not None:
        metrics.claimed(reply.status, loop.time() - started)
    return reply


def _kind(command: cmd.Claim) -> bytes:
    """What sets a claim's choice apart from another of its role: its per-state limits."""
    limits = command.concurrency.per_state if command.concurrency is not None else None
    return bytes(limits) if isinstance(limits, msgspec.Raw) else b""


async def _long_poll(ctx: Context, req: Request, command: cmd.Claim, deadline: float) -> Reply:
    """Try, and while nothing is claimable wait for a wake-up of the role until `deadline`.
    Beyond the server's limit of long-polls, try once and answer at once: a 204 then carries
    Retry-After, when to ask again."""
    service = ctx.service
    loop = asyncio.get_running_loop()
    poll = ctx.wakeups.enter(command.agent_role, command.agent_id, _kind(command))
    if poll is None:
        reply = respond(await service.claim(command, idem(req)))
        if reply.status != 204:
            return reply
        retry_s = max(1, min(WAIT_REFUSED_RETRY_S, math.ceil(deadline - loop.time())))
        return WebReply(204, b"", (("retry-after", str(retry_s)),))
    try:
        with service.notifier.waiting():  # from before the first attempt: see Notifier.listening
            while True:
                poll.trying()
                reply = respond(await service.claim(command, idem(req)))
                poll.tried(took=reply.status != 204)
                remaining = deadline - loop.time()
                if reply.status != 204 or remaining <= 0 or ctx.wakeups.closing:
                    return reply
                if not await poll.wait(remaining, req.disconnected()):
                    return reply  # nobody would receive a lease claimed now
    finally:
        poll.leave()


def _lease_hash(req: Request) -> bytes:
    return lease_token_hash(req.require_bearer())


def _expires(expires_at_ms: int) -> ExpiresBody:
    return ExpiresBody(expires_at_ms)


def _event_id(event_id: int) -> EventIdBody:
    return EventIdBody(event_id)


async def heartbeat(ctx: Context, req: Request) -> Reply:
    token_hash = _lease_hash(req)
    # The body is optional; when present it may ask for a new TTL.
    command = decode_later(cmd.Heartbeat, req.body) if req.body.strip() else cmd.Heartbeat
    result = await ctx.service.heartbeat(
        req.params["id"], token_hash, command, idem(req, token_hash, _expires)
    )
    return respond_with(_expires)(result)


async def append_event(ctx: Context, req: Request) -> Reply:
    token_hash = _lease_hash(req)
    command = decode_later(cmd.AppendEvent, req.body)
    result = await ctx.service.append_event(
        req.params["id"], token_hash, command, idem(req, token_hash, _event_id)
    )
    return respond_with(_event_id)(result)


async def list_events(ctx: Context, req: Request) -> Reply:
    run_id = req.params["id"]
    if ctx.admin_token is not None:
        # The original lets any bearer read events; require the admin token, a key or this
        # run's live lease. Anything else is 401, whatever the reason the lease does not match.
        token = req.require_bearer()
        if await access.principal_of(ctx, token) is None and not await _holds(ctx, run_id, token):
            await access.refused(ctx, req)
            raise Unauthorized("needs the admin token, a key or this run's lease token")
    limit = req.limit(100)
    after = req.event_cursor()
    items, cursor = await ctx.service.list_events(run_id, after, limit)
    return ok(200, _page(items, cursor))


async def _holds(ctx: Context, run_id: str, token: str) -> bool:
    """Whether `token` is the live lease token of run `run_id`."""
    try:
        await ctx.service.check_run_lease(run_id, lease_token_hash(token))
    except (Unauthorized, NotFound, LeaseExpired, TaskCancelled):
        return False
    return True


async def transition(ctx: Context, req: Request) -> Reply:
    token_hash = _lease_hash(req)
    command = decode_later(cmd.MoveTask, req.body)
    result = await ctx.service.transition(
        req.params["id"], token_hash, command, idem(req, token_hash)
    )
    return respond(result)


async def fail(ctx: Context, req: Request) -> Reply:
    token_hash = _lease_hash(req)
    command = decode_later(cmd.FailRun, req.body)
    result = await ctx.service.fail(
        req.params["id"], token_hash, command, idem(req, token_hash, _failed)
    )
    return respond_with(_failed)(result)


async def write_checkpoint(ctx: Context, req: Request) -> Reply:
    token_hash = _lease_hash(req)
    command = decode_later(cmd.WriteCheckpoint, req.body)
    result = await ctx.service.checkpoint(
        req.params["id"], token_hash, command, idem(req, token_hash)
    )
    return respond(result)


async def release(ctx: Context, req: Request) -> Reply:
    token_hash = _lease_hash(req)
    # The body is optional: a reason and an expected_fence.
    command = decode_later(cmd.ReleaseRun, req.body) if req.body.strip() else cmd.ReleaseRun
    result = await ctx.service.release(req.params["id"], token_hash, command, idem(req, token_hash))
    return respond(result)


async def release_agent(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.ReleaseAgent, req.body)
    return respond(await ctx.service.release_agent(command.agent_id, command.reason, idem(req)))


async def get_checkpoint(ctx: Context, req: Request) -> Reply:
    return ok(200, await ctx.service.get_checkpoint(req.params["id"]))


# --- artifacts ---------------------------------------------------------------------------------


async def create_artifact(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.CreateArtifact, req.body)
    return respond_with(_id)(await ctx.service.create_artifact(command, idem(req, body=_id)))


async def list_artifacts(ctx: Context, req: Request) -> Reply:
    limit = req.limit(100)
    after = req.composite_cursor()
    items, cursor = await ctx.service.list_artifacts(
        task_id=req.query.get("task_id"), run_id=req.query.get("run_id"), after=after, limit=limit
    )
    return ok(200, _page(items, cursor))


async def openapi(ctx: Context, req: Request) -> Reply:
    from nulltickets.http.openapi import document  # the document is built from the route table

    return Reply(200, document())


# --- store -------------------------------------------------------------------------------------


async def put_value(ctx: Context, req: Request) -> Reply:
    namespace, key = req.params["namespace"], req.params["key"]
    if namespace == RESERVED_NAMESPACE:
        raise ReservedNamespace('the namespace "search" is reserved')
    command = decode(cmd.PutValue, req.body)
    return respond(await ctx.service.put_value(namespace, key, command, idem(req)))


async def get_value(ctx: Context, req: Request) -> Reply:
    namespace, key = req.params["namespace"], req.params["key"]
    return ok(200, await ctx.service.get_value(namespace, key))


async def delete_value(ctx: Context, req: Request) -> Reply:
    namespace, key = req.params["namespace"], req.params["key"]
    return respond(await ctx.service.delete_value(namespace, key, idem(req)))


async def list_namespaces(ctx: Context, req: Request) -> Reply:
    limit = req.limit(100)
    items, cursor = await ctx.service.list_namespaces(req.query.get("cursor", ""), limit)
    return ok(200, _page(items, cursor))


async def list_namespace(ctx: Context, req: Request) -> Reply:
    return ok(200, await ctx.service.list_namespace(req.params["namespace"]))


async def delete_namespace(ctx: Context, req: Request) -> Reply:
    return respond(await ctx.service.delete_namespace(req.params["namespace"], idem(req)))


async def search_store(ctx: Context, req: Request) -> Reply:
    q = req.query
    text = q.get("q")
    limit = req.search_limit() if text is not None and text.strip() else 10
    hits = await ctx.service.search(
        text=text,
        namespace=q.get("namespace"),
        filter_path=q.get("filter_path"),
        filter_value=q.get("filter_value"),
        limit=limit,
    )
    return ok(200, hits)


# --- keys --------------------------------------------------------------------------------------


async def create_key(ctx: Context, req: Request) -> Reply:
    if ctx.admin_token is None:
        raise KeysNeedToken()
    command = decode(cmd.CreateKey, req.body)
    return ok(201, await ctx.service.create_key(command))


async def list_keys(ctx: Context, req: Request) -> Reply:
    return ok(200, await ctx.service.list_keys())


async def revoke_key(ctx: Context, req: Request) -> Reply:
    return respond(await ctx.service.revoke_key(req.params["id"], idem(req)))


# --- operations --------------------------------------------------------------------------------


async def queue_report(ctx: Context, req: Request) -> Reply:
    near_expiry_ms = req.int_param("near_expiry_ms", 60_000)
    stuck_ms = req.int_param("stuck_ms", 300_000)
    return ok(200, await ctx.service.queue_report(near_expiry_ms, stuck_ms))


async def stage_report(ctx: Context, req: Request) -> Reply:
    return ok(200, await ctx.service.stage_report())


async def retry_report(ctx: Context, req: Request) -> Reply:
    return ok(200, await ctx.service.retry_report(req.limit(100)))


async def list_failures(ctx: Context, req: Request) -> Reply:
    limit = req.limit(50)
    before = req.composite_cursor()
    q = req.query
    items, cursor = await ctx.service.list_failures(
        kind=q.get("kind"),
        pipeline_id=q.get("pipeline_id") or None,
        error=q.get("error"),
        before=before,
        limit=limit,
    )
    return ok(200, _page(items, cursor))


async def failure_groups(ctx: Context, req: Request) -> Reply:
    limit = req.limit(100)
    q = req.query
    groups = await ctx.service.failure_groups(
        kind=q.get("kind"), pipeline_id=q.get("pipeline_id") or None, limit=limit
    )
    return ok(200, groups)


FAILING_WINDOW_MS = (60_000, 3_600_000, 86_400_000)  # least, default, most
FAILING_MIN_FAILURES = (1, 3, 1_000_000)


def _bounded(req: Request, name: str, bounds: tuple[int, int, int]) -> int:
    low, default, high = bounds
    value = req.int_param(name, default)
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be between {low} and {high}")
    return value


async def failing_report(ctx: Context, req: Request) -> Reply:
    limit = req.limit(20)
    window_ms = _bounded(req, "window_ms", FAILING_WINDOW_MS)
    min_failures = _bounded(req, "min_failures", FAILING_MIN_FAILURES)
    return ok(200, await ctx.service.failing_report(window_ms, min_failures, limit))


# --- traces ------------------------------------------------------------------------------------


async def ingest_traces(ctx: Context, req: Request) -> Reply:
    """OTLP/JSON or OTLP/protobuf; anything that does not parse as either is refused with 400
    invalid_json and nothing is stored (the original kept any non-JSON body and answered 200,
    so an exporter never learned that its payload was garbage)."""
    content_type = otlp.normalize_content_type(req.header("content-type"))
    if otlp.is_json(content_type):
        spans = otlp.spans_from_json(req.body)
    elif otlp.is_protobuf(content_type):
        try:
            spans = otlp.spans_from_protobuf(req.body)
        except otlp.OtlpDecodeError as exc:
            raise InvalidJson(str(exc)) from None
    else:
        raise InvalidJson(
            f"Content-Type {content_type[:100]!r} is not OTLP: send application/json or "
            "application/x-protobuf"
        )
    return respond(await ctx.service.ingest_traces(content_type, spans, req.body, idem(req)))


async def list_spans(ctx: Context, req: Request) -> Reply:
    limit = req.limit(100)
    after = req.event_cursor()
    items, cursor = await ctx.service.list_spans(req.params["id"], after, limit)
    return ok(200, _page(items, cursor))
