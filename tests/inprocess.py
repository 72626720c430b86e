"""The real app and storage in this process, driven through its RSGI interface: no socket.

`InProcessServer` builds the settings, checks and migrates the database and makes the app as
`nulltickets serve` does (cli.py, launch.py), then runs the app's event loop in a thread of its
own; `InProcessClient` has tests/server.py's `Client` interface, so a test's own threads call
it as they would a server over HTTP. Each request is one `__rsgi__(scope, protocol)` call, the
protocol implementing what granian's RSGI HTTP protocol offers the app: the body read whole or
by chunks, `response_bytes`, `response_str`, `response_empty`, `response_stream` and
`client_disconnect`.

What granian itself does on the wire (parsing, framing, keep-alive, Content-Length, timeouts
on slow clients, signals) is not here: the tests of it ask for a real process (`process`
marker). A response carries exactly the headers the app set, none that granian would add.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
from collections.abc import AsyncIterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from nulltickets.cli import _parser, hide_passwords
from nulltickets.cli.serve import settings_from_args
from nulltickets.http.app import App
from nulltickets.server.launch import check_settings, preflight, worker_settings
from tests.server import TIME_SCALE, Response, free_port

# What http.client sends for a method that carries a body when none is given.
METHODS_EXPECTING_BODY = frozenset({"PATCH", "POST", "PUT"})


class Headers:
    """granian's RSGIHeaders: names in lower case, `get` the first value of a name."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        self._pairs = [(k.lower(), v) for k, v in pairs]

    def get(self, name: str, default: Any = None) -> Any:
        name = name.lower()
        for key, value in self._pairs:
            if key == name:
                return value
        return default

    def get_all(self, name: str) -> list[str]:
        name = name.lower()
        return [v for k, v in self._pairs if k == name]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def keys(self) -> list[str]:
        return [k for k, _ in self._pairs]

    def values(self) -> list[str]:
        return [v for _, v in self._pairs]

    def items(self) -> list[tuple[str, str]]:
        return list(self._pairs)

    def __iter__(self) -> Any:
        return iter(self.keys())


class Scope:
    """granian's RSGI HTTP scope."""

    proto = "http"
    http_version = "1.1"
    rsgi_version = "1.5"
    scheme = "http"

    def __init__(
        self, method: str, target: str, headers: Headers, server: str, client: str
    ) -> None:
        path, _, query = target.partition("?")
        self.method = method
        self.path = path
        self.query_string = query
        self.headers = headers
        self.server = server
        self.client = client
        self.authority = headers.get("host")


