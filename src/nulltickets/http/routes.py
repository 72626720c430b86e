"""The route table: (method, path pattern) -> handler, with what OpenAPI needs to describe it.

Every verb of the table (service/verbs.py) is a route, answered by the one generic handler
unless its protocol is special (handlers.CUSTOM); the few routes that are no verb (the event
stream, the metrics, the dashboard, the OpenAPI document) are listed where they live.

Matching follows the contract: empty path segments are ignored and the lease routes (heartbeat
and /runs/{id}/...) accept extra trailing segments. A path that exists with other methods only
is a 405 naming them (the contract said 404); HEAD is answered wherever GET is.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from nulltickets import errors as e
from nulltickets.domain import model
from nulltickets.domain.model import Access
from nulltickets.http import handlers, metrics, sse
from nulltickets.http.context import Context
from nulltickets.http.request import Request
from nulltickets.http.response import Reply
from nulltickets.service import VERBS
from nulltickets.service.verbs import Guard, Param, Verb

Handler = Callable[[Context, Request], Awaitable[Reply]]


@dataclass(frozen=True)
class Route:
    method: str
    pattern: str
    handler: Handler
    summary: str
    auth: Guard = Guard.KEY
    request: Any = None
    response: Any = None
    status: int = 200
    errors: tuple[type[e.TrackerError], ...] = ()
    query: tuple[Param, ...] = ()
    trailing: bool = False  # extra trailing segments are ignored
    optional_body: bool = False  # the request body may be left out
    extra: bool = False  # not in the original's API (an addition of ours)
    tag: str = ""
    media: str = "application/json"  # the content type of a success
    # The access a key needs (Guard.KEY routes); None: `read` for GET, `admin` for the rest.
    access: Access | None = None
    idempotency_key: bool = True  # a write that replays by Idempotency-Key
    verb: Verb | None = None  # the verb of the table it carries, if any

    @classmethod
    def of(cls, v: Verb, handler: Handler, **changed: Any) -> Route:
        """The route that carries verb `v` over HTTP."""
        made = cls(
            v.method,
            v.path,
            handler,
            v.summary,
            v.guard,
            request=v.request,
            response=v.response,
            status=v.status,
            errors=v.errors,
            query=v.query,
            trailing=v.trailing,
            optional_body=v.optional_body,
            extra=v.extra,
            tag=v.tag,
            media=v.media,
            access=v.access,
            idempotency_key=v.idempotency_key,
            verb=v,
        )
        return dataclasses.replace(made, **changed) if changed else made

    @functools.cached_property
    def needs(self) -> Access:
        if self.access is not None:
            return self.access
        return Access.READ if self.method == "GET" else Access.ADMIN

    @functools.cached_property
    def parts(self) -> tuple[str, ...]:
        return tuple(p for p in self.pattern.split("/") if p)

    @functools.cached_property
    def _shape(self) -> _Shape:
        parts = self.parts
        rest = parts[-1][1:-2] if parts and parts[-1].endswith("+}") else None
        fixed = parts[:-1] if rest is not None else parts
        return _Shape(
            size=len(parts),
            open_ended=self.trailing or rest is not None,
            literals=tuple((i, p) for i, p in enumerate(fixed) if not p.startswith("{")),
            params=tuple((i, p[1:-1]) for i, p in enumerate(fixed) if p.startswith("{")),
            rest=rest,
        )

    def match(self, segments: list[str]) -> dict[str, str] | None:
        shape = self._shape
        n = len(segments)
        if n < shape.size or (n > shape.size and not shape.open_ended):
            return None
        for i, literal in shape.literals:
            if segments[i] != literal:
                return None
        params = {name: segments[i] for i, name in shape.params}
        if shape.rest is not None:  # the last parameter takes every remaining segment
            params[shape.rest] = "/".join(segments[shape.size - 1 :])
        return params


@dataclass(frozen=True, slots=True)
class _Shape:
    """A pattern taken apart once: which segments must equal what, which are parameters."""

    size: int
    open_ended: bool  # more segments than parts are allowed
    literals: tuple[tuple[int, str], ...]
    params: tuple[tuple[int, str], ...]
    rest: str | None


def _verb_routes() -> tuple[Route, ...]:
    routes = []
    for v in VERBS.values():
        custom = handlers.CUSTOM.get(v.name)
        if custom is None and v.custom:
            raise TypeError(f"verb {v.name} asks for a handler of its own and has none")
        routes.append(Route.of(v, custom or handlers.generic(v)))
    traces = next(r for r in routes if r.verb is not None and r.verb.name == "ingest_traces")
    routes.append(
        dataclasses.replace(traces, pattern="/otlp/v1/traces", summary="Same as POST /v1/traces.")
    )
    return tuple(routes)


# The routes that are no verb of the table: streams and texts of their own.
OTHER_ROUTES = (
    Route(
        "GET",
        "/events/stream",
        sse.stream,
        "Run events as Server-Sent Events (text/event-stream), live: each `data:` is a "
        "FeedEvent, its `id:` the event id. Filters combine; kind takes a comma-separated "
        "list. Resume with the Last-Event-ID header (or last_event_id): the events after it "
        "are replayed first. Without either, the stream starts with the next event. A "
        "comment line every 15 s keeps idle streams open.",
        response=model.FeedEvent,
        media="text/event-stream",
        errors=(e.InvalidCursor, e.Overloaded),
        query=(
            Param("task_id", "Only events of this task's runs."),
            Param("run_id", "Only events of this run."),
            Param("pipeline_id", "Only events of this pipeline's tasks."),
            Param("kind", "Only events of these kinds (comma-separated)."),
            Param("last_event_id", "Replay the events after this id first.", "integer"),
        ),
        extra=True,
        tag="operations",
    ),
    Route(
        "GET",
        "/metrics",
        metrics.metrics_text,
        "Prometheus metrics (text format 0.0.4).",
        media="text/plain",
        extra=True,
        tag="operations",
    ),
)

ROUTES: tuple[Route, ...] = _verb_routes() + OTHER_ROUTES

WRITE_METHODS = frozenset({"POST", "PUT", "DELETE"})


class Router:
    def __init__(self, routes: tuple[Route, ...]) -> None:
        self._by_head: dict[tuple[str, str], list[Route]] = {}
        self._any_method: dict[str, list[Route]] = {}
        # A literal segment wins over a parameter in the same place (/store/search before
        # /store/{namespace}), whatever order the routes were declared in.
        for route in sorted(routes, key=lambda r: tuple(p.startswith("{") for p in r.parts)):
            head = route.parts[0] if route.parts else ""
            self._by_head.setdefault((route.method, head), []).append(route)
            self._any_method.setdefault(head, []).append(route)

    def match(self, method: str, segments: list[str]) -> tuple[Route, dict[str, str]] | None:
        """The route for a request; HEAD takes the GET route (the server sends no body)."""
        head = segments[0] if segments else ""
        for route in self._by_head.get(("GET" if method == "HEAD" else method, head), ()):
            params = route.match(segments)
            if params is not None:
                return route, params
        return None

    def allowed(self, segments: list[str]) -> tuple[str, ...]:
        """The methods the path takes (for a 405's Allow), HEAD wherever GET; () for none."""
        head = segments[0] if segments else ""
        methods = {
            r.method for r in self._any_method.get(head, ()) if r.match(segments) is not None
        }
        if "GET" in methods:
            methods.add("HEAD")
        return tuple(sorted(methods))


def gate(segments: list[str]) -> Guard:
    """How the admin-token gate treats a path, by its segments alone (any method)."""
    n = len(segments)
    if n == 0 or segments[0] == "ui":  # the dashboard's pages: their data comes from the API
        return Guard.NONE
    if n == 1 and segments[0] in ("health", "openapi.json"):
        return Guard.NONE
    if n == 2 and segments == [".well-known", "openapi.json"]:
        return Guard.NONE
    if n >= 3 and (
        (segments[0] == "leases" and segments[2] == "heartbeat")
        or (
            segments[0] == "runs"
            and segments[2] in ("events", "transition", "fail", "checkpoint", "release")
        )
    ):
        return Guard.LEASE
    return Guard.KEY
