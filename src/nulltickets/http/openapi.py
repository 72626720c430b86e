"""The OpenAPI 3.1 document, generated from the route table and the msgspec types it names.

Never edited by hand: a new route or field appears here because it exists.
"""

from __future__ import annotations

import functools
import re
from typing import Annotated, Any

import msgspec

from nulltickets import __version__
from nulltickets.domain.model import ACCESS_ORDER, Access, allows
from nulltickets.http.context import Context
from nulltickets.http.errors import STATUS, ErrorBody, status_of
from nulltickets.http.request import Request
from nulltickets.http.response import Reply
from nulltickets.http.routes import ROUTES, Route
from nulltickets.service.verbs import Guard

REF = "#/components/schemas/{name}"
ADMIN_SECURITY: list[dict[str, list[str]]] = [{"bearerAuth": []}, {}]  # a token, or none
LEASE_SECURITY: list[dict[str, list[str]]] = [{"bearerAuth": []}]


# The pipeline definition as documented. The server validates definitions itself
# (domain/fsm.py, with messages naming the rule that failed), so these types only describe it.


class StateDefinition(msgspec.Struct):
    """A stage of the pipeline. A stage with an agent_role is claimed by agents of that role;
    a terminal stage ends the task. The other keys are the stage's optional policy."""

    agent_role: str | None = None
    terminal: bool | None = None  # null or absent: not terminal
    description: str | None = None
    workflow_id: str | None = None
    lease_ttl_ms: Annotated[int, msgspec.Meta(ge=1, le=86_400_000)] | None = None
    retry_delay_ms: Annotated[int, msgspec.Meta(ge=0, le=31_536_000_000)] | None = None
    retry_backoff: Annotated[float, msgspec.Meta(ge=1, le=100)] | None = None
    retry_max_delay_ms: Annotated[int, msgspec.Meta(ge=0, le=31_536_000_000)] | None = None
    retry_jitter: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    max_concurrency: Annotated[int, msgspec.Meta(ge=1, le=1_000_000)] | None = None


class TransitionDefinition(msgspec.Struct):
    """A move from one stage to another when the run holding the task sends `trigger`."""

    from_: str = msgspec.field(name="from")
    to: str
    trigger: str
    instructions: str | None = None
    required_gates: list[str] | None = None


class PipelineDefinition(msgspec.Struct):
    """A pipeline: its stages by name, the transitions between them, and the initial stage
    new tasks start in. At least one stage is terminal; every other stage has a way out."""

    initial: str
    states: dict[str, StateDefinition]
    transitions: list[TransitionDefinition]


# Free-form JSON fields of the wire types that carry a pipeline definition.
_DEFINITION_FIELDS = (("CreatePipeline", "definition"), ("Pipeline", "definition"))


def _operation_id(route: Route) -> str:
    words = re.sub(r"[{}.\-]", "", route.pattern).strip("/").replace("/", "_") or "root"
    return f"{route.method.lower()}_{words}"


def _collect_types() -> list[Any]:
    types: list[Any] = [ErrorBody, PipelineDefinition]
    for route in ROUTES + OPENAPI_ROUTES:
        for t in (route.request, route.response):
            if t is not None and t not in types:
                types.append(t)
    return types


# The server sees the path percent-decoded once before it splits it (http/request.py).
PATH_PARAMETER = (
    "Percent-encoded; a `/` or `%` inside the value is escaped first (`%2F`, `%25`), so it is "
    "sent as `%252F` or `%2525`."
)