class Protocol:
    """granian's RSGI HTTP protocol for one request, on the app's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, body: bytes) -> None:
        self.loop = loop
        self.body = body
        self.status: int | None = None
        self.headers: list[tuple[str, str]] = []
        self.chunks: list[bytes] = []
        self.gone = loop.create_future()

    async def __call__(self) -> bytes:
        return self.body

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[bytes]:
        if self.body:
            yield self.body

    def _start(self, status: int, headers: list[tuple[str, str]]) -> None:
        if self.status is not None:
            raise RuntimeError("the response was already started")
        self.status, self.headers = status, list(headers)

    def response_empty(self, status: int, headers: list[tuple[str, str]]) -> None:
        self._start(status, headers)

    def response_bytes(self, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self._start(status, headers)
        self.chunks.append(bytes(body))

    def response_str(self, status: int, headers: list[tuple[str, str]], body: str) -> None:
        self.response_bytes(status, headers, body.encode())

    def response_stream(self, status: int, headers: list[tuple[str, str]]) -> Transport:
        self._start(status, headers)
        return Transport(self)

    def client_disconnect(self) -> asyncio.Future[None]:
        return self.gone

    def disconnect(self) -> None:
        """The client went away: what `client_disconnect()` handed out completes."""
        if not self.gone.done():
            self.gone.set_result(None)


class Transport:
    def __init__(self, proto: Protocol) -> None:
        self.proto = proto

    async def send_bytes(self, data: bytes) -> None:
        if self.proto.gone.done():
            raise ConnectionError("the client went away")
        self.proto.chunks.append(bytes(data))

    async def send_str(self, data: str) -> None:
        await self.send_bytes(data.encode())


class InProcessServer:
    """The server of tests/server.py's `Server` (same arguments and `client()`), in this
    process. `args` are `serve`'s flags; `env` is not taken (a server with an environment of
    its own is a process)."""

    def __init__(
        self,
        db: Path,
        *,
        token: str | None = None,
        args: list[str] | None = None,
        dsn: str | None = None,
    ) -> None:
        self.db = db
        self.dsn = dsn
        self.token = token
        self.args = args or []
        # Only what the Host header names: nothing listens on it.
        self.host_port = free_port()
        self.app: App | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._requests = 0

    def command(self) -> list[str]:
        target = self.dsn if self.dsn is not None else str(self.db)
        cmd = ["serve", "--port", str(self.host_port), "--db", target]
        if self.token is not None:
            cmd += ["--token", self.token]
        return cmd + self.args

    def start(self) -> InProcessServer:
        # As `nulltickets serve` with a home of its own (tests/server.py), so a developer's
        # ~/.nulltickets/config.json never leaks in: cli.serve_command, then launch.serve's
        # worker settings, then the app granian's worker would load.
        home = os.environ.get("NULLTICKETS_HOME")
        os.environ["NULLTICKETS_HOME"] = str(self.db.parent / "home")
        try:
            settings = settings_from_args(_parser().parse_args(self.command()))
        finally:
            if home is None:
                del os.environ["NULLTICKETS_HOME"]
            else:
                os.environ["NULLTICKETS_HOME"] = home
        hide_passwords(settings.db)
        check_settings(settings)
        preflight(settings)
        settings, _ = worker_settings(settings)
        self.app = app = App(settings, owns_process=False)
        self.loop = loop = new_loop()
        ready: Future[None] = Future()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                app.__rsgi_init__(loop)
            except BaseException as exc:
                ready.set_exception(exc)
                loop.close()
                return
            ready.set_result(None)
            try:
                loop.run_forever()
            finally:
                self._finish(loop, app)

        self._thread = threading.Thread(target=run, name="nulltickets-inprocess", daemon=True)
        self._thread.start()
        ready.result(20.0 * TIME_SCALE)
        return self

    @staticmethod
    def _finish(loop: asyncio.AbstractEventLoop, app: App) -> None:
        """What granian's worker does at its stop: the requests in flight end, then
        `__rsgi_del__` commits what is queued and closes the database."""
        pending = [t for t in asyncio.all_tasks(loop) if t is not app._upkeep]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        app.__rsgi_del__(loop)
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    def output(self) -> str:
        return ""

    def client(self, token: str | None = None) -> InProcessClient:
        return InProcessClient(self, token=token)

    def call(self, scope: Scope, body: bytes, timeout: float) -> Response:
        loop, app = self.loop, self.app
        assert loop is not None and app is not None, "the server is not running"
        proto_box: list[Protocol] = []

        async def serve() -> None:
            proto = Protocol(loop, body)
            proto_box.append(proto)
            await app.__rsgi__(scope, proto)

        future = asyncio.run_coroutine_threadsafe(serve(), loop)
        try:
            future.result(timeout)
        except FutureTimeout:
            # As a socket client's timeout: it hangs up, the server sees it go.
            if proto_box:
                loop.call_soon_threadsafe(proto_box[0].disconnect)
            raise TimeoutError("timed out") from None
        proto = proto_box[0]
        if proto.status is None:
            raise ConnectionResetError("the app answered nothing")
        payload = b"".join(proto.chunks)
        if scope.method == "HEAD" or proto.status in (204, 304) or proto.status < 200:
            payload = b""  # what an HTTP client reads of such a response
        headers: dict[str, str] = {}
        for name, value in proto.headers:
            key = name.lower()
            # As http.client joins a repeated header's values.
            headers[key] = f"{headers[key]}, {value}" if key in headers else value
        return Response(proto.status, headers, payload)

    def stop(self) -> int:
        loop, thread = self.loop, self._thread
        if loop is None or thread is None:
            return 0
        with contextlib.suppress(RuntimeError):  # already closed (a failed start)
            loop.call_soon_threadsafe(loop.stop)
        thread.join(30.0 * TIME_SCALE)
        self.loop = self._thread = self.app = None
        return 0


def new_loop() -> asyncio.AbstractEventLoop:
    """The loop granian's worker runs (Loops.auto): uvloop where installed."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - a dependency where it builds
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class InProcessClient:
    """tests/server.py's `Client` interface on an `InProcessServer`; like it, one per thread."""

    def __init__(self, server: InProcessServer, token: str | None = None) -> None:
        self.server = server
        self.token = token
        self.timeout = 30.0 * TIME_SCALE
        self.host = "127.0.0.1"
        self.port = server.host_port

    def request(
        self,
        method: str,
        path: str,
        json_body: Any = None,
        *,
        body: bytes | str | None = None,
        headers: dict[str, str] | None = None,
        token: str | None = None,
    ) -> Response:
        hdrs = dict(headers or {})
        bearer = token if token is not None else self.token
        if bearer is not None and "Authorization" not in hdrs:
            hdrs["Authorization"] = f"Bearer {bearer}"
        if json_body is not None:
            body = json.dumps(json_body)
            hdrs.setdefault("Content-Type", "application/json")
        data = body.encode() if isinstance(body, str) else body
        # The headers http.client adds (tests/server.py's Client is one).
        given = {k.lower() for k in hdrs}
        pairs: list[tuple[str, str]] = []
        if "host" not in given:
            pairs.append(("host", f"{self.host}:{self.port}"))
        if "accept-encoding" not in given:
            pairs.append(("accept-encoding", "identity"))
        pairs += list(hdrs.items())
        if "content-length" not in given and "transfer-encoding" not in given:
            if data is not None:
                pairs.append(("content-length", str(len(data))))
            elif method.upper() in METHODS_EXPECTING_BODY:
                pairs.append(("content-length", "0"))
        self.server._requests += 1
        client = f"127.0.0.1:{40000 + self.server._requests % 20000}"
        scope = Scope(method, path, Headers(pairs), f"127.0.0.1:{self.server.host_port}", client)
        return self.server.call(scope, data or b"", self.timeout)

    def get(self, path: str, **kw: Any) -> Response:
        return self.request("GET", path, **kw)

    def post(self, path: str, json_body: Any = None, **kw: Any) -> Response:
        return self.request("POST", path, json_body, **kw)

    def put(self, path: str, json_body: Any = None, **kw: Any) -> Response:
        return self.request("PUT", path, json_body, **kw)

    def delete(self, path: str, **kw: Any) -> Response:
        return self.request("DELETE", path, **kw)

    def close(self) -> None:
        pass
