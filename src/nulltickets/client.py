"""A typed Python client for the nulltickets API, using the server's own msgspec types.

    from nulltickets.client import Client
    with Client("http://127.0.0.1:7700") as api:
        claimed = api.claim("agent-1", "coder", wait_ms=30_000)
        if claimed is not None:
            api.checkpoint(claimed.run.id, claimed.lease_token, {"step": 1})
            api.transition(claimed.run.id, claimed.lease_token, "submit")

One keep-alive connection per client (not thread-safe: one client per thread). Every error
answer raises `ApiError` with the server's status, code and message.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import urllib.parse
from types import TracebackType
from typing import Any, TypeVar

import msgspec

from nulltickets.domain.model import (
    AgentReleased,
    CheckpointResult,
    ClaimResult,
    Released,
    TaskCheckpoint,
    TaskDetails,
    TransitionResult,
)

T = TypeVar("T")


class ApiError(Exception):
    """The server answered with an error envelope (or something that is not JSON)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


class _Id(msgspec.Struct):
    id: int | str


class _Ids(msgspec.Struct):
    ids: list[str]


class _Expires(msgspec.Struct):
    expires_at_ms: int


def _drop_none(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if v is not None}


class Client:
    def __init__(
        self,
        base_url: str = "http://127.0.0.1:7700",
        token: str | None = None,
        timeout: float = 60.0,
    ) -> None:
        url = urllib.parse.urlsplit(base_url)
        if url.scheme not in ("http", "") or not url.hostname:
            raise ValueError(f"base URL must be http://host:port, got {base_url!r}")
        self.host, self.port = url.hostname, url.port or 80
        self.token = token
        self.timeout = timeout
        self._conn: http.client.HTTPConnection | None = None
        self._aborted = False

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
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def abort(self) -> None:
        """Cut the request in flight (from a signal handler or another thread); every later
        request fails. A long-polling claim cut this way claims nothing."""
        self._aborted = True
        conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    # --- transport -----------------------------------------------------------------------------

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        bearer: str | None = None,
        timeout: float | None = None,
    ) -> tuple[int, bytes]:
        headers = {"Content-Type": "application/json"}
        token = bearer if bearer is not None else self.token
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        data = None if body is None else msgspec.json.encode(body)
        for attempt in (1, 2):
            if self._aborted:
                raise ConnectionAbortedError("client aborted")
            if self._conn is None:
                self._conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            if timeout is not None:
                self._conn.timeout = timeout
                if self._conn.sock is not None:
                    self._conn.sock.settimeout(timeout)
            try:
                self._conn.request(method, path, body=data, headers=headers)
                response = self._conn.getresponse()
                payload = response.read()
            except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                # A kept-alive connection the server closed: reconnect once.
                self.close()
                if attempt == 2:
                    raise
                continue
            finally:
                if timeout is not None and self._conn is not None:
                    self._conn.timeout = self.timeout
            if response.getheader("connection", "").lower() == "close":
                self.close()
            if response.status >= 400:
                raise _error(response.status, payload)
            return response.status, payload
        raise AssertionError("unreachable")

    def _call(self, kind: type[T], method: str, path: str, body: Any = None, **kw: Any) -> T:
        _status, payload = self.request(method, path, body, **kw)
        return msgspec.json.decode(payload, type=kind)

    # --- pipelines and tasks -------------------------------------------------------------------

    def create_pipeline(self, name: str, definition: dict[str, Any]) -> str:
        created = self._call(_Id, "POST", "/pipelines", {"name": name, "definition": definition})
        return str(created.id)

    def create_task(
        self, pipeline_id: str, title: str, description: str = "", **fields: Any
    ) -> str:
        body = {"pipeline_id": pipeline_id, "title": title, "description": description, **fields}
        return str(self._call(_Id, "POST", "/tasks", _drop_none(body)).id)

    def create_tasks(self, tasks: list[dict[str, Any]]) -> list[str]:
        return self._call(_Ids, "POST", "/tasks/bulk", {"tasks": tasks}).ids

    def get_task(self, task_id: str) -> TaskDetails:
        return self._call(TaskDetails, "GET", f"/tasks/{_seg(task_id)}")

    def get_checkpoint(self, task_id: str) -> TaskCheckpoint:
        return self._call(TaskCheckpoint, "GET", f"/tasks/{_seg(task_id)}/checkpoint")

    # --- the agent loop ------------------------------------------------------------------------

    def claim(
        self,
        agent_id: str,
        role: str,
        *,
        lease_ttl_ms: int | None = None,
        wait_ms: int | None = None,
    ) -> ClaimResult | None:
        """Claim a task for `role`; with `wait_ms`, wait up to that long for one. None: none."""
        body = _drop_none(
            {
                "agent_id": agent_id,
                "agent_role": role,
                "lease_ttl_ms": lease_ttl_ms,
                "wait_ms": wait_ms,
            }
        )
        read_timeout = self.timeout + (wait_ms or 0) / 1000
        status, payload = self.request("POST", "/leases/claim", body, timeout=read_timeout)
        if status == 204:
            return None
        return msgspec.json.decode(payload, type=ClaimResult)

    def heartbeat(
        self,
        lease_id: str,
        lease_token: str,
        *,
        lease_ttl_ms: int | None = None,
        expected_fence: int | None = None,
    ) -> int:
        body = _drop_none({"lease_ttl_ms": lease_ttl_ms, "expected_fence": expected_fence})
        path = f"/leases/{_seg(lease_id)}/heartbeat"
        return self._call(_Expires, "POST", path, body, bearer=lease_token).expires_at_ms

    def event(
        self,
        run_id: str,
        lease_token: str,
        kind: str,
        data: Any = None,
        *,
        expected_fence: int | None = None,
    ) -> int:
        body = _drop_none({"kind": kind, "data": data, "expected_fence": expected_fence})
        path = f"/runs/{_seg(run_id)}/events"
        return int(self._call(_Id, "POST", path, body, bearer=lease_token).id)

    def checkpoint(
        self,
        run_id: str,
        lease_token: str,
        patch: dict[str, Any],
        *,
        expected_fence: int | None = None,
    ) -> CheckpointResult:
        body = _drop_none({"checkpoint": patch, "expected_fence": expected_fence})
        path = f"/runs/{_seg(run_id)}/checkpoint"
        return self._call(CheckpointResult, "PUT", path, body, bearer=lease_token)

    def transition(
        self,
        run_id: str,
        lease_token: str,
        trigger: str,
        *,
        instructions: str | None = None,
        usage: Any = None,
        expected_stage: str | None = None,
        expected_task_version: int | None = None,
        expected_fence: int | None = None,
    ) -> TransitionResult:
        body = _drop_none(
            {
                "trigger": trigger,
                "instructions": instructions,
                "usage": usage,
                "expected_stage": expected_stage,
                "expected_task_version": expected_task_version,
                "expected_fence": expected_fence,
            }
        )
        path = f"/runs/{_seg(run_id)}/transition"
        return self._call(TransitionResult, "POST", path, body, bearer=lease_token)

    def fail(
        self,
        run_id: str,
        lease_token: str,
        error: str,
        *,
        usage: Any = None,
        expected_fence: int | None = None,
    ) -> None:
        body = _drop_none({"error": error, "usage": usage, "expected_fence": expected_fence})
        self.request("POST", f"/runs/{_seg(run_id)}/fail", body, bearer=lease_token)

    def release(
        self,
        run_id: str,
        lease_token: str,
        reason: str | None = None,
        *,
        expected_fence: int | None = None,
    ) -> Released:
        body = _drop_none({"reason": reason, "expected_fence": expected_fence})
        path = f"/runs/{_seg(run_id)}/release"
        return self._call(Released, "POST", path, body, bearer=lease_token)

    def release_agent(self, agent_id: str, reason: str | None = None) -> AgentReleased:
        body = _drop_none({"agent_id": agent_id, "reason": reason})
        return self._call(AgentReleased, "POST", "/agents/release", body)


def _seg(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def _error(status: int, payload: bytes) -> ApiError:
    try:
        detail = json.loads(payload)["error"]
        return ApiError(status, str(detail["code"]), str(detail["message"]))
    except (ValueError, KeyError, TypeError):
        return ApiError(status, "unexpected_response", payload[:200].decode("utf-8", "replace"))
