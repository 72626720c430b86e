"""The asyncio client: the same operations and retry rules as `nulltickets.client.Client`, on
asyncio streams, with a small pool of kept-alive connections so that coroutines can call at once.

    from nulltickets.client import AsyncClient
    async with AsyncClient("http://127.0.0.1:7700") as api:
        claimed = await api.claim("orchestrator-1", "coder", wait_ms=30_000)

Calls are built, decoded and retried by what `nulltickets.client` shares (`Calls`, `Transport`,
`Attempts`); this module only moves the bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from nulltickets.client.calls import (
    DEFAULT_BASE_URL,
    DEFAULT_RETRY,
    Call,
    Retry,
    RetryEvent,
)
from nulltickets.client.methods import AsyncMethods
from nulltickets.client.sync import Transport

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


class AsyncClient(AsyncMethods):
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
