"""Handlers: decode the request, run its verb as one unit of work, encode the answer.

Every verb of the table (service/verbs.py) is answered by `generic(verb)`: the path's
parameters, the query's (parsed as the verb declares) and the body (decoded into its request
type; under a run's lease only once the lease is checked) go to `Service.call`, whose answer
says what the verb did (`Kind`): here, and only here, that becomes a status. The verbs whose
protocol is special have handlers of their own (`CUSTOM`): the long-polling claim, reading a
run's events (a lease or a key), and OTLP ingest.
"""

from __future__ import annotations

import asyncio
import math
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgspec

from nulltickets.domain import commands as cmd
from nulltickets.domain.tokens import lease_token_hash
from nulltickets.errors import (
    InvalidJson,
    InvalidRetryPolicy,
    LeaseExpired,
    NotFound,
    TaskCancelled,
    TrackerError,
    Unauthorized,
)
from nulltickets.http import access
from nulltickets.http.context import Context
from nulltickets.http.request import Request
from nulltickets.http.response import Reply, WebReply
from nulltickets.service import Answer, Idem, Kind, otlp
from nulltickets.service.verbs import VERBS, Guard, Verb

T = TypeVar("T")

Handler = Callable[[Context, Request], Any]

NO_CONTENT = Reply(204, b"")
# A long-poll the server has no room for answers at once; its 204 asks the client to come back
# after this many seconds at most (its own wait, if shorter).
WAIT_REFUSED_RETRY_S = 5
STATUS = {Kind.CREATED: 201, Kind.OK: 200, Kind.EMPTY: 204}
NO_QUERY: Mapping[str, str] = {}


def reply(answer: Answer) -> Reply:
    """The response to a verb's answer: 201 for CREATED, 200 for OK, 204 for EMPTY."""
    if answer.kind is Kind.EMPTY:
        return NO_CONTENT
    return Reply(STATUS[answer.kind], answer.body)


def idem(req: Request, auth_hash: bytes | None = None) -> Idem | None:
    """The request's identity for idempotent replay, if it carries an Idempotency-Key."""
    key = req.header("idempotency-key")
    if key is None:
        return None
    return Idem(key, req.method, req.path, req.body_hash(), auth_hash)


def query_args(v: Verb, req: Request) -> dict[str, Any]:
    """The verb's query parameters, parsed as it declares them."""
    return parsed_query(v, req.query)


def parsed_query(v: Verb, query: Mapping[str, str]) -> dict[str, Any]:
    return {p.arg or p.name: p.parse(query.get(p.name)) for p in v.query}


def verb_args(
    v: Verb, query: Mapping[str, str], body: bytes, token_hash: bytes | None
) -> dict[str, Any]:
    """What `Service.call` takes for verb `v` from a request's parts: its query parameters
    (parsed), the SHA-256 of the lease token presented (under a lease) and the body (decoded
    into the verb's request type; under a lease only once the lease is checked). The MCP
    server's tools on the server make their calls with it too."""
    args = parsed_query(v, query) if v.query else {}
    lease = v.guard is Guard.LEASE
    if lease:
        args["token_hash"] = token_hash
    request = v.request
    if request is not None:
        if v.optional_body and not body.strip():
            args["cmd"] = request  # called, it makes the empty request
        elif lease:
            args["cmd"] = decode_later(request, body)
        else:
            value = decode(request, body)
            args["cmd"] = lambda: value
    return args


def generic(v: Verb) -> Handler:
    """The handler of a verb of the table."""
    names = v.path_params
    lease = v.guard is Guard.LEASE
    replayable = v.write and v.idempotency_key

    async def handle(ctx: Context, req: Request) -> Reply:
        token_hash = lease_token_hash(req.require_bearer()) if lease else None
        args = verb_args(v, req.query if v.query else NO_QUERY, req.body, token_hash)
        path = [req.params[name] for name in names]
        key = idem(req, token_hash) if replayable else None
        return reply(await ctx.service.call(v, path, args, key))

    handle.__name__ = v.name
    return handle


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


# --- the verbs whose protocol is special ---------------------------------------------------


async def claim(ctx: Context, req: Request) -> Reply:
    command = decode(cmd.Claim, req.body)
    access.check_role(req.principal, command.agent_role)
    wait_ms = max(0, min(command.wait_ms or 0, cmd.MAX_WAIT_MS))
    metrics = ctx.metrics
    if not wait_ms:
        answered = reply(await ctx.service.claim(command, idem(req)))
        if metrics is not None:
            metrics.claimed(answered.status, None)
        return answered
    loop = asyncio.get_running_loop()
    started = loop.time()
    answered = await _long_poll(ctx, req, command, started + wait_ms / 1000)
    if metrics is not None:
        metrics.claimed(answered.status, loop.time() - started)
    return answered


async def _long_poll(ctx: Context, req: Request, command: cmd.Claim, deadline: float) -> Reply:
    """Claim, waiting for work until `deadline`. A claim the server had no room to keep
    waiting was tried once: its 204 carries Retry-After, when to ask again."""
    answer, waited = await ctx.service.claim_waiting(
        command, idem(req), deadline, req.disconnected()
    )
    if waited or answer.kind is not Kind.EMPTY:
        return reply(answer)
    loop = asyncio.get_running_loop()
    retry_s = max(1, min(WAIT_REFUSED_RETRY_S, math.ceil(deadline - loop.time())))
    return WebReply(204, b"", (("retry-after", str(retry_s)),))


async def list_events(ctx: Context, req: Request) -> Reply:
    run_id = req.params["id"]
    if ctx.admin_token is not None:
        # The original lets any bearer read events; require the admin token, a key or this
        # run's live lease. Anything else is 401, whatever the reason the lease does not match.
        token = req.require_bearer()
        if await access.principal_of(ctx, token) is None and not await _holds(ctx, run_id, token):
            await access.refused(ctx, req)
            raise Unauthorized("needs the admin token, a key or this run's lease token")
    v = VERBS["list_events"]
    return reply(await ctx.service.call(v, [run_id], query_args(v, req)))


async def _holds(ctx: Context, run_id: str, token: str) -> bool:
    """Whether `token` is the live lease token of run `run_id`."""
    try:
        await ctx.service.check_run_lease(run_id, lease_token_hash(token))
    except (Unauthorized, NotFound, LeaseExpired, TaskCancelled):
        return False
    return True


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
    args = {"content_type": content_type, "spans": spans, "payload": req.body}
    return reply(await ctx.service.call(VERBS["ingest_traces"], (), args, idem(req)))


CUSTOM: dict[str, Handler] = {
    "claim": claim,
    "list_events": list_events,
    "ingest_traces": ingest_traces,
}
