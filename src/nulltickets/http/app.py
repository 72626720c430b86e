"""The RSGI application granian runs: `__rsgi_init__` opens the database inside the worker,
`__rsgi__` serves one request, `__rsgi_del__` finishes queued writes and closes the file."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

from nulltickets import logs
from nulltickets.config import Settings
from nulltickets.errors import (
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
)
from nulltickets.http import access, openapi, ui
from nulltickets.http import metrics as prometheus
from nulltickets.http.context import Context
from nulltickets.http.errors import EXTRA_HEADERS, error_headers, error_response
from nulltickets.http.origins import OriginGuard
from nulltickets.http.request import Request, split_path
from nulltickets.http.response import STREAMED, Reply, WebReply
from nulltickets.http.routes import ROUTES, WRITE_METHODS, Router, gate
from nulltickets.http.sse import StreamHub
from nulltickets.lifetime import STOP_SIGNALS, exit_after
from nulltickets.mcp.http import MCP_ROUTES
from nulltickets.server import heap
from nulltickets.service import Service
from nulltickets.service.retention import RetentionJob
from nulltickets.service.verbs import Guard
from nulltickets.storage.factory import open_database, secrets_of

log = logging.getLogger("nulltickets")

JSON = ("content-type", "application/json")
# A 204 carries no Content-Length (granian drops a zero one), and clients such as Zig's
# std.http then read its body until the connection closes: close it at once.
CLOSE = ("connection", "close")

# How often the worker checks that the process that started it is still there.
PARENT_CHECK_S = 0.5
# After a shutdown begins, how long the worker may take before it exits regardless.
SHUTDOWN_DEADLINE_S = 1.5


class App:
    """`owns_process`: the app is granian's worker, so it takes the stop signals, watches its
    parent and tunes the process's garbage collector; an app embedded in another program (the
    tests' in-process client) leaves the process alone."""

    def __init__(self, settings: Settings, *, owns_process: bool = True) -> None:
        self.settings = settings
        self.owns_process = owns_process
        self.router = Router(ROUTES + openapi.OPENAPI_ROUTES + ui.UI_ROUTES + MCP_ROUTES)
        self.guard = OriginGuard(settings)
        self.ctx: Context | None = None
        self._upkeep: asyncio.Task[None] | None = None
        self._shutdown_begun = False
        # Requests still reading their body, with their deadline. One sweep a second cancels
        # the late ones: far cheaper than a timer per request.
        self._reading: dict[asyncio.Task[Any], float] = {}
        self._timed_out: dict[asyncio.Task[Any], bool] = {}

    # --- lifecycle -----------------------------------------------------------------------------

    def __rsgi_init__(self, loop: asyncio.AbstractEventLoop) -> None:
        db = open_database(self.settings.db, durability=self.settings.durability)
        service = Service(db, keys_enabled=self.settings.token is not None)
        self.ctx = ctx = Context(service, self.settings.token)
        ctx.hub = StreamHub(ctx.service)
        # What waits costs memory and a connection, not a request slot: the limits server/launch.py
        # set from what this process can hold.
        ctx.service.wakeups.limit = self.settings.max_waiters
        ctx.hub.limit = self.settings.max_streams
        # Long-polling claims wake on the database's notifications (this process's commits on
        # SQLite; every server's on PostgreSQL), delivered on this loop.
        db.notifier.subscribe(ctx.service.wakeups.deliver, loop)
        ctx.metrics = prometheus.Metrics()
        # Event streams read what each commit added: told of every commit, not only of those
        # that notify a role (an appended run event wakes no claim).
        db.notifier.on_commit(ctx.hub.wake, loop, wanted=ctx.hub.listening)
        loop.create_task(prometheus.prime(ctx))
        self._upkeep = loop.create_task(self._maintain())
        if self.settings.retention_s is not None:
            # A thread of its own: each batch is a short transaction of its own (on SQLite, a
            # job of this loop's writer), and an export file's fsync never runs on the loop.
            ctx.retention = RetentionJob(
                db,
                self.settings.retention_s,
                self.settings.prune_interval_s,
                service.clock,
                export=self.settings.retention_export,
                loop=loop,
            )
            ctx.retention.start()
        if not self.owns_process:
            return
        self._take_shutdown_signals(loop)
        _watch_parent(loop, self._begin_shutdown)
        # Last: what start-up made is frozen, out of every later collection (server/heap.py).
        ctx.collector = collector = heap.Collector()
        collector.settle()

    def __rsgi_del__(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._upkeep is not None:
            self._upkeep.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                loop.run_until_complete(self._upkeep)
        if self.ctx is not None:
            if self.ctx.retention is not None:
                self.ctx.retention.stop()  # after the batch in hand, before the database closes
            if self.ctx.collector is not None:
                self.ctx.collector.close()
            self.ctx.service.wakeups.close()
            if self.ctx.hub is not None:
                self.ctx.hub.close()
            if self.ctx.mcp is not None:
                self.ctx.mcp.close()
            self.ctx.service.db.close()
            self.ctx = None
            if self.owns_process:
                log.info("stopped: the database is closed")

    def _take_shutdown_signals(self, loop: asyncio.AbstractEventLoop) -> None:
        """SIGTERM, SIGINT and SIGHUP first answer the waiting long-polls (204), then start
        granian's own graceful stop, which finishes the requests in flight; __rsgi_del__ then
        commits what is queued. Without this, a long-poll held the worker for up to its 30 s
        wait."""
        stop = _granian_stop[0]
        if stop is None:
            return
        try:
            for sig in STOP_SIGNALS:
                loop.add_signal_handler(sig, self._begin_shutdown)
        except (NotImplementedError, RuntimeError):  # Windows: granian's own handlers stay
            return

    def _begin_shutdown(self) -> None:
        """Runs once per process, whatever asks first: a stop signal (each of a burst, and the
        kernel's when the parent dies) or the parent watch. granian's `WorkerSignal.set` sends
        on a channel of one slot and blocks, holding the GIL, when the slot is full and its
        reader has stopped reading: a second or third call hung the worker for good, the
        exit deadline's thread included."""
        if self._shutdown_begun:
            return
        self._shutdown_begun = True
        exit_after(SHUTDOWN_DEADLINE_S)  # first: whatever follows may be what hangs
        if self.ctx is not None:
            log.info(
                "shutting down: answering %d waiting claims", self.ctx.service.wakeups.waiting()
            )
            self.ctx.service.wakeups.close()
            if self.ctx.hub is not None:
                self.ctx.hub.close()
            if self.ctx.mcp is not None:
                self.ctx.mcp.close()  # and ending the event streams
        stop = _granian_stop[0]
        if stop is not None:
            stop.set()

    async def _maintain(self) -> None:
        """Expire overdue leases promptly (not only when someone claims) and drop old
        idempotency records."""
        assert self.ctx is not None
        service = self.ctx.service
        last_purge: float | None = None
        while True:
            await asyncio.sleep(self.settings.reap_interval_s)
            self._cancel_late_readers()
            try:
                await service.reap_expired()
                if last_purge is None or time.monotonic() - last_purge > 3600:
                    await service.purge_idempotency()
                    last_purge = time.monotonic()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # busy or full: try again next round
                log.warning("maintenance failed: %s", exc)

    def _cancel_late_readers(self) -> None:
        now = time.monotonic()
        for task, deadline in list(self._reading.items()):
            if deadline <= now and not task.done():
                self._timed_out[task] = True
                task.cancel()

    # --- requests ------------------------------------------------------------------------------

    async def __rsgi__(self, scope: Any, proto: Any) -> None:
        if scope.proto != "http":
            return
        started = time.perf_counter()
        route = ["unmatched"]
        failed: BaseException | None = None
        try:
            reply = await self._handle(scope, proto, route)
            status, body = reply.status, reply.body
        except BaseException as exc:  # every failure becomes the JSON envelope
            if isinstance(exc, asyncio.CancelledError):
                raise
            status, body = error_response(exc)
            reply, failed = None, exc
        if reply is STREAMED:  # the handler sent its response itself
            status = 200
        else:
            headers = list(reply.headers) if isinstance(reply, WebReply) else [JSON]
            if failed is not None:
                headers.extend(error_headers(failed))
            if status == 204:
                headers.append(CLOSE)
            extra = EXTRA_HEADERS.get(status)
            if extra:
                headers.extend(extra)
            proto.response_bytes(status, headers, body)
        metrics = self.ctx.metrics if self.ctx is not None else None
        if metrics is not None:
            metrics.observe(scope.method, route[0], status, time.perf_counter() - started)

    async def _handle(self, scope: Any, proto: Any, route_of: list[str]) -> Reply:
        ctx = self.ctx
        assert ctx is not None
        path: str = scope.path
        # Before anything else: a page of another origin, or a renamed server, gets nothing.
        self.guard.check(scope.headers, scope.scheme, scope.method, path)
        segments = split_path(path)
        req = Request(scope.method, path, segments, scope.query_string, scope.headers)
        req.proto = proto
        req.scheme = scope.scheme
        req.client = scope.client
        if ctx.admin_token is not None:
            # Who speaks, before routing (contract §2.1: an unknown path is 401 without a
            # token): the bearer (the token or a key), else a dashboard session.
            kind = gate(segments)
            if kind is Guard.KEY:
                if req.bearer() is not None:
                    req.principal = await access.from_bearer(ctx, req)
                else:
                    req.principal = await ui.session_principal(ctx, req)
            elif kind is Guard.LEASE and req.bearer() is None:
                raise Unauthorized("missing Authorization: Bearer token")
        found = self.router.match(req.method, segments)
        if found is None:
            allowed = self.router.allowed(segments)
            if allowed:
                raise MethodNotAllowed(
                    f"{path} does not take {req.method}; it takes {', '.join(allowed)}", allowed
                )
            raise NotFound(f"no route for {req.method} {path}")
        route, req.params = found
        route_of[0] = route.pattern
        principal = req.principal
        if principal is not None:
            access.check_route(principal, route)
        if req.method in WRITE_METHODS:
            req.body = await self._read_body(scope, proto)
        if principal is None or principal.key_id is None:
            return await route.handler(ctx, req)
        with ctx.service.speaking_with(principal.key_id):
            return await route.handler(ctx, req)

    async def _read_body(self, scope: Any, proto: Any) -> bytes:
        limit = self.settings.max_body_bytes
        declared = scope.headers.get("content-length")
        if declared is not None:
            try:
                if int(declared) > limit:
                    raise PayloadTooLarge(f"request body is larger than {limit} bytes")
            except ValueError:
                pass
        task = asyncio.current_task()
        assert task is not None
        self._reading[task] = time.monotonic() + self.settings.body_timeout_s
        try:
            if declared is not None:
                body: bytes = await proto()
            else:
                chunks, size = [], 0
                async for chunk in proto:
                    size += len(chunk)
                    if size > limit:
                        raise PayloadTooLarge(f"request body is larger than {limit} bytes")
                    chunks.append(chunk)
                body = b"".join(chunks)
        except asyncio.CancelledError:
            if self._timed_out.pop(task, False):
                task.uncancel()
                raise RequestTimeout() from None
            raise
        finally:
            self._reading.pop(task, None)
        if len(body) > limit:
            raise PayloadTooLarge(f"request body is larger than {limit} bytes")
        return body


# granian's shutdown signal of this worker process, caught as granian creates it (see load_app).
_granian_stop: list[Any] = [None]


def _catch_granian_stop() -> None:
    """granian's worker makes its shutdown signal with `set_loop_signals(loop)` and keeps it to
    itself; wrap that function (this runs in the worker before granian calls it) so the app can
    answer its long-polls first and then set the signal itself."""
    try:
        import granian._signals as granian_signals
    except ImportError:  # pragma: no cover - granian is a dependency
        return
    original: Any = getattr(granian_signals, "set_loop_signals", None)
    if original is None or getattr(original, "__wrapped__", None) is not None:
        return  # another granian: its own signal handling stays

    def set_loop_signals(loop: Any) -> Any:
        event = original(loop)
        _granian_stop[0] = event
        return event

    set_loop_signals.__wrapped__ = original  # type: ignore[attr-defined]
    granian_signals.set_loop_signals = set_loop_signals


def _watch_parent(loop: asyncio.AbstractEventLoop, shutdown: Any) -> None:
    """A worker whose parent died must not keep serving (and holding the port and the
    database): on Linux the kernel sends SIGTERM when the parent goes (PR_SET_PDEATHSIG);
    everywhere a thread notices that the parent changed and shuts down."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):  # without it, the watch below does the job alone
            import ctypes

            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        log.warning("the server's main process (pid %d) is gone: shutting down", parent)
        with contextlib.suppress(RuntimeError):  # the loop is already closed
            loop.call_soon_threadsafe(shutdown)
        exit_after(SHUTDOWN_DEADLINE_S)

    threading.Thread(target=watch, name="nulltickets-parent-watch", daemon=True).start()


def load_app(target: str = "") -> App:
    """granian's target loader: runs inside the worker, configured through the environment."""
    _catch_granian_stop()
    settings = Settings.from_env()
    logs.hide(*secrets_of(settings.db))
    logs.configure(settings.log_format, settings.log_level)
    return App(settings)
