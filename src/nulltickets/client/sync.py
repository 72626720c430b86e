"""The synchronous client: one connection, kept alive, retried when that is safe (see
`nulltickets.client`). Its methods, one per verb, come from `Calls` (methods.py, generated)."""

from __future__ import annotations

import contextlib
import dataclasses
import email.utils
import http.client
import random
import select
import socket
import ssl
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, TypeVar

import msgspec

from nulltickets.client.calls import (
    DEFAULT_BASE_URL,
    DEFAULT_RETRY,
    ApiError,
    Call,
    ClientAborted,
    Retry,
    RetryEvent,
    Unreachable,
    _Answer,
    _decoder,
)
from nulltickets.client.methods import SyncMethods

T = TypeVar("T")


@dataclass(frozen=True)
class Endpoint:
    """Where the server is: `http://host[:port][/prefix]` or `https://...`."""

    scheme: str
    host: str
    port: int
    prefix: str

    @classmethod
    def parse(cls, base_url: str) -> Endpoint:
        url = urllib.parse.urlsplit(base_url.strip())
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"base URL must be http(s)://host[:port], got {base_url!r}")
        try:
            port = url.port or (443 if url.scheme == "https" else 80)
        except ValueError:
            raise ValueError(f"base URL has a bad port: {base_url!r}") from None
        return cls(url.scheme, url.hostname, port, url.path.rstrip("/"))

    @property
    def tls(self) -> bool:
        return self.scheme == "https"

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.tls else 80
        return host if self.port == default else f"{host}:{self.port}"


@dataclass
class Attempts:
    """The retry decisions of one call, shared by both clients: `after_*` return how long to
    wait before the next attempt, or raise what the caller gets."""

    call: Call[Any]
    policy: Retry
    on_retry: Callable[[RetryEvent], None] | None
    started: float = field(default_factory=time.monotonic)
    attempt: int = 1

    def after_error(self, exc: BaseException, sent: bool) -> float:
        """A connection error; `sent`: the request may have reached the server."""
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        if sent and not self._repeatable():
            raise Unreachable(
                f"{self.call.method} {self.call.path}: connection lost after the request was "
                f"sent ({reason}); not repeated, as it might have been applied"
            ) from exc
        delay = self._next(self.policy.backoff(self.attempt - 1))
        if delay is None:
            raise Unreachable(
                f"{self.call.method} {self.call.path}: server unreachable after "
                f"{self.attempt} attempt(s) in {time.monotonic() - self.started:.1f} s "
                f"({reason})"
            ) from exc
        return self._announce(delay, reason, None)

    def after_answer(self, status: int, headers: Mapping[str, str], payload: bytes) -> float:
        """An error answer: raise it, or say how long to wait before trying again."""
        error = error_of(status, headers, payload)
        if status in (429, 503, 507):
            wait = error.retry_after
            if wait is None:
                wait = self.policy.backoff(self.attempt - 1)
            else:
                wait += random.uniform(0, wait / 10)  # not every client at the same instant
        elif status in (502, 504) and self._repeatable():
            wait = self.policy.backoff(self.attempt - 1)
        else:
            raise error
        delay = self._next(wait)
        if delay is None:
            raise error
        return self._announce(delay, str(error), status)

    def pause_after(self, status: int, headers: Mapping[str, str]) -> float:
        """A long-poll claim answered 204 before its wait was up, with `Retry-After` (the
        server holds as many waiting claims as it is set to): how long to wait, within the
        call's own wait, before reporting that nothing was claimed. 0 for any other answer."""
        if status != 204 or not self.call.wait_s:
            return 0.0
        retry = _retry_after(headers.get("retry-after"))
        if retry is None:
            return 0.0
        left = self.started + self.call.wait_s - time.monotonic()
        return max(0.0, min(retry, left))

    def _repeatable(self) -> bool:
        return self.call.repeatable or self.call.keyed

    def _next(self, wait: float) -> float | None:
        policy = self.policy
        if policy.max_attempts is not None and self.attempt >= policy.max_attempts:
            return None
        if policy.timeout is not None:
            left = self.started + policy.timeout - time.monotonic()
            if wait > left:
                return None
        return wait

    def _announce(self, delay: float, reason: str, status: int | None) -> float:
        if self.on_retry is not None:
            self.on_retry(
                RetryEvent(self.call.method, self.call.path, self.attempt, delay, reason, status)
            )
        self.attempt += 1
        return delay


def error_of(status: int, headers: Mapping[str, str], payload: bytes) -> ApiError:
    retry_after = _retry_after(headers.get("retry-after"))
    try:
        detail = _decoder(_Answer).decode(payload).error
        return ApiError(status, detail.code, detail.message, retry_after)
    except msgspec.DecodeError:
        text = payload[:200].decode("utf-8", "replace")
        return ApiError(status, "unexpected_response", text, retry_after)


def _retry_after(value: str | None) -> float | None:
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    with contextlib.suppress(TypeError, ValueError):
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    return None


