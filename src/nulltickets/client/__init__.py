"""A typed Python client for the whole nulltickets API, using the server's own msgspec types.

    from nulltickets.client import Client
    with Client("http://127.0.0.1:7700") as api:
        claimed = api.claim("agent-1", "coder", wait_ms=30_000)
        if claimed is not None:
            api.checkpoint(claimed.run.id, claimed.lease_token, {"step": 1})
            api.transition(claimed.run.id, claimed.lease_token, "complete")

`Client` keeps one connection (one client per thread); `nulltickets.client.AsyncClient` has the
same operations for asyncio. Both survive anything the server does short of refusing: a
connection error reconnects, and a failed call is tried again, with capped exponential backoff
and jitter, when that is safe:

- a connection that could not be made (refused, reset, unreachable): nothing was sent;
- 503 and 507 (the server refused before writing: storage busy, full, read-only) and 429,
  after the answer's `Retry-After`;
- after the request was sent (a lost answer, a reset, a read timeout, a 502/504 from a proxy),
  only a call that is safe to repeat: a read, a store PUT or DELETE, a heartbeat, or a write
  with an `Idempotency-Key`. Every other write gets a fresh key per call (unless
  `idempotency_keys=False`), reused by its retries, so the server replays the answer of a write
  it already applied instead of applying it twice.

Every error answer raises `ApiError` (status, code, message); a server still unreachable when
the retry budget is spent raises `Unreachable`, an `OSError`.

A long-polling claim the server answered at once with 204 and `Retry-After` (it holds as many
waiting claims as it is set to) returns None only after that pause, within its own wait, so an
agent that claims again in a loop does not ask again at once.
"""

from __future__ import annotations

from nulltickets.client.aio import AsyncClient
from nulltickets.client.calls import (
    DEFAULT_BASE_URL,
    DEFAULT_RETRY,
    FOREVER,
    LEASE_LOST_CODES,
    ApiError,
    Call,
    Calls,
    ClientAborted,
    Retry,
    RetryEvent,
    Unreachable,
)
from nulltickets.client.sync import Attempts, Client, Endpoint, Transport, error_of

__all__ = [
    "DEFAULT_BASE_URL",
    "DEFAULT_RETRY",
    "FOREVER",
    "LEASE_LOST_CODES",
    "ApiError",
    "AsyncClient",
    "Attempts",
    "Call",
    "Calls",
    "Client",
    "ClientAborted",
    "Endpoint",
    "Retry",
    "RetryEvent",
    "Transport",
    "Unreachable",
    "error_of",
]
