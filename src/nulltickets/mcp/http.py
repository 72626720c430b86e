"""`/mcp` on the server: the tools over Streamable HTTP, under the API's own keys.

The route is gated as any other: the browser guard first, then the bearer (on a server with a
token, a key of any access or the token; a wrong one is 401 and slowed down). The tools a key
sees are those its access allows: `read` the read tools; `agent` the agent loop too, claiming
only for the key's roles; `admin` every tool.

The session is the key. A request carries no state of its own: the SDK serves it stateless,
with one JSON answer, so any server of a PostgreSQL tracker answers any request. The task a
key's session holds is the lease its agent id (`mcp-<key id>`, `mcp-token` for the server's
token, `mcp` on a server without one) holds in the database: whichever server a tool call
reaches finds it there. One key, one session: give each agent a key of its own, or name the
session with the `Nulltickets-Session` header (agent id `mcp-<key id>-<name>`): a key only
ever reaches its own sessions.

The SDK is an ASGI application; granian serves RSGI. The route hands the request over as ASGI
and sends back what the SDK answered. The SDK is imported when the first request comes.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping
from typing import Any

import msgspec

from nulltickets.domain.commands import Claim
from nulltickets.domain.model import Access, allows
from nulltickets.errors import InvalidRequest, McpUnavailable
from nulltickets.http import access
from nulltickets.http.access import Principal
from nulltickets.http.context import Context
from nulltickets.http.handlers import verb_args
from nulltickets.http.request import Request
from nulltickets.http.response import WebReply
from nulltickets.http.routes import Route
from nulltickets.mcp.tools import Held
from nulltickets.service import Kind, Service
from nulltickets.service.verbs import Guard, Verb

PATH = "/mcp"
log = logging.getLogger("nulltickets")


class LocalPort:
    """A key's session, carried out by this server's own service."""

    def __init__(
        self, service: Service, principal: Principal | None, keyed: bool, name: str | None = None
    ) -> None:
        self.service = service
        self.principal = principal
        self.agent_id = agent_id_of(principal, keyed, name)
        self.default_role: str | None = None
        if principal is not None and principal.roles is not None and len(principal.roles) == 1:
            (self.default_role,) = principal.roles

    async def claim(self, role: str, wait_s: float, lease_ttl_ms: int | None) -> Any:
        access.check_role(self.principal, role)
        cmd = Claim(self.agent_id, role, lease_ttl_ms=lease_ttl_ms)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            if wait_s > 0:
                answer, waited = await self.service.claim_waiting(cmd, None, deadline)
            else:
                answer, waited = await self.service.claim(cmd), True
            if answer.kind is not Kind.EMPTY:
                return msgspec.json.decode(answer.body)
            left = deadline - loop.time()
            if left <= 0:
                return None
            if not waited:  # no room to wait here: ask again a little later
                await asyncio.sleep(min(left, 1.0))

    async def call(
        self, v: Verb, path: list[str], query: Mapping[str, str], body: bytes, held: Held | None
    ) -> Any:
        token_hash = held.token_hash if held is not None else None
        answer = await self.service.call(v, path, verb_args(v, query, body, token_hash))
        return msgspec.json.decode(answer.body) if answer.body else None

    async def held(self) -> Held | None:
        lease = await self.service.held_by(self.agent_id)
        if lease is None or lease.expires_at_ms <= self.service.clock():
            return None  # an expired lease is no longer the session's, reaped or not
        return Held(lease.id, lease.run_id, lease.task_id, lease.fence, token_hash=lease.token_hash)

    def let_go(self) -> None:
        """Nothing to forget: the lease is gone from the database."""

    def may(self, needed: Access) -> bool:
        return self.principal is None or allows(self.principal.access, needed)


SESSION_HEADER = "nulltickets-session"
SESSION_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def agent_id_of(principal: Principal | None, keyed: bool, name: str | None = None) -> str:
    """The agent id a key's session claims as: the key's, and the session's name if given."""
    if principal is None or not keyed:
        base = "mcp"
    else:
        base = f"mcp-{principal.key_id}" if principal.key_id is not None else "mcp-token"
    return f"{base}-{name}" if name else base


