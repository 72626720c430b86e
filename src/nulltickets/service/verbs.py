"""The table of verbs: every verb of the API declared once, on its implementation.

A declaration (`@verb(...)` on a method of an area of the tracker) says what the verb is
called, where it is reached (method and path), who may call it, what it takes and answers,
and which surfaces carry it. The surfaces are made from the table, never written again:
`http/routes.py` makes the route (one generic handler) and `http/openapi.py` the operation;
`client/` gives both clients a method for it; `cli/` a command where it has one; the MCP
server a tool. `tests/unit/test_verbs.py` fails when a verb lacks a surface it declares.

The implementation runs inside one unit of work (`unit_of_work.Service.call`). What it gets
comes from the names of its parameters, read once here:

- `b`: the unit's `Backend`; `now`: the unit's time (the clock is read once per unit);
- the path's parameters, in order, as the first other parameters (`/tasks/{id}` -> `task_id`);
- `cmd`: the request body, decoded into the verb's `request` type;
- `token_hash`: the SHA-256 of the lease token presented (verbs under a lease);
- `lease`: the run's live lease, checked (with any `expected_fence` of the body) before the
  body is looked at, so a bad lease is reported before a bad body;
- any other name: the query parameter declared for it (`Param.arg`, else its name).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum, StrEnum
from typing import Any, TypeVar

from nulltickets.domain.model import Access, StatusBody
from nulltickets.errors import (
    LeaseExpired,
    LeaseSuperseded,
    NotFound,
    TaskCancelled,
    TrackerError,
    Unauthorized,
)
from nulltickets.service import params as p


class Guard(StrEnum):
    """Who may call a verb."""

    NONE = "none"  # anyone
    KEY = "key"  # on a server with a token: the token, or a key with the verb's access
    LEASE = "lease"  # the lease token of the run or lease in the path


class Surface(StrEnum):
    HTTP = "http"
    CLIENT = "client"  # a method of Client and AsyncClient
    CLI = "cli"  # a command of `nulltickets`
    MCP = "mcp"  # a tool of the MCP server


class Kind(Enum):
    """What a write did, for the caller to answer with. The values are what an idempotency
    record keeps (the column has always held these numbers)."""

    CREATED = 201
    OK = 200
    EMPTY = 204  # nothing to say: no claimable task, a value stored or deleted


@dataclass(frozen=True, slots=True)
class Tool:
    """The verb as a tool of the MCP server (`nulltickets.mcp`). A verb under a lease is a tool
    on the session's current lease: the run or lease in its path and the body's
    `expected_fence` come from the lease the session holds, so a lease token never enters the
    model's context. `hide`: request fields the tool does not offer. `description`: what the
    model reads (the verb's summary when empty). `ends_lease`: the verb ends the run."""

    name: str
    description: str = ""
    hide: tuple[str, ...] = ()
    ends_lease: bool = False  # the session holds no task once it succeeds


@dataclass(frozen=True, slots=True)
class Param:
    """A query parameter of a verb."""

    name: str
    description: str
    kind: str = "string"  # its JSON Schema type
    parse: Callable[[str | None], Any] = p.text
    arg: str | None = None  # the implementation's parameter, when it is named otherwise


def paging(
    default: int, cursor: Callable[[str | None], Any] = p.composite_cursor, arg: str = "after"
) -> tuple[Param, Param]:
    """The parameters of a listing by keyset pages: `limit` (default `default`) and `cursor`,
    given to the implementation's `arg`."""
    return (
        Param("limit", "Page size, 1..1000.", "integer", p.limit(default)),
        Param("cursor", "The next_cursor of the previous page.", parse=cursor, arg=arg),
    )


# What any verb under a lease may answer.
LEASE_ERRORS = (Unauthorized, NotFound, LeaseExpired, LeaseSuperseded, TaskCancelled)


class Arg(Enum):
    """Where a parameter of an implementation comes from."""

    BACKEND = "b"
    NOW = "now"
    PATH = "path"
    BODY = "cmd"
    TOKEN = "token_hash"
    LEASE = "lease"
    QUERY = "query"  # by name: a query parameter, or what a custom handler supplies


_NAMED = {a.value: a for a in (Arg.BACKEND, Arg.NOW, Arg.BODY, Arg.TOKEN, Arg.LEASE)}


@dataclass(frozen=True)
class Verb:
    name: str
    method: str
    path: str
    summary: str
    fn: Callable[..., Any]
    guard: Guard = Guard.KEY
    access: Access | None = None  # None: `read` for GET, `admin` for the rest
    request: Any = None
    response: Any = None
    status: int = 200
    errors: tuple[type[TrackerError], ...] = ()
    query: tuple[Param, ...] = ()
    answer: Callable[[Any], Any] | None = None  # the implementation's value as `response`
    trailing: bool = False  # extra trailing path segments are ignored
    optional_body: bool = False  # the body may be left out (then `request()` is used)
    extra: bool = False  # not in the original's API (an addition of ours)
    tag: str = ""
    media: str = "application/json"
    idempotency_key: bool = True  # a write that replays by Idempotency-Key
    surfaces: frozenset[Surface] = frozenset({Surface.HTTP, Surface.CLIENT})
    client: str = ""  # the clients' name for it (default: `name`)
    cli: str = ""  # the command that calls it, e.g. "tasks list"
    tool: Tool | None = None  # the MCP server's tool for it
    custom: bool = False  # HTTP answers it with a handler of its own (long-poll, ...)
    plan: tuple[tuple[Arg, Any, str | None], ...] = field(default=(), compare=False)

    @functools.cached_property
    def at_service(self) -> bool:
        """Implemented by `Service` itself (more than one unit of work, or a wait)."""
        return inspect.iscoroutinefunction(self.fn)

    @functools.cached_property
    def write(self) -> bool:
        return self.method != "GET"

    @functools.cached_property
    def kind(self) -> Kind:
        return Kind(self.status) if self.status in (201, 204) else Kind.OK

    @functools.cached_property
    def needs(self) -> Access:
        if self.access is not None:
            return self.access
        return Access.READ if self.method == "GET" else Access.ADMIN

    @functools.cached_property
    def path_params(self) -> tuple[str, ...]:
        return tuple(s.strip("{+}") for s in self.path.split("/") if s.startswith("{"))

    @functools.cached_property
    def under_run_lease(self) -> bool:
        """A write under the lease of the run in its path: the lease is checked before the
        body is looked at."""
        return self.guard is Guard.LEASE and self.path.startswith("/runs/") and self.write

    @property
    def client_name(self) -> str:
        return self.client or self.name


VERBS: dict[str, Verb] = {}


F = TypeVar("F", bound=Callable[..., Any])


def verb(method: str, path: str, summary: str, **declared: Any) -> Callable[[F], F]:
    """Declare the decorated implementation as a verb of the API (see the module's doc)."""

    def register(fn: F) -> F:
        name = declared.pop("name", fn.__name__)
        if name in VERBS:
            raise ValueError(f"verb {name!r} is declared twice")
        surfaces = set(declared.pop("surfaces", (Surface.HTTP, Surface.CLIENT)))
        if declared.get("cli"):
            surfaces.add(Surface.CLI)
        if declared.get("tool") is not None:
            surfaces.add(Surface.MCP)
        declared["surfaces"] = frozenset(surfaces)
        made = Verb(name, method, path, summary, fn, **declared)
        object.__setattr__(made, "plan", _plan(made))
        VERBS[name] = made
        return fn

    return register


def _plan(v: Verb) -> tuple[tuple[Arg, Any, str | None], ...]:
    """Where each parameter of the implementation (after `self`) comes from: (source, key,
    the name it is passed by when it is keyword-only)."""
    queries = {q.arg or q.name: q for q in v.query}
    path = list(v.path_params)
    plan: list[tuple[Arg, Any, str | None]] = []
    for param in list(inspect.signature(v.fn).parameters.values())[1:]:
        name = param.name
        by_name = name if param.kind is inspect.Parameter.KEYWORD_ONLY else None
        if name in _NAMED:
            plan.append((_NAMED[name], None, by_name))
        elif name in queries:
            queries.pop(name)
            plan.append((Arg.QUERY, name, by_name))
        elif path:
            plan.append((Arg.PATH, len(v.path_params) - len(path), by_name))
            path.pop(0)
        elif param.default is not inspect.Parameter.empty:
            continue
        elif v.custom:  # its handler supplies it by name
            plan.append((Arg.QUERY, name, by_name))
        else:
            raise TypeError(f"verb {v.name}: nothing supplies the parameter {name!r}")
    if queries:
        raise TypeError(f"verb {v.name}: no parameter takes the query {sorted(queries)}")
    if path and v.guard is not Guard.LEASE:
        raise TypeError(f"verb {v.name}: no parameter takes the path's {path}")
    return tuple(plan)


def declared(surface: Surface) -> Iterable[Verb]:
    """The verbs that declare `surface`, in the order they were declared."""
    return (v for v in VERBS.values() if surface in v.surfaces)


def page(found: tuple[list[Any], str | None]) -> dict[str, Any]:
    """A page of a listing: its items and the cursor of the next page (None: the last)."""
    items, cursor = found
    return {"items": items, "next_cursor": cursor}


def said(status: str) -> Callable[[Any], StatusBody]:
    """An answer that only says what was done."""
    body = StatusBody(status)
    return lambda _: body