class Transport:
    """What both clients hold: the endpoint, the token, and how a call becomes headers."""

    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        timeout: float,
        retry: Retry,
        idempotency_keys: bool,
        on_retry: Callable[[RetryEvent], None] | None,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self.endpoint = Endpoint.parse(base_url)
        self.base_url = base_url
        self.token = token
        self.timeout = timeout
        self.retry = retry
        self.idempotency_keys = idempotency_keys
        self.on_retry = on_retry
        self.ssl_context = ssl_context
        if self.endpoint.tls and ssl_context is None:
            self.ssl_context = ssl.create_default_context()

    def prepare(self, call: Call[Any], retry: Retry | None) -> tuple[Call[Any], Attempts]:
        if call.keyed and not self.idempotency_keys:
            call = dataclasses.replace(call, keyed=False)
        return call, Attempts(call, retry or self.retry, self.on_retry)

    def headers(self, call: Call[Any], key: str | None) -> dict[str, str]:
        headers = {"Host": self.endpoint.host_header, "Accept": "application/json"}
        if call.body is not None:
            headers["Content-Type"] = call.content_type
        token = call.bearer if call.bearer is not None else self.token
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        if key is not None:
            headers["Idempotency-Key"] = key
        return headers

    def target(self, call: Call[Any]) -> str:
        return self.endpoint.prefix + call.path

    def read_timeout(self, call: Call[Any]) -> float:
        return self.timeout + call.wait_s

    @staticmethod
    def new_key(call: Call[Any]) -> str | None:
        return uuid.uuid4().hex if call.keyed else None


# --- the synchronous client --------------------------------------------------------------------


class _NotSent(Exception):
    def __init__(self, cause: BaseException) -> None:
        self.cause = cause


class _Lost(Exception):
    def __init__(self, cause: BaseException) -> None:
        self.cause = cause


class Client(SyncMethods):
    """The API over one kept-alive connection (not thread-safe: one client per thread).

    `retry` is the default policy of every call (a call may give its own to `run`),
    `timeout` bounds each attempt (a long-polling claim gets its wait on top), `on_retry` is
    told of every retry (for a log line), `ssl_context` verifies an `https://` server.
    """

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
        self._conn: http.client.HTTPConnection | None = None
        self._aborted = threading.Event()

    @property
    def base_url(self) -> str:
        return self.transport.base_url

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def abort(self) -> None:
        """Cut the call in flight (from a signal handler or another thread), and make it and
        every later call raise `ClientAborted`. A long-polling claim cut this way claims
        nothing."""
        self._aborted.set()
        conn = self._conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    # --- transport -----------------------------------------------------------------------------

    def run(self, call: Call[T], retry: Retry | None = None) -> T:
        """Send `call` (and again, as its retry policy allows); its decoded answer."""
        call, attempts = self.transport.prepare(call, retry)
        key = self.transport.new_key(call)
        while True:
            if self._aborted.is_set():
                raise ClientAborted("client aborted")
            try:
                status, headers, payload = self._send(call, key)
            except (_NotSent, _Lost) as failure:
                if self._aborted.is_set():
                    raise ClientAborted("client aborted") from failure.cause
                delay = attempts.after_error(failure.cause, sent=isinstance(failure, _Lost))
            else:
                if status < 400:
                    if self._aborted.wait(attempts.pause_after(status, headers)):
                        raise ClientAborted("client aborted")
                    return call.decode(status, payload)
                delay = attempts.after_answer(status, headers, payload)
            if self._aborted.wait(delay):
                raise ClientAborted("client aborted")

    def _connection(self) -> http.client.HTTPConnection:
        conn = self._conn
        if conn is not None and conn.sock is not None and _dropped(conn.sock):
            self.close()  # the server closed it while it was idle
            conn = None
        if conn is None:
            t = self.transport
            ep = t.endpoint
            if ep.tls:
                conn = http.client.HTTPSConnection(
                    ep.host, ep.port, timeout=t.timeout, context=t.ssl_context
                )
            else:
                conn = http.client.HTTPConnection(ep.host, ep.port, timeout=t.timeout)
            self._conn = conn
        return conn

    def _send(self, call: Call[Any], key: str | None) -> tuple[int, dict[str, str], bytes]:
        conn = self._connection()
        try:
            if conn.sock is None:
                conn.connect()
        except (OSError, http.client.HTTPException) as exc:
            self.close()
            raise _NotSent(exc) from exc
        assert conn.sock is not None
        t = self.transport
        try:
            conn.sock.settimeout(t.read_timeout(call))
            conn.request(call.method, t.target(call), call.body, t.headers(call, key))
            response = conn.getresponse()
            payload = response.read()
        except (OSError, http.client.HTTPException) as exc:
            self.close()  # never reuse a connection in an unknown state
            raise _Lost(exc) from exc
        headers = {k.lower(): v for k, v in response.getheaders()}
        if response.will_close:
            self.close()
        return response.status, headers, payload


def _dropped(sock: socket.socket) -> bool:
    """An idle kept-alive connection the server has closed (or sent something unasked on)."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)