class Bridge:
    """The SDK's Streamable HTTP manager, started on first use, answering over RSGI."""

    def __init__(self) -> None:
        self._manager: Any = None
        self._started: asyncio.Future[None] | None = None
        self._runner: asyncio.Task[None] | None = None

    async def manager(self) -> Any:
        if self._started is None:
            loop = asyncio.get_running_loop()
            self._started = loop.create_future()
            self._runner = loop.create_task(self._run(self._started))
        await asyncio.shield(self._started)
        return self._manager

    async def _run(self, started: asyncio.Future[None]) -> None:
        try:
            # The SDK takes a second or more to import: off the event loop, which goes on
            # serving meanwhile.
            await asyncio.to_thread(_import_sdk)
            from mcp.server.streamable_http_manager import StreamableHTTPSessionManager
            from mcp.server.transport_security import TransportSecuritySettings

            from nulltickets.mcp import server

            # The browser guard of the HTTP layer has refused other origins before the SDK
            # sees a request; the SDK's own Host check would refuse every name but localhost.
            self._manager = manager = StreamableHTTPSessionManager(
                app=server.build(),
                json_response=True,
                stateless=True,
                security_settings=TransportSecuritySettings(enable_dns_rebinding_protection=False),
            )
            async with manager.run():
                started.set_result(None)
                await asyncio.Event().wait()
        except BaseException as exc:
            if not started.done():
                log.error("the MCP server cannot start: %s: %s", type(exc).__name__, exc)
                started.set_exception(McpUnavailable(f"the MCP server cannot start: {exc}"))
                self._started = None  # the next request tries again
            raise

    def close(self) -> None:
        if self._runner is not None:
            self._runner.cancel()


def _import_sdk() -> None:
    import mcp.server.streamable_http_manager  # noqa: F401

    import nulltickets.mcp.server  # noqa: F401


async def handle(ctx: Context, req: Request) -> WebReply:
    """One request to /mcp: the SDK answers it, with this request's key as the session."""
    from nulltickets.mcp import server

    bridge = ctx.mcp
    if bridge is None:
        bridge = ctx.mcp = Bridge()
    name = req.header(SESSION_HEADER)
    if name is not None and not SESSION_NAME.fullmatch(name):
        raise InvalidRequest(f"{SESSION_HEADER} must be 1 to 64 letters, digits, '.', '_' or '-'")
    manager = await bridge.manager()
    port = LocalPort(ctx.service, req.principal, ctx.admin_token is not None, name)
    answered: dict[str, Any] = {"status": 500, "headers": [], "body": []}

    async def receive() -> dict[str, Any]:
        if not answered.get("sent_body"):
            answered["sent_body"] = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await asyncio.Event().wait()  # the request has no more: wait to be cancelled
        raise AssertionError("unreachable")

    async def send(message: Mapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            answered["status"] = message["status"]
            answered["headers"] = [
                (k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", [])
            ]
        elif message["type"] == "http.response.body":
            answered["body"].append(message.get("body", b""))

    token = server.PORT.set(port)  # the SDK's tasks for this request inherit it
    try:
        await manager.handle_request(_scope(req), receive, send)
    finally:
        server.PORT.reset(token)
    headers = tuple(
        (k, v) for k, v in answered["headers"] if k.lower() not in ("content-length", "connection")
    )
    return WebReply(int(answered["status"]), b"".join(answered["body"]), headers)


def _scope(req: Request) -> dict[str, Any]:
    host, _, port = req.client.rpartition(":")
    headers = [
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in req.headers.items()
    ]
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": req.method,
        "scheme": req.scheme,
        "path": PATH,
        "raw_path": PATH.encode(),
        "query_string": req.query_string.encode("latin-1"),
        "root_path": "",
        "headers": headers,
        "client": (host, int(port)) if port.isdigit() else None,
        "server": None,
        "state": {},
    }


MCP_ROUTES = (
    Route(
        "POST",
        PATH,
        handle,
        "The MCP server (Streamable HTTP): the agent loop, the store and the queue as tools, "
        "under the key presented.",
        Guard.KEY,
        access=Access.READ,
        extra=True,
        tag="mcp",
        idempotency_key=False,
    ),
)