def _operation(route: Route, schemas: dict[Any, Any]) -> dict[str, Any]:
    op: dict[str, Any] = {
        "operationId": _operation_id(route),
        "summary": route.summary,
        "tags": [route.tag] if route.tag else [],
    }
    params = [
        {
            "name": p.strip("{+}"),
            "in": "path",
            "required": True,
            "description": PATH_PARAMETER,
            "schema": {"type": "string"},
        }
        for p in route.parts
        if p.startswith("{")
    ]
    params += [
        {
            "name": q.name,
            "in": "query",
            "required": False,
            "description": q.description,
            "schema": {"type": q.kind},
        }
        for q in route.query
    ]
    if route.method in ("POST", "PUT", "DELETE") and route.idempotency_key:
        params.append(
            {
                "name": "Idempotency-Key",
                "in": "header",
                "required": False,
                "description": "Replays the stored success of an earlier request with this key "
                "and the same body; another body with the key is a 409.",
                "schema": {"type": "string"},
            }
        )
    if params:
        op["parameters"] = params
    if route.request is not None:
        op["requestBody"] = {
            "required": not route.optional_body,
            "content": {"application/json": {"schema": schemas[route.request]}},
        }
    success: dict[str, Any] = {"description": "Success"}
    if route.response is not None:
        success["content"] = {route.media: {"schema": schemas[route.response]}}
    elif route.media != "application/json":
        success["content"] = {route.media: {"schema": {"type": "string"}}}
    responses: dict[str, Any] = {str(route.status): success}
    if route.pattern == "/leases/claim":
        responses["204"] = {
            "description": "Nothing is claimable for this role. With wait_ms, a 204 that "
            "carries Retry-After came at once: the server holds as many waiting claims as it "
            "is set to; ask again after that many seconds.",
            "headers": {
                "Retry-After": {
                    "description": "Seconds to wait before claiming again.",
                    "schema": {"type": "integer"},
                }
            },
        }
    codes: dict[int, list[str]] = {}
    for exc in route.errors:
        codes.setdefault(status_of(exc()), []).append(exc.code)
    if route.auth is not Guard.NONE:
        codes.setdefault(401, []).append("unauthorized")
    if route.auth is Guard.KEY and route.needs is not Access.READ:
        codes.setdefault(403, []).append("forbidden")
    if route.pattern == "/leases/claim":
        codes.setdefault(403, []).append("forbidden")
    if route.method in ("POST", "PUT", "DELETE") and route.idempotency_key:
        codes.setdefault(409, []).append("idempotency_conflict")
        codes.setdefault(413, []).append("payload_too_large")
    # Any route: a request from a page of another origin, or to a name a server without a
    # token does not answer to (http/origins.py).
    codes.setdefault(403, []).append("forbidden")
    codes.setdefault(503, []).append("storage_busy")
    for status in sorted(codes):
        responses[str(status)] = {
            "description": "Error: " + ", ".join(sorted(set(codes[status]))),
            "content": {"application/json": {"schema": {"$ref": REF.format(name="ErrorBody")}}},
        }
    op["responses"] = responses
    access = _access(route)
    if access:
        op["x-access"] = access
    # One bearer scheme. The document's own security, ADMIN_SECURITY, covers the gated routes
    # (the admin token or a key with an access in x-access, needed only when the server has a
    # token: reading a run's events takes those or the lease token then). Writes under a lease
    # need the lease token; ungated routes take none. Generators such as openapi-python-client
    # read only an operation's own security, and take any non-empty one as "a token is
    # required": so the gated routes inherit theirs and a generated client calls them with or
    # without a token.
    if route.auth is Guard.LEASE and route.method != "GET":
        op["security"] = LEASE_SECURITY
    elif route.auth is Guard.NONE:
        op["security"] = []
    return op


def _access(route: Route) -> list[str]:
    """Who may call the route on a server with a --token: the access levels of the keys that
    may (the token has `admin`), and `lease` where the lease token of the path's run or lease
    is what it takes. Empty for the routes anyone may call."""
    if route.auth is Guard.NONE:
        return []
    if route.auth is Guard.LEASE:
        # Reading a run's events also takes any key (or the token); writing takes the lease.
        return (
            [*(level.value for level in ACCESS_ORDER), "lease"]
            if route.method == "GET"
            else ["lease"]
        )
    return [level.value for level in ACCESS_ORDER if allows(level, route.needs)]


@functools.cache
def document() -> bytes:
    types = _collect_types()
    refs, components = msgspec.json.schema_components(types, ref_template=REF)
    schemas = dict(zip(types, refs, strict=True))
    for name, prop in _DEFINITION_FIELDS:
        components[name]["properties"][prop] = schemas[PipelineDefinition]
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES + OPENAPI_ROUTES:
        paths.setdefault(route.pattern.replace("+}", "}"), {})[route.method.lower()] = _operation(
            route, schemas
        )
    doc = {
        "openapi": "3.1.0",
        "info": {
            "title": "nulltickets",
            "version": __version__,
            "description": "Durable task state for AI agents: pipelines, tasks, leases, runs, "
            "events and artifacts over JSON. Every error is "
            '{"error": {"code", "message"}}.',
        },
        "servers": [{"url": "/"}],
        "security": ADMIN_SECURITY,
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "bearerAuth": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "Gated routes, when the server has a --token / api_token "
                    "(without one they need nothing): that token, or a key made with POST "
                    "/keys whose access is in the operation's x-access list (read: every "
                    "read; agent: reads, claims for its roles, tasks, artifacts, store keys, "
                    "traces; admin: everything); otherwise 401, or 403 forbidden for a key "
                    "without the access. Lease routes (x-access: lease): the lease_token "
                    "returned by /leases/claim.",
                },
            },
        },
    }
    return msgspec.json.encode(doc)


def error_codes() -> dict[str, int]:
    """Every error code the server can send, with its status (for docs and tests)."""
    return {cls.code: status for cls, status in STATUS.items()}


async def serve(ctx: Context, req: Request) -> Reply:
    return Reply(200, document())


OPENAPI_ROUTES = (
    Route("GET", "/openapi.json", serve, "This OpenAPI document.", Guard.NONE, tag="discovery"),
    Route(
        "GET",
        "/.well-known/openapi.json",
        serve,
        "This OpenAPI document.",
        Guard.NONE,
        tag="discovery",
    ),
)
