"""GET /events/stream: run events as Server-Sent Events, live.

A connected stream costs a future and a heartbeat timer, nothing else: no stream reads the
database while nothing happens. After a commit the server calls `StreamHub.wake()` (the moment
the long-polling claims are woken); the hub then reads the new events once, for every stream,
and hands each stream the ones its filters let through. Beyond `StreamHub.limit` open streams
(the server sets it from what the process can hold: server/capacity.py) a new one is refused at once
with 503 `overloaded`. A stream that resumes (the
`Last-Event-ID` header, or the `last_event_id` query parameter a browser's first request can
carry) first replays what it missed from the database, then joins the live feed exactly where
that replay ends. A stream opened with a key ends, at its next event or heartbeat, once the key
is revoked.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from nulltickets.domain.model import FeedEvent
from nulltickets.errors import InvalidCursor, Overloaded, Unauthorized
from nulltickets.http.request import Request
from nulltickets.http.response import EVENT_STREAM, STREAMED, Reply, WebReply
from nulltickets.service import Service

if TYPE_CHECKING:
    from nulltickets.http.context import Context

# A comment line every so often keeps proxies from closing an idle stream (and finds the
# clients that went away). NULLTICKETS_SSE_HEARTBEAT_S changes it (the tests use a short one).
HEARTBEAT_S = float(os.environ.get("NULLTICKETS_SSE_HEARTBEAT_S") or 15.0)
PAGE = 1000  # events per read, live or replayed
RETRY_MS = 2000  # how soon a browser reconnects after the stream ends

_encode = msgspec.json.Encoder().encode
HEADERS = (
    ("content-type", EVENT_STREAM),
    ("cache-control", "no-store"),
    ("x-accel-buffering", "no"),
)


class Filters(msgspec.Struct, frozen=True):
    task_id: str | None = None
    run_id: str | None = None
    pipeline_id: str | None = None
    kinds: frozenset[str] | None = None

    def key(self) -> tuple[str, str | None]:
        """Where a stream is filed: under the most selective of its filters, so that an event
        is checked against the streams that may want it, not against every stream."""
        if self.task_id is not None:
            return "task", self.task_id
        if self.run_id is not None:
            return "run", self.run_id
        if self.pipeline_id is not None:
            return "pipeline", self.pipeline_id
        return "all", None

    def admit(self, ev: FeedEvent) -> bool:
        return (
            (self.task_id is None or ev.task_id == self.task_id)
            and (self.run_id is None or ev.run_id == self.run_id)
            and (self.pipeline_id is None or ev.pipeline_id == self.pipeline_id)
            and (self.kinds is None or ev.kind in self.kinds)
        )


class _Client:
    __slots__ = ("filters", "pending", "waiter")

    def __init__(self, filters: Filters) -> None:
        self.filters = filters
        self.pending: deque[FeedEvent] = deque()
        self.waiter: asyncio.Future[bool] | None = None

    def push(self, ev: FeedEvent) -> None:
        self.pending.append(ev)
        self.poke()

    def poke(self) -> None:
        if self.waiter is not None:
            _resolve(self.waiter)

    def on_gone(self, _: object) -> None:
        self.poke()


class StreamHub:
    def __init__(self, service: Service) -> None:
        self._service = service
        self._clients: set[_Client] = set()
        self._filed: dict[tuple[str, str | None], set[_Client]] = {}  # by Filters.key()
        self._last_id: int | None = None  # the newest event the live feed has handed out
        self._fetching = False
        self._again = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self.closing = False
        self.limit: int | None = None  # open streams at most (None: no limit)
        self._joining = 0
        self.admitted = 0  # counters for /metrics
        self.refused = 0

    @property
    def clients(self) -> int:
        return len(self._clients)

    def listening(self) -> bool:
        """Whether a commit concerns the hub at all (asked on the committing thread)."""
        return bool(self._clients) and not self.closing

    def wake(self) -> None:
        """After a commit: if anyone listens, read what is new (once for all streams)."""
        if not self.listening() or self._last_id is None:
            return
        if self._fetching:
            self._again = True
            return
        loop = self._loop
        if loop is None:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            self._start_fetch()
        else:  # a commit made on another thread
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._start_fetch)

    def _start_fetch(self) -> None:
        if self._fetching or self.closing:
            self._again = True
            return
        self._fetching = True
        assert self._loop is not None
        # In a context of its own: the read is every stream's, not the request's that woke it
        # (a request made with a key has its units of work confirm it: Service.speaking_with).
        self._loop.create_task(self._fetch(), context=contextvars.Context())

    async def _fetch(self) -> None:
        try:
            while True:
                self._again = False
                after = self._last_id
                assert after is not None
                rows = await self._service.events_feed(after, PAGE)
                filed = self._filed
                for ev in rows:
                    for key in (
                        ("all", None),
                        ("pipeline", ev.pipeline_id),
                        ("task", ev.task_id),
                        ("run", ev.run_id),
                    ):
                        for client in filed.get(key, ()):
                            if client.filters.admit(ev):
                                client.push(ev)
                if rows:
                    self._last_id = rows[-1].id
                if len(rows) < PAGE and not self._again:
                    return
        except Exception:  # a failed read: the next commit tries again
            return
        finally:
            self._fetching = False

    async def join(self, filters: Filters) -> tuple[_Client, int]:
        """Register a stream; returns it and the id the live feed hands out events after.
        Raises Overloaded when `limit` streams are open (or opening)."""
        if self.limit is not None and len(self._clients) + self._joining >= self.limit:
            self.refused += 1
            raise Overloaded(
                f"the server holds {self.limit} open event streams, as many as it is set to "
                "(max_streams); retry later"
            )
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        self._joining += 1
        try:
            if self._last_id is None:
                last = await self._service.last_event_id()
                if self._last_id is None:
                    self._last_id = last
        finally:
            self._joining -= 1
        client = _Client(filters)
        self._clients.add(client)
        self._filed.setdefault(filters.key(), set()).add(client)
        self.admitted += 1
        return client, self._last_id

    def leave(self, client: _Client) -> None:
        if client in self._clients:
            self._clients.discard(client)
            key = client.filters.key()
            filed = self._filed[key]
            filed.discard(client)
            if not filed:
                del self._filed[key]

    def close(self) -> None:
        """The server is stopping: every stream ends now."""
        self.closing = True
        self._poke_all()

    def _poke_all(self) -> None:
        for client in self._clients:
            client.poke()

    async def replay(self, filters: Filters, after: int, upto: int) -> list[FeedEvent]:
        """The events in (after, upto] that pass `filters`, read in pages."""
        found: list[FeedEvent] = []
        task_id = filters.task_id
        while after < upto:
            cursor = after
            rows = await self._service.events_feed(cursor, PAGE, task_id)
            for ev in rows:
                if ev.id > upto:
                    return found
                if filters.admit(ev):
                    found.append(ev)
            if len(rows) < PAGE:
                break
            after = rows[-1].id
        return found


async def _key_alive(ctx: Context, key_id: str) -> bool:
    try:
        return await ctx.service.key_by_id(key_id) is not None
    except Unauthorized:  # confirmed gone inside the read itself (Service.speaking_with)
        return False


def _resolve(future: asyncio.Future[bool], beat: bool = False) -> None:
    if not future.done():
        future.set_result(beat)


def _frame(ev: FeedEvent) -> bytes:
    return b"id: %d\ndata: %s\n\n" % (ev.id, _encode(ev))


def _filters(req: Request) -> Filters:
    q = req.query
    kind = q.get("kind")
    kinds = frozenset(k for k in kind.split(",") if k) if kind else None
    return Filters(q.get("task_id"), q.get("run_id"), q.get("pipeline_id"), kinds or None)


def _resume_id(req: Request) -> int | None:
    raw = req.header("last-event-id") or req.query.get("last_event_id")
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise InvalidCursor("Last-Event-ID must be an event id") from None
    return max(0, value)


async def stream(ctx: Context, req: Request) -> Reply:
    hub = ctx.hub
    assert hub is not None
    filters = _filters(req)
    resume = _resume_id(req)
    if req.method == "HEAD":  # what a GET would start with, and no stream
        return WebReply(200, b"", HEADERS)
    client, upto = await hub.join(filters)
    try:
        backlog = await hub.replay(filters, resume, upto) if resume is not None else []
        transport = req.proto.response_stream(200, list(HEADERS))
        gone = asyncio.ensure_future(req.disconnected())
        key_id = req.principal.key_id if req.principal is not None else None
        alive = None if key_id is None else (lambda: _key_alive(ctx, key_id))
        try:
            await _serve(hub, client, transport, backlog, gone, resume or 0, alive)
        finally:
            gone.cancel()
    finally:
        hub.leave(client)
    return STREAMED


async def _serve(
    hub: StreamHub,
    client: _Client,
    transport: Any,
    backlog: list[FeedEvent],
    gone: asyncio.Future[Any],
    sent: int,
    alive: Callable[[], Awaitable[bool]] | None = None,
) -> None:
    """Send the backlog, then live events; `sent` is the id the client has seen up to (the
    live feed may still hand out events up to it that the replay already covered). `alive`,
    asked at each wake-up: whether the stream's key still exists."""
    loop = asyncio.get_running_loop()
    gone.add_done_callback(client.on_gone)
    with contextlib.suppress(Exception):  # the client went away mid-write
        await transport.send_bytes(b"retry: %d\n: connected\n\n" % RETRY_MS)
        for ev in backlog:
            if ev.id > sent:
                await transport.send_bytes(_frame(ev))
                sent = ev.id
        while not hub.closing and not gone.done():
            while client.pending:
                ev = client.pending.popleft()
                if ev.id > sent:
                    await transport.send_bytes(_frame(ev))
                    sent = ev.id
            # One future, awaited directly, resolved by an event, hub.close(), the client going
            # away or the heartbeat timer (as the long-poll claims wait).
            waiter = client.waiter = loop.create_future()
            timer = loop.call_later(HEARTBEAT_S, _resolve, waiter, True)
            try:
                beat = await waiter
            finally:
                timer.cancel()
                client.waiter = None
            if alive is not None and not await alive():
                return  # its key was revoked
            if beat and not hub.closing and not gone.done():
                await transport.send_bytes(b": heartbeat\n\n")
