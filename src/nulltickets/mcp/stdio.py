"""`nulltickets mcp`: the tools on stdio, for agents that start their tools as processes.

The process is a client of a server's HTTP API (`--base`, `--key`). It is the session: the
lease it claims lives in its memory only, its token never leaves it, and while it holds one it
extends it in the background (every third of its time to live), so an agent that thinks for
long between tool calls keeps its task. When stdin closes (the agent's session ended cleanly)
or a stop signal comes (SIGTERM, SIGINT, SIGHUP), it releases the task, claimable at once with
its checkpoint; SIGKILLed (or its machine gone), it lets the lease expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Mapping
from typing import Any

import anyio
import msgspec

from nulltickets.client import AsyncClient
from nulltickets.client.calls import ApiError, Calls, Retry, verb_call
from nulltickets.domain.model import Access
from nulltickets.domain.tokens import lease_token_hash
from nulltickets.lifetime import STOP_SIGNALS
from nulltickets.mcp import server, tools
from nulltickets.mcp.tools import Held, ToolError
from nulltickets.service.verbs import Verb

MAX_POLL_MS = 30_000  # the server holds one long poll at most this long
# A tool call gives up on an unreachable server after this long (clients time tools out near
# 60 s; a claim may wait 50 s of its own first).
RETRY = Retry(timeout=8.0)
HEARTBEAT_MIN_S = 1.0
STOP_GRACE_S = 5.0  # how long a stop signal waits for the release before the process exits


class RemotePort:
    """A session of its own, carried out over the server's HTTP API."""

    def __init__(self, api: AsyncClient, agent_id: str, role: str | None = None) -> None:
        self.api = api
        self.agent_id = agent_id
        self.default_role = role
        self._held: Held | None = None
        self._ttl_ms: int | None = None
        self.beat: asyncio.Event = asyncio.Event()  # a new lease to keep alive

    async def claim(self, role: str, wait_s: float, lease_ttl_ms: int | None) -> Any:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            left_ms = max(0, int((deadline - loop.time()) * 1000))
            call = Calls.claim(
                self.agent_id,
                role,
                lease_ttl_ms=lease_ttl_ms,
                wait_ms=min(left_ms, MAX_POLL_MS) or None,
            )
            claimed = await self.api.run(call)
            if claimed is not None:
                token = claimed.lease_token
                self._held = Held(
                    claimed.lease_id,
                    claimed.run.id,
                    claimed.task.id,
                    claimed.fence,
                    token,
                    lease_token_hash(token),
                )
                started = claimed.run.started_at_ms or claimed.expires_at_ms
                self._ttl_ms = max(1_000, claimed.expires_at_ms - started)
                self.beat.set()
                return _builtins(claimed)
            if loop.time() >= deadline:
                return None

    async def call(
        self, v: Verb, path: list[str], query: Mapping[str, str], body: bytes, held: Held | None
    ) -> Any:
        keyed = v.method != "GET" and v.idempotency_key
        bearer = held.token if held is not None else None
        call = verb_call(v.method, v.path, path, query, body or None, bearer=bearer, keyed=keyed)
        try:
            return await self.api.run(call)
        except ApiError as exc:
            if held is not None and exc.lease_lost:
                self._held = None  # expired, superseded, cancelled: nothing to act on now
            raise

    async def held(self) -> Held | None:
        return self._held

    def let_go(self) -> None:
        self._held = None

    def may(self, needed: Access) -> bool:
        return True  # the server refuses what the key may not do, with a clear error

    async def keep_alive(self) -> None:
        """Extend the held lease every third of its time to live while the session lives."""
        while True:
            await self.beat.wait()
            self.beat.clear()
            while (held := self._held) is not None and self._ttl_ms is not None:
                await asyncio.sleep(max(HEARTBEAT_MIN_S, self._ttl_ms / 3000))
                if self._held is not held:
                    break
                with contextlib.suppress(ApiError, OSError, ToolError):
                    await tools.call(self, "heartbeat", {})

    async def release(self, reason: str) -> None:
        """Put the held task down (the session ends), if it still holds one."""
        if self._held is None:
            return
        with contextlib.suppress(ApiError, OSError, ToolError):
            await tools.call(self, "release_task", {"reason": reason})


def _builtins(value: Any) -> Any:
    return msgspec.json.decode(msgspec.json.encode(value))


def default_agent_id() -> str:
    return f"mcp-{socket.gethostname()}-{os.getpid()}"


async def serve(base_url: str, key: str | None, agent_id: str, role: str | None) -> None:
    """Serve the tools on stdin and stdout until stdin closes, or a stop signal comes; then
    release the held task."""
    from mcp.server.stdio import stdio_server

    mcp_server = server.build()
    async with AsyncClient(base_url, token=key, retry=RETRY) as api:
        port = RemotePort(api, agent_id, role)
        server.PORT.set(port)
        loop = asyncio.get_running_loop()
        beats = loop.create_task(port.keep_alive())
        _stop_on_signals(loop, port, beats)
        try:
            async with stdio_server() as (read, write):
                await mcp_server.run(read, write, mcp_server.create_initialization_options())
        finally:
            beats.cancel()
            with anyio.CancelScope(shield=True):
                await port.release("the MCP session ended")


def _stop_on_signals(
    loop: asyncio.AbstractEventLoop, port: RemotePort, beats: asyncio.Task[None]
) -> None:
    """SIGTERM, SIGINT (and SIGHUP): a supervisor or a person stops the session on purpose, so
    its task is released, then the process exits. Waiting for the SDK to wind down is no
    option: its reader thread holds the process until stdin's next line."""
    stopping: list[asyncio.Task[None]] = []

    async def stop() -> None:
        beats.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(port.release("the MCP server was stopped"), STOP_GRACE_S)
        os._exit(0)

    def on_signal() -> None:
        if not stopping:
            stopping.append(loop.create_task(stop()))

    for signum in STOP_SIGNALS:
        with contextlib.suppress(NotImplementedError, RuntimeError):  # Windows
            loop.add_signal_handler(signum, on_signal)


def main(base_url: str, key: str | None, agent_id: str | None, role: str | None) -> int:
    try:
        asyncio.run(serve(base_url, key, agent_id or default_agent_id(), role))
    except KeyboardInterrupt:
        return 130
    return 0
